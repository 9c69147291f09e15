"""SwiGLU's product `silu(gate) * up` with a lean backward.

`swiglu` keeps two tensors for backward instead of autograd's three (silu(gate) is recomputed). With
`inplace_backward=True` its backward also writes the two gradients into gate's and up's own storage, through
the op `spartron::swiglu_backward_`: a caller whose gate and up are fresh GEMM outputs that nothing else reads
(the FFN's w1 / w3, the experts' grouped GEMMs) then holds no new [rows, inter] buffers in that backward.
Under torch.compile this is what keeps a recomputed FFN's backward small: inductor fuses silu(gate) * up (for
w2's weight gradient) with the two gradients into one kernel of three outputs and keeps six [rows, inter]
buffers alive at once (the AC-full peak of dsv3-12l's dense layer); the opaque in-place op leaves three.

On CUDA the op is one Triton pass (swiglu_triton_kernels.py: fp32 arithmetic, one rounding per gradient);
elsewhere, and for layouts the kernel does not take, it computes with torch ops exactly as autograd's
formulas (bitwise the non-in-place gradients) and copies them in. `swiglu_backward_into` is the same
computation into other tensors (the FP8 experts' backward writes the two halves of one gradient with it, so
they and the bf16 FFN run one SwiGLU backward), and, asked, the forward's product in the same pass (bitwise
`F.silu(gate) * up`: the FP8 experts' w2 weight gradient reads it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from spartron.optional import require


def swiglu_backward_into(grad: Tensor, gate: Tensor, up: Tensor, d_gate: Tensor, d_up: Tensor,
                         h: Tensor | None = None) -> None:
    """d_gate <- d(silu(gate) * up)/d gate * grad, d_up <- silu(gate) * grad (d_gate, d_up may be gate, up), and
    h <- silu(gate) * up when given (bitwise torch's eager F.silu(gate) * up)."""
    tensors = (grad, gate, up, d_gate, d_up) + ((h,) if h is not None else ())
    rows = [_rows(t) for t in tensors] if gate.is_cuda else []
    if rows and all(r is not None for r in rows) and len({t.dtype for t in tensors}) == 1:
        kernels = require("spartron.layers.swiglu_triton_kernels", "swiglu's CUDA backward",
                          "pip install triton (it ships with torch's CUDA wheels)")
        kernels.swiglu_backward_rows(*rows)
        return
    if h is not None:  # before d_gate / d_up overwrite gate / up
        torch.mul(F.silu(gate), up, out=h)
    grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
    torch.mul(grad, F.silu(gate), out=d_up)
    d_gate.copy_(grad_gate)


@torch.library.custom_op("spartron::swiglu_backward_", mutates_args=("gate", "up"))
def swiglu_backward_(grad: Tensor, gate: Tensor, up: Tensor) -> None:
    """gate <- d(silu(gate) * up)/d gate * grad, up <- silu(gate) * grad, in place."""
    swiglu_backward_into(grad, gate, up, gate, up)


def _rows(t: Tensor) -> Tensor | None:
    """t as [rows, last dim] with unit last stride (a view), or None when it has no such view."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, inplace_backward: bool) -> Tensor:
        ctx.save_for_backward(gate, up)
        ctx.inplace_backward = inplace_backward
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        gate, up = ctx.saved_tensors
        if ctx.inplace_backward:
            swiglu_backward_(grad.contiguous(), gate, up)
            return gate, up, None
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up, None


def swiglu(gate: Tensor, up: Tensor, inplace_backward: bool = False) -> Tensor:
    """`silu(gate) * up`, keeping two tensors for backward instead of autograd's three: silu(gate) is
    recomputed in backward (one elementwise pass), the gradients the same kernels on the same values.

    `inplace_backward`: the backward overwrites gate and up with their gradients (no new buffers). Only for
    gate and up that nothing else reads after this call (a GEMM's fresh output): anything that saved them for
    its own backward then fails loudly on autograd's version check. A leaf that requires grad (a parameter, a
    caller's input) is refused."""
    if inplace_backward and any(t.requires_grad and t.is_leaf for t in (gate, up)):
        raise ValueError("swiglu(inplace_backward=True) overwrites gate and up in backward: a leaf tensor that "
                         "requires grad cannot be one of them (pass a GEMM's fresh output)")
    return _SwiGLU.apply(gate, up, inplace_backward)
