"""What each rank the local launcher starts is given: torchrun's rank variables, a port held for rank 0's store,
and its own slice of cores; and whether this process is already one rank of another launcher's run."""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager


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


@contextmanager
def held_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A TCP port the OS picked and this process holds (bound with SO_REUSEADDR, never listening) while the
    block runs: rank 0's store binds it too (Linux lets a SO_REUSEADDR socket bind a port another one holds
    unless that one listens) and nothing else can take it meanwhile. A port that was only free when picked was
    taken by a concurrent test's gloo connection in CI: the kernel gives outgoing connections no bound port.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        yield sock.getsockname()[1]


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
