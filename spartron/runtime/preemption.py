"""Stop at a step boundary on SIGTERM, every rank at the same step, after saving.

Slurm signals a job before preemption or its time limit (`--signal`, `scancel -s TERM`), a local
launcher forwards its own SIGTERM, and an operator may `kill` one rank: the handler only sets a flag,
and at each step boundary the ranks all-reduce it (MAX), so when any rank was signalled every rank
saves the same complete step and stops. The rank then exits with
`spartron.launch.process.STOPPED_STATUS` and `resume = true` continues from that step. A SIGTERM
that came while the process started was held (spartron.launch.process.hold_sigterm): it reaches the
handler as soon as the handler is in place.

SIGUSR1 is handled the same way: many Slurm sites and templates (Lightning, submitit) send it as the warning
before preemption or the time limit (`scancel -s USR1`), and its default action would kill the rank without a
save. (`launch.sbatch_args` refuses `--signal`: launch.signal_before_s asks for SIGTERM.)
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from spartron.comm import labelled

# The same set spartron.launch.process holds from a process's start (runtime cannot import the launcher).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopOnSigterm:
    """A SIGTERM (and SIGUSR1) handler, installed for the life of a `with` block (main thread only; elsewhere
    it installs nothing and only a direct `request()` stops the run)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopOnSigterm:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
            signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))  # a held one arrives here now
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _handle(self, signum, frame) -> None:  # a second SIGTERM changes nothing: the save is under way
        self.requested = True

    def request(self) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """True on every rank when any rank was asked to stop (one all-reduce over the world)."""
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
        with labelled("stop_agreement"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
