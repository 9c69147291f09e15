"""A run config's predicted peak memory per rank: the cost model's `memory_plan` (spartron.layers.costs) for
the step a RunConfig describes. Here, on the runtime floor, so both `spartron plan` (spartron.launch.plan)
and the trainer's startup banner read the same numbers."""

from __future__ import annotations

from spartron.layers.step_memory import MemoryPlan, StepShape, memory_plan
from spartron.runtime.config import RunConfig


def step_shape(cfg: RunConfig, world_size: int) -> StepShape:
    """The run config's keys that shape a step's memory (train.*, ac.*, offload.*, device)."""
    t, ac, off = cfg.train, cfg.ac, cfg.offload
    dims = cfg.parallel.dims(world_size)
    return StepShape(seq_len=t.seq_len, micro_batch_size=t.micro_batch_size, micro_steps=t.micro_steps(dims.dp),
                     optimizer=t.optimizer, ac_mode=ac.mode, ac_freq=ac.freq,
                     ac_targets=tuple(ac.targets) if ac.targets is not None else None, offload=off.enabled,
                     offload_keep_last=off.keep_last if off.window == "all_but_last" else 0,
                     offload_prefetch_depth=off.prefetch_depth, keep_grad_buffers=t.keep_grad_buffers,
                     device="cpu" if cfg.device == "cpu" else "cuda", grad_sync=t.grad_sync)


def plan_memory(cfg: RunConfig, world_size: int, rank: int = 0) -> MemoryPlan:
    """The predicted peak allocated memory of one training step of `cfg` on `rank` of `world_size`."""
    return memory_plan(cfg.model, cfg.parallel.dims(world_size), step_shape(cfg, world_size), rank)
