"""SwiGLU feed-forward: the dense FFN of dense decoder layers and the MoE shared experts.

`w2(silu(w1 x) * w3 x)`, no biases, the DeepSeek / Llama parameter names (w1 gate, w3 up, w2 down)
so checkpoints map one to one. A shared-expert block of n experts of width I is one FFN of width
n * I: the same function, one larger GEMM instead of n small ones.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from spartron.layers.init import init_parameters_
from spartron.layers.swiglu import swiglu


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
        return self.w2(swiglu(self.w1(x), self.w3(x), inplace_backward=True))
