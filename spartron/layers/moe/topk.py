"""MoE top-k expert selection as the custom op `spartron::moe_topk`.

Why an op: a checkpoint replay that re-ran top-k on recomputed scores could pick a different
expert for a near-tie token (different kernels, different rounding), and the replayed dispatch
would then disagree with the saved one. As a named op the checkpoint policy marks it mandatory:
its output ids are saved in the original pass and returned unchanged on replay, so routing is
decided exactly once per forward. The op returns integer ids only; gate weights are gathered
outside it from the differentiable scores, so no gradient ever needs to flow through it.

Group-limited routing (DeepSeek-V2/V3): experts are split into `n_groups` equal groups, each token
keeps the `topk_groups` best groups and picks its `top_k` experts inside them. A group's score is
`group_score`: "max" (the best expert of the group, DeepSeek-V2 with softmax scores) or
"top2_sum" (the sum of the group's two best scores, DeepSeek-V3 with biased sigmoid scores; a
group of one expert uses its single score).
"""

from __future__ import annotations

import torch
from torch import Tensor

OPS: tuple[str, ...] = ("spartron::moe_topk",)

GROUP_SCORES: tuple[str, ...] = ("max", "top2_sum")


def _group_mask(scores: Tensor, n_groups: int, topk_groups: int, group_score: str) -> Tensor:
    """Boolean [tokens, n_experts]: True for experts inside each token's selected groups."""
    tokens, n_experts = scores.shape
    grouped = scores.view(tokens, n_groups, n_experts // n_groups)
    if group_score == "max":
        per_group = grouped.amax(dim=-1)
    else:
        per_group = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    chosen = per_group.topk(topk_groups, dim=-1).indices
    keep = torch.zeros_like(per_group, dtype=torch.bool).scatter_(1, chosen, True)
    return keep.repeat_interleave(n_experts // n_groups, dim=1)


@torch.library.custom_op("spartron::moe_topk", mutates_args=())
def _moe_topk(scores: Tensor, top_k: int, n_groups: int, topk_groups: int, group_score: str) -> Tensor:
    if n_groups > 1:
        scores = scores.masked_fill(~_group_mask(scores, n_groups, topk_groups, group_score), float("-inf"))
    return scores.topk(top_k, dim=-1, sorted=True).indices


@_moe_topk.register_fake
def _(scores, top_k, n_groups, topk_groups, group_score):
    return scores.new_empty((scores.shape[0], top_k), dtype=torch.int64)


def moe_topk(scores: Tensor, top_k: int, n_groups: int = 1, topk_groups: int = 1,
             group_score: str = "max") -> Tensor:
    """Expert ids [tokens, top_k] (int64, best first) chosen from `scores` [tokens, n_experts].

    `scores` are the selection scores (with any load-balancing bias already added); they are
    detached here because selection is not differentiable.
    """
    if scores.dim() != 2:
        raise ValueError(f"moe_topk: scores must be [tokens, n_experts], got shape {tuple(scores.shape)}")
    n_experts = scores.shape[1]
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"moe_topk: top_k {top_k} must be in [1, n_experts={n_experts}]")
    if n_groups < 1 or n_experts % n_groups:
        raise ValueError(f"moe_topk: n_groups {n_groups} must divide n_experts {n_experts}")
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"moe_topk: topk_groups {topk_groups} must be in [1, n_groups={n_groups}]")
    if n_groups > 1 and top_k > topk_groups * (n_experts // n_groups):
        raise ValueError(f"moe_topk: top_k {top_k} exceeds the {topk_groups} x {n_experts // n_groups} "
                         "experts of the selected groups")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"moe_topk: group_score {group_score!r} must be one of {GROUP_SCORES}")
    return _moe_topk(scores.detach(), top_k, n_groups, topk_groups, group_score)
