"""The FP8 compute of the modules apply_fp8 converts: the same modules, parameters and state_dict
keys, with a forward through spartron.layers.fp8.ops. Converted by class swap (as FSDP2's
fully_shard does), so nothing around them changes."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from spartron.checkpointing.replay import reuse_during_recompute
from spartron.layers.ffn import FeedForward
from spartron.layers.fp8 import gemms, quant
from spartron.layers.fp8.expert_ops import grouped_mm_pair, swiglu_grouped_mm
from spartron.layers.fp8.gathered import gathered_operands
from spartron.layers.fp8.ops import backend_impl, linear
from spartron.layers.fp8.weight_cache import WeightCache
from spartron.layers.moe.experts import GroupedExperts


class FP8Linear(nn.Linear):
    """nn.Linear (no bias) whose GEMMs run blockwise FP8; set `fp8_backend`, `fp8_pow2`, `fp8_wgrad`."""

    fp8_backend: str
    fp8_pow2: bool
    fp8_wgrad: bool
    fp8_gemm_weights = (("weight",),)  # each FP8 GEMM's weights, concatenated along N

    def forward(self, x: Tensor) -> Tensor:
        (w,), cached = gathered_operands([self.weight], lead=True)  # model.fp8.param_gather's blocks, or []
        return linear(x, w, self.fp8_backend, self.fp8_pow2, self.fp8_wgrad, cached)


class FP8FeedForward(FeedForward):
    """A SwiGLU FeedForward (dense FFN, shared experts) whose GEMMs run blockwise FP8 as ONE group of the routed
    experts' fused ops: w1 and w3 as one GEMM over [w1; w3] on one quantisation of x (Megatron's fused fc1), w2 on
    SwiGLU's product quantised where it is produced and recomputed in backward (one [rows, inter_dim] tensor less
    kept). Its linears stay nn.Linear: parameters, names and state are unchanged. Set `fp8_backend`, `fp8_pow2`,
    `fp8_wgrad`. Outputs and weight gradients equal three FP8Linear bitwise; x's gradient is one fp32 contraction
    over both halves (as the experts' pair)."""

    fp8_backend: str
    fp8_pow2: bool
    fp8_wgrad: bool
    fp8_gemm_weights = (("w1.weight", "w3.weight"), ("w2.weight",))  # each FP8 GEMM's weights, concatenated along N

    def forward(self, x: Tensor) -> Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        counts = quant.one_group(x2d)  # the one group's rows, on the device
        gemm = (self.fp8_backend, self.fp8_pow2, self.fp8_wgrad)
        # model.fp8.param_gather: the all-gathered blocks of [w1; w3] and w2, or []
        weights, cached = gathered_operands([lin.weight for lin in (self.w1, self.w3, self.w2)], lead=True)
        w1, w3, w2 = (w.unsqueeze(0) for w in weights)
        h13 = grouped_mm_pair(x2d, w1, w3, counts, *gemm, cached[:4], None, None, 1, [])
        return swiglu_grouped_mm(h13, w2, counts, *gemm, cached[4:], []).reshape(*x.shape[:-1], w2.shape[1])


class FP8GroupedExperts(GroupedExperts):
    """GroupedExperts whose grouped GEMMs (and their dgrad / wgrad) run blockwise FP8: w1 and w3 as one
    GEMM over [w1; w3] on one quantisation of x, w2 on SwiGLU's product quantised where it is produced
    (spartron.layers.fp8.expert_ops). `fp8_cache`: a WeightCache (model.fp8.weight_cache on) that
    keeps the weights' quantisation until invalidated, or None (quantised at every GEMM call)."""

    fp8_backend: str
    fp8_pow2: bool
    fp8_wgrad: bool
    fp8_gemm_weights = (("w1", "w3"), ("w2",))  # each FP8 GEMM's weights, concatenated along N
    fp8_cache: WeightCache | None = None

    def quantised_weights(self) -> list[Tensor]:
        """gemms.weight_blocks of (w1, w3, w2) from the cache; [] when the cache is off."""
        if self.fp8_cache is None:
            return []
        weights = (self.w1, self.w3, self.w2)
        return self.fp8_cache.get(weights, self.fp8_backend, self.fp8_pow2, lambda: gemms.weight_blocks(
            backend_impl(self.fp8_backend), *(w.detach() for w in weights), self.fp8_pow2))

    def forward(self, x: Tensor, tokens_per_expert: Tensor | list[int], order: Tensor | None = None,
                inverse: Tensor | None = None, k: int = 1) -> Tensor:
        """x: the rows grouped by expert, or with `order` / `inverse` / `k` (a GatheredRows plan) the rows
        x[order // k], read in place by the quantisation: no bf16 rows written."""
        if len(tokens_per_expert) != self.n_local_experts:
            raise ValueError(f"GroupedExperts: tokens_per_expert has {len(tokens_per_expert)} entries for "
                             f"{self.n_local_experts} local experts")
        if x.dtype != self.w1.dtype:
            raise ValueError(f"FP8 GroupedExperts: input dtype {x.dtype} differs from expert weights {self.w1.dtype}")
        counts = torch.as_tensor(tokens_per_expert, device=x.device).to(torch.int32)
        rows = x.shape[0] if order is None else order.shape[0]
        gemm = (self.fp8_backend, self.fp8_pow2, self.fp8_wgrad)
        # model.fp8.param_gather: the all-gathered blocks of [w1; w3] and w2, or []
        (w1, w3, w2), cached = gathered_operands([self.w1, self.w3, self.w2])
        if not cached and self.fp8_cache is not None:  # a checkpoint replay gets the original pass's lists back
            cached = reuse_during_recompute(self.quantised_weights)
        layout = reuse_during_recompute(checked_layout, self.fp8_backend, counts, rows)
        h13 = grouped_mm_pair(x, w1, w3, counts, *gemm, cached[:4], order, inverse, k, layout)
        return swiglu_grouped_mm(h13, w2, counts, *gemm, cached[4:], layout)


def checked_layout(backend: str, counts: Tensor, rows: int) -> list[Tensor]:
    """The routed rows' slot layout for every GEMM of one experts forward (its backward and AC replay too), after
    a device check that the counts add up to the rows: the kernels trust them (the reference backend checks them
    on the host)."""
    if backend != "reference":
        torch._assert_async(counts.sum() == rows, "FP8 GroupedExperts: tokens_per_expert sum != rows")
    return backend_impl(backend).slot_layout(counts, rows)
