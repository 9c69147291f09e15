"""SwiGLU's backward as one Triton pass that writes the gradients over its inputs (spartron.layers.swiglu).

Reads grad, gate and up once, computes in fp32 (torch's silu_backward formula: s = sigmoid(gate), d gate =
grad * up * s * (1 + gate * (1 - s)), d up = grad * gate * s) and stores each gradient once, rounded to the
tensor's dtype, into gate's and up's storage. Imported only on CUDA (Triton).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024


@triton.jit
def _swiglu_backward_kernel(grad_ptr, gate_ptr, up_ptr, n_cols, grad_stride, gate_stride, up_stride,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(grad_ptr + row * grad_stride + cols, mask=mask).to(tl.float32)
    a = tl.load(gate_ptr + row * gate_stride + cols, mask=mask).to(tl.float32)
    b = tl.load(up_ptr + row * up_stride + cols, mask=mask).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-a))
    d_up = g * (a * s)
    d_gate = (g * b) * (s * (1.0 + a * (1.0 - s)))
    tl.store(up_ptr + row * up_stride + cols, d_up.to(up_ptr.dtype.element_ty), mask=mask)
    tl.store(gate_ptr + row * gate_stride + cols, d_gate.to(gate_ptr.dtype.element_ty), mask=mask)


def swiglu_backward_inplace(grad: Tensor, gate: Tensor, up: Tensor) -> None:
    """grad, gate, up: [rows, cols] with unit column stride, one shape and dtype; gate and up overwritten."""
    rows, cols = gate.shape
    if grad.shape != gate.shape or up.shape != gate.shape:
        raise ValueError(f"swiglu backward: shapes differ: grad {tuple(grad.shape)}, gate {tuple(gate.shape)}, "
                         f"up {tuple(up.shape)}")
    if rows == 0 or cols == 0:
        return
    grid = (rows, triton.cdiv(cols, BLOCK))
    _swiglu_backward_kernel[grid](grad, gate, up, cols, grad.stride(0), gate.stride(0), up.stride(0), BLOCK=BLOCK)
