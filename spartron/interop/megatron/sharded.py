"""`sharded_state_dict` of the MoE adapter for megatron-core's dist_checkpointing.

Without it Megatron treats every tensor of the adapter as replicated over data parallelism (its
default for modules without a `sharded_state_dict`), so only dp rank 0's experts are written and a
load gives every rank rank 0's experts. Here, as Megatron's own experts do:

- each local-expert tensor (a `GroupedExperts` parameter, stored [E_local, ...]) is a ShardedTensor
  of the global [E, ...] tensor at expert offset ep_rank * E_local (the expert axis comes after any
  axes the callers prepend in `sharded_offsets`), replicated over the expert-data-parallel group:
  replica_id (0, 0, expt_dp rank). A save under one EP size loads under any other that divides E.
- every other tensor (router weight and expert bias, shared experts) is replicated over data x
  context parallelism as Megatron's dense modules are (make_sharded_tensors_for_checkpoint with
  metadata's dp_cp_group): replica_id (0, tp rank = 0, dp_cp rank), so one rank writes it.

Keys are the state_dict names under `prefix` (e.g. `decoder.layers.1.mlp.moe.experts.w1`); the
expert tensors keep Spartron's layout (w1, w3 [E, inter, dim]; w2 [E, dim, inter]), so checkpoints
load into Spartron-spec models, not into Megatron's own MoE layers.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from spartron.interop.megatron.expert_params import expert_parameter_names


def _rank_and_size(pg: dist.ProcessGroup | None) -> tuple[int, int]:
    return (0, 1) if pg is None else (dist.get_rank(pg), dist.get_world_size(pg))


def moe_sharded_state_dict(module: nn.Module, prefix: str, sharded_offsets: tuple, metadata: dict | None,
                           ep_group: dist.ProcessGroup | None,
                           expt_dp_group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Megatron's ShardedStateDict of `module` (module docstring); `ep_group` None = one EP rank."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    state = module.state_dict(prefix="", keep_vars=True)
    experts = expert_parameter_names(module)
    unknown = sorted(experts - set(state))
    if unknown:
        raise RuntimeError(f"expert parameters {unknown} are missing from {type(module).__name__}'s state_dict")
    dense = {k: v for k, v in state.items() if k not in experts}
    out = make_sharded_tensors_for_checkpoint(dense, prefix, {}, sharded_offsets, tp_group=None,
                                              dp_cp_group=metadata["dp_cp_group"])
    ep_rank, ep_size = _rank_and_size(ep_group)
    expt_dp_rank, _ = _rank_and_size(expt_dp_group)
    axis = len(sharded_offsets)  # the expert axis of the global tensor, after the prepended ones
    for name in sorted(experts):
        out[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
            f"{prefix}{name}", state[name], *sharded_offsets, (axis, ep_rank, ep_size),
            replica_id=(0, 0, expt_dp_rank), prepend_axis_num=axis)
    return out
