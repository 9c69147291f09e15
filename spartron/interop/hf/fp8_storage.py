"""DeepSeek's FP8 checkpoints (the released DeepSeek-V3 / V3.2 weights): their linear weights stored as E4M3 with
one `<name>_scale_inv` per block of `weight_block_size` (128 x 128), declared by config.json's
`quantization_config` = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}.

Imported dequantised: value = float32(e4m3) * its block's scale_inv, computed in float32 and rounded to the
model's dtype as it is copied in, which is what DeepSeek's own conversion script (fp8_cast_bf16) computes. The
other tensors of such a checkpoint (embeddings, head, norms, the router and its bias) are read as they are.
Checked from the headers before anything is read: every E4M3 tensor has its scale, every scale its E4M3 weight,
of the block grid's shape; a NaN or Inf scale shows as a non-finite value when the weight is read.

Exported the same way on request (`spartron convert --to-hf DIR --fp8-weights`, for serving engines that read
DeepSeek's release format): the decoder layers' 2-D weights as E4M3 in 128 x 128 blocks, each scaled by its
amax / 448 in float32 (`quantize`), the rest as they are. Imported back, a weight is `quantize` then `dequantize`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from spartron.interop.hf.header import TensorInfo
from spartron.interop.hf.names import Box
from spartron.layers.fp8.quant import TILE, quantize_blocks

FP8 = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"
SCALE_DTYPES = ("F32", "BF16")
KNOWN_KEYS = {"quant_method", "fmt", "weight_block_size", "activation_scheme", "modules_to_not_convert"}
# config.json's quantization_config of an export with FP8 weights: DeepSeek-V3's release's
EXPORT_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [128, 128]}
EXPORT_BLOCK = (TILE, TILE)
# 2-D tensors of the decoder layers that DeepSeek's release keeps in bf16: the router's gate, the V3.2 indexer's
# head weights (its inference code reads them in float32), an MTP layer's embedding and head
_KEPT = ("mlp.gate.weight", "indexer.weights_proj.weight", "embed_tokens.weight", "shared_head.head.weight")


def stored_in_fp8(hf_name: str, shape: tuple[int, ...]) -> bool:
    """Whether an export with FP8 weights stores this tensor as E4M3 (as DeepSeek's release does)."""
    return hf_name.startswith("model.layers.") and len(shape) == 2 and not hf_name.endswith(_KEPT)


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale_inv tensor's shape of a [rows, cols] weight: one per block, partial blocks at the edges included."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def stored_bytes(shape: tuple[int, ...], dtype: torch.dtype, in_fp8: bool) -> int:
    """The bytes a tensor takes in an export: in its dtype, or (in_fp8) E4M3 values and a float32 scale a block."""
    if in_fp8:
        return math.prod(shape) + 4 * math.prod(scale_grid(shape, EXPORT_BLOCK))
    return math.prod(shape) * dtype.itemsize


def quantize(w: Tensor) -> tuple[Tensor, Tensor]:
    """A [rows, cols] weight -> (its E4M3 values, float32 scale_inv per 128 x 128 block): the training recipe's
    block quantisation (spartron.layers.fp8.quant.quantize_blocks, scales amax / 448 as DeepSeek's release has
    them, not rounded to powers of two) of w zero-padded to whole blocks, so a partial block at an edge is scaled
    by its own values. `dequantize` multiplies them back."""
    rows, cols = w.shape
    grid = scale_grid(w.shape, EXPORT_BLOCK)
    padded = w.new_zeros(grid[0] * TILE, grid[1] * TILE, dtype=torch.float32)
    padded[:rows, :cols] = w
    q, scales = quantize_blocks(padded, pow2=False)
    return q[:rows, :cols].contiguous(), scales


def storage_block(quantization: object) -> tuple[int, int] | str:
    """The (rows, cols) scale block of a config.json `quantization_config` Spartron reads, or why it cannot."""
    if not isinstance(quantization, dict):
        return "must be a JSON object (DeepSeek's blockwise FP8) or absent"
    unknown = sorted(set(quantization) - KNOWN_KEYS)
    if unknown:
        return f"unknown keys {unknown}: Spartron reads DeepSeek's blockwise FP8 only"
    if quantization.get("quant_method") != "fp8" or quantization.get("fmt", "e4m3") != "e4m3":
        return ("Spartron reads DeepSeek's blockwise FP8 (quant_method 'fp8', fmt 'e4m3'); dequantize other "
                "formats to bfloat16 first")
    if quantization.get("activation_scheme", "dynamic") != "dynamic":
        return "activation_scheme must be 'dynamic' (static activation scales are an inference format)"
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 65536 for b in block)):
        return f"weight_block_size {block!r} must be two integers in 1..65536"
    return block[0], block[1]


def scaled_weights(infos: dict[str, TensorInfo], block: tuple[int, int] | None) -> tuple[dict[str, str], str | None]:
    """({E4M3 weight: its scale's name}, None) of a checkpoint's headers, or ({}, why they do not fit `block`: a
    scale without its E4M3 weight, an E4M3 weight without its scale, a scale of another shape or dtype)."""
    if block is None:
        return {}, None  # no quantization_config: a scale is an unexpected tensor, an E4M3 weight a refused dtype
    out = {}
    for scale in sorted(name for name in infos if name.endswith(SCALE_SUFFIX)):
        weight = scale.removesuffix(SCALE_SUFFIX)
        if weight not in infos or infos[weight].dtype != FP8:
            return {}, f"{scale} scales no {FP8} tensor {weight}"
        shape, info = infos[weight].shape, infos[scale]
        if len(shape) != 2:
            return {}, f"{weight} is {FP8} of shape {list(shape)}: only matrices are stored blockwise"
        grid = scale_grid(shape, block)
        if info.dtype not in SCALE_DTYPES or info.shape != grid:
            return {}, (f"{scale} is {info.dtype} {list(info.shape)}; {list(shape)} in blocks of {list(block)} "
                        f"needs float32 or bfloat16 {list(grid)}")
        out[weight] = scale
    bare = sorted(n for n, info in infos.items() if info.dtype == FP8 and n not in out)
    if bare:
        return {}, f"{bare[0]} is {FP8} without its {bare[0]}{SCALE_SUFFIX}"
    return out, None


def scale_box(src: Box, block: tuple[int, int]) -> Box:
    """The blocks of the scale grid that cover the weight's box `src`."""
    return tuple((a // b, -(-e // b)) for (a, e), b in zip(src, block, strict=True))


def dequantize(values: Tensor, scales: Tensor, src: Box, block: tuple[int, int]) -> Tensor:
    """float32 values of the E4M3 box `src` of a weight: each times its block's scale (`scales`: the blocks
    scale_box(src) covers), in float32."""
    full = scales.float()
    for dim, b in enumerate(block):
        full = full.repeat_interleave(b, dim=dim)
    crop = tuple(slice(a - (a // b) * b, a - (a // b) * b + (e - a)) for (a, e), b in zip(src, block, strict=True))
    return values.to(torch.float32) * full[crop]
