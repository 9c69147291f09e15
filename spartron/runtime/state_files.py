"""The saved state's files, read and written safely (spartron.runtime.state decides what goes in them).

Reading: DCP's ``.metadata`` through an unpickler that admits exactly `METADATA_GLOBALS` (torch's
weights-only unpickler refuses DCP's protocol-4 FRAME opcode), DCP's byte items and tensors and the per-rank
RNG tensors through ``torch.load(weights_only=True)``; every refusal names the file. Writing: every byte DCP
and the state module write is counted and CRC-32'd as it goes (the COMPLETE manifest), durably (fsync of the
file and its directory), and a write error names the path.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.futures import Future

from spartron.runtime.rundir import _FILE_NAME, StateLoadError, _first_line
from spartron.runtime.safe_open import UnsafeEntryError, open_file

# ---- reading files safely -----------------------------------------------------------------------------
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# Exactly what DCP's Metadata pickles to on torch 2.11-2.13 (checked by a test that records every global a
# real save's .metadata references), plus every torch dtype a tensor may have.
METADATA_GLOBALS = frozenset(
    {(_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                        "TensorStorageMetadata", "ChunkStorageMetadata",
                                        "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}
    | {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)})


class _RefusedGlobal(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Admits exactly the (module, qualified name) pairs of METADATA_GLOBALS: no prefixes, no dotted paths."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        raise _RefusedGlobal(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _RefusedGlobal(f"persistent id {str(pid)[:80]!r}")


def read_metadata_file(path: Path) -> Metadata:
    """DCP's .metadata through the exact allowlist, checked to be DCP metadata; StateLoadError names the file."""
    try:
        data = path.read_bytes()
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _RefusedGlobal as err:
        raise StateLoadError(f"{path}: refusing to unpickle {err}: not one of DCP's metadata types "
                             "(nothing from the file was run)") from None
    except Exception as err:  # noqa: BLE001 - any malformed pickle is one line naming the file
        raise StateLoadError(f"{path}: not readable DCP metadata ({_first_line(err)})") from None
    _check_metadata(path, metadata)
    return metadata


def _check_metadata(path: Path, md: Any) -> None:
    def bad(what: str) -> StateLoadError:
        return StateLoadError(f"{path}: not valid DCP metadata ({what})")

    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise bad(f"holds a {type(md).__name__}")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            raise bad(f"entry {str(key)[:80]!r}")
    if not isinstance(md.storage_data, dict):
        raise bad("storage_data")
    for info in md.storage_data.values():
        if not (isinstance(info, _StorageInfo) and isinstance(info.relative_path, str)
                and _FILE_NAME.match(info.relative_path) and isinstance(info.offset, int)
                and isinstance(info.length, int) and info.offset >= 0 and info.length >= 0):
            raise bad(f"storage entry {info!r:.120}")


def _load_problem(err: BaseException) -> str:
    """What torch.load(weights_only=True) refused, in one line (without torch's advice to load unsafely)."""
    text = str(err)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return (f"refusing to unpickle {found.group(1)}: torch's weights-only loader does not allow it "
                "(nothing from the file was run)")
    if isinstance(err, pickle.UnpicklingError) or "WeightsUnpickler error" in text:
        detail = text.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
        return (f"not loadable by torch's weights-only loader ({detail[0] if detail else type(err).__name__}; "
                "nothing from the file was run)")
    return f"not a readable torch file ({_first_line(err)})"


def _torch_load(source: Path | io.BytesIO, name: str | Path) -> Any:
    """torch.load(weights_only=True); a refused global or a damaged file is a StateLoadError naming `name`."""
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": the refusal below says enough
            warnings.simplefilter("ignore")
            return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001
        raise StateLoadError(f"{name}: {_load_problem(err)}") from None


class SafeFileSystemReader(FileSystemReader):
    """DCP's filesystem reader: metadata through the exact allowlist, every read error naming its file."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata_file(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner) -> Future[None]:  # noqa: ANN001 - DCP signature
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except StateLoadError as err:
                raise StateLoadError(f"{Path(self.path) / relative_path}: {err}") from None
            except Exception as err:  # noqa: BLE001 - DCP's own torch.load of a tensor item, or a bad file
                raise StateLoadError(f"{Path(self.path) / relative_path}: {_load_problem(err)}") from None
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor items read through torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:  # noqa: ANN001 - DCP signature
        obj = _torch_load(value, f"item {read_item.dest_index.fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ---- writing files with their sizes and checksums -----------------------------------------------------
def _write_error(err: OSError, path: Path) -> OSError:
    """The same OSError, naming the file (a failed write() says only 'No space left on device')."""
    if isinstance(err, UnsafeEntryError):  # names the entry already
        return err
    return OSError(err.errno, err.strerror or str(err), str(path))


class _TallyStream:
    """A write-only stream that keeps the size and CRC-32 of what passes through it, for the manifest, and
    the first write error in `errors`: torch.save's C++ zip writer turns an exception raised by a Python
    stream's write into its own "inline_container.cc ... unexpected pos" error, which names nothing."""

    def __init__(self, raw: Any, path: Path, record: list[int], errors: list[OSError]) -> None:
        self._raw, self._path, self._record, self._errors = raw, path, record, errors

    def _failed(self, err: OSError) -> OSError:
        named = _write_error(err, self._path)
        self._errors.append(named)
        return named

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            n = self._raw.write(view)
        except OSError as err:
            raise self._failed(err) from None
        n = len(view) if n is None else n
        self._record[0] += n
        self._record[1] = zlib.crc32(view[:n], self._record[1])
        return n

    def _call(self, name: str) -> Any:
        try:
            return getattr(self._raw, name)()
        except OSError as err:
            raise self._failed(err) from None

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        self._call("close")

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


class _TallyFileSystem(FileSystem):
    """DCP's local file system; streams opened for writing keep their file's [size, crc32] in `tally`."""

    def __init__(self, tally: dict[str, list[int]]) -> None:
        super().__init__()
        self.tally = tally
        self.errors: list[OSError] = []  # every write error of this rank's streams, first first

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        try:  # a fresh folder; never through a link planted there
            raw = os.fdopen(open_file(path.parent, path.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), mode)
        except OSError as err:
            self.errors.append(_write_error(err, path))
            raise self.errors[-1] from None
        record = self.tally[path.name] = [0, 0]
        try:
            yield _TallyStream(raw, path, record, self.errors)
        finally:
            try:
                raw.close()
            except OSError as err:
                self.errors.append(_write_error(err, path))
                raise self.errors[-1] from None  # noqa: B012 - the close error names the file too

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        self.tally[Path(new_path).name] = self.tally.pop(Path(path).name)


class _TallyWriter(dcp.FileSystemWriter):
    def __init__(self, path: Path, tally: dict[str, list[int]]) -> None:
        super().__init__(path)
        self.fs = _TallyFileSystem(tally)


def _write_durable(path: Path, data: bytes, tally: dict[str, list[int]] | None = None) -> None:
    try:
        with os.fdopen(open_file(path.parent, path.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise _write_error(err, path) from None
    if tally is not None:
        tally[path.name] = [len(data), zlib.crc32(data)]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
