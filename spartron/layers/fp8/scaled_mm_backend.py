"""The "torch_scaled_mm" backend's primitives: every FP8 GEMM through torch's blockwise `scaled_mm`
(cuBLASLt's DeepSeek-style scaling, sm90), with Spartron's Triton quantisation (the same values as
the "triton" backend: spartron.layers.fp8.triton_backend).

Grouped GEMMs run one cuBLAS GEMM per group (per local expert) on its rows, as TransformerEngine's
GroupedLinear does: the group sizes are read on the host once per op (`group_counts`, one device
sync), each GEMM writes its rows of the output in place (`_scaled_mm_v2.out`). cuBLASLt overlaps the
block scaling with the next tile's MMAs, which the Triton kernel cannot (docs/FP8.md); the loop costs a
launch per group, which pays for few large groups (DeepSeek-V3's 8 local experts), not for many small
ones (64 experts at dim 2048: use "triton" there; benchmarks/fp8_moe.py measures both).

`F.scaled_mm` (torch's `_scaled_mm_v2`) checks its scale layouts, and they are not Spartron's:
- 1x128 scales of an [R, K] operand: [R, K/128] with strides (1, R) (outer-dim-major). Spartron's
  row scales [K/128, R] are that buffer (a `.t()` view; one group's rows a small copy), its column
  scales [C, T] are stored slot-major (strides (1, C)): a group's slots are a view.
- 128x128 scales of the right operand [K, N] (contraction first): [L4, N/128] with strides (1, L4),
  L4 = K/128 rounded up to a multiple of 4 (cuBLASLt's padding): one padded copy for all groups.
- wgrad contracts over the tokens in the slot-aligned column layout: a group's slots are whole
  128-token tiles, zero past its count, so any group size works.
`group_operands` builds each GEMM's arguments; it is pure torch, tested against torch's own shape and
stride checks on the meta device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from spartron.layers.fp8.quant import TILE

ROW, BLOCK = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128


class GroupCounts(NamedTuple):
    """The rows of each group on the device (what the quantisation kernels read) and on the host (what
    the per-group GEMM loop slices by)."""
    device: Tensor
    host: list[int]


def group_counts(counts: Tensor | GroupCounts) -> GroupCounts:
    return counts if isinstance(counts, GroupCounts) else GroupCounts(counts, counts.tolist())


def one_group(x2d: Tensor) -> GroupCounts:
    """A dense linear: one group of all rows (known on the host: no sync)."""
    m = x2d.shape[0]
    return GroupCounts(torch.tensor([m], dtype=torch.int32, device=x2d.device), [m])


def _triton():
    """The Triton backend (imported at first use: the layouts below are tested where triton is absent)."""
    from spartron.layers.fp8 import triton_backend
    return triton_backend


def quantize_rows(x: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    return _triton().quantize_rows(x, pow2)


def swiglu_quantize_rows(gate: Tensor, up: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    return _triton().swiglu_quantize_rows(gate, up, pow2)


def quantize_blocks(w: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    return _triton().quantize_blocks(w, pow2)


def quantize_blocks_t(w: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    return _triton().quantize_blocks_t(w, pow2)


def quantize_blocks_cat(weights: tuple[Tensor, ...], pow2: bool, transpose: bool = False) -> tuple[Tensor, Tensor]:
    return _triton().quantize_blocks_cat(weights, pow2, transpose)


def quantize_blocks_both(weights: tuple[Tensor, ...], pow2: bool) -> list[Tensor]:
    return _triton().quantize_blocks_both(weights, pow2)


def quantize_cols_grouped(x: Tensor, counts: Tensor | GroupCounts, pow2: bool) -> tuple[Tensor, Tensor]:
    return _triton().quantize_cols_grouped(x, group_counts(counts).device, pow2)


def block_scales(s: Tensor) -> Tensor:
    """128x128 scales [G, N/128, K/128] of right operands [K, N] (K the contraction; any strides) ->
    torch's [G, L4, N/128], each group strides (1, L4), rows past K/128 zero (cuBLASLt reads none)."""
    g, nb, kb = s.shape
    out = torch.zeros(g, nb, -(-kb // 4) * 4, dtype=s.dtype, device=s.device)
    out[..., :kb] = s
    return out.transpose(-2, -1)


def _rows_scale(s: Tensor, r0: int, rows: int) -> Tensor:
    """Rows r0 ... r0 + rows of 1x128 scales [K/128, M] -> torch's [rows, K/128], strides exactly (1, rows)
    (a fresh buffer: `.contiguous()` keeps a slice's strides when K/128 is 1, and torch refuses them)."""
    out = torch.empty(s.shape[0], rows, dtype=s.dtype, device=s.device)
    out.copy_(s[:, r0:r0 + rows])
    return out.t()


def _row_ranges(counts: GroupCounts, rows: int) -> list[tuple[int, int, int]]:
    """(group, first row, row count) of every non-empty group."""
    if sum(counts.host) != rows:
        raise ValueError(f"fp8 blockwise: tokens_per_expert sums to {sum(counts.host)}, x has {rows} rows")
    starts = [sum(counts.host[:g]) for g in range(len(counts.host))]
    return [(g, r0, c) for g, (r0, c) in enumerate(zip(starts, counts.host, strict=True)) if c]


def _slot_ranges(counts: GroupCounts) -> list[tuple[int, int, int]]:
    """(group, first slot, slot count) of every non-empty group in the slot-aligned column layout."""
    tiles = [-(-c // TILE) for c in counts.host]
    starts = [sum(tiles[:g]) for g in range(len(tiles))]
    return [(g, t0, t) for g, (t0, t) in enumerate(zip(starts, tiles, strict=True)) if t]


def group_operands(kind: str, a: Tensor, sa: Tensor, b: Tensor, sb: Tensor,
                   counts: GroupCounts) -> list[tuple[int, slice, tuple]]:
    """(group, its output rows or None for all, `F.scaled_mm`'s first six arguments) of each non-empty group.

    fprop: a = x [M, K] (scales [K/128, M]), b = w [G, N, K] (scales [G, N/128, K/128]).
    dgrad: a = grad [M, N] (scales [N/128, M]), b = w^T [G, K, N] as quantize_blocks_t wrote it
    (scales [G, K/128, N/128], a view): b[g].t() is the column-major right operand, no copy.
    wgrad: a = grad^T [N, L], b = x^T [K, L] in the slot-aligned layout, scales [*, T] slot-major.
    """
    if kind == "wgrad":
        return [(g, None, (a[:, t0 * TILE:(t0 + t) * TILE], b[:, t0 * TILE:(t0 + t) * TILE].t(),
                           sa[:, t0:t0 + t], ROW, sb[:, t0:t0 + t], ROW))
                for g, t0, t in _slot_ranges(counts)]
    whole = len(counts.host) == 1
    scales_b = block_scales(sb)
    return [(g, slice(r0, r0 + c), (a[r0:r0 + c], b[g].t(), sa.t() if whole else _rows_scale(sa, r0, c),
                                    ROW, scales_b[g], BLOCK))
            for g, r0, c in _row_ranges(counts, a.shape[0])]


def _scaled_mm_into(out: Tensor, a: Tensor, b: Tensor, sa: Tensor, ra, sb: Tensor, rb) -> None:
    torch.ops.aten._scaled_mm_v2.out(a, b, [sa], [ra.value], [], [sb], [rb.value], [], None, out.dtype, [], False,
                                     out=out)


def _rows_gemm(kind: str, a, sa, b, sb, counts, dtype: torch.dtype) -> Tensor:
    counts = group_counts(counts)
    out = torch.empty(a.shape[0], b.shape[1], dtype=dtype, device=a.device)
    for _, rows, args in group_operands(kind, a, sa, b, sb, counts):
        _scaled_mm_into(out[rows], *args)
    return out


def fprop(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, counts, dtype: torch.dtype) -> Tensor:
    return _rows_gemm("fprop", xq, xs, wq, ws, counts, dtype)


def dgrad(gq: Tensor, gs: Tensor, wtq: Tensor, wts: Tensor, counts, dtype: torch.dtype) -> Tensor:
    return _rows_gemm("dgrad", gq, gs, wtq, wts, counts, dtype)


def wgrad(gt: Tensor, gts: Tensor, xt: Tensor, xts: Tensor, counts, dtype: torch.dtype) -> Tensor:
    """-> dw [G, N, K]; a group with no rows gets zeros (its gradient)."""
    counts = group_counts(counts)
    dw = torch.zeros(len(counts.host), gt.shape[0], xt.shape[0], dtype=dtype, device=gt.device) \
        if 0 in counts.host else torch.empty(len(counts.host), gt.shape[0], xt.shape[0], dtype=dtype, device=gt.device)
    for g, _, args in group_operands("wgrad", gt, gts, xt, xts, counts):
        _scaled_mm_into(dw[g], *args)
    return dw
