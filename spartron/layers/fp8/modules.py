"""The FP8 compute of the modules apply_fp8 converts: the same modules, parameters and state_dict
keys, with a forward through spartron.layers.fp8.ops. Converted by class swap (as FSDP2's
fully_shard does), so nothing around them changes."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from spartron.layers.ffn import swiglu
from spartron.layers.fp8.ops import grouped_mm, linear
from spartron.layers.moe.experts import GroupedExperts


class FP8Linear(nn.Linear):
    """nn.Linear (no bias) whose GEMMs run blockwise FP8; set `fp8_backend`, `fp8_pow2`."""

    fp8_backend: str
    fp8_pow2: bool

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.fp8_backend, self.fp8_pow2)


class FP8GroupedExperts(GroupedExperts):
    """GroupedExperts whose three grouped GEMMs (and their dgrad / wgrad) run blockwise FP8."""

    fp8_backend: str
    fp8_pow2: bool

    def forward(self, x: Tensor, tokens_per_expert: Tensor | list[int]) -> Tensor:
        if len(tokens_per_expert) != self.n_local_experts:
            raise ValueError(f"GroupedExperts: tokens_per_expert has {len(tokens_per_expert)} entries for "
                             f"{self.n_local_experts} local experts")
        if x.dtype != self.w1.dtype:
            raise ValueError(f"FP8 GroupedExperts: input dtype {x.dtype} differs from expert weights {self.w1.dtype}")
        counts = torch.as_tensor(tokens_per_expert, device=x.device).to(torch.int32)
        gemm = (self.fp8_backend, self.fp8_pow2)
        h = swiglu(grouped_mm(x, self.w1, counts, *gemm), grouped_mm(x, self.w3, counts, *gemm))
        return grouped_mm(h, self.w2, counts, *gemm)
