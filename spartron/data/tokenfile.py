"""Spartron's token folder: what `spartron data` writes and `train.data.kind = "packed"` reads.

  tokens.bin      every document's ids back to back, EOS-terminated, uint16 (vocab <= 65536) or uint32:
                  the flat token file `train.data.kind = "mmap"` also reads
  loss_mask.bin   uint8, one per token, 1 where the token is a training target (only for chat corpora)
  documents.bin   int64 [n_documents + 1]: where each document starts (first 0, last n_tokens); binary and
                  memory-mapped, so a corpus of millions of documents costs no Python list on any rank
  tokens.json     written last: format, dtype, vocab_size, eos_id, bos_id, the tokenizer's file and SHA-256,
                  n_tokens, n_documents, the names of the files above, the corpus files

`spartron data` writes them into a hidden sibling folder renamed to the output folder at the end, and a
folder without tokens.json is incomplete. Reading checks every field and the file sizes against it
and refuses anything else with one line naming the file and the key.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spartron.configbase import ConfigError
from spartron.temporaries import make_sibling, remove_stale

FORMAT = "spartron-tokens"
VERSION = 1
TOKENS, MASK, DOCS, META = "tokens.bin", "loss_mask.bin", "documents.bin", "tokens.json"
_META_MAX_BYTES = 1 << 30


def token_dtype(vocab_size: int) -> str:
    """The narrowest dtype holding every id of the vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


@dataclass
class TokenFolder:
    """An opened token folder: the memory maps and the checked metadata."""

    path: Path
    meta: dict
    tokens: np.memmap
    loss_mask: np.memmap | None
    offsets: np.ndarray  # int64 [n_documents + 1] (memory-mapped)

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def fingerprint(self) -> str:
        """What a saved data position is valid for: the same tokens and documents."""
        return f"packed:{self.meta['tokenizer']['sha256'][:16]}:{self.meta['n_tokens']}:{len(self.offsets) - 1}"


def write_token_folder(out: str | Path, records: Iterable[tuple[list[int], list[int]]], *, vocab_size: int,
                       eos_id: int, tokenizer: dict, corpus: dict, chunk_tokens: int = 1 << 20,
                       bos_id: int | None = None, extra: Callable[[Path], dict] | None = None) -> dict:
    """Stream (ids, loss mask) records into `out` (new, or an empty folder); returns the metadata written.

    Everything is written into a hidden sibling `.NAME.partial-HOST-PID-HEX`, renamed to `out` at the end
    (or its files moved into an existing empty `out`, tokens.json last): a failure (a bad record, a full
    disk) or an interrupt (Ctrl-C; `spartron data` turns SIGTERM into one) removes it, and even a SIGKILL
    leaves `out` as it was, so the same command can run again (it removes, with a note, the sibling a
    killed run left: spartron.temporaries). `extra(folder)`, when given, writes more files into the folder
    before tokens.json and returns the metadata entries that describe them."""
    given = str(out)  # every message names the folder as the user gave it, not the path it resolves to
    _refuse_link(Path(out), given)
    out = Path(os.path.realpath(out))  # `.` and `..`: the folder they name (a link there was refused above)
    _check_output(out, given)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for note in remove_stale(out, "partial"):  # what a SIGKILLed earlier attempt left
            print(note, file=sys.stderr, flush=True)
        tmp = make_sibling(out, "partial")  # the umask's permissions, like any folder the user makes
    except OSError as err:
        raise ConfigError(f"output folder {given!r} cannot be made: {err.strerror or err}") from None
    moved: list[Path] = []  # into an existing empty folder: removed again on failure
    try:
        meta = _write(tmp, records, vocab_size, eos_id, bos_id, tokenizer, corpus, chunk_tokens, extra)
        _refuse_link(out, given)  # still no link, and new or empty: nothing of someone else's is replaced
        _check_output(out, given)
        if out.is_dir():  # the user's empty folder stays (its permissions; maybe a shell's working directory)
            _fill(tmp, out, moved)
        else:
            os.rename(tmp, out)  # onto a link made meanwhile: ENOTDIR, the link stays as it was
        return meta
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        for path in moved:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise ConfigError(f"writing output folder {given!r} failed: {err.strerror or err}") from None
        raise


def _fill(tmp: Path, out: Path, moved: list[Path]) -> None:
    """Move tmp's files into the empty folder `out`, tokens.json last (complete), through a descriptor of
    `out` opened without following a link: a link swapped in after the check is refused, not written through."""
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in sorted(os.listdir(tmp), key=lambda n: n == META):
            moved.append(out / name)
            os.rename(tmp / name, name, dst_dir_fd=fd)
    finally:
        os.close(fd)
    tmp.rmdir()


def _refuse_link(out: Path, given: str) -> None:
    """An output folder that is a symbolic link is refused: filling its target (an empty folder elsewhere, or
    one made where a dangling link points) writes outside the folder the user named."""
    try:
        target = os.readlink(out) if out.is_symlink() else None
    except OSError as err:  # a name too long, a folder on the path that is not one
        raise ConfigError(f"output folder {given!r} cannot be read: {err.strerror or err}") from None
    if target is not None:
        raise ConfigError(f"output folder {given!r} is a symbolic link (to {target!r}): `spartron data` writes a "
                          "new folder or fills an empty one, never through a link (name its target)")


def _check_output(out: Path, given: str) -> None:
    """`out` may be new or an empty folder, nothing else."""
    try:
        if out.is_dir():
            if any(out.iterdir()):
                raise ConfigError(f"output folder {given!r} exists and is not empty (choose a new folder)")
        elif out.exists() or out.is_symlink():
            raise ConfigError(f"output folder {given!r} exists and is not a folder (choose a new folder)")
    except OSError as err:
        raise ConfigError(f"output folder {given!r} cannot be read: {err.strerror or err}") from None


def _write(out: Path, records: Iterable[tuple[list[int], list[int]]], vocab_size: int, eos_id: int,
           bos_id: int | None, tokenizer: dict, corpus: dict, chunk_tokens: int,
           extra: Callable[[Path], dict] | None) -> dict:
    dtype = np.dtype(token_dtype(vocab_size))
    ids_buf, mask_buf, starts, has_mask = [], [], [0], False
    n_tokens, n_documents = 0, 0
    with (out / TOKENS).open("wb") as tf, (out / MASK).open("wb") as mf, (out / DOCS).open("wb") as df:
        def flush() -> None:
            np.asarray(ids_buf, dtype=dtype).tofile(tf)
            np.asarray(mask_buf, dtype=np.uint8).tofile(mf)
            np.asarray(starts, dtype=np.int64).tofile(df)
            ids_buf.clear()
            mask_buf.clear()
            starts.clear()

        for ids, mask in records:
            ids_buf += ids
            mask_buf += mask
            has_mask = has_mask or not all(mask)
            n_tokens += len(ids)
            n_documents += 1
            starts.append(n_tokens)  # this document's end: the next one's start
            if len(ids_buf) >= chunk_tokens:
                flush()
        flush()
    if n_tokens == 0:
        raise ConfigError("the corpus holds no document")
    if not has_mask:
        (out / MASK).unlink()
    meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "vocab_size": vocab_size, "eos_id": eos_id,
            "bos_id": bos_id, "tokenizer": tokenizer, "n_tokens": n_tokens, "n_documents": n_documents,
            "loss_mask": MASK if has_mask else None, "documents": DOCS, "corpus": corpus}
    if extra is not None:
        meta.update(extra(out))
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _need(meta: dict, key: str, kind: type | tuple[type, ...], where: str):  # noqa: ANN202
    value = meta.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(f"{where}: key {key!r} is missing or not {getattr(kind, '__name__', kind)}")
    return value


def open_token_folder(path: str | Path) -> TokenFolder:
    """Open and check a token folder; ConfigError naming train.data.path and the file otherwise."""
    path = Path(path)
    where = f"train.data.path {str(path)!r}"
    meta_file = path / META
    try:
        if not path.is_dir():
            raise ConfigError(f"{where} is not a folder (train.data.kind = 'packed' reads a folder written by "
                              "`spartron data`)")
        if not meta_file.is_file():
            raise ConfigError(f"{where} has no {META} (not written by `spartron data`, or not finished)")
        if meta_file.stat().st_size > _META_MAX_BYTES:
            raise ConfigError(f"{meta_file} is larger than {_META_MAX_BYTES} bytes")
        meta = json.loads(meta_file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ConfigError(f"{meta_file}: not valid JSON ({err})") from None
    except OSError as err:
        raise ConfigError(f"{where} cannot be read: {err.strerror or err}") from None
    where = str(meta_file)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ConfigError(f"{where}: not a {FORMAT} version {VERSION} file")
    dtype = meta.get("dtype")
    if dtype not in ("uint16", "uint32"):
        raise ConfigError(f"{where}: dtype must be 'uint16' or 'uint32', got {dtype!r}")
    vocab = _need(meta, "vocab_size", int, where)
    n_tokens = _need(meta, "n_tokens", int, where)
    eos = _need(meta, "eos_id", int, where)
    if vocab < 1 or (dtype == "uint16" and vocab > 2**16) or not 0 <= eos < vocab or n_tokens < 1:
        raise ConfigError(f"{where}: vocab_size {vocab}, eos_id {eos}, n_tokens {n_tokens} do not fit dtype {dtype}")
    bos = meta.get("bos_id")  # absent or null: documents start without one
    if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool) or not 0 <= bos < vocab):
        raise ConfigError(f"{where}: bos_id must be null or a token id below vocab_size {vocab}, got {bos!r}")
    tok = meta.get("tokenizer")
    if not isinstance(tok, dict) or not isinstance(tok.get("sha256"), str):
        raise ConfigError(f"{where}: key 'tokenizer' must hold the tokenizer's 'sha256'")
    n_docs = _need(meta, "n_documents", int, where)
    if not 1 <= n_docs <= n_tokens:
        raise ConfigError(f"{where}: n_documents {n_docs} must be in 1..n_tokens ({n_tokens})")
    if meta.get("documents") != DOCS:
        raise ConfigError(f"{where}: documents must be {DOCS!r}, got {meta.get('documents')!r}")
    offsets = _map(path / DOCS, "int64", n_docs + 1, "document offsets")
    if offsets[0] != 0 or offsets[-1] != n_tokens or not (np.diff(offsets) > 0).all():
        raise ConfigError(f"{path / DOCS}: the document offsets must rise strictly from 0 to n_tokens = {n_tokens} "
                          f"({META})")
    tokens = _map(path / TOKENS, dtype, n_tokens)
    mask_name = meta.get("loss_mask")
    if mask_name not in (None, MASK):
        raise ConfigError(f"{where}: loss_mask must be null or {MASK!r}, got {mask_name!r}")
    mask = _map(path / MASK, "uint8", n_tokens) if mask_name else None
    return TokenFolder(path, meta, tokens, mask, offsets)


def _map(file: Path, dtype: str, n: int, what: str = "tokens") -> np.memmap:
    width = np.dtype(dtype).itemsize
    try:
        size = file.stat().st_size if file.is_file() else None
        if size is None:
            raise ConfigError(f"{file} is missing (or not a regular file)")
        if size != n * width:
            raise ConfigError(f"{file} has {size} bytes, but {META} says {n} {what} of {dtype} ({n * width} bytes)")
        return np.memmap(file, dtype=np.dtype(dtype), mode="r")
    except OSError as err:
        raise ConfigError(f"{file} cannot be read: {err.strerror or err}") from None
