"""The training engine: a `Trainer` runs one job from a RunConfig on this rank (setup / step / close) and
`train(cfg)` is the loop over it. The process entry of a rank is spartron.launch.rank (or `spartron train`).

One optimizer step: global_batch_size sequences are split over the data-parallel ranks (dp =
dp_replicate x fsdp) and, on each, into micro-batches of micro_batch_size; gradients accumulate
over the dp_size-th share of the batch (global_batch_size / (dp x micro_batch_size) micro-steps).
Context-parallel ranks of one dp rank read the SAME sequences; the model keeps its own
load-balanced slice of the sequence. Then: global-norm clipping over every shard, optimizer step,
the model's expert-bias update, metrics, and every save_every steps a distributed save.

Failures: an exception on any rank is raised with the rank and step in its message; the process
entry prints the traceback and exits non-zero at once, and the ranks waiting for it in a collective
fail after parallel.timeout_s and exit non-zero too, so a job never hangs silently. A non-finite loss
or gradient norm is detected on the all-reduced values, so every rank stops at the same step.
SIGTERM (Slurm preemption or time limit, a launcher forwarding its own) stops every rank at the same
step boundary after saving it (spartron.runtime.preemption); `[debug]` makes one rank fail on purpose.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from spartron.checkpointing.offload import ActivationOffloader
from spartron.layers.costs import training_flops_per_token
from spartron.layers.outputs import ModelOutput
from spartron.parallel.dims import ParallelDims
from spartron.parallel.groups import ParallelGroups
from spartron.runtime import metrics as M
from spartron.runtime.config import ConfigError, RunConfig, dump_config
from spartron.runtime.data import build_train_loader
from spartron.runtime.debug import check_fault, inject_fault
from spartron.runtime.evaluate import (
    Evaluator,
    check_held_out,
    describe_eval_data,
    eval_data_origin,
    step_eval_config,
)
from spartron.runtime.init_from import init_from_factory
from spartron.runtime.memory import plan_memory
from spartron.runtime.observe import Heartbeat, RunObserver, banner
from spartron.runtime.optim import build_optimizer, clip_and_step_, global_grad_norm, lr_at, set_lr
from spartron.runtime.preemption import StopOnSigterm
from spartron.runtime.rundir import check_newest_marker, marker_kind, read_manifest, read_meta, training_notes
from spartron.runtime.state import (
    AsyncSaveGroup,
    PendingSave,
    StateLoadError,
    latest_complete_step,
    load_state,
    lock_for_reading,
    resume_notes,
    start_run,
    start_save,
    state_config,
    step_dir,
)
from spartron.runtime.state_layout import expert_mesh, resplit_data_position


@runtime_checkable
class TrainableModel(Protocol):
    """What the trainer needs from every model (the reference SparseMoEModel implements all below).

    ``model(tokens[B,S], labels[B,S]) -> ModelOutput`` with ``loss`` = LM + MTP + aux + indexer
    losses, scaled so that the average over the dp_cp ranks is the global token mean. The protocols
    after this one are what a model may add; the trainer uses each one a model implements.
    """

    def __call__(self, tokens: Tensor, labels: Tensor) -> ModelOutput: ...

    def parameters(self) -> Iterable[nn.Parameter]: ...


@runtime_checkable
class ExpertBiasModel(Protocol):
    def update_expert_bias(self, group: dist.ProcessGroup) -> None:
        """Once per optimizer step, after ``optimizer.step()``; ``group`` is the dp x cp ProcessGroup
        (``groups.dp_cp``) over which the step's expert counts are summed."""


@runtime_checkable
class ExpertParallelModel(Protocol):
    def ep_sharded_parameters(self) -> Iterable[nn.Parameter]:
        """Parameters whose tensors hold only this EP rank's experts without saying so in a DTensor
        placement (their squared norms are summed over the EP group for clipping; they are saved as
        global tensors over the expert mesh, spartron.runtime.state_layout). Required with parallel.ep > 1."""


@runtime_checkable
class ClosableModel(Protocol):
    def close(self) -> object:
        """Release communication buffers: a collective, called on every rank when a run ends well."""


ModelFactory = Callable[[RunConfig, ParallelGroups], nn.Module]


class TrainingError(RuntimeError):
    """A step failed on this rank; the message names the rank and the step."""


class LossGuardStop(TrainingError):
    """A loss guard stopped the run on purpose (every rank at the same step, before the optimizer step):
    the launcher reports it as one line naming the step and the value, exit status 2, no traceback."""


class NonFiniteLossError(LossGuardStop):
    """The (all-reduced) loss or gradient norm is NaN or Inf."""


class LossSpikeError(LossGuardStop):
    """The (all-reduced, finite) loss is above train.max_loss or train.loss_spike_factor x the first loss."""


@dataclass
class TrainResult:
    run_dir: Path
    records: list[dict] = field(default_factory=list)  # one per step run by this call
    resumed_from: int | None = None
    stopped_at: int | None = None  # SIGTERM: the step saved before stopping early (None: ran to train.steps)


def default_model_factory(cfg: RunConfig, groups: ParallelGroups) -> nn.Module:
    """The reference model of spartron.layers.model, built on the meta device, parallelised there (AC,
    compile, FSDP2 with model.dtype as compute dtype over model.master_dtype masters, gradients reduced
    in model.reduce_dtype) and materialised shard by shard on the current default device: no rank
    holds more than its shards and one parameter's temporary."""
    from spartron.layers.init import materialize_
    from spartron.layers.model import build_model
    from spartron.layers.parallelize import parallelize

    t, m = cfg.train, cfg.model
    model = build_model(m, groups, seed=t.seed, micro_batches=t.intra_layer_micro_batches,
                        micro_batch_scope=t.intra_layer_micro_batch_scope, device="meta")
    model = parallelize(model, groups, cfg.ac, compile_backend=t.compile_backend if t.compile else None,
                        param_dtype=getattr(torch, m.dtype) if m.master_dtype else None,
                        reduce_dtype=getattr(torch, m.reduce_dtype))
    return materialize_(model, torch.get_default_device(), t.seed, m.init_std)


def resolve_device(cfg: RunConfig) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' requested but torch.cuda.is_available() is False "
                          "(install a CUDA build of torch, or set device = 'cpu')")
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def micro_steps(cfg: RunConfig, dims: ParallelDims) -> int:
    """Micro-batches per optimizer step on each rank; a ConfigError if the batch does not divide."""
    return cfg.train.micro_steps(dims.dp)


def _ep_sharded(model: nn.Module, groups: ParallelGroups) -> dict[int, tuple]:
    if groups.size("ep") == 1:
        return {}
    if not isinstance(model, ExpertParallelModel):
        raise ConfigError(f"parallel.ep = {groups.size('ep')}: {type(model).__name__} has no "
                          "ep_sharded_parameters() saying which parameters hold only this rank's experts")
    return {id(p): (groups.ep,) for p in model.ep_sharded_parameters()}


def _ep_state(model: nn.Module, groups: ParallelGroups, dims: ParallelDims) -> tuple[dict, dict]:
    """(the EP-sharded parameters' extra norm groups, save_state / load_state's EP keywords)."""
    ep_extra = _ep_sharded(model, groups)
    # Every EP rank holds different experts under the same names: saved as global tensors over ep_mesh.
    ep_state = {"ep_sharded": [n for n, q in model.named_parameters() if id(q) in ep_extra],
                "ep_rank": groups.rank_in("ep"), "layout": dims.describe(), "ep_mesh": expert_mesh(groups)}
    return ep_extra, ep_state


def _init_process_group(cfg: RunConfig) -> bool:
    """Initialise torch.distributed from the launcher's environment unless already done; True if we did."""
    if dist.is_initialized():
        return False
    from spartron.parallel.env import discover, init_distributed

    init_distributed(discover(), cfg.parallel.backend, cfg.parallel.timeout_s)
    return True


class _StepStats:
    """Detached per-step sums over micro-batches, all-reduced to global means at the end."""

    def __init__(self) -> None:
        self.values: list[Tensor] | None = None
        self.counts: Tensor | None = None
        self.n_mtp = 0

    def add(self, out: ModelOutput) -> None:
        zero = torch.zeros((), device=out["loss"].device)
        row = [out["loss"], out["lm_loss"], out["aux_loss"] if out["aux_loss"] is not None else zero,
               out["indexer_loss"] if out["indexer_loss"] is not None else zero, *out["mtp_losses"]]
        row = [t.detach().float() for t in row]
        self.n_mtp = len(out["mtp_losses"])
        self.values = row if self.values is None else [a + b for a, b in zip(self.values, row, strict=True)]
        tpe = out["tokens_per_expert"]
        if tpe is not None:
            self.counts = tpe.detach().clone() if self.counts is None else self.counts + tpe.detach()

    def reduce(self, n_micro: int, group: dist.ProcessGroup) -> tuple[list[float], Tensor | None]:
        stacked = torch.stack(self.values) / n_micro
        dist.all_reduce(stacked, group=group)  # gloo has no AVG: sum, then divide
        means = (stacked / dist.get_world_size(group)).tolist()
        counts = None
        if self.counts is not None:
            counts = self.counts.to(torch.int64)
            dist.all_reduce(counts, group=group)
        return means, counts


@dataclass(frozen=True)
class StepProbe:
    """What a benchmark or profiler may vary or watch in one `Trainer.step` (a run never sets one).

    `offloader`: the offloader this step's session comes from instead of the run's ("run"), or None for a
    step without offload; benchmarks alternate windows on one model this way (offload is a property of
    the step's session, not of the model). `on_phase(name)` is called with "forward" (before the first
    micro-batch), "backward" (each micro-batch's forward returned), "optimizer" (the last backward was
    issued) and "end" (the step's work finished on the device). `on_region_forward` /
    `on_region_backward` are the offload session's region observers. The open session is
    `Trainer.offload_session` while the step runs and after it.
    """
    offloader: ActivationOffloader | None | Literal["run"] = "run"
    on_phase: Callable[[str], None] | None = None
    on_region_forward: Callable[[int], None] | None = None
    on_region_backward: Callable[[int], None] | None = None


class Trainer:
    """One training job on this rank, in three explicit parts.

    `setup()` checks the config against the world, builds the groups, the model (the factory's),
    the optimizer, the loader, the offloader and the metrics log, and resumes from the run directory.
    `step()` runs one optimizer step (its micro-batches, clipping, optimizer, expert-bias update),
    records and logs its metrics, saves when due (or when any rank got SIGTERM) and returns the record.
    `close()` ends the run: the log is closed and, when the run ended well, the model's communication
    buffers are released (a collective). `train()` is the loop over them; benchmarks and profilers
    build and step the same object.
    """

    def __init__(self, cfg: RunConfig, model_factory: ModelFactory | None = None,
                 before_commit: Callable[[Path], None] | None = None, stop: StopOnSigterm | None = None):
        self.cfg = cfg
        self.model_factory = model_factory or default_model_factory
        self.before_commit = before_commit
        self.stop = stop or StopOnSigterm()  # not installed: only stop.request() stops the run
        self.records: list[dict] = []
        self.stopped_at: int | None = None
        self.started = time.perf_counter()  # the summary's total time counts from here
        self.last_saved: int | None = None  # the newest committed step: this run's, or the one it resumed from

    def setup(self) -> Trainer:
        """Build everything (class docstring); rank 0 says every observe.progress_every_s while it runs."""
        beat = Heartbeat(self.cfg.observe.progress_every_s, enabled=dist.get_rank() == 0)
        try:
            with beat.phase("setup (process groups, model, optimizer, resume)"):
                return self._setup()
        finally:
            beat.close()

    def _setup(self) -> Trainer:
        cfg, t, p = self.cfg, self.cfg.train, self.cfg.parallel
        self.device = device = resolve_device(cfg)
        self.rank, self.world = rank, world = dist.get_rank(), dist.get_world_size()
        # Everything that can be wrong with the config is checked before the first collective.
        self.dims = dims = p.dims(world)
        self.n_micro = micro_steps(cfg, dims)
        fault = check_fault(cfg.debug, world, t.steps)
        if fault:
            raise ConfigError(fault)
        if cfg.debug.fail_step is not None and rank == 0:  # never a surprise in a real run's log
            print(f"spartron: [debug] rank {cfg.debug.fail_rank} will fail at step {cfg.debug.fail_step} "
                  f"(fail_mode = {cfg.debug.fail_mode!r})", file=sys.stderr, flush=True)
        self.groups = groups = ParallelGroups.build(dims, device.type, timeout=timedelta(seconds=p.timeout_s),
                                                    nccl=p.nccl_settings())
        # The run directory against this run (refusals, resume step) before the model is built.
        self.run_dir, self.state_shape = run_dir, shape = cfg.run_dir(), state_config(cfg)
        shape.update(recorded_run_settings(cfg))  # with each saved step: the lr schedule, train.eval_steps
        plan, self.run_id = start_run(run_dir, resume=t.resume, overwrite=t.overwrite, steps=t.steps,
                                      layout=dims.describe(), config=shape)
        self.run_lock = plan.lock  # rank 0's: held until release_run_dir() (train(): after every rank ended)

        # The reference model's init depends on train.seed and names only (spartron.layers.init); this is
        # for custom factories that draw from the global RNG: the same state on every rank.
        torch.manual_seed(t.seed)
        factory = self.model_factory
        if t.init_from is not None and plan.resume_step is None:  # a resumed run loads its own saved step
            factory = init_from_factory(cfg, factory)
        with device:
            self.model = model = factory(cfg, groups)
        self.params = [q for q in model.parameters() if q.requires_grad]
        # Offload windows: the run-long offloader (window, host-buffer pool, streams); each step opens a session.
        self.offloader = ActivationOffloader.for_model(model, cfg.offload, device) if cfg.offload.enabled else None
        self.offload_session = None  # the current (or last) step's session: see StepProbe
        self.optimizer = build_optimizer(model, t)
        self.ep_extra, self.ep_state = _ep_state(model, groups, dims)
        self.async_save_group = AsyncSaveGroup() if t.async_save else None
        self.pending_save: PendingSave | None = None  # an async save, committed after the next step
        self.loader = build_train_loader(cfg, groups.rank_in("dp"), dims.dp)

        self.step_no, self.counters = 0, {"tokens": 0}
        self.resumed_from = self.last_saved = plan.resume_step
        if self.resumed_from is not None:
            self._resume(plan)
        self.log = M.MetricsLog(run_dir / "metrics.jsonl", t.steps, enabled=rank == 0, progress=t.progress)
        self.log.write({"type": "header", "name": cfg.name, "config": cfg.model_dump(mode="json"),
                        "config_toml": dump_config(cfg), "versions": M.versions(), "git_commit": M.git_commit(),
                        "hardware": M.hardware(device, world), "layout": dims.describe(),
                        "deterministic": device.type == "cpu", "resumed_from_step": self.resumed_from,
                        "run_id": self.run_id, "skipped_incomplete_steps": list(plan.skipped),
                        "micro_steps": self.n_micro})
        self.flops_per_token = training_flops_per_token(cfg.model, t.seq_len)
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        self.peak_flops = t.peak_tflops * 1e12 if t.peak_tflops else M.measure_peak_flops(device, dtype)
        self.evaluator = (Evaluator(cfg, groups.rank_in("dp"), dims.dp, self.n_micro, groups.dp_cp, device)
                          if t.eval_every else None)
        self.observer = RunObserver(cfg.observe, run_dir, rank, device, cfg.model_dump(mode="json"))
        if rank == 0 and t.progress:
            try:
                plan = plan_memory(cfg, world)
            except Exception:  # noqa: BLE001 - as in `spartron plan`: the banner still says the rest
                plan = None
            print(banner(cfg, dims, model, run_dir, self.resumed_from, plan), file=sys.stderr, flush=True)
        return self

    def _resume(self, plan) -> None:  # noqa: ANN001
        path = step_dir(self.run_dir, self.resumed_from)
        meta, rank_state = load_state(path, self.model, self.optimizer, self.device, config=self.state_shape,
                                      verify_checksums=self.cfg.train.verify_checksums, **self.ep_state)
        self.step_no, self.counters, self.run_id = meta["step"], meta["counters"], meta["run_id"] or self.run_id
        try:  # the global sample count, re-split over this run's dp ranks (a no-op on the saved layout)
            self.loader.load_state_dict(resplit_data_position(rank_state["data"], self.loader.dp_rank,
                                                              self.loader.dp_size, str(path)))
        except (KeyError, TypeError, ValueError) as err:
            raise StateLoadError(f"{path / f'rank-{self.rank:05d}.json'}: its data position does not fit this run "
                                 f"({err})") from None
        if self.rank == 0:
            changed = [c for c in resume_notes(meta["config"] or {}, self.state_shape)
                       if c.split(" ", 1)[0] not in SCHEDULE_KEYS]  # said by schedule_note
            note = f"; settings changed since that step (its tensors fit): {', '.join(changed)}" if changed else ""
            print(plan.message() + note, file=sys.stderr, flush=True)
            schedule = schedule_note(meta["config"] or {}, self.cfg.train, self.step_no)
            if schedule:
                print(schedule, file=sys.stderr, flush=True)
            for line in training_notes(meta["config"] or {}, self.state_shape, SCHEDULE_KEYS if schedule else ()):
                print(line, file=sys.stderr, flush=True)

    def release_run_dir(self) -> None:
        """Let another run use the run directory (rank 0 holds its lock from setup on; a no-op elsewhere)."""
        lock = getattr(self, "run_lock", None)
        if lock is not None:
            lock.release()

    @property
    def done(self) -> bool:
        """train.steps reached, or stopped early after a SIGTERM."""
        return self.stopped_at is not None or self.step_no >= self.cfg.train.steps

    def step(self, probe: StepProbe | None = None) -> dict[str, Any]:
        """One optimizer step and what follows it (metrics, log, a save when due); returns its record.
        A failure is raised as a TrainingError naming the rank and the step. `probe`: see StepProbe."""
        cfg, t = self.cfg, self.cfg.train
        step = self.step_no + 1
        try:
            inject_fault(cfg.debug, self.rank, step)
            with self.observer.phase(f"step {step}", step):
                record = self._optimizer_step(step, probe or StepProbe())
            self.step_no = step
            counters = self.counters
            counters.setdefault("first_loss", record["loss"])  # saved: a resumed run keeps the spike reference
            tokens_per_step = t.global_batch_size * t.seq_len
            counters["tokens"] += tokens_per_step
            tps = tokens_per_step / record["step_time_s"]
            record.update(tokens=counters["tokens"], tokens_per_s=tps, tokens_per_s_per_gpu=tps / self.world,
                          mfu=self.flops_per_token * tps / self.world / self.peak_flops)
            if self.evaluator is not None and (step % t.eval_every == 0 or step == t.steps):
                with self.observer.phase(f"evaluation after step {step}", step):
                    record.update(self.evaluator.run(self.model))
            self.records.append(record)
            self.log.write(record)
            self.observer.write(record)
            if self.pending_save is not None:  # train.async_save: its write overlapped this step
                pending, self.pending_save = self.pending_save, None
                with self.observer.phase(f"committing step {pending.step}", step):
                    pending.commit()
                self.last_saved = pending.step
            stopping = self.stop.agreed(self.device) and step < t.steps  # every rank stops at the same step
            if (t.save_every and step % t.save_every == 0) or stopping:
                with self.observer.phase(f"saving step {step}", step):
                    background = self.async_save_group if step < t.steps and not stopping else None
                    pending = start_save(self.run_dir, step, self.model, self.optimizer, dict(counters),
                                         {"data": self.loader.state_dict()}, self.device, self.before_commit,
                                         async_group=background, run_id=self.run_id, config=self.state_shape,
                                         keep_last=t.keep_last, **self.ep_state)
                    if background is None:
                        pending.commit()
                        self.last_saved = step
                    else:
                        self.pending_save = pending
            if stopping:
                self.stopped_at = step
        except TrainingError:
            raise
        except Exception as err:
            raise TrainingError(f"rank {self.rank} failed at step {step}: {type(err).__name__}: {err}") from err
        return record

    def _open_offload_session(self, probe: StepProbe):  # noqa: ANN202
        """The step's offload session (one per step), or a null context for a step without one."""
        offloader = self.offloader if probe.offloader == "run" else probe.offloader
        self.offload_session = None if offloader is None else offloader.session(
            on_region_backward=probe.on_region_backward, on_region_forward=probe.on_region_forward)
        return self.offload_session if self.offload_session is not None else contextlib.nullcontext()

    def _optimizer_step(self, step: int, probe: StepProbe) -> dict[str, Any]:
        t, model, optimizer, device = self.cfg.train, self.model, self.optimizer, self.device
        phase = probe.on_phase or (lambda name: None)
        lr = lr_at(step, t)
        set_lr(optimizer, lr)
        M.reset_peak_memory(device)
        start = time.perf_counter()
        stats = _StepStats()
        n_micro, data_s = self.n_micro, 0.0
        with self._open_offload_session(probe):
            phase("forward")
            for micro in range(n_micro):
                if isinstance(model, FSDPModule):  # FSDP2: reduce on the last micro-batch or on each (train.grad_sync)
                    model.set_requires_gradient_sync(micro == n_micro - 1 or t.grad_sync == "every_micro_batch")
                fetch = time.perf_counter()
                batch = self.loader.next(t.micro_batch_size)  # packed documents add their positions
                data_s += time.perf_counter() - fetch
                out = model(batch.tokens.to(device, non_blocking=True), batch.labels.to(device, non_blocking=True),
                            **batch.model_kwargs(device))
                phase("backward")
                (out["loss"] / n_micro).backward()
                stats.add(out)
            phase("optimizer")
        (loss, lm_loss, aux_loss, indexer_loss, *mtp), counts = stats.reduce(n_micro, self.groups.dp_cp)
        grad_norm = global_grad_norm(self.params, self.ep_extra)
        norm = float(grad_norm)
        if not (torch.isfinite(torch.tensor(loss)) and torch.isfinite(torch.tensor(norm))):
            raise NonFiniteLossError(f"non-finite values at step {step}: loss {loss}, grad norm {norm} "
                                     f"(lm {lm_loss}, mtp {mtp}, aux {aux_loss}, indexer {indexer_loss})")
        # before the optimizer step: the state stays the last good one
        _check_loss_limits(t, step, loss, self.counters.get("first_loss"))
        clip_and_step_(optimizer, self.params, t.grad_clip, grad_norm, norm)  # TritonAdamW clips inside its pass
        optimizer.zero_grad(set_to_none=not t.keep_grad_buffers)
        if isinstance(model, ExpertBiasModel):
            model.update_expert_bias(self.groups.dp_cp)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        phase("end")
        elapsed = time.perf_counter() - start
        alloc, reserved = M.peak_memory(device)
        return {"type": "step", "step": step, "loss": loss, "lm_loss": lm_loss, "mtp_losses": mtp,
                "aux_loss": aux_loss, "indexer_loss": indexer_loss, "grad_norm": norm, "lr": lr,
                "step_time_s": elapsed, "data_time_s": data_s, "peak_memory_allocated_bytes": alloc,
                "peak_memory_reserved_bytes": reserved, "alloc_retries": M.alloc_retries(device),
                "expert_load_max_violation": M.expert_load_max_violation(counts),
                "expert_load_per_layer": M.expert_load_per_layer(counts)}

    def close(self, ok: bool = True) -> TrainResult:
        """End the run. `ok` False (a failure): only the log is closed, nothing collective runs (a peer may
        still be inside a collective)."""
        if ok and self.pending_save is not None:  # a caller that stops stepping before train.steps
            self.pending_save.commit()
            self.last_saved, self.pending_save = self.pending_save.step, None
        saved = None if self.last_saved is None else f"{self.last_saved} ({step_dir(self.run_dir, self.last_saved)})"
        self.log.close(summary=ok and self.cfg.train.progress, first_loss=self.counters.get("first_loss"),
                       total_s=time.perf_counter() - self.started, saved=saved)
        self.observer.close()
        if ok:
            if self.async_save_group is not None:
                self.async_save_group.destroy()
            if isinstance(self.model, ClosableModel):  # collective: every rank ends the run well together
                self.model.close()
            if self.stopped_at is not None and self.rank == 0:
                print(f"spartron: SIGTERM: saved step {self.stopped_at} of {self.cfg.train.steps} in {self.run_dir} "
                      f"and stopped; resume = true continues from it", file=sys.stderr, flush=True)
        return TrainResult(run_dir=self.run_dir, records=self.records, resumed_from=self.resumed_from,
                           stopped_at=self.stopped_at)


def train(cfg: RunConfig, model_factory: ModelFactory | None = None,
          before_commit: Callable[[Path], None] | None = None) -> TrainResult:
    """Run (or resume) the job described by cfg on the ranks of the current launch: a Trainer's setup,
    steps until done, close."""
    with StopOnSigterm() as stop:  # from the start: a SIGTERM during setup stops after the first step
        owns_pg = _init_process_group(cfg)
        trainer = Trainer(cfg, model_factory, before_commit, stop)
        try:  # rank 0 holds the run directory's lock until every rank has passed the last barrier (or it fails)
            trainer.setup()
            try:
                while not trainer.done:
                    trainer.step()
            except Exception:
                trainer.close(ok=False)
                raise
            result = trainer.close()
            # On failure the group is left alone: tearing it down can block on peers still in a collective.
            dist.barrier()  # every rank is done with the run directory; no rank tears its transport down
            if owns_pg:  # while a peer still talks to it (gloo aborts)
                dist.destroy_process_group()
        finally:
            trainer.release_run_dir()
    return result


# Recorded with every saved step besides state_config: the learning-rate schedule (a resume that changes it
# says so: schedule_note) and train.eval_steps (`spartron eval` of a step evaluates what the run evaluated).
SCHEDULE_KEYS = ("train.lr", "train.warmup_steps", "train.min_lr_ratio", "train.steps")


def recorded_run_settings(cfg: RunConfig) -> dict[str, Any]:
    return {key: getattr(cfg.train, key.split(".", 1)[1]) for key in (*SCHEDULE_KEYS, "train.eval_steps")}


def schedule_note(saved: dict[str, Any], t, step: int) -> str | None:  # noqa: ANN001 - t: TrainConfig
    """One line when resuming after `step` under a learning-rate schedule other than the saved step's: the first
    step whose lr changes, what it would have been and is now, and the keys that changed. A resume that raises
    train.steps to extend a run re-plans the cosine decay; this is the line that says so (None: no change, or a
    step saved before the schedule was recorded)."""
    if not all(key in saved for key in SCHEDULE_KEYS):
        return None
    changed = [key for key in SCHEDULE_KEYS if saved[key] != getattr(t, key.split(".", 1)[1])]
    if not changed:
        return None
    before = t.model_copy(update={key.split(".", 1)[1]: saved[key] for key in SCHEDULE_KEYS})
    for s in range(step + 1, t.steps + 1):
        was, now = lr_at(s, before), lr_at(s, t)
        if not math.isclose(was, now, rel_tol=1e-9, abs_tol=0.0):
            break
    else:
        return None
    keys = ", ".join(f"{key} {saved[key]!r} -> {getattr(t, key.split('.', 1)[1])!r}" for key in changed)
    return (f"spartron: note: the learning-rate schedule changed on resume: lr at step {s} was to be {was:.4g}, "
            f"is now {now:.4g} ({keys})")


def _check_loss_limits(t, step: int, loss: float, first_loss: float | None) -> None:  # noqa: ANN001
    """train.max_loss / train.loss_spike_factor: an exploding (still finite) loss stops the run at its step."""
    if t.max_loss is not None and loss > t.max_loss:
        raise LossSpikeError(f"loss {loss:.6g} at step {step} is above train.max_loss = {t.max_loss:g}")
    if t.loss_spike_factor and first_loss is not None and first_loss > 0 \
            and loss > t.loss_spike_factor * first_loss:
        raise LossSpikeError(f"loss {loss:.6g} at step {step} is {loss / first_loss:.3g}x the first step's loss "
                             f"{first_loss:.6g}, above train.loss_spike_factor = {t.loss_spike_factor:g} "
                             "(lower train.lr, or set train.loss_spike_factor = 0 to train on)")


def evaluate_saved(cfg: RunConfig, path: str | Path, model_factory: ModelFactory | None = None,
                   explicit: Collection[str] = ()) -> dict[str, Any]:
    """`spartron eval`: the validation loss (spartron.runtime.evaluate) of a saved step, or of a run
    directory's newest complete step, on the ranks of the current launch (any layout: saved states are
    layout-free), on the data the step records unless `explicit` (the dotted keys given with --set) names
    other (step_eval_config). Returns the Evaluator's values with "step", "path", "data" (what was evaluated)
    and "notes" (one line per setting taken from the step instead of cfg); the run is not changed."""
    path = Path(path)
    reading = lock_for_reading(path)  # held until the end: no run starts, saves or prunes steps meanwhile
    if marker_kind(path) == "absent":  # a run directory: its newest complete step
        check_newest_marker(path)
        newest = latest_complete_step(path) if path.is_dir() else None
        if newest is None:
            raise StateLoadError(f"{path}: neither a saved step nor a run directory holding one")
        path = step_dir(path, newest)
    read_manifest(path)  # the step's data settings; load_state verifies meta.json with every other file
    saved = read_meta(path)["config"]
    cfg, notes = step_eval_config(cfg, saved, explicit, str(path / "meta.json"))
    origin = eval_data_origin(cfg, saved)
    check_held_out(cfg, origin, str(path))
    owns_pg = _init_process_group(cfg)
    device = resolve_device(cfg)
    dims = cfg.parallel.dims(dist.get_world_size())
    n_micro = micro_steps(cfg, dims)
    groups = ParallelGroups.build(dims, device.type, timeout=timedelta(seconds=cfg.parallel.timeout_s),
                                  nccl=cfg.parallel.nccl_settings())
    torch.manual_seed(cfg.train.seed)
    with device:
        model = (model_factory or default_model_factory)(cfg, groups)
    optimizer = build_optimizer(model, cfg.train)  # load_state restores both; only the model is used
    _, ep_state = _ep_state(model, groups, dims)
    meta, _ = load_state(path, model, optimizer, device, config=state_config(cfg),
                         verify_checksums=cfg.train.verify_checksums, **ep_state)
    result = Evaluator(cfg, groups.rank_in("dp"), dims.dp, n_micro, groups.dp_cp, device).run(model)
    result.update(step=meta["step"], path=str(path), data=describe_eval_data(cfg, origin), notes=notes)
    if isinstance(model, ClosableModel):
        model.close()
    if owns_pg:
        dist.barrier()
        dist.destroy_process_group()
    reading.release()
    return result
