"""The blockwise recipe's GEMM sequences, over a backend's primitives (spartron.layers.fp8.reference
or .triton_backend: quantize_rows / quantize_blocks / quantize_blocks_t / quantize_cols_grouped,
fprop / dgrad / wgrad, swiglu_quantize_rows).

Tilings (DeepSeek-V3): fprop x 1x128 @ w 128x128; dgrad grad 1x128 @ the same w blocks (quantised
straight into the transposed layout dgrad reads); wgrad
grad^T and x^T both 128x1 along the tokens, tiles restarting at each expert. A dense linear is one
group. `pair_*` run the experts' w1 and w3 GEMMs on one quantisation of x (forward: its 1x128
tiles; backward: its 128x1 tiles); `swiglu_*` run w2 on silu(gate) * up quantised where it is
produced, and recompute that product in backward instead of keeping it. Both equal the unfused
sequence bitwise: the same quantised values reach the same GEMMs, and dx of the pair is the bf16 sum
autograd forms when x feeds two GEMMs. The experts' sequences take their weights' quantisation from
the weight cache when it is on (`cached`: weight_blocks' list; spartron.layers.fp8.weight_cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def forward(impl, x: Tensor, w: Tensor, counts: Tensor, pow2: bool) -> Tensor:
    return impl.fprop(*impl.quantize_rows(x, pow2), *impl.quantize_blocks(w, pow2), counts, x.dtype)


def _wgrad(impl, grad: Tensor, xcols: tuple[Tensor, Tensor], counts: Tensor, pow2: bool, dtype) -> Tensor:
    return impl.wgrad(*impl.quantize_cols_grouped(grad, counts, pow2), *xcols, counts, dtype)


def backward(impl, grad: Tensor, x: Tensor, w: Tensor, counts: Tensor, pow2: bool,
             wt: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """`wt`: w's transposed blocks [q^T, s^T] when cached (None: quantise here)."""
    wt = wt or impl.quantize_blocks_t(w, pow2)
    dx = impl.dgrad(*impl.quantize_rows(grad, pow2), *wt, counts, x.dtype)
    return dx, _wgrad(impl, grad, impl.quantize_cols_grouped(x, counts, pow2), counts, pow2, w.dtype)


def pair_forward(impl, x: Tensor, w1: Tensor, w3: Tensor, counts: Tensor, pow2: bool,
                 cached: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """`cached`: weight_blocks((w1, w3)) from the experts' weight cache (None: quantise here)."""
    q1, q3 = (cached[0:2], cached[4:6]) if cached else (impl.quantize_blocks(w, pow2) for w in (w1, w3))
    xq = impl.quantize_rows(x, pow2)
    return impl.fprop(*xq, *q1, counts, x.dtype), impl.fprop(*xq, *q3, counts, x.dtype)


def pair_backward(impl, g1: Tensor, g3: Tensor, x: Tensor, w1: Tensor, w3: Tensor, counts: Tensor,
                  pow2: bool, cached: list[Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    wt1, wt3 = (cached[2:4], cached[6:8]) if cached else (impl.quantize_blocks_t(w, pow2) for w in (w1, w3))
    dx1 = impl.dgrad(*impl.quantize_rows(g1, pow2), *wt1, counts, x.dtype)
    dx3 = impl.dgrad(*impl.quantize_rows(g3, pow2), *wt3, counts, x.dtype)
    xcols = impl.quantize_cols_grouped(x, counts, pow2)
    return dx1 + dx3, _wgrad(impl, g1, xcols, counts, pow2, w1.dtype), _wgrad(impl, g3, xcols, counts, pow2, w3.dtype)


def swiglu_forward(impl, gate: Tensor, up: Tensor, w: Tensor, counts: Tensor, pow2: bool,
                   cached: list[Tensor] | None = None) -> Tensor:
    q = cached or impl.quantize_blocks(w, pow2)
    return impl.fprop(*impl.swiglu_quantize_rows(gate, up, pow2), q[0], q[1], counts, gate.dtype)


def swiglu_backward(impl, grad: Tensor, gate: Tensor, up: Tensor, w: Tensor, counts: Tensor,
                    pow2: bool, cached: list[Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The w2 GEMM's dgrad / wgrad on the recomputed h, then SwiGLU's backward as
    spartron.layers.ffn.swiglu runs it (the same kernels on the same values)."""
    silu = F.silu(gate)
    dh, dw = backward(impl, grad, silu * up, w, counts, pow2, cached[2:4] if cached else None)
    return torch.ops.aten.silu_backward(dh * up, gate), dh * silu, dw


def weight_blocks(impl, weights: tuple[Tensor, ...], pow2: bool) -> list[Tensor]:
    """Each weight's 128x128 blocks and transposed blocks: [q, s, q^T, s^T] per weight, in order (the
    experts' weight cache holds this list)."""
    out = []
    for w in weights:
        out += [*impl.quantize_blocks(w, pow2), *impl.quantize_blocks_t(w, pow2)]
    return out
