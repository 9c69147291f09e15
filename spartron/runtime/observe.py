"""The `[observe]` section: where a run's metrics go besides metrics.jsonl, and what is recorded when
it fails. `RunObserver` is the trainer's one handle on all of it.

- TensorBoard event files in `<run dir>/tensorboard` (`observe.tensorboard`; spartron.runtime.tensorboard)
  and Weights & Biases (`observe.wandb_project`), on rank 0; each optional package is checked when the
  config is validated, so a configured sink without its package is an error naming the key.
- A startup banner (rank 0, before the first step): parameter counts, layout, planned memory, outputs.
- Progress on long phases: rank 0 prints a line every `observe.progress_every_s` (10 s) while the setup,
  one step, one evaluation or one save is still running (a timer thread: building a big model, the first
  step's warm-up and a save of many GiB are otherwise minutes of silence).
- `observe.memory_snapshot_on_oom` (CUDA): the allocator records its history from the end of setup on, and
  a CUDA out-of-memory error in a step, an evaluation or a save dumps it to
  `<run dir>/memory/oom-rank<r>-step<s>.pickle` (open it at https://pytorch.org/memory_viz) before the error
  goes on.
- `observe.nccl_flight_recorder = N`: NCCL's flight recorder keeps the last N collectives per rank and
  dumps them to `<run dir>/nccl_trace/rank_<r>` on a watchdog timeout. torch reads it from the
  environment when the process group starts, so the launcher sets it (`launch_env`), never the user.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator

from spartron.configbase import ConfigSection
from spartron.runtime.safe_open import make_dir, open_file

INSTALL = {"tensorboard": "pip install tensorboard", "wandb": "pip install wandb"}


class ObserveConfig(ConfigSection):
    """Metric sinks, progress lines and failure records of a run (module docstring)."""

    tensorboard: bool = False  # event files in <run dir>/tensorboard
    wandb_project: str | None = None  # set: also log to Weights & Biases (package `wandb`)
    wandb_entity: str | None = None
    wandb_mode: Literal["online", "offline"] = "online"
    progress_every_s: float = Field(10.0, ge=0)  # a line while setup, a step, an eval or a save runs longer; 0: off
    memory_snapshot_on_oom: bool = False  # CUDA: allocator history, dumped on out-of-memory
    memory_history_entries: int = Field(100_000, ge=1)
    nccl_flight_recorder: int = Field(0, ge=0)  # collectives kept per rank (TORCH_NCCL_TRACE_BUFFER_SIZE); 0: off

    @model_validator(mode="after")
    def _check(self) -> ObserveConfig:
        if self.wandb_project is None:
            for key in ("wandb_entity", "wandb_mode"):
                if getattr(self, key) != ObserveConfig.model_fields[key].default:
                    raise ValueError(f"observe.{key} is set but observe.wandb_project is not: set the project "
                                     "to log to Weights & Biases, or remove it")
        if self.memory_history_entries != ObserveConfig.model_fields["memory_history_entries"].default \
                and not self.memory_snapshot_on_oom:
            raise ValueError("observe.memory_history_entries is set but observe.memory_snapshot_on_oom = false")
        for key, package in (("tensorboard", "tensorboard"), ("wandb_project", "wandb")):
            if getattr(self, key) not in (None, False) and importlib.util.find_spec(package) is None:
                raise ValueError(f"observe.{key} needs the Python package {package!r}, which is not installed: "
                                 f"{INSTALL[package]} (or remove observe.{key})")
        return self


FLIGHT_RECORDER_ENV = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def launch_env(cfg: ObserveConfig, run_dir: Path) -> dict[str, str]:
    """The environment the ranks' process groups need for what `cfg` asks (the flight recorder)."""
    if not cfg.nccl_flight_recorder:
        return {}
    values = (str(cfg.nccl_flight_recorder), "1", str(run_dir / "nccl_trace" / "rank_"))
    return dict(zip(FLIGHT_RECORDER_ENV, values, strict=True))


class Heartbeat:
    """Rank 0's timer thread: while a phase runs longer than `every_s`, print how long it has run."""

    def __init__(self, every_s: float, enabled: bool, say: Callable[[str], None] | None = None) -> None:
        self.every_s, self.enabled = every_s, enabled and every_s > 0
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._phase: tuple[str, float] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(target=self._loop, name="spartron-heartbeat", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def phase(self, what: str) -> Iterator[None]:
        with self._lock:
            self._phase = (what, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._phase = None

    def _loop(self) -> None:
        said: tuple[float | None, int] = (None, 0)  # (phase start, lines printed for it)
        while not self._stop.wait(min(self.every_s, 1.0)):
            with self._lock:
                phase = self._phase
            if phase is None:
                continue
            what, since = phase
            ran = time.monotonic() - since
            due = int(ran // self.every_s)  # one line per whole multiple of every_s
            if due > (said[1] if said[0] == since else 0):
                said = (since, due)
                self.say(f"spartron: {what} running for {ran:.0f} s")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


class MemoryHistory:
    """CUDA allocator history from its creation on; `dump(path)` writes the snapshot (memory_viz format)."""

    def __init__(self, cfg: ObserveConfig, device: torch.device) -> None:
        self.enabled = cfg.memory_snapshot_on_oom and device.type == "cuda"
        if self.enabled:
            torch.cuda.memory._record_memory_history(max_entries=cfg.memory_history_entries)

    def dump(self, run_dir: Path, relative: str) -> Path | None:
        """Write the snapshot to run_dir/relative, never through a link (what torch's _dump_snapshot writes)."""
        if not self.enabled:
            return None
        data = pickle.dumps(torch.cuda.memory._snapshot())
        with os.fdopen(open_file(run_dir, relative, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
            f.write(data)
        return run_dir / relative

    def close(self) -> None:
        if self.enabled:
            torch.cuda.memory._record_memory_history(enabled=None)


class RunObserver:
    """Everything `[observe]` asks of one rank of a run: sinks (rank 0), heartbeat (rank 0), OOM snapshots."""

    def __init__(self, cfg: ObserveConfig, run_dir: Path, rank: int, device: torch.device, config: dict) -> None:
        from spartron.runtime.tensorboard import MetricSinks

        self.run_dir, self.rank = run_dir, rank
        self.sinks = MetricSinks(cfg, run_dir, config) if rank == 0 else None
        self.heartbeat = Heartbeat(cfg.progress_every_s, enabled=rank == 0)
        self.memory = MemoryHistory(cfg, device)
        self.snapshots: list[Path] = []
        if cfg.nccl_flight_recorder:  # NCCL writes its dumps there (launch_env), but creates no folder
            make_dir(run_dir, "nccl_trace")  # a real folder of the run directory, not a link

    @contextlib.contextmanager
    def phase(self, what: str, step: int) -> Iterator[None]:
        """Run one step or save: progress lines while it is long, a memory snapshot if it runs out of memory."""
        with self.heartbeat.phase(what):
            try:
                yield
            except torch.OutOfMemoryError:
                path = self.memory.dump(self.run_dir, f"memory/oom-rank{self.rank}-step{step}.pickle")
                if path is not None:
                    self.snapshots.append(path)
                    print(f"spartron: rank {self.rank} ran out of memory in {what}; allocator snapshot {path}",
                          file=sys.stderr, flush=True)
                raise

    def write(self, record: dict) -> None:
        if self.sinks is not None:
            self.sinks.write(record)

    def close(self) -> None:
        self.heartbeat.close()
        self.memory.close()
        if self.sinks is not None:
            self.sinks.close()


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def banner(cfg, dims, model: torch.nn.Module, run_dir: Path, resumed_from: int | None,  # noqa: ANN001
           plan=None) -> str:  # noqa: ANN001 - a step_memory.MemoryPlan
    """The lines rank 0 prints before the first step. Total and active counts (active: dense parameters
    plus top_k of n_routed_experts of the routed ones), the state bytes per rank and `plan` (the predicted
    peak of a step, spartron.runtime.memory.plan_memory; None: not computed) are the cost model's
    (spartron.layers.costs) for the reference model; the per-rank count is this rank's own shards of the
    model actually built."""
    from spartron.layers.costs import count_parameters, state_bytes_per_rank

    params = count_parameters(cfg.model)
    moe = cfg.model.moe
    active = params.dense + params.experts * moe.top_k // max(moe.n_routed_experts, 1)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    state = state_bytes_per_rank(cfg.model, dims, cfg.train.optimizer,
                                 moments_dtype=cfg.train.adamw_moments_dtype)["total"]
    peak = (f"predicted peak {plan.peak / 2**30:.3f} GiB at {plan.phase}, of which " if plan is not None
            else "")
    t, o = cfg.train, cfg.observe
    outputs = [f"metrics {run_dir / 'metrics.jsonl'}", f"saved steps {run_dir}/step-*"
               + (f" every {t.save_every}" if t.save_every else " (train.save_every = 0: none)")]
    if dims.world_size > 1:
        outputs.append(f"rank logs {run_dir / 'logs'}")
    if o.tensorboard:
        outputs.append(f"tensorboard {run_dir / 'tensorboard'}")
    if o.wandb_project:
        outputs.append(f"wandb project {o.wandb_project} ({o.wandb_mode})")
    start = f"resuming after step {resumed_from}" if resumed_from is not None else (
        f"from {t.init_from}" if t.init_from else f"from seed {t.seed}")
    evaluation = (f"every {t.eval_every} steps on {t.eval_steps * t.global_batch_size} held-out sequences"
                  if t.eval_every else "off (train.eval_every = 0)")
    return "\n".join([
        f"spartron: run {cfg.name!r}: {t.steps} steps of {t.global_batch_size} x {t.seq_len} tokens, {start}",
        f"  parameters   {_count(params.total)} total, {_count(active)} active per token, {_count(local)} on rank 0",
        f"  layout       {dims.describe()}",
        f"  memory/rank  {peak}{state / 2**30:.3f} GiB parameters, gradients and optimizer state (cost model)",
        f"  evaluation   {evaluation}",
        "  outputs      " + "; ".join(outputs),
    ])
