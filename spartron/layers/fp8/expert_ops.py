"""The routed experts' FP8 GEMMs as two ops (spartron.layers.fp8.gemms: the sequences):

- `spartron_fp8::grouped_mm_pair(x, w1, w3)` -> h13 = x @ w1^T | x @ w3^T [M, 2I] per expert: ONE
  GEMM over [w1; w3] (N = 2I), x quantised once; its dgrad one GEMM contracting over 2I. Given the last
  regrouping's `order` / `inverse` / `k` (a GatheredRows: the EP permutation of the received rows, or the
  one-rank replication of the tokens into their top-k slots), x is that regrouping's source and the
  quantisation reads the rows through the index: the regrouped bf16 rows are never written (forward) or
  re-read (the wgrad's column quantisation), the quantisation fused into the permutation.
- `spartron_fp8::swiglu_grouped_mm(h13, w2)` -> (silu(gate) * up) @ w2^T per expert: SwiGLU's
  product is quantised where it is produced (the Triton backend's fused kernel) and recomputed in
  backward, so neither it nor its FP8 copy is kept: per MoE layer one [routed rows, moe_inter_dim]
  bf16 tensor less alive from forward to backward than swiglu + grouped_mm.

Both equal `grouped_mm` / `swiglu` / `grouped_mm` bitwise (tested) except the pair's dx (one fp32
contraction over 2I where the unfused path adds two bf16 results: gemms.pair_backward), and save
only bf16 tensors (x, h13 and the weights), so AC replays and offload see what they see for the bf16 GEMMs. They are
GEMM targets of the checkpoint policy like `spartron_fp8::grouped_mm`.

`cached`: the weights' quantisation from the experts' weight cache (gemms.weight_blocks' list;
empty: quantise inside, as without the cache). `layout`: the backend's slot layout of the routed rows
(`slot_layout`: "deep_gemm" starts each expert's rows at a 128-row slot; empty for the others), computed once
per experts forward for both ops and their backward. Both are held on the autograd context as attributes,
not saved for backward: the cache keeps its tensors alive anyway, the layout is a few bytes per row, and the
saved-tensor hooks of AC and offload must not copy them per call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spartron.layers.fp8 import gemms
from spartron.layers.fp8.ops import backend_impl


@torch.library.custom_op("spartron_fp8::grouped_mm_pair", mutates_args=())
def grouped_mm_pair(x: Tensor, w1: Tensor, w3: Tensor, counts: Tensor, backend: str,
                    pow2: bool, fp8_wgrad: bool, cached: list[Tensor], order: Tensor | None,
                    inverse: Tensor | None, k: int, layout: list[Tensor]) -> Tensor:
    """x [M, K] grouped by `counts` [E]; w1, w3 [E, I, K] -> h13 [M, 2I] = x @ w1^T | x @ w3^T in x's dtype.
    With `order` (its inverse permutation `inverse`, `k`) the rows are x[order // k], never written: the
    quantisation reads them through the index, and x's gradient is gathered back (GatheredRows)."""
    return gemms.pair_forward(backend_impl(backend), x, w1, w3, counts, pow2, cached, order, k, layout)


@grouped_mm_pair.register_fake
def _(x, w1, w3, counts, backend, pow2, fp8_wgrad, cached, order, inverse, k, layout):
    return x.new_empty(x.shape[0] if order is None else order.shape[0], w1.shape[1] + w3.shape[1])


@torch.library.custom_op("spartron_fp8::grouped_mm_pair_backward", mutates_args=())
def grouped_mm_pair_backward(g13: Tensor, x: Tensor, w1: Tensor, w3: Tensor, counts: Tensor,
                             backend: str, pow2: bool, fp8_wgrad: bool, cached: list[Tensor],
                             order: Tensor | None, inverse: Tensor | None, k: int,
                             layout: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    return gemms.pair_backward(backend_impl(backend), g13.contiguous(), x, w1, w3, counts, pow2, fp8_wgrad, cached,
                               order, inverse, k, layout)


@grouped_mm_pair_backward.register_fake
def _(g13, x, w1, w3, counts, backend, pow2, fp8_wgrad, cached, order, inverse, k, layout):
    return torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w3)


def _pair_setup(ctx, inputs, output):
    x, w1, w3, counts, backend, pow2, fp8_wgrad, cached, order, inverse, k, layout = inputs
    ctx.save_for_backward(x, w1, w3, counts, order, inverse)
    ctx.backend, ctx.pow2, ctx.fp8_wgrad, ctx.cached, ctx.k = backend, pow2, fp8_wgrad, cached, k
    ctx.layout = layout


def _pair_backward(ctx, g13):
    x, w1, w3, counts, order, inverse = ctx.saved_tensors
    dx, dw1, dw3 = grouped_mm_pair_backward(g13, x, w1, w3, counts, ctx.backend, ctx.pow2, ctx.fp8_wgrad,
                                            ctx.cached, order, inverse, ctx.k, ctx.layout)
    return dx, dw1, dw3, None, None, None, None, [None] * len(ctx.cached), None, None, None, [None] * len(ctx.layout)


grouped_mm_pair.register_autograd(_pair_backward, setup_context=_pair_setup)


@torch.library.custom_op("spartron_fp8::swiglu_grouped_mm", mutates_args=())
def swiglu_grouped_mm(h13: Tensor, w: Tensor, counts: Tensor, backend: str, pow2: bool, fp8_wgrad: bool,
                      cached: list[Tensor], layout: list[Tensor]) -> Tensor:
    """h13 = gate | up [M, 2I] grouped by `counts` [E]; w [E, N, I] -> (silu(gate) * up) @ w^T [M, N]."""
    return gemms.swiglu_forward(backend_impl(backend), h13, w, counts, pow2, cached, layout)


@swiglu_grouped_mm.register_fake
def _(h13, w, counts, backend, pow2, fp8_wgrad, cached, layout):
    return h13.new_empty(h13.shape[0], w.shape[1])


@torch.library.custom_op("spartron_fp8::swiglu_grouped_mm_backward", mutates_args=())
def swiglu_grouped_mm_backward(grad: Tensor, h13: Tensor, w: Tensor, counts: Tensor, backend: str,
                               pow2: bool, fp8_wgrad: bool, cached: list[Tensor],
                               layout: list[Tensor]) -> tuple[Tensor, Tensor]:
    return gemms.swiglu_backward(backend_impl(backend), grad.contiguous(), h13, w, counts, pow2, fp8_wgrad, cached,
                                 layout)


@swiglu_grouped_mm_backward.register_fake
def _(grad, h13, w, counts, backend, pow2, fp8_wgrad, cached, layout):
    return torch.empty_like(h13), torch.empty_like(w)


def _swiglu_setup(ctx, inputs, output):
    h13, w, counts, backend, pow2, fp8_wgrad, cached, layout = inputs
    ctx.save_for_backward(h13, w, counts)
    ctx.backend, ctx.pow2, ctx.fp8_wgrad, ctx.cached, ctx.layout = backend, pow2, fp8_wgrad, cached, layout


def _swiglu_backward(ctx, grad):
    h13, w, counts = ctx.saved_tensors
    d13, dw = swiglu_grouped_mm_backward(grad, h13, w, counts, ctx.backend, ctx.pow2, ctx.fp8_wgrad, ctx.cached,
                                         ctx.layout)
    return d13, dw, None, None, None, None, [None] * len(ctx.cached), [None] * len(ctx.layout)


swiglu_grouped_mm.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)
