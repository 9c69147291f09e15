"""Writing a saved step: `save_state` / `start_save` and the `PendingSave` that commits it (COMPLETE last,
then the rename; train.keep_last), `AsyncSaveGroup` for train.async_save, `remove_step`. What a step holds,
and why it is written this way: spartron.runtime.state."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import DeviceMesh

from spartron.runtime.rundir import (
    COMPLETE,
    FORMAT_VERSION,
    META,
    _first_line,
    complete_steps,
    latest_complete_step,
    step_dir,
)
from spartron.runtime.safe_open import UnsafeEntryError, check_entry, remove_tree
from spartron.runtime.state_files import _fsync_dir, _TallyWriter, _write_durable
from spartron.runtime.state_layout import globalize, restore
from spartron.runtime.state_verify import _agreed_errors, _all_gather, _first_nonfinite, _rank_world, _tensors


class StateSaveError(RuntimeError):
    """A save that did not happen (write error, non-finite state); the previous complete step is intact."""


# ---- per-rank RNG -------------------------------------------------------------------------------------
def _rng_state(device: torch.device) -> tuple[dict, dict[str, torch.Tensor]]:
    py = random.getstate()
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    plain = {"python": [py[0], list(py[1]), py[2]],
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}
    tensors = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["torch_cuda"] = torch.cuda.get_rng_state(device)
    return plain, tensors



def _bytes_human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _free_bytes(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


# ---- save --------------------------------------------------------------------------------------------
def save_state(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
               counters: dict[str, Any], rank_state: dict, device: torch.device,
               before_commit: Callable[[Path], None] | None = None,
               ep_sharded: Collection[str] = (), ep_rank: int = 0, layout: str | None = None,
               run_id: str | None = None, config: dict[str, Any] | None = None,
               keep_last: int | None = None, ep_mesh: DeviceMesh | None = None) -> Path:
    """Collective: save everything needed to continue after optimizer step `step`; returns the directory.

    counters: small global JSON values (same on every rank), rank_state: this rank's JSON-able state
    (data position). before_commit(tmp_dir) runs on every rank after all data is written and before
    the COMPLETE marker (a crash-injection hook for tests); if it raises, nothing is committed and the
    temporary directory is left as a crash would leave it. ep_sharded: names of parameters holding only
    this EP rank's experts (stacked on dim 0), saved as global tensors over ep_mesh
    (spartron.runtime.state_layout.expert_mesh; ep_rank is only read to load format-2 states). layout: the
    parallel layout (ParallelDims.describe()); run_id and config (`state_config`) identify the run.
    keep_last: after the commit, remove all but the newest keep_last complete steps (None/0: keep all).
    Raises StateSaveError on every rank when any rank cannot write or holds non-finite state.
    """
    return start_save(run_dir, step, model, optimizer, counters, rank_state, device, before_commit,
                      ep_sharded=ep_sharded, ep_rank=ep_rank, layout=layout, run_id=run_id, config=config,
                      keep_last=keep_last, ep_mesh=ep_mesh).commit()


class AsyncSaveGroup:
    """The gloo process group asynchronous saves run their collectives on, from DCP's writer thread: its
    own group, so they never interleave with the training step's collectives. Collective to create."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", group_desc="spartron_async_save")

    def destroy(self) -> None:
        dist.destroy_process_group(self.group)


def _model_and_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """get_state_dict, except that an optimizer that has not stepped saves (and keeps) no per-parameter state.

    torch's get_state_dict initialises an empty optimizer with a zero-gradient step (AdamW: step 1, zero
    moments); saved, that state would make the resumed run's first update 0.735x a fresh AdamW's.
    """
    fresh = not optimizer.state and all(p.grad is None for g in optimizer.param_groups for p in g["params"])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if fresh:
        optimizer.state.clear()
        optim_sd["state"] = {}
    return model_sd, optim_sd


def start_save(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
               counters: dict[str, Any], rank_state: dict, device: torch.device,
               before_commit: Callable[[Path], None] | None = None, *,
               async_group: AsyncSaveGroup | None = None, **kwargs: Any) -> PendingSave:
    """Collective: the first part of `save_state` (same arguments): checks, the temporary directory, the
    tensors and the per-rank files; returns the PendingSave whose `commit()` finishes it. With async_group
    (train.async_save) the tensors are copied to host memory here and written by DCP's async_save in the
    background: the caller may train on (and change the parameters) until it commits."""
    ep_sharded, ep_mesh = kwargs.get("ep_sharded", ()), kwargs.get("ep_mesh")
    rank, world = _rank_world()
    run_dir = Path(run_dir)
    model_sd, optim_sd = _model_and_optimizer_state(model, optimizer)
    bad = _first_nonfinite({"model": model_sd, "optim": optim_sd})
    failed = _agreed_errors(None if bad is None else f"{bad} holds non-finite values")
    if failed:
        raise StateSaveError(f"refusing to save step {step}: " + "; ".join(f"rank {r}: {e}" for r, e in failed)
                             + " (no state was written; the last complete step is "
                             f"{latest_complete_step(run_dir)})")
    needed = sum(_all_gather(sum(t.numel() * t.element_size()
                                 for _, t in _tensors({"m": model_sd, "o": optim_sd}, "s"))))
    pending = PendingSave(run_dir, step, needed, kwargs.get("keep_last"), before_commit)
    tmp = pending.tmp

    error = None
    if rank == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            remove_tree(tmp)  # debris of an earlier crashed save of this step (a link there is refused)
            tmp.mkdir()
        except UnsafeEntryError as err:
            error = f"rank 0: {err}"
        except OSError as err:
            error = f"rank 0: cannot create {tmp}: {_first_line(err)}"
    pending.check(error)

    originals = globalize(model_sd, optim_sd, ep_sharded, ep_mesh)
    error, state = None, {"model": model_sd, "optim": optim_sd}
    try:
        if async_group is None:
            dcp.save(state, storage_writer=pending.writer)
        else:  # the default stager copies every tensor to host memory before this returns
            response = dcp.async_save(state, storage_writer=pending.writer, process_group=async_group.group)
            pending.future = getattr(response, "upload_completion", response)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - every rank reports its own error, all agree
        error = pending.write_error(err)
    restore(model_sd, optim_sd, originals)
    pending.check(error)

    error = None
    try:
        plain, tensors = _rng_state(device)
        buffer = io.BytesIO()
        torch.save({k: v.cpu() for k, v in tensors.items()}, buffer)
        _write_durable(tmp / f"rank-{rank:05d}.pt", buffer.getvalue(), pending.tally)
        _write_durable(tmp / f"rank-{rank:05d}.json", json.dumps({"rng": plain, "rank": rank_state}).encode(),
                       pending.tally)
        if rank == 0:
            meta = {"format_version": FORMAT_VERSION, "step": step, "world_size": world, "counters": counters,
                    "layout": kwargs.get("layout"), "run_id": kwargs.get("run_id"), "config": kwargs.get("config")}
            _write_durable(tmp / META, json.dumps(meta).encode(), pending.tally)
    except OSError as err:
        error = f"rank {rank}: {_first_line(err)}"
    pending.check(error)
    return pending


class PendingSave:
    """A save whose tensors are written (or being written, asynchronously) into ``.tmp-step-*``. No
    ``step-*`` directory of it exists until `commit()` (collective) waited for the write, gathered the
    manifest and wrote ``COMPLETE`` last: a crash before that leaves only the temporary directory."""

    def __init__(self, run_dir: Path, step: int, needed: int, keep_last: int | None,
                 before_commit: Callable[[Path], None] | None) -> None:
        self.run_dir, self.step, self.needed, self.keep_last = run_dir, step, needed, keep_last
        self.before_commit = before_commit
        self.final = step_dir(run_dir, step)
        self.tmp = run_dir / f".tmp-{self.final.name}"
        self.tally: dict[str, list[int]] = {}  # file name -> [size, crc32], filled while writing
        self.writer = _TallyWriter(self.tmp, self.tally)
        self.future: Any = None  # DCP's async write (concurrent.futures.Future), None once waited for
        self.rank = _rank_world()[0]

    def done(self) -> bool:
        """This rank's tensor files are written (always True for a synchronous save)."""
        return self.future is None or self.future.done()

    def write_error(self, err: BaseException) -> str | None:
        """This rank's part of a DCP write failure, in one line (None: another rank failed)."""
        fs_errors = self.writer.fs.errors
        if isinstance(err, CheckpointException):  # raised on every rank, with every failing rank's exception
            raised = err.failures.get(self.rank, (None,))[0]
            if raised is not None and not isinstance(raised, Exception):  # Ctrl-C, a SIGTERM handler's exception:
                raise raised  # a stop (DCP caught it mid-write), not a failed write
            mine = fs_errors[0] if fs_errors else raised
            if mine is not None:
                return f"rank {self.rank}: {_first_line(mine)}"
            return None if err.failures else f"rank {self.rank}: {_first_line(err)}"
        return f"rank {self.rank}: {_first_line(fs_errors[0] if fs_errors else err)}"

    def check(self, error: str | None) -> None:
        """Collective: agree on every rank's error; if any, remove the temporary directory and raise."""
        failed = _agreed_errors(error)
        if not failed:
            return
        if self.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
        free = _free_bytes(self.run_dir)
        raise StateSaveError(
            f"saving step {self.step} failed: " + "; ".join(e for _, e in failed)
            + f"; the state needs about {_bytes_human(self.needed)} ({self.needed} bytes) in {self.run_dir}"
            + (f", {_bytes_human(free)} free there" if free is not None else "")
            + f"; the last complete step ({latest_complete_step(self.run_dir)}) is intact")

    def commit(self) -> Path:
        """Collective: wait for the write, then COMPLETE (the manifest) last and the rename; keep_last."""
        error, run_dir, tmp, final = None, self.run_dir, self.tmp, self.final
        if self.future is not None:
            try:
                self.future.result()
            except (Exception, CheckpointException) as err:  # noqa: BLE001 - CheckpointException is a BaseException
                error = self.write_error(err)
            self.future = None
        self.check(error)
        manifest = sorted((name, size, crc) for part in _all_gather(self.tally) for name, (size, crc) in part.items())
        if self.before_commit is not None:
            self.before_commit(tmp)
        error = None
        if self.rank == 0:
            try:
                files = [{"path": name, "size": size, "crc32": crc} for name, size, crc in manifest]
                marker = {"format_version": FORMAT_VERSION, "step": self.step, "checksum": "crc32", "files": files}
                _write_durable(tmp / COMPLETE, json.dumps(marker).encode())
                if os.path.lexists(final):
                    remove_step(final)
                os.replace(tmp, final)
                _fsync_dir(run_dir)
            except UnsafeEntryError as err:
                error = f"rank 0: {err}"
            except OSError as err:
                error = f"rank 0: {_first_line(err)}"
        self.check(error)
        if self.rank == 0 and self.keep_last:
            for old in complete_steps(run_dir)[:-self.keep_last]:
                try:
                    remove_step(step_dir(run_dir, old))
                except UnsafeEntryError as err:  # a step linked into another run: that run keeps its step
                    print(f"spartron: warning: train.keep_last did not remove {err}", file=sys.stderr, flush=True)
                except OSError as err:  # the new step is committed: an old one left behind is only a warning
                    print(f"spartron: warning: train.keep_last could not remove {step_dir(run_dir, old)}: "
                          f"{_first_line(err)}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.barrier()
        return final


def remove_step(path: Path) -> None:
    """Delete a step directory, its COMPLETE marker first: a deletion cut short (kill -9) leaves a directory
    that no resume takes for complete. A step that is a link (into another run, say) or not a folder is
    refused (UnsafeEntryError), never followed: nothing outside the run directory is removed."""
    check_entry(path, "dir")
    try:
        (path / COMPLETE).unlink(missing_ok=True)  # a link or FIFO there: the entry itself goes
    except IsADirectoryError:
        pass  # a folder named COMPLETE (never a save's): rmtree removes it without following links inside
    _fsync_dir(path)
    shutil.rmtree(path)
