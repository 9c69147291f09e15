"""Token -> expert routing: gate, score function, top-k selection, gate weights, balancing.

Selection vs weights. The aux-loss-free expert bias (DeepSeek-V3) is added to the scores only to
choose experts; the gate weights are gathered from the unbiased scores, so the bias steers load
without entering the layer's output or its gradients. Selection itself is the mandatory-save op
`spartron::moe_topk` (layers/moe/topk.py): a checkpoint replay reuses the saved ids.

Group score rule (group-limited routing, `n_groups > 1`): with sigmoid scores a group is ranked by
the sum of its two best biased scores (DeepSeek-V3), with softmax scores by its best score
(DeepSeek-V2). The rule follows `score_func`; there is no separate option.
"""

from __future__ import annotations

from typing import TypedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from spartron.comm import labelled
from spartron.layers.config import MoEConfig
from spartron.layers.init import init_parameters_
from spartron.layers.moe.topk import moe_topk


class Routing(TypedDict):
    scores: Tensor  # [tokens, n_experts] after the score function, unbiased, fp32 if router_fp32
    topk_ids: Tensor  # [tokens, top_k] int64 global expert ids
    topk_weights: Tensor  # [tokens, top_k] gate weights (normalised if asked, times route_scale)
    aux_loss: Tensor | None  # scalar, already multiplied by aux_loss_coeff; None when the coeff is 0


def load_balancing_loss(scores: Tensor, topk_ids: Tensor, n_sequences: int, score_func: str,
                        top_k: int) -> Tensor:
    """DeepSeek-V3 balance loss sum_i f_i * P_i, averaged over `n_sequences` equal token groups.

    f_i = n_experts / (top_k * T) * (tokens routed to i), P_i = mean over tokens of the score of i
    normalised over all experts (sigmoid scores are not a distribution; softmax ones already are).
    `n_sequences` = batch size for the sequence-level loss, 1 for the batch-level loss.
    """
    tokens, n_experts = scores.shape
    probs = scores / scores.sum(dim=-1, keepdim=True) if score_func == "sigmoid" else scores
    hits = torch.zeros_like(probs).scatter_(1, topk_ids, 1.0)
    per_seq = tokens // n_sequences
    f = hits.view(n_sequences, per_seq, n_experts).sum(dim=1) * (n_experts / (top_k * per_seq))
    p = probs.view(n_sequences, per_seq, n_experts).mean(dim=1)
    return (f * p).sum(dim=-1).mean()


class Router(nn.Module):
    """Gate projection + selection. `expert_bias` is a persistent fp32 buffer (saved with the model)."""

    def __init__(self, cfg: MoEConfig, dim: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, init_std: float = 0.02):
        super().__init__()
        self.cfg = cfg
        self.init_std = init_std
        self.group_score = "top2_sum" if cfg.score_func == "sigmoid" else "max"
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, dim, dtype=dtype, device=device))
        self.register_buffer("expert_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32,
                                                        device=device))
        self.reset_parameters()

    def reset_parameters(self, seed: int = 0, prefix: str = "") -> None:
        init_parameters_(self, seed, self.init_std, prefix)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The expert bias starts at zero (also after materialising from the meta device)."""
        self.expert_bias.zero_()

    def forward(self, x: Tensor) -> Routing:
        """Route x [batch, seq, dim]; tokens are flattened batch-major."""
        cfg = self.cfg
        if self.expert_bias.dtype != torch.float32:
            raise ValueError(f"Router.expert_bias must stay float32, found {self.expert_bias.dtype}: build "
                             "the model in model.dtype instead of casting it with .to(dtype)")
        batch = x.shape[0]
        tokens = x.reshape(-1, x.shape[-1])
        if cfg.router_fp32:
            logits = F.linear(tokens.float(), self.weight.float())
        else:
            logits = F.linear(tokens, self.weight)
        scores = logits.sigmoid() if cfg.score_func == "sigmoid" else logits.softmax(dim=-1)
        topk_ids = moe_topk(scores + self.expert_bias, cfg.top_k, cfg.n_groups, cfg.topk_groups,
                            self.group_score)
        weights = scores.gather(1, topk_ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * cfg.route_scale
        aux_loss = None
        if cfg.aux_loss_coeff > 0:
            n_seq = batch if cfg.aux_loss_type == "seq" else 1
            aux_loss = cfg.aux_loss_coeff * load_balancing_loss(scores, topk_ids, n_seq, cfg.score_func,
                                                                cfg.top_k)
        return Routing(scores=scores, topk_ids=topk_ids, topk_weights=weights, aux_loss=aux_loss)

    @torch.no_grad()
    def update_expert_bias(self, counts: Tensor, group: dist.ProcessGroup | None = None) -> None:
        """`bias += rate * sign(mean - count)` from this step's per-expert token counts.

        `counts` [n_experts] are the counts of the tokens this rank routed (all micro-batches of the
        step). `group` must cover every rank that routes *distinct* tokens with the same weights:
        the data-parallel x context-parallel group (`groups.dp_cp`). EP ranks are part of it (EP is
        laid over dp x cp and each EP rank routes its own tokens before dispatch), so reducing over
        `ep` alone would miss the other data-parallel replicas, and over `dp` alone would miss the
        CP shards of each sequence. After the sum every rank holds identical counts, so every rank
        applies the identical update; no broadcast is needed. None = single rank.
        """
        n_experts = self.cfg.n_routed_experts
        if counts.shape != (n_experts,) or counts.dtype.is_floating_point:
            raise ValueError(f"update_expert_bias: counts must be an integer tensor of shape ({n_experts},), "
                             f"got {counts.dtype} of shape {tuple(counts.shape)}")
        total = counts.to(device=self.expert_bias.device, dtype=torch.int64, copy=True)
        if group is not None and dist.get_world_size(group) > 1:
            with labelled("expert_bias", group):
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        load = total.to(torch.float32)
        self.expert_bias.add_(self.cfg.bias_update_rate * torch.sign(load.mean() - load))
