"""The "deep_gemm" backend's primitives: the routed experts' fprop and dgrad on DeepGEMM's grouped FP8 GEMM
(sm90, `m_grouped_fp8_gemm_nt_contiguous`: DeepSeek's kernel, with the block scaling overlapped with the
next MMA, which Spartron's Triton kernel cannot do); everything else as "torch_scaled_mm" does it (the dense
linears and the experts' wgrad on cuBLAS, the quantisation on Spartron's Triton kernels:
spartron.layers.fp8.scaled_mm_backend). The values are those of the other backends: the same quantisation,
and the GEMMs equal the Triton kernel's bitwise (GPU test).

DeepGEMM's contiguous grouped layout starts every group at a multiple of 128 rows; Spartron's routed rows
are packed. `padded_rows` maps the packed rows into the slot layout the wgrad already uses (group g's rows
from slot_start[g] * 128; quant.tile_slots bounds the slots statically, no host sync), and DeepGEMM's
"psum" form of the layout (each group's end row) makes it schedule only the groups' own tiles. The
quantised rows are gathered into that layout and the output gathered back: two copies per GEMM.

DeepGEMM is an optional extra: `check_backend` says how to get it where it is missing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spartron.layers.fp8 import scaled_mm_backend as cublas
from spartron.layers.fp8.quant import TILE, tile_slots

group_counts = cublas.group_counts
one_group = cublas.one_group
quantize_rows = cublas.quantize_rows
swiglu_quantize_rows = cublas.swiglu_quantize_rows
quantize_blocks = cublas.quantize_blocks
quantize_blocks_t = cublas.quantize_blocks_t
quantize_blocks_cat = cublas.quantize_blocks_cat
quantize_blocks_both = cublas.quantize_blocks_both
quantize_cols_grouped = cublas.quantize_cols_grouped
wgrad = cublas.wgrad


def padded_rows(counts: Tensor, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """The slot layout of `rows` packed rows grouped by `counts` [G] (device ops, no host sync) ->
    (source [T*128]: the packed row each slot row reads (0 for the rows past a group's count, which no
    output keeps), dest [rows]: the slot row of each packed row, ends [G] int32: each group's last slot
    row + 1, DeepGEMM's psum layout). T = quant.tile_slots(rows, G)."""
    c = counts.long()
    tiles = (c + TILE - 1) // TILE
    slot_end = torch.cumsum(tiles, 0)
    first = (slot_end - tiles) * TILE  # each group's first slot row
    row_start = torch.cumsum(c, 0) - c
    slot_rows = torch.arange(tile_slots(rows, c.numel()) * TILE, device=c.device)
    group = torch.searchsorted(slot_end, slot_rows // TILE, right=True).clamp(max=c.numel() - 1)
    offset = slot_rows - first[group]
    source = torch.where(offset < c[group], row_start[group] + offset, torch.zeros_like(offset))
    packed = torch.arange(rows, device=c.device)
    packed_group = torch.searchsorted(torch.cumsum(c, 0), packed, right=True)
    dest = first[packed_group] + packed - row_start[packed_group]
    return source, dest, (first + c).to(torch.int32)


def _deep_gemm():
    import deep_gemm  # checked by spartron.layers.fp8.apply.check_backend
    return deep_gemm


def _grouped(aq: Tensor, sa: Tensor, bq: Tensor, sb: Tensor, counts: Tensor, dtype: torch.dtype) -> Tensor:
    """aq [M, K] e4m3 grouped by counts (scales [K/128, M]) @ bq[g] [N, K]^T (scales [G, N/128, K/128])."""
    if dtype != torch.bfloat16:
        raise ValueError(f"model.fp8.backend = 'deep_gemm' writes bf16 outputs, the experts run in {dtype}")
    m = aq.shape[0]
    source, dest, ends = padded_rows(counts, m)
    a = aq.view(torch.uint8).index_select(0, source).view(aq.dtype)
    scales = sa.index_select(1, source)  # [K/128, T*128]: .t() is the MN-major layout DeepGEMM reads, no copy
    out = torch.empty(source.numel(), bq.shape[1], dtype=dtype, device=aq.device)
    if m:
        _deep_gemm().m_grouped_fp8_gemm_nt_contiguous((a, scales.t()), (bq, sb), out, ends, use_psum_layout=True)
    return out.index_select(0, dest)


def fprop(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, counts, dtype: torch.dtype) -> Tensor:
    """A dense linear: cuBLAS; the routed experts: DeepGEMM."""
    counts = group_counts(counts)
    if counts.dense:
        return cublas.fprop(xq, xs, wq, ws, counts, dtype)
    return _grouped(xq, xs, wq, ws, counts.device, dtype)


def dgrad(gq: Tensor, gs: Tensor, wtq: Tensor, wts: Tensor, counts, dtype: torch.dtype) -> Tensor:
    """dgrad contracts over N: w^T [G, K, N] as quantize_blocks_t wrote it (K-major for DeepGEMM: N is
    contiguous), its scales [G, K/128, N/128] a view."""
    counts = group_counts(counts)
    if counts.dense:
        return cublas.dgrad(gq, gs, wtq, wts, counts, dtype)
    return _grouped(gq, gs, wtq, wts, counts.device, dtype)
