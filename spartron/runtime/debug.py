"""The `[debug]` config section: a test hook that makes one rank fail at a chosen step.

Why a config section and not an environment variable: the run is described by its config alone
(and the frozen config of a Slurm job carries it), so a fault is as reproducible as the run.
Off by default; `fail_step` turns it on. At the start of step `fail_step`, global rank `fail_rank`:
- "raise": raises RuntimeError (the trainer's normal failure path: traceback, exit status 1);
- "exit": `os._exit(3)` (a crash that skips every handler);
- "kill": SIGKILL to itself (exit status 137, as the OOM killer does);
- "stop": SIGSTOP to itself (a hung rank: the launcher and the peers' collective timeout notice).
"""

from __future__ import annotations

import os
import signal
from typing import Literal

from pydantic import Field, model_validator

from spartron.configbase import ConfigSection

FAULT_EXIT_STATUS = 3


class DebugConfig(ConfigSection):
    """Fault injection for tests of failure handling (`debug.fail_step` enables it)."""

    fail_step: int | None = Field(None, ge=1)  # None: off
    fail_rank: int = Field(0, ge=0)  # global rank; checked against the world size at train start
    fail_mode: Literal["raise", "exit", "kill", "stop"] = "raise"

    @model_validator(mode="after")
    def _check(self) -> DebugConfig:
        # against the defaults, not the keys given: a dumped config (every key written) must load
        ignored = [k for k in ("fail_rank", "fail_mode") if getattr(self, k) != type(self).model_fields[k].default]
        if self.fail_step is None and ignored:
            raise ValueError(f"debug.{ignored[0]} has no effect without debug.fail_step")
        return self


def check_fault(debug: DebugConfig, world_size: int, steps: int) -> str | None:
    """The error message if the fault can never fire in this run, else None."""
    if debug.fail_step is None:
        return None
    if debug.fail_rank >= world_size:
        return f"debug.fail_rank {debug.fail_rank} is not a rank of this run (world size {world_size})"
    if debug.fail_step > steps:
        return f"debug.fail_step {debug.fail_step} is beyond train.steps {steps}"
    return None


def inject_fault(debug: DebugConfig, rank: int, step: int) -> None:
    """Fail as configured when this is the chosen rank and step; otherwise do nothing."""
    if debug.fail_step != step or debug.fail_rank != rank:
        return
    if debug.fail_mode == "raise":
        raise RuntimeError(f"debug.fail_mode = 'raise' at step {step} on rank {rank}")
    if debug.fail_mode == "exit":
        os._exit(FAULT_EXIT_STATUS)
    os.kill(os.getpid(), signal.SIGKILL if debug.fail_mode == "kill" else signal.SIGSTOP)
