"""How a Spartron process ends: `exit_process`, the one exit of the `spartron` command and of
``python -m spartron.launch.rank``.

DTensor's caches keep device meshes, and through them gloo process groups and their C++ threads,
alive after ``destroy_process_group``. Interpreter finalization then destroyed them in no defined
order, and about 3 % of two-rank CPU training runs aborted ("terminate called without an active
exception") after all their work was done. So a finished process ends at once, as the ranks of
the test harness do. Every command has flushed and closed its files by the time it returns.
"""

from __future__ import annotations

import logging
import os
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


def exit_process(code: int) -> NoReturn:
    """Flush the standard streams and logging, then end the process with `code`, without teardown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
