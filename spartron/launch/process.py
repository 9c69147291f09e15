"""How a Spartron process starts and ends: `hold_sigterm` from its first line, `exit_process`, the one exit of
the `spartron` command and of ``python -m spartron.launch.rank``.

A rank gets SIGTERM whenever Slurm or a launcher forwards it (`--signal` before the time limit, preemption),
also while it still imports torch, seconds before the trainer installs its handler: the default action then
killed it (status 143) instead of saving a step. So the process holds SIGTERM (blocked, pending in the
kernel) from its start, and the handler's owner releases it once the handler is in place.

DTensor's caches keep device meshes, and through them gloo process groups and their C++ threads,
alive after ``destroy_process_group``. Interpreter finalization then destroyed them in no defined
order, and about 3 % of two-rank CPU training runs aborted ("terminate called without an active
exception") after all their work was done. So a finished process ends at once, as the ranks of
the test harness do. Every command has flushed and closed its files by the time it returns.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn

# The exit status of a rank (and of `spartron train`, and of a Slurm job) that got SIGTERM, saved a
# complete step and stopped before train.steps: resuming continues from that step. 75 is sysexits'
# EX_TEMPFAIL ("try again later"), so it differs from a failure and from a death by SIGTERM (143).
STOPPED_STATUS = 75
# The exit status of a refusal (a mistake in the config, the flags, the data; a loss guard's stop): the
# process printed one `spartron: error: ...` line and no traceback.
USAGE_STATUS = 2
ERROR_PREFIX = "spartron: error: "
# Held from the start: SIGTERM, and SIGUSR1, which Slurm users send as the preemption / time-limit warning
# (`scancel -s USR1`, site templates) and which the ranks treat like SIGTERM (spartron.runtime.preemption).
HELD_SIGNALS = {signal.SIGTERM, signal.SIGUSR1}


def hold_sigterm() -> None:
    """Keep a SIGTERM (or SIGUSR1) pending from now until `release_sigterm` (in this thread and threads it
    starts)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)


def release_sigterm() -> None:
    """Deliver a held SIGTERM or SIGUSR1 (to the handler now installed, or the default action) and stop
    holding."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)


def exit_process(code: int) -> NoReturn:
    """Flush the standard streams and logging, then end the process with `code`, without teardown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
