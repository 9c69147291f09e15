"""One machine, N ranks: spawn the same command once per rank with the torchrun rank variables set.

Rank 0 keeps the terminal (progress bar, summary); ranks 1.. write to `<log_dir>/rank<k>.log`.
When any rank exits non-zero the others are stopped (SIGTERM, then SIGKILL), the failing rank's
output is surfaced and its exit status is returned, so a crash never leaves ranks hanging in a
collective.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

TERMINATE_GRACE_S = 5.0


def existing_launcher(environ: Mapping[str, str]) -> str | None:
    """'torchrun' or 'srun' when this process is already one rank of a multi-rank launch, else None.

    An sbatch batch script also has SLURM_PROCID and SLURM_NTASKS set, but no SLURM_STEP_ID: only
    the tasks of an `srun` step are ranks. Rank variables (torchrun, or our own spawn) win.
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return "torchrun"
    if "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ and int(environ.get("SLURM_NTASKS", "1")) > 1:
        return "srun"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rank_environ(environ: Mapping[str, str], rank: int, nproc: int, master_addr: str,
                 master_port: int) -> dict[str, str]:
    """The parent's environment plus the variables torchrun would set for `rank` of `nproc`."""
    env = dict(environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK="0", MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    env.setdefault("OMP_NUM_THREADS", "1")  # like torchrun: N ranks must not each take every core
    return env


def core_slices(allowed: Sequence[int], nproc: int) -> list[list[int]]:
    """Each local rank's cores: disjoint contiguous slices of `allowed` (the remainder to the first
    ranks); with more ranks than cores, one core each, round-robin.

    Why bind at all: unpinned ranks' Python threads and NCCL's proxy threads migrate and collide, and
    the slowest rank's host paces every GPU. On the lent 2-GPU H200 VM the slice size (1 to 16 cores)
    made no difference to the host time of an NCCL all-to-all call (25 us on a quiet core); which
    vCPUs a slice holds did (some run Python ~1.6x slower). srun binds Slurm tasks the same way.
    """
    cores = sorted(allowed)
    if nproc < 1 or not cores:
        raise ValueError(f"need nproc >= 1 and at least one core, got nproc={nproc}, cores={cores}")
    if nproc >= len(cores):
        return [[cores[r % len(cores)]] for r in range(nproc)]
    base, extra = divmod(len(cores), nproc)
    slices, start = [], 0
    for r in range(nproc):
        size = base + (r < extra)
        slices.append(cores[start:start + size])
        start += size
    return slices


def _status(returncode: int) -> int:
    """Shell-style status: a rank killed by signal S is 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(text[-lines:])


def launch_local(command: Sequence[str], nproc: int, environ: Mapping[str, str], log_dir: Path,
                 master_addr: str = "127.0.0.1", poll_s: float = 0.05, bind_cores: bool = False) -> int:
    """Run `command` as `nproc` ranks on this machine; returns 0 or the first failing rank's status.

    bind_cores: start rank r on `core_slices(...)[r]` of the cores this launcher may use.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    slices = core_slices(os.sched_getaffinity(0), nproc) if bind_cores else None
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port(master_addr)
    procs: list[subprocess.Popen] = []
    logs: list[Path | None] = []
    # A SIGTERM to the launcher (scancel, a CI timeout) must stop the ranks too, not orphan them.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        for rank in range(nproc):
            env = rank_environ(environ, rank, nproc, master_addr, port)
            if rank == 0:
                log, out = None, None
            else:
                log = log_dir / f"rank{rank}.log"
                out = log.open("w")
            logs.append(log)
            try:
                # the launcher is single-threaded, so setting the child's affinity before exec is safe
                pin = (lambda cores=slices[rank]: os.sched_setaffinity(0, cores)) if slices else None
                procs.append(subprocess.Popen(list(command), env=env, stdout=out, preexec_fn=pin,
                                              stderr=subprocess.STDOUT if out else None))
            finally:
                if out:
                    out.close()
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank = failed[0]
                status = _status(codes[rank])
                _stop(procs)
                _report_failure(rank, status, logs[rank])
                return status
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    except BaseException:  # Ctrl-C, SIGTERM or an error here: never leave orphan ranks behind
        _stop(procs)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


class LauncherTerminated(SystemExit):
    """The launcher got SIGTERM; exits with status 143 after the ranks are stopped."""


def _raise_terminated(signum, frame) -> None:
    raise LauncherTerminated(128 + signum)


def _report_failure(rank: int, status: int, log: Path | None) -> None:
    where = "its output is above" if log is None else f"last lines of {log}:"
    print(f"spartron: rank {rank} failed with exit status {status}; stopped the other ranks; {where}",
          file=sys.stderr)
    if log is not None:
        print(_tail(log), file=sys.stderr)
