"""Spartron's router as megatron-core's training machinery expects a router to be.

Who owns the expert-bias update: Megatron's `finalize_model_grads`. When the Megatron config has
`moe_router_enable_expert_bias` (megatron_config_from_spartron sets it from model.moe.bias_update_rate
> 0), finalize_model_grads visits every module with an `expert_bias` and reads its
`local_tokens_per_expert`: it all-reduces the stacked counts over parallel_state's tensor x data x
context-parallel group (dp x cp at tp = 1: the group Spartron's trainer reduces over, so
parallel_state must be initialised, as for Megatron's own router), sets
`bias + rate * sign(mean - count)` -- Spartron's rule (Router.update_expert_bias) -- and zeroes the
counts. `MegatronRouter` provides those counts.

A loop without finalize_model_grads calls `update_expert_bias(model, group)` here instead: Spartron's
rule over the same counts, which it also consumes. Either path moves the bias once per step even if
both run (the second finds zero counts: sign(0 - 0) = 0). The MoE layer's own path
(`MoELayer.update_expert_bias`, which counts eval forwards too) is refused on these routers.

Counting: only forwards in training mode (Megatron's evaluate() puts the model in eval mode, so its
eval forwards never steer the bias), through Spartron's replay-safe op `record_routing_stats`
(mandatory under Spartron activation checkpointing: a replay never counts twice). Counts are int64:
exact, and left alone by `.bfloat16()`.

Float16Module casts every floating buffer with `module.bfloat16()`. As Megatron's router does, the
expert bias is put back to fp32 before each forward, state_dict and load_state_dict; a bias cast
while non-zero has lost its low bits, which is refused (wrap the model before training or loading,
as Megatron does) instead of routing on a rounded bias.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from spartron.layers.config import MoEConfig
from spartron.layers.moe.router import Router, Routing
from spartron.layers.moe.telemetry import record_routing_stats


class MegatronRouter(Router):
    """Spartron's Router plus Megatron's `local_tokens_per_expert` and an fp32-kept `expert_bias`."""

    def __init__(self, cfg: MoEConfig, dim: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, init_std: float = 0.02):
        super().__init__(cfg, dim, dtype=dtype, device=device, init_std=init_std)
        self.register_buffer("local_tokens_per_expert",
                             torch.zeros(cfg.n_routed_experts, dtype=torch.int64, device=device), persistent=False)
        self.register_state_dict_pre_hook(lambda module, prefix, keep_vars: module.keep_bias_fp32())
        self.register_load_state_dict_pre_hook(lambda module, *args: module.keep_bias_fp32())

    @classmethod
    def like(cls, router: Router) -> MegatronRouter:
        """A MegatronRouter with `router`'s config, dtype and device (initialise it afterwards)."""
        w = router.weight
        return cls(router.cfg, w.shape[1], dtype=w.dtype, device=w.device, init_std=router.init_std)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        super().reset_buffers()
        counts = getattr(self, "local_tokens_per_expert", None)  # None inside Router.__init__
        if counts is not None:
            counts.zero_()

    @torch.no_grad()
    def keep_bias_fp32(self) -> None:
        """Undo Float16Module's cast of the expert bias (refused when the cast rounded it)."""
        bias = self.expert_bias
        if bias.dtype == torch.float32:
            return
        if bias.any():
            raise RuntimeError(f"the router's expert_bias was cast to {bias.dtype} while non-zero, which "
                               "rounded it: wrap the model in Float16Module before training or loading")
        self.expert_bias = bias.float()

    def forward(self, x: Tensor) -> Routing:
        self.keep_bias_fp32()
        routing = super().forward(x)
        if self.training:
            record_routing_stats(routing["topk_ids"], self.local_tokens_per_expert)
        return routing

    def update_expert_bias(self, counts: Tensor, group: dist.ProcessGroup | None = None) -> None:
        raise RuntimeError("the expert bias of a router under Megatron moves from its local_tokens_per_expert: "
                           "call megatron's finalize_model_grads (moe_router_enable_expert_bias=True) or "
                           "spartron.interop.megatron.update_expert_bias(model, group), not "
                           "MoELayer.update_expert_bias")

    @torch.no_grad()
    def consume_counts(self, group: dist.ProcessGroup | None) -> None:
        """Spartron's rule over this router's counts since the last update, then zero them."""
        self.keep_bias_fp32()
        Router.update_expert_bias(self, self.local_tokens_per_expert, group)
        self.local_tokens_per_expert.zero_()


def megatron_routers(model: nn.Module) -> list[MegatronRouter]:
    return [m for m in model.modules() if isinstance(m, MegatronRouter)]


def update_expert_bias(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Once per step, for loops without finalize_model_grads: every router's bias by Spartron's rule.

    `group`: the dp x cp group (Spartron's `groups.dp_cp`, Megatron's `pg_collection.dp_cp`).
    Collective over `group`. A no-op for counts that finalize_model_grads already consumed."""
    for router in megatron_routers(model):
        router.consume_counts(group)
