"""Reading one box of a Hugging Face tensor from an open safetensors shard: as stored, or dequantised when the
checkpoint stores it as DeepSeek's FP8 (spartron.interop.hf.fp8_storage); every value checked finite."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from spartron.interop.hf.folder import CONFIG, MAX_CONFIG_BYTES, HFCheckpointError, read_json
from spartron.interop.hf.fp8_storage import dequantize, scale_box, storage_block
from spartron.interop.hf.names import Box


def box_index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def finite_read(path: Path, name: str, t: Tensor) -> Tensor:
    """`t` (the part of `name` this rank reads), refused if any value is NaN or Inf: a run would train into a
    NaN loss at its first step, and a converted state would only be refused at save, naming Spartron's tensor."""
    if not bool(torch.isfinite(t).all()):
        raise HFCheckpointError(f"{path}: {name} holds non-finite values (NaN or Inf): nothing is imported "
                                "from a checkpoint with them")
    return t


def storage_block_of(hf_dir: Path) -> tuple[int, int] | None:
    """config.json's FP8 scale block (model_config_from_hf checks it too), or None: not quantized."""
    quantization = read_json(hf_dir / CONFIG, MAX_CONFIG_BYTES).get("quantization_config")
    block = None if quantization is None else storage_block(quantization)
    if isinstance(block, str):
        raise HFCheckpointError(f"{hf_dir / CONFIG}: quantization_config {quantization!r}: {block}")
    return block


class BoxReader:
    """Boxes of a checkpoint's tensors; `fp8` maps each E4M3-stored weight to its scale's name (scaled_weights)
    and `block` is config.json's scale block (storage_block_of), the scales read from whichever shard holds them
    (`safe_open`: safetensors')."""

    def __init__(self, hf_dir: Path, files: dict[str, str], fp8: dict[str, str], block: tuple[int, int] | None,
                 safe_open: Callable) -> None:
        self.hf_dir, self.files, self.fp8, self.block, self.safe_open = hf_dir, files, fp8, block, safe_open

    def read(self, f, file: str, name: str, src: Box) -> Tensor:  # noqa: ANN001 - a safetensors safe_open handle
        values = f.get_slice(name)[box_index(src)]
        scale = self.fp8.get(name)
        if scale is None:
            return finite_read(self.hf_dir / file, name, values)
        box = box_index(scale_box(src, self.block))
        if self.files[scale] == file:
            scales = f.get_slice(scale)[box]
        else:
            with self.safe_open(str(self.hf_dir / self.files[scale]), framework="pt") as g:
                scales = g.get_slice(scale)[box]
        return finite_read(self.hf_dir / file, name, dequantize(values, scales, src, self.block))
