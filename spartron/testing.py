"""Run a function on N real gloo ranks in child processes: the distributed test harness.

Fork is the default (workers forked from a parent that already imported torch start in ~0.1 s);
spawn is available for tests that need a clean interpreter. Any rank's exception fails the call with
that rank's traceback; a run that does not finish within `timeout` kills every rank and fails,
instead of hanging the test session.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from spartron.launch.process import exit_process


class DistributedTestError(AssertionError):
    """A rank raised, or the run timed out; the message carries each failing rank's traceback."""


def _worker(fn, rank, world_size, store_path, timeout, args, kwargs, conn) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.setpgid(0, 0)  # a group of its own: what the rank starts (a library's helper process) ends with it
    status, payload = "ok", None
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        # every pair connected before any rank can fail and close its side: a peer still connecting would
        # report gloo's 'Connection closed by peer' instead of its own error (a test asserting every rank's
        # message saw 3 of 4)
        dist.barrier()
        payload = fn(rank, world_size, *args, **kwargs)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        status, payload = "error", traceback.format_exc()
    if status == "ok" and dist.is_initialized():
        try:  # no rank tears gloo down while a peer is still connecting or finishing a collective
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=timeout))
            else:
                dist.barrier()
        except BaseException:  # noqa: BLE001
            status, payload = "error", traceback.format_exc()
    try:  # by value: Connection.send would share a tensor's storage through this process, which exits next
        message = pickle.dumps((status, payload))
    except Exception:  # noqa: BLE001 - unpicklable result
        message = pickle.dumps(("error", f"rank {rank} returned an unpicklable value:\n{traceback.format_exc()}"))
    conn.send_bytes(message)
    conn.close()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        exit_process(0)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
                    start_method: str = "fork", **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks; return each rank's result."""
    import torch._dynamo  # noqa: F401 - custom ops import it lazily (~3 s): pay once here, not per fork

    ctx = mp.get_context(start_method)
    with tempfile.TemporaryDirectory(prefix="spartron-dist-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs, conns = [], []
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(fn, rank, world_size, store_path, timeout, args, kwargs,
                                                   child_conn), daemon=True)
            p.start()
            child_conn.close()
            procs.append(p)
            conns.append(parent_conn)
        results: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size and time.monotonic() < deadline:
                for rank, conn in enumerate(conns):
                    if rank in results:
                        continue
                    if conn.poll(0.01):
                        try:
                            results[rank] = pickle.loads(conn.recv_bytes())
                        except EOFError:
                            results[rank] = ("error", f"rank {rank} died without a result "
                                                      f"(exit code {procs[rank].exitcode})")
                    elif not procs[rank].is_alive() and not conn.poll(0):
                        results[rank] = ("error", f"rank {rank} died without a result "
                                                  f"(exit code {procs[rank].exitcode})")
                if any(status == "error" for status, _ in results.values()):
                    # Give the others a moment to report their own errors, then stop.
                    grace = time.monotonic() + 2.0
                    while len(results) < world_size and time.monotonic() < grace:
                        for rank, conn in enumerate(conns):
                            if rank not in results and conn.poll(0.05):
                                try:
                                    results[rank] = pickle.loads(conn.recv_bytes())
                                except EOFError:
                                    pass
                    break
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):  # the rank and all it started
                    os.killpg(p.pid, signal.SIGKILL)  # (Megatron's async checkpointing leaves a Manager process)
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)
        errors = [f"--- rank {r} ---\n{payload}" for r, (status, payload) in sorted(results.items())
                  if status == "error"]
        if errors:
            raise DistributedTestError(f"{len(errors)} of {world_size} ranks failed:\n" + "\n".join(errors))
        missing = [r for r in range(world_size) if r not in results]
        if missing:
            raise DistributedTestError(f"timed out after {timeout} s; ranks {missing} did not finish")
        return [results[r][1] for r in range(world_size)]


def sigkill_when_exists(proc: subprocess.Popen, marker: Path, timeout: float) -> None:
    """SIGKILL `proc` as soon as `marker` exists (e.g. a save's COMPLETE file): a crash at a chosen point.

    Fails if the process ended on its own first or the marker never appeared.
    """
    deadline = time.monotonic() + timeout
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed:\n{(err or '')[-4000:]}"
    assert marker.exists(), f"{marker} never appeared"
