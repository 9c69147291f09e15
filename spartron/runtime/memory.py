"""A run config's predicted peak memory per rank: the cost model's `memory_plan` (spartron.layers.costs) for
the step a RunConfig describes. Here, on the runtime floor, so both `spartron plan` (spartron.launch.plan)
and the trainer's startup banner read the same numbers. A staged run is planned per stage (its DSA mode, its
trainable parameters) and its peak is its worst stage's."""

from __future__ import annotations

from dataclasses import replace

from spartron.layers.costs import param_shapes
from spartron.layers.step_memory import MemoryPlan, StepShape, memory_plan
from spartron.runtime.config import RunConfig
from spartron.runtime.stages import stages_of, trainable_names


def step_shape(cfg: RunConfig, world_size: int) -> StepShape:
    """The run config's keys that shape a step's memory (train.*, ac.*, offload.*, device)."""
    t, ac, off = cfg.train, cfg.ac, cfg.offload
    dims = cfg.parallel.dims(world_size)
    return StepShape(seq_len=t.seq_len, micro_batch_size=t.micro_batch_size, micro_steps=t.micro_steps(dims.dp),
                     optimizer=t.optimizer, moments_dtype=t.adamw_moments_dtype, ac_mode=ac.mode, ac_freq=ac.freq,
                     ac_targets=tuple(ac.targets) if ac.targets is not None else None, offload=off.enabled,
                     offload_keep_last=off.keep_last if off.window == "all_but_last" else 0,
                     offload_prefetch_depth=off.prefetch_depth, keep_grad_buffers=t.keep_grad_buffers,
                     device="cpu" if cfg.device == "cpu" else "cuda", grad_sync=t.grad_sync)


def stage_plans(cfg: RunConfig, world_size: int, rank: int = 0) -> list[tuple[str, MemoryPlan]]:
    """(stage name, its step's plan) per `[[train.stages]]` stage, in order: the stage's DSA mode and its
    trainable parameters (spartron.runtime.stages' rule over the cost model's parameter names; a pattern
    matching none is a ConfigError naming it). [] without stages."""
    if not cfg.train.stages:
        return []
    dims, base = cfg.parallel.dims(world_size), step_shape(cfg, world_size)
    names = list(param_shapes(cfg.model))
    return [(stage.name, memory_plan(cfg.model, dims, replace(base, dsa_mode=stage.config.dsa_mode,
                                                              trainable=frozenset(trainable_names(names, stage))),
                                     rank)) for stage in stages_of(cfg.train)]


def plan_memory(cfg: RunConfig, world_size: int, rank: int = 0) -> MemoryPlan:
    """The predicted peak allocated memory of one training step of `cfg` on `rank` of `world_size`; with
    `[[train.stages]]`, the step of the stage whose peak is highest (the first of equal ones)."""
    stages = stage_plans(cfg, world_size, rank)
    if stages:
        return max((plan for _, plan in stages), key=lambda plan: plan.peak)
    return memory_plan(cfg.model, cfg.parallel.dims(world_size), step_shape(cfg, world_size), rank)
