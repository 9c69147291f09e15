"""The "deep_gemm" backend's primitives: fprop and dgrad on DeepGEMM's grouped FP8 GEMM (sm90,
`m_grouped_fp8_gemm_nt_contiguous`: DeepSeek's kernel, with the block scaling overlapped with the next MMA, which
Spartron's Triton kernel cannot do), for the routed experts and for the dense linears (one group); the FP8 wgrad
and all quantisation on Spartron's Triton kernels (no host sync: cuBLAS's per-expert wgrad reads the counts on the
host, and that wait left the MoE layer host-bound at 8k rows). The dense linears ran on cuBLAS's blockwise
`scaled_mm` until 8531377: 2.46 ms of host time per linear forward + backward at V3's shapes against 1.28 ms on
the Triton GEMM (H100; the V3 rank's FP8 step is host-bound). The values are those of the "triton" backend
bitwise (GPU test).

DeepGEMM's contiguous grouped layout starts every group at a multiple of 128 rows; Spartron's routed rows
are packed. `padded_rows` maps them into the slot layout the wgrad already uses (group g's rows from
slot_start[g] * 128; quant.tile_slots bounds the slots statically, no host sync), and DeepGEMM's "psum" form of
the layout (each group's end row) makes it schedule only the groups' own tiles. The quantisation writes the
operand straight into the slots (`gemm_rows`: the row index it reads through; a slot row past its group's
count reads row 0, and no output keeps it), and fprop / dgrad gather their output back to the packed rows:
one bf16 copy per GEMM. One group whose rows fill whole tiles (a dense linear's or FFN's rows, a multiple of 128) is
its own slot layout: no layout kernel, no gather. The layout is computed once per op (`SlotCounts`), the routed experts'
once per experts forward for all their ops (`slot_layout`), by one Triton kernel
(triton_backend.slot_rows; `padded_rows` is its torch definition, which the GPU test holds it to).

DeepGEMM is an optional extra: `check_backend` says how to get it where it is missing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from spartron.layers.fp8 import quant, scaled_mm_backend
from spartron.layers.fp8.quant import TILE, rows_in_order, tile_slots

# the Triton quantisers, imported at first use (scaled_mm_backend's wrappers: this module loads without triton)
quantize_rows = scaled_mm_backend.quantize_rows
swiglu_quantize_rows = scaled_mm_backend.swiglu_quantize_rows
quantize_blocks = scaled_mm_backend.quantize_blocks
quantize_blocks_t = scaled_mm_backend.quantize_blocks_t
quantize_blocks_cat = scaled_mm_backend.quantize_blocks_cat
quantize_blocks_both = scaled_mm_backend.quantize_blocks_both


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


class SlotCounts:
    """The routed experts' counts on the device with the slot layout of the op's rows, computed at its first use
    and kept for the op (never read on the host). One group whose rows fill whole 128-row tiles (a dense linear's
    usual rows) is its own slot layout: no layout kernel and no gather."""

    dense = False

    def __init__(self, device: Tensor, rows: int | None = None):
        self.device = device
        self.rows = rows  # the op's rows: known up front for a dense linear, else set by its first GEMM
        self.layout: tuple[Tensor | None, Tensor | None, Tensor] | None = None

    def slots(self, rows: int) -> tuple[Tensor | None, Tensor | None, Tensor]:
        if self.rows is not None and rows != self.rows:
            raise ValueError(f"fp8 deep_gemm: one op's GEMMs take {self.rows} rows, got {rows}")
        if self.layout is None:
            self.rows = rows
            if self.device.numel() == 1 and rows % TILE == 0:  # the packed rows are the slot layout
                self.layout = (None, None, self.device)
            else:  # one Triton kernel on the GPU; its torch definition elsewhere (the CPU tests of this layout)
                slots = _triton().slot_rows if self.device.is_cuda else padded_rows
                self.layout = slots(self.device, rows)
        return self.layout


def group_counts(counts: Tensor | SlotCounts, layout: Sequence[Tensor] = ()) -> SlotCounts:
    """The counts with their slot layout (the routed experts', or a dense linear's one group): `layout` as
    slot_layout computed it for the experts' ops, else computed at the op's first GEMM."""
    if isinstance(counts, SlotCounts):
        return counts
    slots = SlotCounts(counts)
    if layout:
        source, dest, ends = layout
        slots.rows, slots.layout = dest.numel(), (source, dest, ends)
    return slots


def slot_layout(counts: Tensor, rows: int) -> list[Tensor]:
    """[source, dest, ends] of `rows` rows grouped by `counts` (padded_rows), computed once for the experts' ops
    (both forward ops, their AC replay and backward: one layout kernel per experts forward, not six). No rows
    (an EP rank that received none: the GEMMs of no rows read none) or one group (each op's own costs no kernel
    in whole tiles): none."""
    return list(SlotCounts(counts).slots(rows)) if rows and counts.numel() > 1 else []


def one_group(x2d: Tensor) -> SlotCounts:
    """A dense linear: one group of all rows, run as DeepGEMM's grouped GEMM like one expert."""
    return SlotCounts(quant.one_group(x2d), x2d.shape[0])


def quantize_cols_grouped(x: Tensor, counts, pow2: bool, index: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return _triton().quantize_cols_grouped(x, group_counts(counts).device, pow2, index)


def gemm_rows(counts: SlotCounts, rows: int, index: Tensor | None) -> Tensor | None:
    """The slot rows' source rows (of x, or of x[index]): the quantised operand is written in the slot layout.
    No rows at all stay as they are."""
    if rows == 0:
        return index
    source = counts.slots(rows)[0]
    if source is None:  # the packed rows are the slot layout
        return index
    return source if index is None else index.index_select(0, source)


def _triton():
    from spartron.layers.fp8 import triton_backend
    return triton_backend


def _deep_gemm():
    import deep_gemm  # checked by spartron.layers.fp8.apply.check_backend
    return deep_gemm


def _grouped(aq: Tensor, sa: Tensor, bq: Tensor, sb: Tensor, counts: SlotCounts, dtype: torch.dtype,
             rows: Tensor | None = None, k: int = 1) -> Tensor:
    """aq [T*128, K] e4m3 in the slot layout (scales [K/128, T*128]) @ bq[g] [N, K]^T (scales
    [G, N/128, K/128]) -> [M, N], the rows packed (`rows`, `k`: quant.rows_in_order of the packed rows, one
    gather from the slot layout for both)."""
    if dtype != torch.bfloat16:
        raise ValueError(f"model.fp8.backend = 'deep_gemm' writes bf16 outputs, the experts run in {dtype}")
    if not isinstance(counts, SlotCounts) or counts.layout is None:
        if aq.shape[0] == 0:
            return torch.empty(0 if rows is None else rows.numel() // k, bq.shape[1], dtype=dtype, device=aq.device)
        raise ValueError("fp8 deep_gemm: the grouped GEMM's rows must be quantised through gemm_rows (slot layout)")
    source, dest, ends = counts.layout
    slot_rows = counts.rows if source is None else source.numel()
    if aq.shape[0] != slot_rows:
        raise ValueError(f"fp8 deep_gemm: {aq.shape[0]} operand rows, the slot layout of {counts.rows} has "
                         f"{slot_rows}")
    out = torch.empty(aq.shape[0], bq.shape[1], dtype=dtype, device=aq.device)
    # sa.t(): [T*128, K/128] MN-major, the layout DeepGEMM reads (no copy); bq's scales may be a transposed view
    _deep_gemm().m_grouped_fp8_gemm_nt_contiguous((aq, sa.t()), (bq, sb), out, ends, use_psum_layout=True)
    if rows is not None:
        dest = rows if dest is None else dest.index_select(0, rows)
    return out if dest is None else rows_in_order(out, dest, k if rows is not None else 1)


def fprop(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, counts, dtype: torch.dtype) -> Tensor:
    """DeepGEMM on the slot-layout rows (a dense linear: one group)."""
    return _grouped(xq, xs, wq, ws, group_counts(counts), dtype)


def dgrad(gq: Tensor, gs: Tensor, wtq: Tensor, wts: Tensor, counts, dtype: torch.dtype,
          rows: Tensor | None = None, k: int = 1) -> Tensor:
    """dgrad contracts over N: w^T [G, K, N] as quantize_blocks_t wrote it (K-major for DeepGEMM: N is
    contiguous), its scales [G, K/128, N/128] a view. `rows`: the packed rows in that order, gathered from the
    slot layout at once (the experts' gradient back through their regrouping: one gather, not two), `k` > 1 each
    k consecutive of them summed in the same pass (quant.rows_in_order)."""
    return _grouped(gq, gs, wtq, wts, group_counts(counts), dtype, rows, k)


def wgrad(gt: Tensor, gts: Tensor, xt: Tensor, xts: Tensor, counts, dtype: torch.dtype) -> Tensor:
    """The Triton grouped wgrad on the slot-aligned columns (no host sync)."""
    return _triton().wgrad(gt, gts, xt, xts, group_counts(counts).device, dtype)
