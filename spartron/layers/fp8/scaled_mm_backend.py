"""The "torch_scaled_mm" backend's primitives: FP8 GEMMs through torch's blockwise `scaled_mm`
(cuBLASLt's DeepSeek-style scaling, sm90) where it measured faster than the Triton kernels, with
Spartron's Triton quantisation (the same values as the "triton" backend: spartron.layers.fp8.triton_backend).

Which GEMM runs where (the measurements: docs/KERNEL_NOTES.md, "FP8 GEMMs"):
- A dense linear (one group): fprop, dgrad and wgrad on cuBLAS.
- The routed experts' wgrad: one cuBLAS GEMM per local expert over its 128-token slots, each writing its
  expert's gradient in place (`_scaled_mm_v2.out`); cuBLAS overlaps the block scaling with the next
  MMA, which the Triton kernel cannot. The group sizes are read on the host once per op (copied when
  the op starts, waited for before the loop: TransformerEngine's GroupedLinear takes its split sizes
  on the host too).
- The routed experts' fprop and dgrad: the Triton grouped kernel (one cuBLAS GEMM per expert of a
  thousand rows is slower than it).
With many small experts the per-expert wgrad loop costs more in launches than it gains: "triton" there.

`F.scaled_mm` (torch's `_scaled_mm_v2`) checks its scale layouts, and they are not Spartron's:
- 1x128 scales of an [R, K] operand: [R, K/128] with strides (1, R) (outer-dim-major). Spartron's
  row scales [K/128, R] are that buffer (a `.t()` view), its column
  scales [C, T] are stored slot-major (strides (1, C)): a group's slots are a view.
- 128x128 scales of the right operand [K, N] (contraction first): [L4, N/128] with strides (1, L4),
  L4 = K/128 rounded up to a multiple of 4 (cuBLASLt's padding): one padded copy for all groups.
- wgrad contracts over the tokens in the slot-aligned column layout: a group's slots are whole
  128-token tiles, zero past its count, so any group size works.
`group_operands` builds each cuBLAS GEMM's arguments; it is pure torch, tested against torch's own shape and
stride checks on the meta device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from spartron.layers.fp8.quant import TILE, gemm_rows, rows_in_order, slot_layout  # noqa: F401 (this backend's rows stay packed)

ROW, BLOCK = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128


class GroupCounts:
    """The rows of each group on the device (what the kernels read) and on the host (what the per-group
    cuBLAS loop slices by). On CUDA the copy to the host starts when the op starts (pinned, asynchronous,
    an event after it) and `host` waits for that event only: the host then waits for the work queued before
    this op, not for the op's own dgrad and quantisation kernels, which keep the GPU busy while the host
    launches the loop. An op that runs no loop (the experts' forward) never waits."""

    def __init__(self, device: Tensor | None, host: list[int] | None = None, dense: bool = False,
                 on: torch.device | None = None):
        self._device, self._on = device, on  # None: a dense linear's, filled on `on` when first read
        self.dense = dense  # a dense linear's one group (one_group): its fprop and dgrad run on cuBLAS
        self._host = host
        self._copy = None
        if host is None and device.is_cuda:
            pinned = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
            pinned.copy_(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copy = (pinned, event)

    @property
    def device(self) -> Tensor:
        if self._device is None:
            self._device = torch.full((1,), self._host[0], dtype=torch.int32, device=self._on)
        return self._device

    @property
    def host(self) -> list[int]:
        if self._host is None:
            if self._copy is None:
                self._host = self.device.tolist()
            else:
                pinned, event = self._copy
                event.synchronize()
                self._host = pinned.tolist()
        return self._host


def group_counts(counts: Tensor | GroupCounts, layout: Sequence[Tensor] = ()) -> GroupCounts:
    return counts if isinstance(counts, GroupCounts) else GroupCounts(counts)


def one_group(x2d: Tensor) -> GroupCounts:
    """A dense linear: one group of all rows (known on the host: no sync)."""
    m = x2d.shape[0]
    return GroupCounts(None, [m], dense=True, on=x2d.device)


def _triton():
    """The Triton backend (imported at first use: the layouts below are tested where triton is absent)."""
    from spartron.layers.fp8 import triton_backend
    return triton_backend


def quantize_rows(x: Tensor, pow2: bool, index: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return _triton().quantize_rows(x, pow2, index)


def swiglu_quantize_rows(gate: Tensor, up: Tensor, pow2: bool, index: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return _triton().swiglu_quantize_rows(gate, up, pow2, index)


def quantize_blocks(w: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    return _triton().quantize_blocks(w, pow2)


def quantize_blocks_t(w: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    return _triton().quantize_blocks_t(w, pow2)


def quantize_blocks_cat(weights: tuple[Tensor, ...], pow2: bool, transpose: bool = False) -> tuple[Tensor, Tensor]:
    return _triton().quantize_blocks_cat(weights, pow2, transpose)


def quantize_blocks_both(weights: tuple[Tensor, ...], pow2: bool) -> list[Tensor]:
    return _triton().quantize_blocks_both(weights, pow2)


def quantize_cols_grouped(x: Tensor, counts: Tensor | GroupCounts, pow2: bool,
                          index: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return _triton().quantize_cols_grouped(x, group_counts(counts).device, pow2, index)


def block_scales(s: Tensor) -> Tensor:
    """128x128 scales [G, N/128, K/128] of right operands [K, N] (K the contraction; any strides) ->
    torch's [G, L4, N/128], each group strides (1, L4), rows past K/128 zero (cuBLASLt reads none).
    Contiguous scales with K/128 a multiple of 4 (every DeepSeek-V3 dim) already are that layout: a view, no
    launch (an FP8 linear's host time is mostly its launches)."""
    g, nb, kb = s.shape
    if kb % 4 == 0 and s.is_contiguous():
        return s.transpose(-2, -1)
    out = torch.zeros(g, nb, -(-kb // 4) * 4, dtype=s.dtype, device=s.device)
    out[..., :kb] = s
    return out.transpose(-2, -1)


def _outer_major(s: Tensor) -> Tensor:
    """1x128 scales [R, tiles] as torch takes them, strides exactly (1, R): `s` itself when it has them
    (slot-major column scales), else a copy (the rows of one half of the experts' [w1; w3] gradient)."""
    if s.stride() == (1, s.shape[0]):
        return s
    out = torch.empty(s.shape[1], s.shape[0], dtype=s.dtype, device=s.device)
    out.copy_(s.t())
    return out.t()


def _slot_ranges(counts: GroupCounts) -> list[tuple[int, int, int]]:
    """(group, first slot, slot count) of every non-empty group in the slot-aligned column layout."""
    tiles = [-(-c // TILE) for c in counts.host]
    starts = [sum(tiles[:g]) for g in range(len(tiles))]
    return [(g, t0, t) for g, (t0, t) in enumerate(zip(starts, tiles, strict=True)) if t]


def group_operands(kind: str, a: Tensor, sa: Tensor, b: Tensor, sb: Tensor,
                   counts: GroupCounts) -> list[tuple[int, tuple]]:
    """(group, `F.scaled_mm`'s first six arguments) of each GEMM cuBLAS runs.

    fprop (one group): a = x [M, K] (scales [K/128, M]), b = w [1, N, K] (scales [1, N/128, K/128]).
    dgrad (one group): a = grad [M, N] (scales [N/128, M]), b = w^T [1, K, N] as quantize_blocks_t wrote
    it (scales [1, K/128, N/128], a view): b[0].t() is the column-major right operand, no copy.
    wgrad (every non-empty group): a = grad^T [N, L], b = x^T [K, L] in the slot-aligned layout, scales
    [*, T] slot-major.
    """
    if kind == "wgrad":
        return [(g, (a[:, t0 * TILE:(t0 + t) * TILE], b[:, t0 * TILE:(t0 + t) * TILE].t(),
                     _outer_major(sa[:, t0:t0 + t]), ROW, _outer_major(sb[:, t0:t0 + t]), ROW))
                for g, t0, t in _slot_ranges(counts)]
    if counts.host != [a.shape[0]]:
        raise ValueError(f"fp8 torch_scaled_mm: {kind} on cuBLAS takes one group of all {a.shape[0]} rows, "
                         f"got counts {counts.host}")
    if a.shape[0] % 4:  # cuBLASLt returns NOT_SUPPORTED for 1 or 130 rows, runs 4, 16, 136 (H100, torch 2.11)
        raise ValueError(f"model.fp8.backend = 'torch_scaled_mm': cuBLASLt's blockwise GEMM takes a multiple of 4 "
                         f"rows, this {kind} has {a.shape[0]} (use backend 'triton')")
    return [(0, (a, b[0].t(), sa.t(), ROW, block_scales(sb)[0], BLOCK))] if a.shape[0] else []


def _scaled_mm_into(out: Tensor, a: Tensor, b: Tensor, sa: Tensor, ra, sb: Tensor, rb) -> None:
    torch.ops.aten._scaled_mm_v2.out(a, b, [sa], [ra.value], [], [sb], [rb.value], [], None, out.dtype, [], False,
                                     out=out)


def _dense_gemm(kind: str, a, sa, b, sb, counts: GroupCounts, dtype: torch.dtype) -> Tensor:
    out = torch.empty(a.shape[0], b.shape[1], dtype=dtype, device=a.device)
    for _, args in group_operands(kind, a, sa, b, sb, counts):
        _scaled_mm_into(out, *args)
    return out


def fprop(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, counts, dtype: torch.dtype) -> Tensor:
    """A dense linear: cuBLAS; the routed experts (any number of them, one included): the Triton grouped
    kernel (see the module's docstring)."""
    counts = group_counts(counts)
    if not counts.dense:
        return _triton().fprop(xq, xs, wq, ws, counts.device, dtype)
    return _dense_gemm("fprop", xq, xs, wq, ws, counts, dtype)


def dgrad(gq: Tensor, gs: Tensor, wtq: Tensor, wts: Tensor, counts, dtype: torch.dtype,
          rows: Tensor | None = None, k: int = 1) -> Tensor:
    """A dense linear: cuBLAS; the routed experts: the Triton grouped kernel (see the module's docstring).
    `rows`, `k`: quant.rows_in_order."""
    counts = group_counts(counts)
    if not counts.dense:
        return _triton().dgrad(gq, gs, wtq, wts, counts.device, dtype, rows, k)
    return rows_in_order(_dense_gemm("dgrad", gq, gs, wtq, wts, counts, dtype), rows, k)


def wgrad(gt: Tensor, gts: Tensor, xt: Tensor, xts: Tensor, counts, dtype: torch.dtype) -> Tensor:
    """-> dw [G, N, K]; a group with no rows gets zeros (its gradient)."""
    counts = group_counts(counts)
    alloc = torch.zeros if 0 in counts.host else torch.empty
    dw = alloc(len(counts.host), gt.shape[0], xt.shape[0], dtype=dtype, device=gt.device)
    for g, args in group_operands("wgrad", gt, gts, xt, xts, counts):
        _scaled_mm_into(dw[g], *args)
    return dw
