"""A safetensors file's header, read and checked by Spartron before safetensors' own reader sees the file.

Why: safetensors' errors name neither the file nor the tensor, and a header is only 8 bytes of length plus
JSON. Checked here: the file is a regular file; the header length fits the file; the JSON is an object of
tensors with a known dtype, a shape of non-negative integers and `data_offsets` whose byte length is the
shape's at that dtype, inside the data area and tiling it without gaps or overlaps (a truncated file
fails here, naming the first tensor it cuts). Nothing is executed or allocated beyond the header itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from spartron.interop.hf.jsonfile import JSONFileError, json_object, open_regular

# safetensors' dtype names -> bytes per element
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
               "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
FLOAT_WEIGHTS = ("F32", "BF16", "F16")  # what Spartron imports (float16 exactly as float32)
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


class HeaderError(ValueError):
    """A safetensors file whose header cannot be trusted; the message names the file (and the tensor)."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


def _ints(value: object, n: int | None = None) -> bool:
    return isinstance(value, list) and (n is None or len(value) == n) and \
        all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _read(path: Path) -> tuple[bytes, int]:
    """The header's JSON bytes and the size of the data area after it."""
    with open_regular(path) as (f, size):
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError(f"{path}: truncated ({size} bytes: not even the 8-byte header length)")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise HeaderError(f"{path}: header length {n} does not fit the file ({size} bytes; corrupt or "
                              "truncated)")
        return f.read(n), size - 8 - n


_WHY = {"unreadable": "cannot be read ({detail})", "irregular": "not a regular file",
        "json": "the header is not valid JSON ({detail})", "object": "the header is not a JSON object"}


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of the safetensors file `path` (dtype, shape), after checking the header (module docstring)."""
    path = Path(path)
    try:
        raw, data_bytes = _read(path)
        header = json_object(raw)
    except JSONFileError as err:
        raise HeaderError(f"{path}: {_WHY[err.check].format(detail=err.detail)}") from None
    out, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict):
                raise HeaderError(f"{path}: __metadata__ is not a JSON object")
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise HeaderError(f"{where}: its header entry is not a JSON object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise HeaderError(f"{where}: unknown dtype {dtype!r}")
        if not _ints(shape):
            raise HeaderError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not _ints(offsets, 2) or offsets[0] > offsets[1]:
            raise HeaderError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
        if offsets[1] > data_bytes:
            raise HeaderError(f"{where}: data_offsets {offsets} run past the file's {data_bytes} data bytes "
                              "(truncated?)")
        need = math.prod(shape) * DTYPE_BYTES[dtype]
        if offsets[1] - offsets[0] != need:
            raise HeaderError(f"{where}: shape {shape} of {dtype} is {need} bytes, its data_offsets {offsets} "
                              f"hold {offsets[1] - offsets[0]}")
        out[name] = TensorInfo(dtype, tuple(shape))
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise HeaderError(f"{path}: tensor {name!r}: data_offsets start at {begin}, where the data before it "
                              f"ends at {end} (overlapping or a gap)")
        end = stop
    if end != data_bytes:
        raise HeaderError(f"{path}: its tensors hold {end} bytes, the file's data area is {data_bytes}")
    return out
