"""The blockwise recipe's GEMM sequences, over a backend's primitives (spartron.layers.fp8.reference
or .triton_backend: quantize_rows / quantize_blocks / quantize_blocks_t / quantize_cols_grouped,
fprop / dgrad / wgrad, swiglu_quantize_rows).

Tilings (DeepSeek-V3): fprop x 1x128 @ w 128x128; dgrad grad 1x128 @ the same w blocks (quantised straight into the
transposed layout dgrad reads); wgrad grad^T and x^T both 128x1 along the tokens, tiles restarting at each expert. A
dense linear is one group. `fp8_wgrad` False runs every wgrad in the inputs' dtype instead (model.fp8.wgrad =
"model_dtype", Megatron's fp8_wgrad = False): the GEMM the unquantised layers' backward runs, no column
quantisation. `pair_*` run the experts' w1 and w3 as ONE GEMM over [w1; w3] (N = 2I forward, K = 2I in dgrad; x
quantised once); `swiglu_*` run w2 on silu(gate) * up quantised where it is produced, and recompute that product in
backward instead of keeping it. They equal the unfused sequence bitwise
(the same quantised values reach the same GEMMs: 1x128 / 128x128 / 128x1 tiles never straddle the
w1 | w3 boundary, I being a multiple of 128) except dx of the pair: one fp32 contraction over 2I
rounded once, where two GEMMs round dx1 and dx3 and add them in bf16 (tests/layers/test_fp8_fused.py). The experts'
sequences take their weights' quantisation from
the weight cache when it is on (`cached`: weight_blocks' list; spartron.layers.fp8.weight_cache).
Each sequence takes its group counts through `impl.group_counts` once (a backend that loops over the
groups on the host reads them there, one sync per op; the experts' sequences pass the rows' `impl.slot_layout`,
computed once per experts forward), and quantises each fprop / dgrad operand through
`impl.gemm_rows` (the rows packed, or where the backend's grouped GEMM reads them: "deep_gemm" pads each
group to 128-row slots in the quantisation itself; its fprop / dgrad return the rows packed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from spartron.layers.swiglu import swiglu_backward_into


def _index(order: Tensor | None, k: int) -> Tensor | None:
    """The row index into x of the rows x[order // k] (GatheredRows), None without a plan."""
    return order if order is None or k == 1 else order // k


def _gemm_rows(impl, x: Tensor, counts, pow2: bool, order: Tensor | None = None, k: int = 1):
    """An fprop / dgrad operand: x's rows (or x[order // k]) quantised where impl's grouped GEMM reads them."""
    rows = x.shape[0] if order is None else order.numel()
    return impl.quantize_rows(x, pow2, impl.gemm_rows(counts, rows, _index(order, k)))


def forward(impl, x: Tensor, w: Tensor, counts: Tensor, pow2: bool, wq: Sequence[Tensor] = ()) -> Tensor:
    """`wq`: w's blocks [q, s] when given (model.fp8.param_gather; empty: quantise here)."""
    counts = impl.group_counts(counts)
    wq = wq or impl.quantize_blocks(w, pow2)
    return impl.fprop(*_gemm_rows(impl, x, counts, pow2), *wq, counts, x.dtype)


def unquantised_wgrad(grad: Tensor, x: Tensor, counts) -> Tensor:
    """dw [G, N, K] = grad^T @ x over each group's rows, in their dtype: the wgrad of the bf16 layers'
    backward (torch._grouped_mm over the counts' offsets, as the grouped experts' autograd runs it; one group:
    one mm, as nn.Linear's). `counts`: a backend's group_counts (the device tensor read, never the host)."""
    if not isinstance(counts, Tensor):  # a backend's counts object: a dense linear's is never read on the device
        counts = None if counts.dense else counts.device
    if counts is None or counts.numel() == 1:
        return (grad.t() @ x).unsqueeze(0)
    return torch._grouped_mm(grad.t(), x, offs=torch.cumsum(counts, 0, dtype=torch.int32))


def _wgrad(impl, grad: Tensor, x: Tensor, counts, pow2: bool, fp8_wgrad: bool, dtype) -> Tensor:
    if not fp8_wgrad:
        return unquantised_wgrad(grad, x, counts)
    xcols = impl.quantize_cols_grouped(x, counts, pow2)
    return impl.wgrad(*impl.quantize_cols_grouped(grad, counts, pow2), *xcols, counts, dtype)


def backward(impl, grad: Tensor, x: Tensor, w: Tensor, counts: Tensor, pow2: bool, fp8_wgrad: bool,
             wt: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """`wt`: w's transposed blocks [q^T, s^T] when cached (None: quantise here)."""
    counts = impl.group_counts(counts)
    dx = _dgrad(impl, grad, w, counts, pow2, x.dtype, wt)
    return dx, _wgrad(impl, grad, x, counts, pow2, fp8_wgrad, w.dtype)


def _dgrad(impl, grad: Tensor, w: Tensor, counts, pow2: bool, dtype: torch.dtype, wt: Sequence[Tensor] | None):
    """grad @ w per group: `wt` w's transposed blocks when cached (None: quantised here)."""
    wt = wt or impl.quantize_blocks_t(w, pow2)
    return impl.dgrad(*_gemm_rows(impl, grad, counts, pow2), *wt, counts, dtype)


def pair_forward(impl, x: Tensor, w1: Tensor, w3: Tensor, counts: Tensor, pow2: bool,
                 cached: list[Tensor], order: Tensor | None = None, k: int = 1,
                 layout: Sequence[Tensor] = ()) -> Tensor:
    """x @ [w1; w3]^T per expert: one GEMM of N = 2I -> h13 [M, 2I] (gate | up). `cached`: the
    weight cache's [q13, s13, q13^T, s13^T] (empty: quantise here). `order`: the rows are x[order // k],
    read through the index by the quantisation (spartron.layers.moe.dispatch.GatheredRows). `layout`: impl.slot_layout
    of the rows, computed once for the experts' ops (empty: the backend's own, per op)."""
    counts = impl.group_counts(counts, layout)
    q = cached[0:2] if cached else impl.quantize_blocks_cat((w1, w3), pow2)
    return impl.fprop(*_gemm_rows(impl, x, counts, pow2, order, k), *q, counts, x.dtype)


def pair_backward(impl, g13: Tensor, x: Tensor, w1: Tensor, w3: Tensor, counts: Tensor,
                  pow2: bool, fp8_wgrad: bool, cached: list[Tensor], order: Tensor | None = None,
                  inverse: Tensor | None = None, k: int = 1,
                  layout: Sequence[Tensor] = ()) -> tuple[Tensor, Tensor, Tensor]:
    """dx = g13 @ [w1; w3]: ONE dgrad contracting over 2I (fp32 over both halves, rounded once: the
    recipe's definition, Megatron's fused fc1 alike; not the bf16 sum dx1 + dx3 of two GEMMs). dw1, dw3:
    the wgrad over each half of g13's columns (128x1 tiles are per column: the halves' quantisation is
    each half's own). With `order`, dx is x's gradient (the rows' gathered back by `inverse`, each x row's
    k copies summed)."""
    counts = impl.group_counts(counts, layout)
    wt = cached[2:4] if cached else impl.quantize_blocks_cat((w1, w3), pow2, transpose=True)
    # with `order`: the rows' gradient back to x (permute_rows' / replicate_tokens' backward), its gather by
    # `inverse` and the sum of each token's k rows inside the dgrad's own gather
    dx = impl.dgrad(*_gemm_rows(impl, g13, counts, pow2), *wt, counts, x.dtype, inverse, k if order is not None else 1)
    i = w1.shape[1]
    if not fp8_wgrad:
        rows = x if order is None else x.index_select(0, _index(order, k))
        return dx, unquantised_wgrad(g13[:, :i], rows, counts), unquantised_wgrad(g13[:, i:], rows, counts)
    gq, gs = impl.quantize_cols_grouped(g13, counts, pow2)
    xcols = impl.quantize_cols_grouped(x, counts, pow2, _index(order, k))
    return (dx, impl.wgrad(gq[:i], gs[:i], *xcols, counts, w1.dtype),
            impl.wgrad(gq[i:], gs[i:], *xcols, counts, w3.dtype))


def swiglu_forward(impl, h13: Tensor, w: Tensor, counts: Tensor, pow2: bool, cached: list[Tensor],
                   layout: Sequence[Tensor] = ()) -> Tensor:
    """silu(gate) * up of h13 = gate | up (read in place), quantised where produced, @ w^T."""
    i = h13.shape[1] // 2
    counts = impl.group_counts(counts, layout)
    q = cached[0:2] if cached else impl.quantize_blocks(w, pow2)
    hq = impl.swiglu_quantize_rows(h13[:, :i], h13[:, i:], pow2, impl.gemm_rows(counts, h13.shape[0], None))
    return impl.fprop(*hq, *q, counts, h13.dtype)


def swiglu_backward(impl, grad: Tensor, h13: Tensor, w: Tensor, counts: Tensor,
                    pow2: bool, fp8_wgrad: bool, cached: list[Tensor],
                    layout: Sequence[Tensor] = ()) -> tuple[Tensor, Tensor]:
    """The w2 GEMM's dgrad, then SwiGLU's backward as spartron.layers.swiglu runs it (swiglu_backward_into: the
    same kernel on the same values as the bf16 FFN's), written into the two halves of one [M, 2I] gradient (the
    pair's dgrad reads it whole) and recomputing h = silu(gate) * up in the same pass, then w2's wgrad on h."""
    i = h13.shape[1] // 2
    counts = impl.group_counts(counts, layout)
    gate, up = h13[:, :i], h13[:, i:]
    dh = _dgrad(impl, grad, w, counts, pow2, h13.dtype, cached[2:4] if cached else None)
    d13, h = torch.empty_like(h13), gate.new_empty(gate.shape)
    swiglu_backward_into(dh, gate, up, d13[:, :i], d13[:, i:], h)
    del dh
    return d13, _wgrad(impl, grad, h, counts, pow2, fp8_wgrad, w.dtype)


def weight_blocks(impl, w1: Tensor, w3: Tensor, w2: Tensor, pow2: bool) -> list[Tensor]:
    """The experts' weight cache: [q13, s13, q13^T, s13^T] of [w1; w3] and [q2, s2, q2^T, s2^T] of w2,
    blocks and transposed blocks from one read of each weight."""
    return [*impl.quantize_blocks_both((w1, w3), pow2), *impl.quantize_blocks_both((w2,), pow2)]
