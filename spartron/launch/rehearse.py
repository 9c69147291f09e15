"""`spartron rehearse`: rank R of an N-rank run, alone on the local device, at the config's true shapes.

What is built is what `spartron train` builds: the same Trainer (groups, model on meta, AC, compile, FSDP2
shards, EP's local experts, CP's slice, offload, optimizer), on a mirrored process group
(spartron.comm.mirror) instead of a real one: every collective returns what a real run whose ranks all
hold identical data returns, so shapes and values are true and nothing moves. What is MEASURED: compute
time (with the step's host work), peak allocated / reserved memory, the bytes of every collective.
What is MODELLED: communication time, from those bytes and the link table (spartron.runtime.linktable),
and the step time with it (spartron.launch.rehearse_report).

A step of the run has `n` micro-batches (train.global_batch_size / (dp x micro_batch_size)); a rehearsed
step runs `m = min(n, 2)` of them and the step is extrapolated: first forward + (n - 1) x (a backward
and the next forward, measured between the two) + last backward + optimizer. The peak is measured on the
m-micro-batch step: with train.grad_sync = 'every_micro_batch' later micro-batches repeat the second's
memory; with 'last_micro_batch' unsharded gradients exist from the first one on.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from spartron.comm.mirror import CollectiveRecord, mirrored_world
from spartron.runtime.config import ConfigError, RunConfig, config_from_dict

REHEARSED_MICRO_BATCHES = 2


@dataclass
class Segment:
    """One stretch of a rehearsed step between two phase marks: its time and its collectives."""

    name: str
    seconds: float
    records: list[CollectiveRecord] = field(default_factory=list)


COMPILED_REHEARSAL_TORCH = (2, 13)  # the first torch whose dynamo traces a mirrored (Python) process group


def check_rehearsable(cfg: RunConfig, torch_version: str = torch.__version__) -> None:
    """Refuse, naming the key, what a mirrored rank cannot run: peer-memory token exchanges, and compiled
    blocks on a torch whose dynamo cannot query a Python process group (size, rank) inside a graph."""
    if cfg.train.compile and torch.torch_version.TorchVersion(torch_version) < COMPILED_REHEARSAL_TORCH:
        need = ".".join(map(str, COMPILED_REHEARSAL_TORCH))
        raise ConfigError(f"train.compile = true cannot be rehearsed on torch {torch_version}: its dynamo cannot "
                          f"trace the mirrored process group's size/rank in a compiled block (torch >= {need} "
                          "can); rehearse with --set train.compile=false")
    moe = cfg.model.moe
    if moe.dispatcher == "deepep":
        raise ConfigError("model.moe.dispatcher = 'deepep' cannot be rehearsed: DeepEP's buffers map peer GPUs' "
                          "memory, which a mirrored rank has no peer for; rehearse with --set "
                          "model.moe.dispatcher='all_to_all' (same bytes, NCCL's all-to-all)")
    if getattr(moe, "all_to_all_transport", "nccl") != "nccl":
        raise ConfigError(f"model.moe.all_to_all_transport = {moe.all_to_all_transport!r} cannot be rehearsed: the "
                          "copy-engine exchange writes into peers' symmetric memory; rehearse with --set "
                          "model.moe.all_to_all_transport='nccl'")


def rehearsal_config(cfg: RunConfig, world: int, steps: int, run_dir: str) -> tuple[RunConfig, int, list[str]]:
    """The config the rehearsal trains: `cfg` with `steps` steps of at most REHEARSED_MICRO_BATCHES
    micro-batches, no saves, evaluation, resume, init_from, progress output or metric sinks, in
    `run_dir`. Returns it, the run's micro-batches per step and notes on what was changed (the report
    prints them: a rehearsal that silently left out a config's evaluation read as its full cost).
    A staged config (train.stages) rehearses every stage's steps: `steps` (--steps) must be their total,
    and a mismatch is refused naming --steps, the option the user sets (train.steps is the rehearsal's)."""
    check_rehearsable(cfg)
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    staged = sum(s.steps for s in cfg.train.stages)
    if staged and steps != staged:
        parts = " + ".join(str(s.steps) for s in cfg.train.stages)
        raise ConfigError(f"--steps {steps}: the config is staged (train.stages) and a rehearsal runs every stage's "
                          f"steps, {staged} ({parts}) in all: rehearse with --steps {staged}")
    dims = cfg.parallel.dims(world)
    n_micro = cfg.train.micro_steps(dims.dp)
    m = min(n_micro, REHEARSED_MICRO_BATCHES)
    data = cfg.model_dump(mode="json", exclude_none=True)
    t = data["train"]
    notes = []
    if t.get("init_from") is not None:
        notes.append("train.init_from is not read: a rehearsal starts from the seed's initialisation")
    if data["parallel"].get("nccl"):
        notes.append("parallel.nccl communicator settings have nothing to configure on a mirrored group")
    if t.get("eval_every"):
        notes.append(f"train.eval_every = {t['eval_every']} is not rehearsed: the steps and tokens/s leave out "
                     "evaluation")
    if t.get("save_every"):
        notes.append(f"train.save_every = {t['save_every']} is not rehearsed: the steps and tokens/s leave out "
                     f"saves{' (async_save included)' if t.get('async_save') else ''}")
    data["parallel"]["nccl"] = {}
    for key in ("init_from", "init_from_step"):
        t.pop(key, None)
    t.update(steps=steps, save_every=0, eval_every=0, resume=False, overwrite=True, progress=False,
             async_save=False, run_dir=run_dir,
             global_batch_size=dims.dp * cfg.train.micro_batch_size * m)
    data["observe"] = {"progress_every_s": 0.0}
    data["debug"] = {}
    return config_from_dict(data), n_micro, notes


def local_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameter shards (a DTensor's local tensor, or the plain tensor)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


class _Marks:
    """The StepProbe's phase callback: time and collectives of each stretch between phases.

    A step also runs collectives outside its marks: the loss normalisation's all-reduce before "forward"
    and, after "end", the SIGTERM agreement's all-reduce in Trainer.step. Both run once per step, so they
    are filed with the first stretch (forward->backward) and the last (optimizer->end, `finish`), whose
    weights are 1; their time is not compute (the data loading before "forward" is not counted either)."""

    def __init__(self, ledger: Any, device: torch.device) -> None:
        self.ledger, self.device = ledger, device
        self.segments: list[Segment] = []
        self._last: tuple[str, float] | None = None
        self._before: list[CollectiveRecord] = []

    def __call__(self, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        records = self.ledger.take()
        if self._last is None:
            self._before = records  # the step's collectives before its first mark
        else:
            name, start = self._last
            if not self.segments:
                records = self._before + records
            self.segments.append(Segment(f"{name}->{phase}", now - start, records))
        self._last = (phase, now)

    def finish(self) -> None:
        """After Trainer.step returned: its collectives after the "end" mark go to the last stretch."""
        self.segments[-1].records += self.ledger.take()


PROFILED_KERNELS = 25  # kernels listed by a profiled rehearsal, by total device time


def _kernel_table(prof: Any, device: torch.device) -> dict[str, Any]:
    """The profiled step's kernels (CUDA; CPU ops on a CPU run) by total time: where a rank's compute goes."""
    on_cuda = device.type == "cuda"
    rows = []
    for evt in prof.key_averages():
        ms = (evt.self_device_time_total if on_cuda else evt.self_cpu_time_total) / 1e3
        if ms > 0 and (not on_cuda or evt.device_type == torch.autograd.DeviceType.CUDA):
            rows.append({"name": evt.key, "ms": ms, "calls": evt.count})
    rows.sort(key=lambda r: -r["ms"])
    return {"device_ms": sum(r["ms"] for r in rows), "top": rows[:PROFILED_KERNELS],
            "what": "CUDA kernels" if on_cuda else "CPU ops (self time)"}


def _profiled_step(trainer: Any) -> dict[str, Any]:
    """One more step under torch.profiler (not a reported step: profiling slows it)."""
    from torch.profiler import ProfilerActivity, profile

    from spartron.runtime.trainer import StepProbe

    on_cuda = trainer.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]) as prof:
        trainer.step(StepProbe())
        if on_cuda:
            torch.cuda.synchronize(trainer.device)
    return _kernel_table(prof, trainer.device)


def run_rehearsal(cfg: RunConfig, world: int, rank: int, steps: int, balanced: bool,
                  profile: bool = False) -> dict[str, Any]:
    """Rank `rank` of `world` running `steps` rehearsed steps of `cfg`; the measured part of the report
    (spartron.launch.rehearse_report models the rest). `profile`: one more step under torch.profiler,
    its kernels by time in the result."""
    from spartron.runtime.trainer import StepProbe, Trainer

    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"--rank {rank} must be in [0, {world}) for --world-size {world}")
    with tempfile.TemporaryDirectory(prefix="spartron-rehearse-") as tmp:
        rcfg, n_micro, notes = rehearsal_config(cfg, world, steps + int(profile), tmp)
        started = time.perf_counter()
        with mirrored_world(rank, world, balanced=balanced) as ledger:
            trainer = Trainer(rcfg)
            trainer.setup()
            setup_s = time.perf_counter() - started
            ledger.take()  # the set-up's collectives (group creation, initial broadcasts): not a step's
            groups = trainer.groups
            group_ranks = {name: tuple(groups.group_ranks(name)) for name in ("ep", "cp", "fsdp_cp", "expert_fsdp")}
            out_steps = []
            for _ in range(steps):
                marks = _Marks(ledger, trainer.device)
                record = trainer.step(StepProbe(on_phase=marks))
                marks.finish()
                out_steps.append({"record": record, "segments": marks.segments})
            kernels = _profiled_step(trainer) if profile else None
            param_bytes = local_parameter_bytes(trainer.model)
            peak_flops, flops_per_token = trainer.peak_flops, trainer.flops_per_token
            trainer.close()
    return {"config": cfg, "world": world, "rank": rank, "balanced": balanced, "n_micro": n_micro,
            "rehearsed_micro": min(n_micro, REHEARSED_MICRO_BATCHES), "notes": notes, "setup_s": setup_s,
            "steps": out_steps, "param_bytes": param_bytes, "group_ranks": group_ranks,
            "peak_flops": peak_flops, "flops_per_token": flops_per_token, "device": str(rcfg.device),
            "device_name": _device_name(rcfg.device), "torch": torch.__version__, "kernels": kernels}


def _device_name(device: str) -> str:
    """The accelerator's model ("NVIDIA H200"), which a report needs to be compared; "cpu" on the CPU."""
    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
