"""SwiGLU's backward as one Triton pass (spartron.layers.swiglu).

Reads grad, gate and up once, computes in fp32 (torch's silu_backward formula: s = sigmoid(gate), d gate =
grad * up * s * (1 + gate * (1 - s)), d up = grad * gate * s) and stores each gradient once, rounded to the
output's dtype: into gate's and up's own storage (the in-place backward) or into two other tensors (the FP8
experts' [M, 2I] gradient halves). Given `h`, the same pass also writes the forward's product silu(gate) * up
rounded as torch's eager silu and mul round it (expf and a correctly rounded division, then the product of the
two rounded factors): the FP8 experts' w2 weight gradient reads it, and recomputing it apart cost two more
passes over gate and up. Imported only on CUDA (Triton).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

BLOCK = 1024


@triton.jit
def _swiglu_backward_kernel(grad_ptr, gate_ptr, up_ptr, d_gate_ptr, d_up_ptr, h_ptr, n_cols, grad_stride, gate_stride,
                            up_stride, d_gate_stride, d_up_stride, h_stride, BLOCK: tl.constexpr, H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(grad_ptr + row * grad_stride + cols, mask=mask).to(tl.float32)
    a = tl.load(gate_ptr + row * gate_stride + cols, mask=mask).to(tl.float32)
    b = tl.load(up_ptr + row * up_stride + cols, mask=mask).to(tl.float32)
    if H:  # before the stores: d_gate / d_up may be gate / up
        dtype = gate_ptr.dtype.element_ty
        silu = tl.math.div_rn(a, 1.0 + libdevice.exp(-a)).to(dtype).to(tl.float32)
        tl.store(h_ptr + row * h_stride + cols, (silu * b).to(h_ptr.dtype.element_ty), mask=mask)
    s = 1.0 / (1.0 + tl.exp(-a))
    d_up = g * (a * s)
    d_gate = (g * b) * (s * (1.0 + a * (1.0 - s)))
    tl.store(d_up_ptr + row * d_up_stride + cols, d_up.to(d_up_ptr.dtype.element_ty), mask=mask)
    tl.store(d_gate_ptr + row * d_gate_stride + cols, d_gate.to(d_gate_ptr.dtype.element_ty), mask=mask)


def swiglu_backward_rows(grad: Tensor, gate: Tensor, up: Tensor, d_gate: Tensor, d_up: Tensor,
                         h: Tensor | None = None) -> None:
    """All [rows, cols] with unit column stride, one shape and dtype; d_gate and d_up written (they may be gate
    and up: each program reads its elements before it stores them), and h = silu(gate) * up when given."""
    rows, cols = gate.shape
    shapes = [tuple(t.shape) for t in (grad, gate, up, d_gate, d_up) + ((h,) if h is not None else ())]
    if len(set(shapes)) > 1:
        raise ValueError(f"swiglu backward: shapes differ (grad, gate, up, d gate, d up): {shapes}")
    if rows == 0 or cols == 0:
        return
    grid = (rows, triton.cdiv(cols, BLOCK))
    _swiglu_backward_kernel[grid](grad, gate, up, d_gate, d_up, d_up if h is None else h, cols, grad.stride(0),
                                  gate.stride(0), up.stride(0), d_gate.stride(0), d_up.stride(0),
                                  0 if h is None else h.stride(0), BLOCK=BLOCK, H=h is not None)
