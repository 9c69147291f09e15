"""`spartron plan`: what a config will do before it runs — resolved config, rank groups, memory per rank.

Everything about memory comes from the one cost model (spartron.layers.costs): the parameter count,
the bytes of parameters, gradients and optimizer state per rank after FSDP/EP sharding (in the stored
dtype: model.master_dtype, else model.dtype), and `memory_plan`'s predicted peak allocated memory of a
training step per rank (activations per AC mode, offload window, FSDP buffers, the loss). The plan is
for eager steps (train.compile changes what is saved; the plan does not model it) on the run's device.
"""

from __future__ import annotations

from spartron.layers.costs import MemoryPlan, StepShape, count_parameters, memory_plan, state_bytes_per_rank
from spartron.parallel.dims import GROUP_DIMS
from spartron.runtime.config import RunConfig, dump_config


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**24 else f"{n / 2**20:.2f} MiB"


def step_shape(cfg: RunConfig, world_size: int) -> StepShape:
    """The run config's keys that shape a step's memory (train.*, ac.*, offload.*, device)."""
    t, ac, off = cfg.train, cfg.ac, cfg.offload
    dims = cfg.parallel.dims(world_size)
    return StepShape(seq_len=t.seq_len, micro_batch_size=t.micro_batch_size, micro_steps=t.micro_steps(dims.dp),
                     optimizer=t.optimizer, ac_mode=ac.mode, ac_freq=ac.freq,
                     ac_targets=tuple(ac.targets) if ac.targets is not None else None, offload=off.enabled,
                     offload_keep_last=off.keep_last if off.window == "all_but_last" else 0,
                     offload_prefetch_depth=off.prefetch_depth, keep_grad_buffers=t.keep_grad_buffers,
                     device="cpu" if cfg.device == "cpu" else "cuda")


def plan_memory(cfg: RunConfig, world_size: int, rank: int = 0) -> MemoryPlan:
    """The predicted peak allocated memory of one training step of `cfg` on `rank` of `world_size`."""
    return memory_plan(cfg.model, cfg.parallel.dims(world_size), step_shape(cfg, world_size), rank)


def render_plan(cfg: RunConfig, world_size: int, max_groups: int = 16) -> str:
    """The text `spartron plan` prints (at most `max_groups` groups listed per dimension)."""
    dims = cfg.parallel.dims(world_size)
    out = ["# resolved config", dump_config(cfg).rstrip(), "", f"# parallel layout: {dims.describe()}"]
    for name in GROUP_DIMS:
        groups = dims.rank_groups(name)
        shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:max_groups])
        more = f" ... ({len(groups) - max_groups} more)" if len(groups) > max_groups else ""
        out.append(f"{name:<13} size {dims.group_size(name):<4} {len(groups)} group(s): {shown}{more}")
    params = count_parameters(cfg.model)
    mem = state_bytes_per_rank(cfg.model, dims, cfg.train.optimizer)
    out += ["", f"# state per rank ({cfg.model.stored_dtype} parameters, gradients and optimizer state): "
                f"parameters {params.total:,} ({params.dense:,} dense, {params.experts:,} in routed experts)"]
    out += [f"{key:<16} {_gib(value)}" for key, value in mem.items()]
    try:
        plan = plan_memory(cfg, world_size)
    except Exception as err:  # noqa: BLE001 - e.g. a batch that does not divide: the layout is still worth printing
        out += ["", f"# predicted peak per rank: not computed ({err})"]
    else:
        out += ["", f"# predicted peak allocated memory per rank (rank 0, eager step, ac.mode = {cfg.ac.mode!r}"
                    f"{', offload' if cfg.offload.enabled else ''}): {_gib(plan.peak)} at {plan.phase}"]
        out += [f"{key:<22} {_gib(value)}" for key, value in plan.parts.items()]
    return "\n".join(out) + "\n"
