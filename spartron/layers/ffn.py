"""SwiGLU feed-forward: the dense FFN of dense decoder layers and the MoE shared experts.

`w2(silu(w1 x) * w3 x)`, no biases, the DeepSeek / Llama parameter names (w1 gate, w3 up, w2 down)
so checkpoints map one to one. A shared-expert block of n experts of width I is one FFN of width
n * I: the same function, one larger GEMM instead of n small ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spartron.layers.init import init_parameters_


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """`silu(gate) * up`, keeping two tensors for backward instead of autograd's three.

    Autograd saves gate (for silu's backward) and both factors of the product, silu(gate) included;
    here silu(gate) is recomputed in backward (one elementwise pass) and the gradients are the same
    kernels on the same values, so bitwise equal. Per MoE layer of dsv3-12l that is one [tokens x
    top_k, moe_inter_dim] bf16 tensor (138 MB) less kept alive from forward to backward."""
    return _SwiGLU.apply(gate, up)


class FeedForward(nn.Module):
    def __init__(self, dim: int, inter_dim: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, init_std: float = 0.02):
        super().__init__()
        self.init_std = init_std
        self.w1 = nn.Linear(dim, inter_dim, bias=False, dtype=dtype, device=device)
        self.w3 = nn.Linear(dim, inter_dim, bias=False, dtype=dtype, device=device)
        self.w2 = nn.Linear(inter_dim, dim, bias=False, dtype=dtype, device=device)
        self.reset_parameters()

    def reset_parameters(self, seed: int = 0, prefix: str = "") -> None:
        init_parameters_(self, seed, self.init_std, prefix)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))
