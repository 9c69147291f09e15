"""`spartron plan`: what a config will do before it runs — resolved config, rank groups, memory per rank.

Everything about memory comes from the one cost model (spartron.layers.costs): the parameter count,
the bytes of parameters, gradients and optimizer state per rank after FSDP/EP sharding (in the stored
dtype: model.master_dtype, else model.dtype), and `memory_plan`'s predicted peak allocated memory of a
training step per rank (activations per AC mode, offload window, FSDP buffers, the loss). The plan is
for eager steps (train.compile changes what is saved; the plan does not model it) on the run's device.
"""

from __future__ import annotations

from spartron.layers.costs import count_parameters, state_bytes_per_rank
from spartron.parallel.dims import GROUP_DIMS
from spartron.runtime.config import RunConfig, dump_config
from spartron.runtime.memory import plan_memory, stage_plans, step_shape  # noqa: F401 (this module's API too)
from spartron.runtime.stages import planned_stage_table


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**24 else f"{n / 2**20:.2f} MiB"


def _stage_memory(cfg: RunConfig, world_size: int) -> list[str]:
    """One line per stage: its predicted peak on rank 0 and what makes it up (spartron.runtime.memory)."""
    try:
        plans = stage_plans(cfg, world_size)
    except Exception as err:  # noqa: BLE001 - as the peak below: the table is still worth printing
        return [f"predicted peak per stage: not computed ({err})"]
    return [f"stage {i} {name!r} predicted peak {_gib(p.peak)} at {p.phase}: "
            + ", ".join(f"{key} {_gib(value)}" for key, value in p.parts.items())
            for i, (name, p) in enumerate(plans, 1)]


def render_plan(cfg: RunConfig, world_size: int, max_groups: int = 16) -> str:
    """The text `spartron plan` prints (at most `max_groups` groups listed per dimension)."""
    dims = cfg.parallel.dims(world_size)
    out = ["# resolved config", dump_config(cfg).rstrip(), "", f"# parallel layout: {dims.describe()}"]
    for name in GROUP_DIMS:
        groups = dims.rank_groups(name)
        shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:max_groups])
        more = f" ... ({len(groups) - max_groups} more)" if len(groups) > max_groups else ""
        out.append(f"{name:<13} size {dims.group_size(name):<4} {len(groups)} group(s): {shown}{more}")
    stages = planned_stage_table(cfg)  # a pattern matching no parameter: a ConfigError naming it
    if stages:
        out += ["", f"# training stages ({len(stages)}, [[train.stages]])", *(line.strip() for line in stages)]
        out += _stage_memory(cfg, world_size)
    params = count_parameters(cfg.model)
    mem = state_bytes_per_rank(cfg.model, dims, cfg.train.optimizer, moments_dtype=cfg.train.adamw_moments_dtype)
    moments = f", AdamW moments in {cfg.train.adamw_moments_dtype}" if cfg.train.adamw_moments_dtype else ""
    out += ["", f"# state per rank ({cfg.model.stored_dtype} parameters, gradients and optimizer state{moments}): "
                f"parameters {params.total:,} ({params.dense:,} dense, {params.experts:,} in routed experts)"]
    out += [f"{key:<16} {_gib(value)}" for key, value in mem.items()]
    try:
        plan = plan_memory(cfg, world_size)
    except Exception as err:  # noqa: BLE001 - e.g. a batch that does not divide: the layout is still worth printing
        out += ["", f"# predicted peak per rank: not computed ({err})"]
    else:
        worst = next((f", stage {name!r}" for name, p in stage_plans(cfg, world_size) if p == plan), "")
        out += ["", f"# predicted peak allocated memory per rank (rank 0, eager step, ac.mode = {cfg.ac.mode!r}"
                    f"{', offload' if cfg.offload.enabled else ''}{worst}): {_gib(plan.peak)} at {plan.phase}"]
        out += [f"{key:<22} {_gib(value)}" for key, value in plan.parts.items()]
    return "\n".join(out) + "\n"
