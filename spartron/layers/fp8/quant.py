"""Blockwise FP8 quantisation (DeepSeek-V3's recipe), the pure-torch reference every backend matches.

E4M3 values with one fp32 scale per tile; the scale is the DEQUANTISATION factor (value = q * scale),
the form cuBLAS, DeepGEMM and torch's `scaled_mm` take. Three tilings:
- rows, 1x128: one scale per row per 128 columns of the contraction dim (activations, output
  gradients of fprop and dgrad). Scales are stored [K/128, M] (column-major, as DeepGEMM and cuBLAS
  read them): `scale[k // 128, m]`.
- blocks, 128x128: one scale per 128x128 block of a weight [..., N, K] -> [..., N/128, K/128]. A block
  is the same block of the transposed weight, so dgrad reuses fprop's quantised weight.
- columns per group, 128x1 (wgrad): the operands of `grad_w = grad_out^T @ x` are scaled along the
  tokens, in tiles of 128 rows that restart at each expert's first row (a tile never mixes experts).
  Stored transposed ([C, M], the tokens contiguous: the contraction dim of wgrad) with scales
  [C, T] where T = M // 128 + E tile slots (a static bound, no host sync): tile b of group g is slot
  `slot_start[g] + b`, slot_start the exclusive cumsum of ceil(count / 128). Unused slots hold 0.

Scales: amax / 448, or with `pow2` the next power of two at or above it (exact scaling, Megatron /
TransformerEngine's default for this recipe). An all-zero tile gets scale 1. Values are clamped to
+-448 before the cast (torch's e4m3fn cast is not saturating).
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TILE = 128


def tile_scales(amax: Tensor, pow2: bool) -> Tensor:
    """Dequantisation scales from per-tile amax (fp32)."""
    amax = amax.float()
    # tensor / tensor: on CUDA, torch divides by a Python scalar as a multiply by its reciprocal (not correctly
    # rounded); the Triton kernels divide correctly rounded (div_rn), as this does on every device
    scale = amax / torch.full_like(amax, FP8_MAX)
    if pow2:  # round the exponent up when any mantissa bit is set: exact, no log2 (the kernels do the same)
        bits = scale.view(torch.int32)
        exponent = bits & 0x7F800000
        scale = torch.where((bits & 0x007FFFFF) != 0, exponent + 0x00800000, exponent).view(torch.float32)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _cast(x: Tensor, scale: Tensor) -> Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def check_tiled(name: str, size: int) -> None:
    if size % TILE:
        raise ValueError(f"fp8 blockwise: {name} {size} is not a multiple of {TILE}")


def quantize_rows(x: Tensor, pow2: bool = True) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scales [K/128, M] fp32): 1x128 tiles along K."""
    m, k = x.shape
    check_tiled("contraction dim", k)
    tiles = x.reshape(m, k // TILE, TILE)
    scale = tile_scales(tiles.abs().amax(dim=-1), pow2)  # [M, K/128]
    q = _cast(tiles, scale.unsqueeze(-1)).reshape(m, k)
    return q, scale.t().contiguous()


def dequantize_rows(q: Tensor, scale: Tensor) -> Tensor:
    m, k = q.shape
    return (q.float().reshape(m, k // TILE, TILE) * scale.t().unsqueeze(-1)).reshape(m, k)


def quantize_blocks(w: Tensor, pow2: bool = True) -> tuple[Tensor, Tensor]:
    """w [..., N, K] -> (q [..., N, K] e4m3, scales [..., N/128, K/128] fp32): 128x128 blocks."""
    *lead, n, k = w.shape
    check_tiled("weight rows", n)
    check_tiled("weight columns", k)
    blocks = w.reshape(*lead, n // TILE, TILE, k // TILE, TILE)
    scale = tile_scales(blocks.abs().amax(dim=(-3, -1)), pow2)  # [..., N/128, K/128]
    q = _cast(blocks, scale[..., :, None, :, None]).reshape(w.shape)
    return q, scale


def dequantize_blocks(q: Tensor, scale: Tensor) -> Tensor:
    *lead, n, k = q.shape
    blocks = q.float().reshape(*lead, n // TILE, TILE, k // TILE, TILE)
    return (blocks * scale[..., :, None, :, None]).reshape(q.shape)


def tile_slots(rows: int, groups: int) -> int:
    """The static number of 128-row tile slots of `rows` rows split into `groups` groups."""
    return rows // TILE + groups


def slot_starts(counts: Tensor) -> Tensor:
    """Exclusive cumsum of each group's tile count: the first slot of each group."""
    tiles = (counts.long() + TILE - 1) // TILE
    return torch.cumsum(tiles, 0) - tiles


def quantize_cols_grouped(x: Tensor, counts: Tensor, pow2: bool = True) -> tuple[Tensor, Tensor]:
    """x [M, C] with rows grouped by `counts` -> (q_t [C, M] e4m3, scales [C, T] fp32): 128x1 tiles
    along M restarting at every group (reads the counts on the host: the reference backend)."""
    m, c = x.shape
    q_t = torch.empty(c, m, dtype=FP8, device=x.device)
    scales = torch.zeros(c, tile_slots(m, len(counts)), dtype=torch.float32, device=x.device)
    start, slot = 0, 0
    for count in counts.tolist():
        for lo in range(start, start + count, TILE):
            hi = min(lo + TILE, start + count)
            tile = x[lo:hi].t()  # [C, rows]
            scale = tile_scales(tile.abs().amax(dim=1), pow2)
            q_t[:, lo:hi] = _cast(tile, scale[:, None])
            scales[:, slot] = scale
            slot += 1
        start += count
    if start != m:
        raise ValueError(f"fp8 blockwise: tokens_per_expert sums to {start}, x has {m} rows")
    return q_t, scales


def dequantize_cols_grouped(q_t: Tensor, scales: Tensor, counts: Tensor) -> Tensor:
    """The [C, M] fp32 values of quantize_cols_grouped's output."""
    out = q_t.float()
    start, slot = 0, 0
    for count in counts.tolist():
        for lo in range(start, start + count, TILE):
            hi = min(lo + TILE, start + count)
            out[:, lo:hi] *= scales[:, slot:slot + 1]
            slot += 1
        start += count
    return out
