"""spartron.testing.run_distributed ends what its ranks started: a rank's helper process (Megatron's async
checkpointing starts a multiprocessing Manager in each rank) was left running after every test that used it,
330 MB each, until the machine restarted."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from spartron.testing import run_distributed


def _start_a_helper(rank, world):
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    return helper.pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped by init is gone for this purpose
        return f.read().split(") ", 1)[1].split()[0] != "Z"


def test_a_ranks_helper_process_does_not_outlive_the_run():
    pids = run_distributed(_start_a_helper, 2)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [_alive(p) for p in pids] == [False, False]
