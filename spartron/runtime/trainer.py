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
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from spartron.checkpointing.offload import ActivationOffloader, OffloadSession
from spartron.layers.costs import training_flops_per_token
from spartron.layers.fp8 import invalidate_weight_caches
from spartron.layers.outputs import ModelOutput
from spartron.runtime import metrics as M
from spartron.runtime.config import ConfigError, RunConfig, dump_config
from spartron.runtime.data import build_train_loader
from spartron.runtime.debug import check_fault, inject_fault
from spartron.runtime.evaluate import Evaluator
from spartron.runtime.gc_schedule import ScheduledGC
from spartron.runtime.guards import LossGuardStop, LossSpikeError, NonFiniteLossError, TrainingError, check_loss_limits
from spartron.runtime.indexer_metrics import IndexerProbe
from spartron.runtime.init_from import init_from_factory
from spartron.runtime.loss_norm import StepStats, TokenNormModel, step_loss_norm
from spartron.runtime.memory import plan_memory
from spartron.runtime.observe import Heartbeat, RunObserver, banner
from spartron.runtime.optim import build_optimizer, clip_and_step_, global_grad_norm, set_lr
from spartron.runtime.preemption import StopOnSigterm
from spartron.runtime.rank_setup import (
    ClosableModel,
    ExpertParallelModel,
    ModelFactory,
    RankModel,
    RankPlace,
    default_model_factory,
    init_process_group,
)
from spartron.runtime.rundir import RunDirLock, training_notes
from spartron.runtime.saved_config import seq_len_note
from spartron.runtime.saved_eval import evaluate_saved
from spartron.runtime.schedule import SCHEDULE_KEYS, recorded_run_settings, schedule_note
from spartron.runtime.stages import StageRunner, default_indexer_mode, lr_for_step
from spartron.runtime.state import (
    AsyncSaveGroup,
    PendingSave,
    StateLoadError,
    load_state,
    resume_notes,
    start_run,
    start_save,
    state_config,
    step_dir,
)
from spartron.runtime.state_layout import resplit_data_position

# Defined beside the rank set-up, the guards and `spartron eval`; imported from here by launchers and tests.
__all__ = ["ClosableModel", "ExpertParallelModel", "LossGuardStop", "LossSpikeError", "ModelFactory",
           "NonFiniteLossError", "StepProbe", "TokenNormModel", "TrainResult", "TrainableModel", "Trainer",
           "TrainingError", "default_model_factory", "evaluate_saved", "schedule_note", "train"]


@runtime_checkable
class TrainableModel(Protocol):
    """What the trainer needs from every model (the reference SparseMoEModel implements all below).

    ``model(tokens[B,S], labels[B,S]) -> ModelOutput`` with ``loss`` = LM + MTP + aux + indexer
    losses, scaled so that the average over the dp_cp ranks is the global token mean (of the micro-batch; of
    the step, given its LossNorm: TokenNormModel). The protocols after this one are what a model may add; the
    trainer uses each one a model implements.
    """

    def __call__(self, tokens: Tensor, labels: Tensor) -> ModelOutput: ...

    def parameters(self) -> Iterable[nn.Parameter]: ...


@runtime_checkable
class ExpertBiasModel(Protocol):
    def update_expert_bias(self, group: dist.ProcessGroup) -> None:
        """Once per optimizer step, after ``optimizer.step()``; ``group`` is the dp x cp ProcessGroup
        (``groups.dp_cp``) over which the step's expert counts are summed."""


@dataclass
class TrainResult:
    run_dir: Path
    records: list[dict] = field(default_factory=list)  # one per step run by this call
    resumed_from: int | None = None
    stopped_at: int | None = None  # SIGTERM: the step saved before stopping early (None: ran to train.steps)


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
        self.gc = ScheduledGC(cfg.train.gc_every)  # the collector off from setup() to close()
        self.records: list[dict] = []
        self.stopped_at: int | None = None
        self.started = time.perf_counter()  # the summary's total time counts from here
        self.last_saved: int | None = None  # the newest committed step: this run's, or the one it resumed from
        self.step_no, self.counters = 0, {"tokens": 0}  # counters: saved with each step
        self.resumed_from: int | None = None
        self.pending_save: PendingSave | None = None  # an async save, committed after the next step
        self.offload_session: OffloadSession | None = None  # the current (or last) step's: see StepProbe
        self.run_lock: RunDirLock | None = None  # rank 0's: held until close() or release_run_dir()
        self.phase = "new"  # "running" once setup() returned, "closed" by close(): step() runs only while running
        # The products of setup(), declared here:
        self.place: RankPlace  # device, rank, world, layout, micro-batches per step, groups
        self.run_dir: Path
        self.run_id: str
        self.state_shape: dict[str, Any]  # the config saved with each step (state_config and the schedule)
        self.model: nn.Module
        self.optimizer: torch.optim.Optimizer
        self.params: list[nn.Parameter]  # those with requires_grad
        self.ep_extra: dict[int, tuple]  # EP-sharded parameters: their clip-norm groups
        self.ep_state: dict  # save_state / load_state's EP keywords
        self.offloader: ActivationOffloader | None  # run-long (window, host-buffer pool); a session per step
        self.async_save_group: AsyncSaveGroup | None
        self.loader: Any  # spartron.runtime.data's train loader
        self.log: M.MetricsLog
        self.observer: RunObserver
        self.evaluator: Evaluator | None
        self.flops_per_token: float
        self.peak_flops: float
        self.stages: StageRunner  # the training stages (one implicit stage when train.stages is empty)
        self.indexer_probe: IndexerProbe | None  # the indexer-quality metric; None when off or no DSA layer

    # What benchmarks and tests read of the rank's place.
    device = property(lambda self: self.place.device)
    n_micro = property(lambda self: self.place.n_micro)
    groups = property(lambda self: self.place.groups)

    def setup(self) -> Trainer:
        """Build everything (class docstring); rank 0 says every observe.progress_every_s while it runs."""
        beat = Heartbeat(self.cfg.observe.progress_every_s, enabled=dist.get_rank() == 0)
        try:
            with beat.phase("setup (process groups, model, optimizer, resume)"):
                return self._setup()
        finally:
            beat.close()

    def _setup(self) -> Trainer:
        cfg, t = self.cfg, self.cfg.train
        # Everything that can be wrong with the config is checked before the first collective.
        fault = check_fault(cfg.debug, dist.get_world_size(), t.steps)
        if fault:
            raise ConfigError(fault)
        if cfg.debug.fail_step is not None and dist.get_rank() == 0:  # never a surprise in a real run's log
            print(f"spartron: [debug] rank {cfg.debug.fail_rank} will fail at step {cfg.debug.fail_step} "
                  f"(fail_mode = {cfg.debug.fail_mode!r})", file=sys.stderr, flush=True)
        self.place = place = RankPlace.of(cfg)
        device, rank, world, dims, groups = place.device, place.rank, place.world, place.dims, place.groups
        # The run directory against this run (refusals, resume step) before the model is built.
        self.run_dir, self.state_shape = run_dir, shape = cfg.run_dir(), state_config(cfg)
        shape.update(recorded_run_settings(cfg))  # with each saved step: the lr schedule, train.eval_steps
        plan, self.run_id = start_run(run_dir, resume=t.resume, overwrite=t.overwrite, steps=t.steps,
                                      layout=dims.describe(), config=shape)
        self.run_lock = plan.lock

        factory = self.model_factory
        if t.init_from is not None and plan.resume_step is None:  # a resumed run loads its own saved step
            factory = init_from_factory(cfg, factory)
        built = RankModel.build(cfg, place, factory)
        self.model, self.optimizer, self.ep_extra, self.ep_state = (built.model, built.optimizer, built.ep_extra,
                                                                    built.ep_state)
        invalidate_weight_caches(self.model)  # model.fp8.param_gather: the first FP8 shards (a collective)
        # [[train.stages]]: the stage of the first step to train, or of the saved step it resumes from
        self.stages = StageRunner(self.model, t, default_indexer_mode(self.model))
        self._enter_stage(plan.resume_step or 1, first=True)
        self.indexer_probe = IndexerProbe.for_model(self.model, t, groups.dp_cp)
        self.offloader = ActivationOffloader.for_model(self.model, cfg.offload, device) if cfg.offload.enabled else None
        self.async_save_group = AsyncSaveGroup() if t.async_save else None
        self.loader = build_train_loader(cfg, groups.rank_in("dp"), dims.dp)

        self.resumed_from = self.last_saved = plan.resume_step
        if self.resumed_from is not None:
            self._resume(plan)
        self.log = M.MetricsLog(run_dir / "metrics.jsonl", t.steps, enabled=rank == 0, progress=t.progress)
        self.log.write({"type": "header", "name": cfg.name, "config": cfg.model_dump(mode="json"),
                        "config_toml": dump_config(cfg), "versions": M.versions(), "git_commit": M.git_commit(),
                        "hardware": M.hardware(device, world), "layout": dims.describe(),
                        "deterministic": device.type == "cpu", "resumed_from_step": self.resumed_from,
                        "run_id": self.run_id, "skipped_incomplete_steps": list(plan.skipped),
                        "micro_steps": place.n_micro})
        self.flops_per_token = training_flops_per_token(cfg.model, t.seq_len)
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        self.peak_flops = t.peak_tflops * 1e12 if t.peak_tflops else M.measure_peak_flops(device, dtype)
        self.evaluator = (Evaluator(cfg, groups.rank_in("dp"), dims.dp, place.n_micro, groups.dp_cp, device)
                          if t.eval_every else None)
        self.observer = RunObserver(cfg.observe, run_dir, rank, device, cfg.model_dump(mode="json"))
        if rank == 0 and t.progress:
            try:
                memory = plan_memory(cfg, world)
            except Exception:  # noqa: BLE001 - as in `spartron plan`: the banner still says the rest
                memory = None
            stages = ["  stages", *self.stages.table()] if t.stages else []
            print("\n".join([banner(cfg, dims, self.model, run_dir, self.resumed_from, memory), *stages]),
                  file=sys.stderr, flush=True)
        self.gc.start()
        self.phase = "running"
        return self

    def _enter_stage(self, step: int, first: bool = False) -> None:
        """Step `step`'s stage in force (trainable parameters, DSA mode, optimizer: spartron.runtime.stages).
        The trainable-parameter list is read only at set-up (`first`) and when the stage changes."""
        before = self.stages.current
        self.optimizer = self.stages.enter(step, self.optimizer, lambda m: build_optimizer(m, self.cfg.train))
        if first or self.stages.current is not before:
            self.params = [q for q in self.model.parameters() if q.requires_grad]
        if self.stages.current is not before and self.place.rank == 0:
            print(self.stages.describe(), file=sys.stderr, flush=True)

    def _resume(self, plan) -> None:  # noqa: ANN001
        path = step_dir(self.run_dir, self.resumed_from)
        meta, rank_state = load_state(path, self.model, self.optimizer, self.device, config=self.state_shape,
                                      verify_checksums=self.cfg.train.verify_checksums, **self.ep_state)
        invalidate_weight_caches(self.model)
        self.step_no, self.counters, self.run_id = meta["step"], meta["counters"], meta["run_id"] or self.run_id
        try:  # the global sample count, re-split over this run's dp ranks (a no-op on the saved layout)
            self.loader.load_state_dict(resplit_data_position(rank_state["data"], self.loader.dp_rank,
                                                              self.loader.dp_size, str(path)))
        except (KeyError, TypeError, ValueError) as err:
            raise StateLoadError(f"{path / f'rank-{self.place.rank:05d}.json'}: its data position does not fit "
                                 f"this run ({err})") from None
        if self.place.rank == 0:
            changed = [c for c in resume_notes(meta["config"] or {}, self.state_shape)
                       if c.split(" ", 1)[0] not in SCHEDULE_KEYS]  # said by schedule_note
            note = f"; settings changed since that step (its tensors fit): {', '.join(changed)}" if changed else ""
            print(plan.message() + note, file=sys.stderr, flush=True)
            schedule = schedule_note(meta["config"] or {}, self.cfg.train, self.step_no)
            if schedule:
                print(schedule, file=sys.stderr, flush=True)
            for line in training_notes(meta["config"] or {}, self.state_shape, SCHEDULE_KEYS if schedule else ()):
                print(line, file=sys.stderr, flush=True)
            data = seq_len_note(meta["config"] or {}, self.state_shape, self.loader.position * self.loader.dp_size,
                                self.loader.source.fingerprint)
            if data:
                print(data, file=sys.stderr, flush=True)

    def release_run_dir(self) -> None:
        """Let another run use the run directory (rank 0 holds its lock from setup on; a no-op elsewhere)."""
        if self.run_lock is not None:
            self.run_lock.release()

    @property
    def done(self) -> bool:
        """train.steps reached, or stopped early after a SIGTERM."""
        return self.stopped_at is not None or self.step_no >= self.cfg.train.steps

    def step(self, probe: StepProbe | None = None) -> dict[str, Any]:
        """One optimizer step and what follows it (metrics, log, a save when due); returns its record.
        A failure is raised as a TrainingError naming the rank and the step. `probe`: see StepProbe.
        A step the run does not have (before setup(), after close(), once `done`) is refused, on every rank alike:
        a loop that overshoots would train past the schedule and save a step beyond train.steps."""
        cfg, t = self.cfg, self.cfg.train
        step = self.step_no + 1
        if self.phase != "running":
            raise RuntimeError("Trainer.step() before setup()" if self.phase == "new" else
                               "Trainer.step() after close(): build a new Trainer to go on (resume = true)")
        if self.done:
            why = f"stopped after SIGTERM at step {self.stopped_at}" if self.stopped_at is not None else \
                f"train.steps = {t.steps} reached"
            raise RuntimeError(f"Trainer.step(): the run is done ({why}); raise train.steps and resume to train on")
        try:
            inject_fault(cfg.debug, self.place.rank, step)
            self._enter_stage(step)
            with self.observer.phase(f"step {step}", step):
                record = self._optimizer_step(step, probe or StepProbe())
            self.step_no = step
            counters = self.counters
            counters.setdefault("first_loss", record["loss"])  # saved: a resumed run keeps the spike reference
            tokens_per_step = t.global_batch_size * t.seq_len
            counters["tokens"] += tokens_per_step
            tps = tokens_per_step / record["step_time_s"]
            record.update(tokens=counters["tokens"], tokens_per_s=tps, tokens_per_s_per_gpu=tps / self.place.world,
                          mfu=self.flops_per_token * tps / self.place.world / self.peak_flops)
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
            raise TrainingError(f"rank {self.place.rank} failed at step {step}: {type(err).__name__}: {err}") from err
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
        lr = lr_for_step(step, t)
        set_lr(optimizer, lr)
        M.reset_peak_memory(device)
        start = time.perf_counter()
        self.gc.step(step)  # every rank at the same step; its pause is in the step's time
        stats, measured = StepStats(), {}
        n_micro = self.n_micro
        fetch = time.perf_counter()
        batches = [self.loader.next(t.micro_batch_size) for _ in range(n_micro)]  # the step's, counted first
        data_s = time.perf_counter() - fetch
        loss_norm = step_loss_norm(model, batches, self.groups.dp_cp, device)
        with self._open_offload_session(probe):
            phase("forward")
            for micro, batch in enumerate(batches):
                if isinstance(model, FSDPModule):  # FSDP2: reduce on the last micro-batch or on each (train.grad_sync)
                    model.set_requires_gradient_sync(micro == n_micro - 1 or t.grad_sync == "every_micro_batch")
                with (self.indexer_probe.measuring(step, measured) if self.indexer_probe and micro == 0
                      else contextlib.nullcontext()):
                    out = model(batch.tokens.to(device, non_blocking=True),
                                batch.labels.to(device, non_blocking=True), **batch.model_kwargs(device),
                                **({} if loss_norm is None else {"loss_norm": loss_norm}))
                    phase("backward")
                    (out["loss"] if loss_norm is not None else out["loss"] / n_micro).backward()
                stats.add(out)
            phase("optimizer")
        (loss, lm_loss, aux_loss, indexer_loss, *mtp), counts = stats.reduce(n_micro, self.groups.dp_cp,
                                                                             shares=loss_norm is not None)
        grad_norm = global_grad_norm(self.params, self.ep_extra)
        norm = float(grad_norm)
        if not (torch.isfinite(torch.tensor(loss)) and torch.isfinite(torch.tensor(norm))):
            raise NonFiniteLossError(f"non-finite values at step {step}: loss {loss}, grad norm {norm} "
                                     f"(lm {lm_loss}, mtp {mtp}, aux {aux_loss}, indexer {indexer_loss})")
        # before the optimizer step: the state stays the last good one
        check_loss_limits(t, step, loss, self.counters.get("first_loss"))
        clip_and_step_(optimizer, self.params, t.grad_clip, grad_norm, norm)  # TritonAdamW clips inside its pass
        invalidate_weight_caches(model)  # model.fp8.weight_cache: the next forward re-quantises the new weights
        optimizer.zero_grad(set_to_none=not t.keep_grad_buffers)
        if isinstance(model, ExpertBiasModel):  # not while the routers are frozen (stages)
            self.stages.update_expert_bias(model, self.groups.dp_cp)
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
                "expert_load_per_layer": M.expert_load_per_layer(counts),
                **({"stage": self.stages.current.name} if self.stages.current else {}),
                **(self.indexer_probe.record(measured) if self.indexer_probe else {})}

    def close(self, ok: bool = True) -> TrainResult:
        """End the run: collective when `ok`; on return the run directory is free for the next run on every
        rank. `ok` False (a failure): only the log is closed, nothing collective runs (a peer may still be inside
        a collective); the lock then goes with release_run_dir()."""
        if ok and self.pending_save is not None:  # a caller that stops stepping before train.steps
            self.pending_save.commit()
            self.last_saved, self.pending_save = self.pending_save.step, None
        self.phase = "closed"
        self.gc.stop()
        saved = None if self.last_saved is None else f"{self.last_saved} ({step_dir(self.run_dir, self.last_saved)})"
        self.log.close(summary=ok and self.cfg.train.progress, first_loss=self.counters.get("first_loss"),
                       total_s=time.perf_counter() - self.started, saved=saved)
        self.observer.close()
        if ok:
            if self.async_save_group is not None:
                self.async_save_group.destroy()
            if isinstance(self.model, ClosableModel):  # collective: every rank ends the run well together
                self.model.close()
            if self.stopped_at is not None and self.place.rank == 0:
                print(f"spartron: SIGTERM: saved step {self.stopped_at} of {self.cfg.train.steps} in {self.run_dir} "
                      f"and stopped; resume = true continues from it", file=sys.stderr, flush=True)
            # every rank is done with the directory before rank 0 lets it go, and none returns before it has:
            # whichever rank returns first may start the next run there (plan_run probes the lock on every rank)
            if dist.is_initialized():
                dist.barrier()
            self.release_run_dir()
            if dist.is_initialized():
                dist.barrier()
        return TrainResult(run_dir=self.run_dir, records=self.records, resumed_from=self.resumed_from,
                           stopped_at=self.stopped_at)


def train(cfg: RunConfig, model_factory: ModelFactory | None = None,
          before_commit: Callable[[Path], None] | None = None) -> TrainResult:
    """Run (or resume) the job described by cfg on the ranks of the current launch: a Trainer's setup,
    steps until done, close."""
    with StopOnSigterm() as stop:  # from the start: a SIGTERM during setup stops after the first step
        owns_pg = init_process_group(cfg)
        trainer = Trainer(cfg, model_factory, before_commit, stop)
        try:  # rank 0 holds the run directory's lock until close() (or a failure) lets it go
            trainer.setup()
            try:
                while not trainer.done:
                    trainer.step()
            except Exception:
                trainer.close(ok=False)
                raise
            # close() ends with a barrier: no rank tears its transport down while a peer still talks to it (gloo
            # aborts). On failure the group is left alone: tearing it down can block on peers in a collective.
            result = trainer.close()
            if owns_pg:
                dist.destroy_process_group()
        finally:
            trainer.release_run_dir()
    return result


