"""RMSNorm: the normalisation of MLA's compressed query / key-value latents and of decoder blocks.

Statistics are computed in float32 whatever the activation dtype, because bf16 mean-of-squares over
thousands of channels loses the precision the following projection relies on.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(compute)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
