"""Where this process sits in the job: rank, local rank, world size and master, from the launcher.

`discover(environ)` is a pure function of the environment mapping (torchrun variables first, then
Slurm's, else a single process), so every launcher layout is testable without launching anything.
This is the one module in Spartron that reads ``os.environ``; options never come from it.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

# ports 16000..32767, so jobs sharing a node rarely collide, and below Linux's default ephemeral range
# (32768..60999), where any process's outgoing connection could hold the port when rank 0 binds it
SLURM_PORT_BASE = 16000
SLURM_PORT_SPAN = 16768


class DistEnvError(ValueError):
    """The launcher's variables are missing, malformed or inconsistent; the message names them."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    launcher: Literal["torchrun", "slurm", "single"]

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise DistEnvError(f"world size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise DistEnvError(f"rank {self.rank} must be in [0, world size {self.world_size})")
        if self.local_rank < 0 or self.local_rank > self.rank:
            raise DistEnvError(f"local rank {self.local_rank} must be in [0, rank {self.rank}]")
        if not 0 < self.master_port < 65536:
            raise DistEnvError(f"master port {self.master_port} must be in 1..65535")
        if not self.master_addr:
            raise DistEnvError("master address is empty")


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_brackets(body: str, text: str) -> list[str]:
    """`01-04,07` -> ['01', '02', '03', '04', '07'] (zero padding kept from the range start)."""
    out = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise DistEnvError(f"malformed Slurm nodelist {text!r}: bad range {part!r} in [{body}]")
        start, end = m.group(1), m.group(2) or m.group(1)
        if int(end) < int(start):
            raise DistEnvError(f"malformed Slurm nodelist {text!r}: range {part!r} runs backwards")
        width = len(start) if start.startswith("0") else 0
        out += [str(i).zfill(width) for i in range(int(start), int(end) + 1)]
    return out


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets."""
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise DistEnvError(f"malformed Slurm nodelist {text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise DistEnvError(f"malformed Slurm nodelist {text!r}: unmatched ']'")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise DistEnvError(f"malformed Slurm nodelist {text!r}: unclosed '['")
    return items + [cur]


def expand_nodelist(text: str) -> list[str]:
    """Expand Slurm's compressed host list: `gpu[01-04,07],cpu3` -> gpu01..gpu04, gpu07, cpu3.

    Several bracket groups in one name (`r[1-2]n[1-2]`) expand as a product, like Slurm does.
    """
    if not text or not text.strip():
        raise DistEnvError("Slurm nodelist is empty")
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        item = item.strip()
        if not item:
            raise DistEnvError(f"malformed Slurm nodelist {text!r}: empty host name")
        pieces = re.split(r"(\[[^\]]*\])", item)
        if any(c in p for p in pieces if not p.startswith("[") for c in "[]"):
            raise DistEnvError(f"malformed Slurm nodelist {text!r}: stray bracket in {item!r}")
        choices = [_expand_brackets(p[1:-1], text) if p.startswith("[") else [p] for p in pieces if p]
        hosts += ["".join(parts) for parts in itertools.product(*choices)]
    return hosts


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise DistEnvError(f"{name}={value!r} is not an integer") from None


def _require(environ: Mapping[str, str], names: tuple[str, ...], launcher: str) -> None:
    missing = [n for n in names if n not in environ]
    if missing:
        raise DistEnvError(f"{launcher} environment is incomplete: missing {', '.join(missing)}")


def _from_torchrun(environ: Mapping[str, str]) -> DistEnv:
    _require(environ, ("RANK", "WORLD_SIZE", "LOCAL_RANK"), "torchrun")
    if "MASTER_ADDR" not in environ or "MASTER_PORT" not in environ:
        raise DistEnvError("torchrun environment has RANK/WORLD_SIZE but no master: set MASTER_ADDR and "
                           "MASTER_PORT (torchrun sets them; a hand-made launch must too)")
    return DistEnv(rank=_int(environ, "RANK"), local_rank=_int(environ, "LOCAL_RANK"),
                   world_size=_int(environ, "WORLD_SIZE"), master_addr=environ["MASTER_ADDR"],
                   master_port=_int(environ, "MASTER_PORT"), launcher="torchrun")


def _from_slurm(environ: Mapping[str, str]) -> DistEnv:
    _require(environ, ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"), "Slurm")
    if "MASTER_ADDR" in environ:
        addr = environ["MASTER_ADDR"]
    else:
        # The step's list first: task 0 of a step runs on its first node.
        keys = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        key = next((k for k in keys if k in environ), None)
        if key is None:
            raise DistEnvError("Slurm environment has no master: set SLURM_JOB_NODELIST (srun does) "
                               "or MASTER_ADDR")
        addr = expand_nodelist(environ[key])[0]
    if "MASTER_PORT" in environ:
        port = _int(environ, "MASTER_PORT")
    elif "SLURM_JOB_ID" in environ:
        port = SLURM_PORT_BASE + _int(environ, "SLURM_JOB_ID") % SLURM_PORT_SPAN
    else:
        raise DistEnvError("Slurm environment has no master port: set SLURM_JOB_ID (Slurm does) "
                           "or MASTER_PORT")
    return DistEnv(rank=_int(environ, "SLURM_PROCID"), local_rank=_int(environ, "SLURM_LOCALID"),
                   world_size=_int(environ, "SLURM_NTASKS"), master_addr=addr, master_port=port,
                   launcher="slurm")


def discover(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Rank/world/master of this process: torchrun variables, else Slurm's, else a single process.

    `environ` defaults to the process environment; tests pass a plain dict.
    """
    environ = os.environ if environ is None else environ
    if any(k in environ for k in ("RANK", "WORLD_SIZE")):
        return _from_torchrun(environ)
    if "SLURM_PROCID" in environ:
        return _from_slurm(environ)
    return DistEnv(rank=0, local_rank=0, world_size=1, master_addr="127.0.0.1", master_port=29500,
                   launcher="single")


def slurm_restart_count(environ: Mapping[str, str]) -> int:
    """How many times Slurm has requeued this job (SLURM_RESTART_COUNT; 0 on a first run and outside Slurm).
    Like SLURM_PROCID, what the launcher tells this process, not an option: a requeued job's ranks may find
    their run already finished (spartron.launch.cmd_train.finished_before_the_requeue)."""
    if "SLURM_RESTART_COUNT" not in environ:
        return 0
    count = _int(environ, "SLURM_RESTART_COUNT")
    if count < 0:
        raise DistEnvError(f"SLURM_RESTART_COUNT={count} is negative")
    return count


def process_environ() -> dict[str, str]:
    """A copy of this process's environment, for launchers that pass it on to the ranks they spawn."""
    return dict(os.environ)


def resolve_backend(backend: str, cuda_available: bool) -> str:
    """'auto' -> NCCL with CUDA, gloo without; an explicit NCCL request without CUDA is an error."""
    if backend == "auto":
        return "nccl" if cuda_available else "gloo"
    if backend == "nccl" and not cuda_available:
        raise DistEnvError("backend 'nccl' needs CUDA, but torch.cuda.is_available() is False; "
                           "use backend 'gloo' (or 'auto') on CPU")
    if backend not in ("nccl", "gloo"):
        raise DistEnvError(f"backend must be 'auto', 'nccl' or 'gloo', got {backend!r}")
    return backend


def init_distributed(env: DistEnv, backend: str = "auto", timeout_s: float = 300.0) -> str:
    """Initialise the default process group for `env`; returns the backend used.

    On CUDA the current device is set to the local rank first, so NCCL binds the right GPU.
    A single process (launcher 'single') uses an in-memory store and opens no port.
    """
    if dist.is_initialized():
        raise DistEnvError("torch.distributed is already initialized; call destroy_distributed() first")
    cuda = torch.cuda.is_available()
    backend = resolve_backend(backend, cuda)
    if backend == "nccl":
        count = torch.cuda.device_count()
        if env.local_rank >= count:
            raise DistEnvError(f"local rank {env.local_rank} has no GPU: this node has {count} "
                               "visible devices")
        torch.cuda.set_device(env.local_rank)
    timeout = timedelta(seconds=timeout_s)
    if env.launcher == "single":
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
        if env.rank > 0:
            wait_for_master(env, timeout_s)
        try:
            dist.init_process_group(backend, init_method=f"tcp://{host}:{env.master_port}", rank=env.rank,
                                    world_size=env.world_size, timeout=timeout)
        except dist.DistStoreError as err:  # a rank never came: say who waited where, in one line
            raise DistEnvError(f"rank {env.rank} of {env.world_size} ({env.launcher}) gave up after {timeout_s:g} s "
                               f"(parallel.timeout_s) waiting for the other ranks at {host}:{env.master_port}: "
                               f"{str(err).splitlines()[0]}") from None
        except dist.DistNetworkError as err:  # the master's port is taken, or the master cannot be reached
            raise DistEnvError(_network_problem(env, host, timeout_s, str(err).splitlines()[0])) from None
    return backend


def wait_for_master(env: DistEnv, timeout_s: float, poll_s: float = 0.2) -> None:
    """Until rank 0's store accepts a connection at the master address (polled), or one line naming
    MASTER_ADDR / MASTER_PORT: the store's own retries log C++ stacks for a name that does not resolve and a port
    nothing listens on, then raise."""
    who = f"rank {env.rank} of {env.world_size} ({env.launcher})"
    try:
        addresses = socket.getaddrinfo(env.master_addr, env.master_port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise DistEnvError(f"{who}: the master address {env.master_addr!r} (MASTER_ADDR) does not resolve: "
                           f"{err.strerror}") from None
    family, kind, proto, _, address = addresses[0]
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(max(0.05, min(poll_s * 5, deadline - time.monotonic())))
            try:
                sock.connect(address)
                return
            except OSError as err:
                problem = err.strerror or type(err).__name__
        if time.monotonic() >= deadline:
            raise DistEnvError(f"{who} gave up after {timeout_s:g} s (parallel.timeout_s): nothing accepted a "
                               f"connection at {env.master_addr}:{env.master_port} (MASTER_ADDR, MASTER_PORT; "
                               f"rank 0 listens there): {problem}")
        time.sleep(poll_s)


def _network_problem(env: DistEnv, host: str, timeout_s: float, message: str) -> str:
    """One line for torch's DistNetworkError at the rendezvous, naming the variables to fix."""
    who = f"rank {env.rank} of {env.world_size} ({env.launcher})"
    if "EADDRINUSE" in message:
        return (f"{who} cannot listen on {host}:{env.master_port}, the master port: another process holds it "
                "(another job on this node, or one left behind); set MASTER_PORT to a free port")
    return (f"{who} could not connect to the master's store at {host}:{env.master_port} (MASTER_ADDR, MASTER_PORT; "
            f"parallel.timeout_s = {timeout_s:g}): {message}")


def destroy_distributed() -> None:
    """Tear down every process group this process created (no-op when none)."""
    if dist.is_initialized():
        dist.destroy_process_group()
