"""Reading and rewriting safetensors files byte by byte (no library: a case must be able to write what the
library would refuse to), and the edits the Hugging Face cases make to an exported checkpoint. The project's
one raw safetensors reader and writer: the tests that damage a header use it too."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

SHARD = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"
EMBED = "model.embed_tokens.weight"
EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
NORM = "model.norm.weight"
NUMPY = {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "U8": np.uint8, "BOOL": np.bool_,
         "F16": np.float16, "F64": np.float64, "F32": np.float32}


def read(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def tensors(path: Path) -> tuple[dict[str, tuple[str, list[int], bytes]], dict]:
    header, data = read(path)
    meta = header.pop("__metadata__", {})
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items()}, meta


def write_raw(path: Path, header: dict, data: bytes, pad: bool = True) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def write(path: Path, items: dict[str, tuple[str, list[int], bytes]], meta: dict | None = None) -> None:
    header: dict = {"__metadata__": meta} if meta else {}
    data = bytearray()
    for name, (dtype, shape, blob) in items.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    write_raw(path, header, bytes(data))


def _f32(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype=np.float32).copy()


def edit(fn: Callable[[dict], None], shard: str = SHARD) -> Callable[[Path], None]:
    """A setup editing the tensors of `hf/<shard>` (a dict name -> (dtype, shape, bytes)), rewritten consistently."""
    def setup(work: Path) -> None:
        path = work / "hf" / shard
        items, meta = tensors(path)
        fn(items)
        write(path, items, meta)
    return setup


def retype(name: str, dtype: str) -> Callable[[Path], None]:
    def fn(items: dict) -> None:
        _, shape, blob = items[name]
        values = _f32(blob)
        if dtype == "BF16":
            out = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        elif dtype == "F8_E4M3":
            out = np.clip(np.round(values * 8), -100, 100).astype(np.int8).tobytes()
        elif dtype == "BOOL":
            out = (values > 0).astype(np.bool_).tobytes()
        elif dtype.startswith(("I", "U")):
            out = np.round(values * 100).astype(NUMPY[dtype]).tobytes()
        else:
            out = values.astype(NUMPY[dtype]).tobytes()
        items[name] = (dtype, shape, out)
    return edit(fn)


def reshape(name: str, shape: list[int]) -> Callable[[Path], None]:
    """The tensor with another shape (its values cut or repeated to fit: a consistent file)."""
    def fn(items: dict) -> None:
        dtype, _, blob = items[name]
        values = _f32(blob)
        n = int(np.prod(shape)) if shape else 1
        items[name] = (dtype, shape, np.resize(values, n).astype(np.float32).tobytes())
    return edit(fn)


def poison(name: str, value: float, where: int = 0) -> Callable[[Path], None]:
    def fn(items: dict) -> None:
        dtype, shape, blob = items[name]
        values = _f32(blob)
        values[where] = value
        items[name] = (dtype, shape, values.tobytes())
    return edit(fn)


def drop(name: str) -> Callable[[Path], None]:
    return edit(lambda items: items.pop(name))


def add(name: str, dtype: str = "F32", shape: tuple[int, ...] = (4,)) -> Callable[[Path], None]:
    def fn(items: dict) -> None:
        items[name] = (dtype, list(shape), np.zeros(shape, dtype=np.float32).tobytes())
    return edit(fn)


def header_edit(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    """A setup changing the header only (the data stays): offsets, shapes or dtypes that lie."""
    def setup(work: Path) -> None:
        path = work / "hf" / SHARD
        header, data = read(path)
        fn(header)
        write_raw(path, header, data)
    return setup


def raw_edit(fn: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        path = work / "hf" / SHARD
        path.write_bytes(fn(path.read_bytes()))
    return setup


def json_edit(rel: str, fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        path = work / "hf" / rel
        data = json.loads(path.read_text())
        fn(data)
        path.write_text(json.dumps(data))
    return setup


def split_shards(work: Path) -> None:
    """The single shard as two (embed and head in the second) with an index naming both."""
    path = work / "hf" / SHARD
    items, meta = tensors(path)
    second = {k: items.pop(k) for k in ("lm_head.weight", EMBED)}
    path.unlink()
    write(work / "hf" / "model-00001-of-00002.safetensors", items, meta)
    write(work / "hf" / "model-00002-of-00002.safetensors", second, meta)
    index = json.loads((work / "hf" / INDEX).read_text())
    index["weight_map"] = {k: ("model-00002-of-00002.safetensors" if k in second else
                               "model-00001-of-00002.safetensors") for k in index["weight_map"]}
    (work / "hf" / INDEX).write_text(json.dumps(index))
