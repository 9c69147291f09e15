"""The training engine: `train(cfg)` runs one job from a RunConfig; `python -m spartron.runtime.trainer
CONFIG [--set key=value ...]` runs it as a process (one per rank under torchrun/srun/the launcher).

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

import argparse
import contextlib
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from spartron.checkpointing.offload import ActivationOffloader
from spartron.launch.process import STOPPED_STATUS, exit_process
from spartron.layers.costs import training_flops_per_token
from spartron.layers.outputs import ModelOutput
from spartron.parallel.dims import ParallelDims
from spartron.parallel.groups import ParallelGroups
from spartron.runtime import metrics as M
from spartron.runtime.config import ConfigError, RunConfig, dump_config, load_config
from spartron.runtime.data import build_loader
from spartron.runtime.debug import check_fault, inject_fault
from spartron.runtime.optim import build_optimizer, clip_grads_, global_grad_norm, lr_at, set_lr
from spartron.runtime.preemption import StopOnSigterm
from spartron.runtime.state import (
    StateLoadError,
    load_state,
    resume_notes,
    save_state,
    start_run,
    state_config,
    step_dir,
)


@runtime_checkable
class TrainableModel(Protocol):
    """What the trainer needs from a model (the reference SparseMoEModel implements it).

    Required: ``model(tokens[B,S], labels[B,S]) -> ModelOutput`` with ``loss`` = LM + MTP + aux +
    indexer losses, scaled so that the average over the dp_cp ranks is the global token mean.
    Optional methods, used when present:
    - ``update_expert_bias(group)``: once per optimizer step, after ``optimizer.step()``; ``group`` is
      the dp x cp ProcessGroup (``groups.dp_cp``) over which the step's expert counts are summed.
    - ``ep_sharded_parameters() -> Iterable[Parameter]``: parameters whose tensors hold only this EP
      rank's experts without saying so in a DTensor placement (their squared norms are summed over
      the EP group for clipping). Without it, parameters under a module path containing ``experts``
      are taken to be EP-sharded when parallel.ep > 1.
    - ``set_requires_gradient_sync(bool)`` (FSDP2): reduce gradients only on the last micro-batch.
    - ``close()``: release communication buffers (a collective) when the run ends well.
    """

    def __call__(self, tokens: Tensor, labels: Tensor) -> ModelOutput: ...

    def parameters(self) -> Iterable[nn.Parameter]: ...


ModelFactory = Callable[[RunConfig, ParallelGroups], nn.Module]


class TrainingError(RuntimeError):
    """A step failed on this rank; the message names the rank and the step."""


class NonFiniteLossError(TrainingError):
    """The (all-reduced) loss or gradient norm is NaN or Inf."""


class LossSpikeError(TrainingError):
    """The (all-reduced, finite) loss is above train.max_loss or train.loss_spike_factor x the first loss."""


@dataclass
class TrainResult:
    run_dir: Path
    records: list[dict] = field(default_factory=list)  # one per step run by this call
    resumed_from: int | None = None
    stopped_at: int | None = None  # SIGTERM: the step saved before stopping early (None: ran to train.steps)


def default_model_factory(cfg: RunConfig, groups: ParallelGroups) -> nn.Module:
    """The reference model of spartron.layers.model, parallelised (AC, compile, FSDP2) for the groups."""
    from spartron.layers.model import build_model
    from spartron.layers.parallelize import parallelize

    t = cfg.train
    model = build_model(cfg.model, groups, seed=t.seed, micro_batches=t.intra_layer_micro_batches,
                        micro_batch_scope=t.intra_layer_micro_batch_scope)
    return parallelize(model, groups, cfg.ac, compile_backend=t.compile_backend if t.compile else None)


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
    if hasattr(model, "ep_sharded_parameters"):
        params = list(model.ep_sharded_parameters())
    else:
        params = [p for name, p in model.named_parameters() if "experts" in name.split(".")]
    return {id(p): (groups.ep,) for p in params}


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


def train(cfg: RunConfig, model_factory: ModelFactory | None = None,
          before_commit: Callable[[Path], None] | None = None) -> TrainResult:
    """Run (or resume) the job described by cfg on the ranks of the current launch."""
    with StopOnSigterm() as stop:  # from the start: a SIGTERM during setup stops after the first step
        owns_pg = _init_process_group(cfg)
        result = _train(cfg, model_factory or default_model_factory, before_commit, stop)
    # On failure the group is left alone: tearing it down can block on peers still in a collective.
    if owns_pg:
        dist.barrier()  # no rank tears its transport down while a peer still talks to it (gloo aborts)
        dist.destroy_process_group()
    return result


def _train(cfg: RunConfig, model_factory: ModelFactory,
           before_commit: Callable[[Path], None] | None, stop: StopOnSigterm | None = None) -> TrainResult:
    t = cfg.train
    stop = stop or StopOnSigterm()  # not installed: only stop.request() stops the run
    device = resolve_device(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    p = cfg.parallel
    # Everything that can be wrong with the config is checked before the first collective.
    dims = p.dims(world)
    n_micro = micro_steps(cfg, dims)
    fault = check_fault(cfg.debug, world, t.steps)
    if fault:
        raise ConfigError(fault)
    if cfg.debug.fail_step is not None and rank == 0:  # never a surprise in a real run's log
        print(f"spartron: [debug] rank {cfg.debug.fail_rank} will fail at step {cfg.debug.fail_step} "
              f"(fail_mode = {cfg.debug.fail_mode!r})", file=sys.stderr, flush=True)
    groups = ParallelGroups.build(dims, device.type, timeout=timedelta(seconds=p.timeout_s),
                                  nccl=p.nccl_settings())
    # The run directory against this run (refusals, resume step) before the model is built.
    run_dir, shape = cfg.run_dir(), state_config(cfg)
    plan, run_id = start_run(run_dir, resume=t.resume, overwrite=t.overwrite, steps=t.steps,
                             layout=dims.describe(), config=shape)

    # The reference model's init depends on train.seed and names only (spartron.layers.init); this is
    # for custom factories that draw from the global RNG: the same state on every rank.
    torch.manual_seed(t.seed)
    with device:
        model = model_factory(cfg, groups)
    params = [q for q in model.parameters() if q.requires_grad]
    # Offload windows: the run-long offloader (window, host-buffer pool, streams); each step opens a session.
    offloader = ActivationOffloader.for_model(model, cfg.offload, device) if cfg.offload.enabled else None
    optimizer = build_optimizer(model, t)
    ep_extra = _ep_sharded(model, groups)
    # Saved per EP rank: every EP rank holds different experts under the same names.
    ep_state = {"ep_sharded": [n for n, q in model.named_parameters() if id(q) in ep_extra],
                "ep_rank": groups.rank_in("ep"), "layout": dims.describe()}
    loader = build_loader(t.data, cfg.model.vocab_size, t.seq_len, t.seed, groups.rank_in("dp"), dims.dp)

    start, counters = 0, {"tokens": 0}
    resumed_from = plan.resume_step
    if resumed_from is not None:
        path = step_dir(run_dir, resumed_from)
        meta, rank_state = load_state(path, model, optimizer, device, config=shape,
                                      verify_checksums=t.verify_checksums, **ep_state)
        start, counters, run_id = meta["step"], meta["counters"], meta["run_id"] or run_id
        try:
            loader.load_state_dict(rank_state["data"])
        except (KeyError, TypeError, ValueError) as err:
            raise StateLoadError(f"{path / f'rank-{rank:05d}.json'}: its data position does not fit this run "
                                 f"({err})") from None
        if rank == 0:
            changed = resume_notes(meta["config"] or {}, shape)
            note = f"; settings changed since that step (its tensors fit): {', '.join(changed)}" if changed else ""
            print(plan.message() + note, file=sys.stderr, flush=True)

    log = M.MetricsLog(run_dir / "metrics.jsonl", t.steps, enabled=rank == 0, progress=t.progress)
    log.write({"type": "header", "name": cfg.name, "config": cfg.model_dump(mode="json"),
               "config_toml": dump_config(cfg), "versions": M.versions(), "git_commit": M.git_commit(),
               "hardware": M.hardware(device, world), "layout": dims.describe(),
               "deterministic": device.type == "cpu", "resumed_from_step": resumed_from,
               "run_id": run_id, "skipped_incomplete_steps": list(plan.skipped),
               "micro_steps": n_micro})
    flops_per_token = training_flops_per_token(cfg.model, t.seq_len)
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    peak = t.peak_tflops * 1e12 if t.peak_tflops else M.measure_peak_flops(device, dtype)
    tokens_per_step = t.global_batch_size * t.seq_len
    records: list[dict] = []
    step, stopped_at = start, None
    try:
        for step in range(start + 1, t.steps + 1):
            inject_fault(cfg.debug, rank, step)
            record = _one_step(cfg, step, model, optimizer, loader, params, ep_extra, groups, n_micro, device,
                               offloader, first_loss=counters.get("first_loss"))
            counters.setdefault("first_loss", record["loss"])  # saved: a resumed run keeps the spike reference
            counters["tokens"] += tokens_per_step
            tps = tokens_per_step / record["step_time_s"]
            record.update(tokens=counters["tokens"], tokens_per_s=tps, tokens_per_s_per_gpu=tps / world,
                          mfu=flops_per_token * tps / world / peak)
            records.append(record)
            log.write(record)
            stopping = stop.agreed(device) and step < t.steps  # every rank stops at the same step
            if (t.save_every and step % t.save_every == 0) or stopping:
                save_state(run_dir, step, model, optimizer, dict(counters), {"data": loader.state_dict()},
                           device, before_commit, run_id=run_id, config=shape, keep_last=t.keep_last,
                           **ep_state)
            if stopping:
                stopped_at = step
                break
    except TrainingError:
        log.close(summary=False)
        raise
    except Exception as err:
        log.close(summary=False)
        raise TrainingError(f"rank {rank} failed at step {step}: {type(err).__name__}: {err}") from err
    log.close(summary=t.progress)
    if hasattr(model, "close"):  # collective, so only here: every rank ends the run well together
        model.close()
    if stopped_at is not None and rank == 0:
        print(f"spartron: SIGTERM: saved step {stopped_at} of {t.steps} in {run_dir} and stopped; "
              f"resume = true continues from it", file=sys.stderr, flush=True)
    return TrainResult(run_dir=run_dir, records=records, resumed_from=resumed_from, stopped_at=stopped_at)


def _one_step(cfg: RunConfig, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, loader,
              params: list[nn.Parameter], ep_extra: dict, groups: ParallelGroups, n_micro: int,
              device: torch.device, offloader: ActivationOffloader | None = None,
              first_loss: float | None = None) -> dict[str, Any]:
    t = cfg.train
    lr = lr_at(step, t)
    set_lr(optimizer, lr)
    M.reset_peak_memory(device)
    start = time.perf_counter()
    stats = _StepStats()
    with offloader.session() if offloader is not None else contextlib.nullcontext():  # closed with the step
        for micro in range(n_micro):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(micro == n_micro - 1)
            tokens, labels = loader.next_batch(t.micro_batch_size)
            out = model(tokens.to(device, non_blocking=True), labels.to(device, non_blocking=True))
            (out["loss"] / n_micro).backward()
            stats.add(out)
    (loss, lm_loss, aux_loss, indexer_loss, *mtp), counts = stats.reduce(n_micro, groups.dp_cp)
    grad_norm = global_grad_norm(params, ep_extra)
    norm = float(grad_norm)
    if not (torch.isfinite(torch.tensor(loss)) and torch.isfinite(torch.tensor(norm))):
        raise NonFiniteLossError(f"non-finite values at step {step}: loss {loss}, grad norm {norm} "
                                 f"(lm {lm_loss}, mtp {mtp}, aux {aux_loss}, indexer {indexer_loss})")
    _check_loss_limits(t, step, loss, first_loss)  # before the optimizer step: the state stays the last good one
    if norm + 1e-6 > t.grad_clip > 0:  # else the clip coefficient is exactly 1: skip a pass over every grad
        clip_grads_(params, t.grad_clip, grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=not t.keep_grad_buffers)
    if hasattr(model, "update_expert_bias"):
        model.update_expert_bias(groups.dp_cp)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    alloc, reserved = M.peak_memory(device)
    return {"type": "step", "step": step, "loss": loss, "lm_loss": lm_loss, "mtp_losses": mtp,
            "aux_loss": aux_loss, "indexer_loss": indexer_loss, "grad_norm": norm, "lr": lr,
            "step_time_s": elapsed, "peak_memory_allocated_bytes": alloc,
            "peak_memory_reserved_bytes": reserved,
            "expert_load_max_violation": M.expert_load_max_violation(counts)}


def _check_loss_limits(t, step: int, loss: float, first_loss: float | None) -> None:  # noqa: ANN001
    """train.max_loss / train.loss_spike_factor: an exploding (still finite) loss stops the run at its step."""
    if t.max_loss is not None and loss > t.max_loss:
        raise LossSpikeError(f"loss {loss:.6g} at step {step} is above train.max_loss = {t.max_loss:g}")
    if t.loss_spike_factor is not None and first_loss is not None and first_loss > 0 \
            and loss > t.loss_spike_factor * first_loss:
        raise LossSpikeError(f"loss {loss:.6g} at step {step} is {loss / first_loss:.3g}x the first step's loss "
                             f"{first_loss:.6g}, above train.loss_spike_factor = {t.loss_spike_factor:g}")


def main(argv: list[str] | None = None, model_factory: ModelFactory | None = None) -> int:
    """Process entry: train, print the traceback and exit non-zero on any failure (never hang in teardown)."""
    parser = argparse.ArgumentParser(prog="python -m spartron.runtime.trainer", description=__doc__)
    parser.add_argument("config", nargs="?", default=None, help="run config TOML (default: defaults)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        result = train(cfg, model_factory)
    except BaseException:  # noqa: BLE001 - every failure must surface and end this rank
        rank = dist.get_rank() if dist.is_initialized() else "?"
        sys.stderr.write(f"[spartron rank {rank}] training failed:\n{traceback.format_exc()}")
        exit_process(1)  # skip process-group teardown, which can block on peers that are still waiting
    return 0 if result.stopped_at is None else STOPPED_STATUS


if __name__ == "__main__":
    exit_process(main())
