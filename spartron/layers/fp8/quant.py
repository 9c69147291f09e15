"""Blockwise FP8 quantisation (DeepSeek-V3's recipe), the pure-torch reference every backend matches.

E4M3 values with one fp32 scale per tile; the scale is the DEQUANTISATION factor (value = q * scale),
the form cuBLAS, DeepGEMM and torch's `scaled_mm` take. Three tilings:
- rows, 1x128: one scale per row per 128 columns of the contraction dim (activations, output
  gradients of fprop and dgrad). Scales are stored [K/128, M] (column-major, as DeepGEMM and cuBLAS
  read them): `scale[k // 128, m]`.
- blocks, 128x128: one scale per 128x128 block of a weight [..., N, K] -> [..., N/128, K/128]. A block
  is the same block of the transposed weight, so dgrad's operand is fprop's quantised weight
  transposed (below).
- columns per group, 128x1 (wgrad): the operands of `grad_w = grad_out^T @ x` are scaled along the
  tokens, in tiles of 128 rows that restart at each expert's first row (a tile never mixes experts).
  Stored transposed and slot-aligned: q_t [C, T*128] (the tokens contiguous: the contraction dim of
  wgrad), T = M // 128 + E tile slots (a static bound, no host sync); tile b of group g fills columns
  (slot_start[g] + b) * 128 ... + 128, slot_start the exclusive cumsum of ceil(count / 128). Rows past
  a group's count and unused slots are zero, so a GEMM over a group's slots reads whole, 128-aligned
  tiles without masks (zeros add nothing). Scales [C, T] (slot t of column c), stored slot-major
  (strides (1, C): one slot's scales contiguous, the layout torch's 1x128 `scaled_mm` scales take);
  unused slots hold 0.
- blocks transposed (dgrad): q^T [..., K, N] of the same 128x128 blocks and the transposed scale grid
  [..., K/128, N/128], so dgrad reads the weight contraction-contiguous with no transposing copy.

Scales: amax / 448, or with `pow2` the next power of two at or above it (exact scaling, Megatron /
TransformerEngine's default for this recipe). An all-zero tile gets scale 1. Values are clamped to
+-448 before the cast (torch's e4m3fn cast is not saturating).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from spartron.layers.moe.combine import moe_slot_sum

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


def group_counts(counts: Tensor, layout: Sequence[Tensor] = ()) -> Tensor:
    """The group counts as a backend's GEMMs take them: this device tensor (the "reference" and "triton"
    backends; "torch_scaled_mm" reads them on the host once per op: its own group_counts). `layout`: slot_layout's
    (none here)."""
    return counts


def slot_layout(counts: Tensor, rows: int) -> list[Tensor]:
    """Where a backend's grouped GEMM reads `rows` rows grouped by `counts`, computed once for the experts' ops
    and handed to group_counts: none, the rows packed ("deep_gemm" starts each group at a 128-row slot: its own)."""
    return []


def gemm_rows(counts, rows: int, index: Tensor | None) -> Tensor | None:
    """The row index the quantiser reads a grouped fprop / dgrad operand through: `index` itself, the rows packed
    (the "deep_gemm" backend starts each group at a 128-row slot: its own gemm_rows)."""
    return index


def rows_in_order(out: Tensor, rows: Tensor | None, k: int = 1) -> Tensor:
    """A dgrad output's rows in the order `rows` names (every backend's dgrad takes it: the experts' gradient back
    through their regrouping); k > 1: each k consecutive of them summed (the one-rank replication of each token
    into its top-k slots, spartron.layers.moe.combine.moe_slot_sum: on CUDA one pass, not a gather then a sum)."""
    if rows is None:
        return out
    return out.index_select(0, rows) if k == 1 else moe_slot_sum(out, rows, k)


def one_group(x2d: Tensor) -> Tensor:
    """The counts of a dense linear: one group of all rows, filled on the device (torch.tensor from a host list
    is a synchronous copy on CUDA: one host sync per FP8 linear call)."""
    return torch.full((1,), x2d.shape[0], dtype=torch.int32, device=x2d.device)


def tile_slots(rows: int, groups: int) -> int:
    """The static number of 128-row tile slots of `rows` rows split into `groups` groups."""
    return rows // TILE + groups


def slot_starts(counts: Tensor) -> Tensor:
    """Exclusive cumsum of each group's tile count: the first slot of each group."""
    tiles = (counts.long() + TILE - 1) // TILE
    return torch.cumsum(tiles, 0) - tiles


def quantize_blocks_t(w: Tensor, pow2: bool = True) -> tuple[Tensor, Tensor]:
    """w [..., N, K] -> (q^T [..., K, N] e4m3, scales [..., K/128, N/128]): quantize_blocks' values and
    scales, transposed (dgrad's operand)."""
    q, s = quantize_blocks(w, pow2)
    return q.transpose(-2, -1).contiguous(), s.transpose(-2, -1)


def token_columns(counts: Tensor) -> Tensor:
    """The column of each token (row of x) in the slot-aligned column layout: token p of group g sits
    at slot_start[g] * 128 + p."""
    counts = counts.long().cpu()
    groups = torch.repeat_interleave(torch.arange(len(counts)), counts)
    row_start = torch.cumsum(counts, 0) - counts
    return torch.arange(int(counts.sum())) - row_start[groups] + slot_starts(counts)[groups] * TILE


def quantize_cols_grouped(x: Tensor, counts: Tensor, pow2: bool = True) -> tuple[Tensor, Tensor]:
    """x [M, C] with rows grouped by `counts` -> (q_t [C, T*128] e4m3, scales [C, T] fp32): 128x1 tiles
    along M restarting at every group, slot-aligned (reads the counts on the host: the reference backend)."""
    m, c = x.shape
    slots = tile_slots(m, len(counts))
    if int(counts.sum()) != m:
        raise ValueError(f"fp8 blockwise: tokens_per_expert sums to {int(counts.sum())}, x has {m} rows")
    padded = torch.zeros(slots * TILE, c, dtype=x.dtype, device=x.device)
    padded[token_columns(counts).to(x.device)] = x
    tiles = padded.t().reshape(c, slots, TILE)
    scales = tile_scales(tiles.abs().amax(dim=-1), pow2)  # [C, T]; an all-zero (unused) slot gets 1 here
    q_t = _cast(tiles, scales[..., None]).reshape(c, slots * TILE).contiguous()  # row-major, as the kernels'
    used = torch.arange(slots) < int(((counts.long() + TILE - 1) // TILE).sum())
    scales = torch.where(used.to(x.device), scales, torch.zeros_like(scales))
    return q_t, scales.t().contiguous().t()


def dequantize_cols_grouped(q_t: Tensor, scales: Tensor, counts: Tensor) -> Tensor:
    """The [C, M] fp32 values of quantize_cols_grouped's output, in token order."""
    c, width = q_t.shape
    values = q_t.float().reshape(c, width // TILE, TILE) * scales[..., None]
    return values.reshape(c, width)[:, token_columns(counts).to(q_t.device)]
