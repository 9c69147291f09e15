"""What a Hugging Face checkpoint folder holds, read without trusting it: the folder itself, its JSON files
(config.json, the index) and which tensor each shard holds (the shards' checked headers).

Why apart from the import: each of these reads is where a hostile folder bites first (a FIFO that blocks, a
link to /dev/zero, an index that points outside the folder or disagrees with its shards), and each refusal
is an HFCheckpointError naming the file, before any tensor is read.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from spartron.interop.hf.header import HeaderError, TensorInfo, read_header
from spartron.interop.hf.jsonfile import JSONFileError, json_object, open_regular

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
_PLAIN_FILE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]{0,254}\.safetensors$")


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint directory that cannot be read as (or written from) this model."""


MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_CONFIG_BYTES = 1024 * 1024


def read_json(path: Path, limit: int) -> dict:
    """A JSON object from a regular file of at most `limit` bytes, read by `jsonfile` (a FIFO, /dev/zero or a
    folder is refused before a byte is read; a symbolic link to a regular file, as in a Hugging Face cache
    folder, is read)."""
    try:
        with open_regular(path) as (f, size):
            if size > limit:
                raise HFCheckpointError(f"{path}: {size} bytes, larger than the {limit} a JSON file of a "
                                        "Hugging Face checkpoint may be here")
            raw = f.read(limit + 1)
        if len(raw) > limit:
            raise HFCheckpointError(f"{path}: grew past {limit} bytes while read")
        return json_object(raw)
    except JSONFileError as err:
        raise HFCheckpointError(f"{path}: {_why(path, err)}") from None


def _why(path: Path, err: JSONFileError) -> str:
    """A failed check in folder.py's words (a missing file is told apart from a link to nothing)."""
    if err.check == "unreadable" and err.errno == errno.ENOENT:
        missing = "missing (a Hugging Face checkpoint directory holds it)"
        return f"is {_kind(path)}" if os.path.islink(path) else missing
    if err.check == "unreadable":
        return f"cannot be read ({err.detail})"
    if err.check == "irregular":
        return f"is {_kind(path)}, not a regular file"
    return f"not readable JSON ({err.detail})" if err.check == "json" else "must hold a JSON object"


def _header(path: Path) -> dict[str, TensorInfo]:
    try:
        return read_header(path)
    except HeaderError as err:
        raise HFCheckpointError(str(err)) from None


def weight_files(hf_dir: Path) -> dict[str, str]:
    """HF tensor name -> shard file name, from the index (or the single `model.safetensors`). A path that is
    no checkpoint folder is named as what it is (missing, a file, a FIFO, a broken link, a folder without
    one). Shards are plain file names inside the directory (a symbolic link there, as in a Hugging Face cache
    folder, is followed)."""
    _check_folder(hf_dir)
    index = hf_dir / INDEX
    if os.path.lexists(index) and not index.is_file():
        raise HFCheckpointError(f"{index}: {_kind(index)}, not a file")
    if index.is_file():
        weight_map = read_json(index, MAX_INDEX_BYTES).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFCheckpointError(f"{index}: 'weight_map' must map tensor names to shard files")
        for name, file in weight_map.items():
            if not isinstance(file, str) or not _PLAIN_FILE.match(file) or not (hf_dir / file).is_file():
                raise HFCheckpointError(f"{index}: {name!r} -> {file!r} is not a .safetensors file in {hf_dir}")
        return dict(weight_map)
    single = hf_dir / SINGLE
    if os.path.lexists(single) and not single.is_file():
        raise HFCheckpointError(f"{single}: {_kind(single)}, not a file")
    if not single.is_file():
        pickled = sorted(n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json") if (hf_dir / n).exists())
        hint = (f"; its {pickled[0]} is not read (a pickle can run code): save the model as safetensors"
                if pickled else "")
        raise HFCheckpointError(f"{hf_dir}: a folder without a Hugging Face safetensors checkpoint (neither "
                                f"{INDEX} nor {SINGLE} in it){hint}")
    return {name: SINGLE for name in _header(single)}


def _kind(path: Path) -> str:
    """What `path` is, following links (a link into a Hugging Face cache is fine) and naming a broken one."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        if os.path.islink(path):
            loops = err.errno == errno.ELOOP
            return f"a {'looping' if loops else 'dangling'} symbolic link (to {os.readlink(path)!r})"
        return "missing" if err.errno == errno.ENOENT else f"unreadable ({err.strerror or err})"
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a regular file"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a file or folder")


def _check_folder(hf_dir: Path) -> None:
    """A checkpoint is a folder: a missing path, a file or a FIFO is named as what it is."""
    kind = _kind(hf_dir)
    if kind == "missing":
        raise HFCheckpointError(f"{hf_dir}: does not exist (a Hugging Face checkpoint folder is expected)")
    if kind != "a folder":
        raise HFCheckpointError(f"{hf_dir}: is {kind}, not a folder (a Hugging Face checkpoint is a folder "
                                f"holding {CONFIG} and {SINGLE} or {INDEX})")


def ignored_tensor(name: str) -> bool:
    """Tensors a checkpoint may hold that carry no weight: RoPE's `rotary_emb.inv_freq` buffers (older
    transformers saved them; transformers itself skips them on load). They are never read."""
    return name.endswith(".rotary_emb.inv_freq")


def checked_headers(hf_dir: Path, files: dict[str, str]) -> dict[str, TensorInfo]:
    """HF tensor name -> (dtype, shape) from every shard's checked header. Each shard must hold exactly what
    the index maps to it: a tensor the index maps to a shard that lacks it, one a shard holds that the index
    maps to another shard (present twice: which copy is meant?) or does not list at all (a tensor nothing
    explains) is an HFCheckpointError naming the tensor and the file(s)."""
    out: dict[str, TensorInfo] = {}
    for file in sorted(set(files.values())):
        header = _header(hf_dir / file)
        for name in (n for n, f in files.items() if f == file):
            if name not in header:
                raise HFCheckpointError(f"{hf_dir / file}: holds no tensor {name!r}, which {INDEX} maps to it")
            out[name] = header[name]
        for name in sorted(header):
            if name in files and files[name] != file:
                raise HFCheckpointError(f"{hf_dir / file}: holds {name!r} too, which {INDEX} maps to "
                                        f"{hf_dir / files[name]} (a tensor present twice)")
            if name not in files and not ignored_tensor(name):
                raise HFCheckpointError(f"{hf_dir / file}: holds {name!r}, which {INDEX} does not list (a "
                                        "tensor its config.json does not explain)")
    return out



__all__ = ["CONFIG", "INDEX", "MAX_CONFIG_BYTES", "MAX_INDEX_BYTES", "SINGLE", "HFCheckpointError",
           "checked_headers", "ignored_tensor", "read_json", "weight_files"]
