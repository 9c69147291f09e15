"""Megatron's per-parameter attributes on the adapters' parameters, as megatron-core 0.16 sets them.

Megatron's DDP, optimizer and checkpoint code tell expert from dense parameters only by attributes
on the Parameter objects (DistributedDataParallel puts `allreduce=False` parameters into its
expert-parallel buffers, reduced over the expert-data-parallel group; `broadcast_params` and the
optimizer's parameter groups read the same flag). Without them Megatron's DDP averages different
experts' gradients across EP ranks. The attributes set here, per parameter role, are the ones
megatron-core 0.16.1's own MoE layer puts on its parameters (tests compare the two sets):

- local experts (every parameter of a `GroupedExperts`): `allreduce = not expert_parallel`, the rule
  of Megatron's expert linears (`not (is_expert and expert_parallel)`, expert_parallel meaning
  expert_model_parallel_size > 1), and the tensor-parallel triple `tensor_model_parallel`,
  `partition_dim`, `partition_stride`;
- the router weight: `sequence_parallel = False` only (Megatron's router sets config.sequence_parallel,
  which config.py requires to be False);
- every other parameter (shared experts, dense FFN, attention): `allreduce = True` and the triple.

The triple holds Megatron's "not partitioned" values (False, -1, 1; set_tensor_model_parallel_attributes)
where Megatron's own linears say which axis TP splits: Spartron weights are whole (tp = 1 is required)
and a stacked [experts, out, in] weight has no such axis. At tp = 1 Megatron computes nothing
differently from either value (param_is_not_tensor_parallel_duplicate is True for both).
The attributes live on the Parameter objects, so they survive `.cuda()`, `.bfloat16()` and
Float16Module (which change `param.data` in place).
"""

from __future__ import annotations

from torch import nn

from spartron.layers.moe.router import Router


def expert_parameter_names(module: nn.Module) -> set[str]:
    """Names (as in `module.named_parameters()`) of the local-expert parameters under `module`."""
    return {f"{name}.{p}" if name else p for name, sub in module.named_modules()
            if getattr(sub, "is_expert_module", False) for p, _ in sub.named_parameters()}


def set_megatron_param_attributes(module: nn.Module, expert_parallel: bool) -> None:
    """Tag every parameter of an adapter `module` for Megatron (module docstring).

    `expert_parallel`: the expert-parallel size is > 1 (then local experts are reduced over the
    expert-data-parallel group, not the data-parallel one)."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    experts = expert_parameter_names(module)
    router_weights = {id(sub.weight) for sub in module.modules() if isinstance(sub, Router)}
    for name, param in module.named_parameters():
        if id(param) in router_weights:
            param.sequence_parallel = False
            continue
        param.allreduce = not (name in experts and expert_parallel)
        if not hasattr(param, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(param, is_parallel=False, dim=-1, stride=1)
