"""Failure reports and preemption through `spartron train` (the CLI, the real local launcher, gloo ranks
of the tiny preset): the `[debug]` hook fails one rank at a chosen step, SIGTERM stops a run after a save.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spartron.launch.process import STOPPED_STATUS
from spartron.runtime.config import ConfigError, load_config
from spartron.runtime.debug import check_fault
from spartron.runtime.state import verify_step

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")
TIMEOUT_S = 4  # parallel.timeout_s of these runs: a stopped rank's peers give up after it
FAST = ["--set", "train.progress=false", "--set", f"parallel.timeout_s={TIMEOUT_S}"]


def _train(args: list[str], cwd: Path, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "spartron.launch.cli", "train", TINY, *FAST, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


# ---- the [debug] section --------------------------------------------------------------------------
def test_debug_section_defaults_off_and_rejects_settings_that_do_nothing():
    cfg = load_config(TINY)
    assert (cfg.debug.fail_step, cfg.debug.fail_rank, cfg.debug.fail_mode) == (None, 0, "raise")
    with pytest.raises(ConfigError, match=r"^invalid config: debug\.fail_rank has no effect without "
                                          r"debug\.fail_step$"):
        load_config(TINY, ["debug.fail_rank=1"])
    with pytest.raises(ConfigError, match=r"^invalid config: debug\.fail_mode: "):
        load_config(TINY, ["debug.fail_step=1", 'debug.fail_mode="segfault"'])
    with pytest.raises(ConfigError, match=r"^invalid config: debug\.fail_step: "):
        load_config(TINY, ["debug.fail_step=0"])


def test_check_fault_names_a_fault_that_can_never_fire():
    debug = load_config(TINY, ["debug.fail_step=3", "debug.fail_rank=2"]).debug
    assert check_fault(debug, world_size=4, steps=3) is None
    assert check_fault(debug, world_size=2, steps=3) == \
        "debug.fail_rank 2 is not a rank of this run (world size 2)"
    assert check_fault(debug, world_size=4, steps=2) == "debug.fail_step 3 is beyond train.steps 2"


def test_fault_outside_the_world_is_refused_before_any_rank_starts(tmp_path):
    proc, _ = _train(["--set", "launch.nproc=2", "--set", "debug.fail_step=1", "--set", "debug.fail_rank=2"],
                     tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "spartron: error: debug.fail_rank 2 is not a rank of this run (world size 2)"]
    assert not (tmp_path / "runs" / "tiny" / "logs").exists()


def test_fault_outside_the_world_is_refused_by_a_rank_of_another_launcher(tmp_path, master_port):
    """Under torchrun/srun the world size is the launcher's: the trainer checks it before any collective."""
    import os

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(master_port))
    proc = subprocess.run([sys.executable, "-m", "spartron.launch.cli", "train", TINY, *FAST, "--set",
                           "debug.fail_step=1", "--set", "debug.fail_rank=1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == \
        "spartron: error: debug.fail_rank 1 is not a rank of this run (world size 1)"


# ---- one rank fails: the report names it, its status and its log; every rank ends non-zero --------
_ENDINGS = "spartron: how the ranks ended: "


@pytest.mark.parametrize(("world", "rank", "mode", "status", "what"), [
    (2, 1, "raise", 1, "exited with status 1"),
    (2, 1, "exit", 3, "exited with status 3"),
    (2, 1, "kill", 137, "was killed by SIGKILL"),
    (2, 1, "stop", 147, "stopped (SIGSTOP)"),
    (2, 0, "kill", 137, "was killed by SIGKILL"),
    pytest.param(4, 2, "raise", 1, "exited with status 1", marks=pytest.mark.slow),
    pytest.param(4, 3, "exit", 3, "exited with status 3", marks=pytest.mark.slow),
    pytest.param(4, 1, "kill", 137, "was killed by SIGKILL", marks=pytest.mark.slow),
    pytest.param(4, 2, "stop", 147, "stopped (SIGSTOP)", marks=pytest.mark.slow),
])
def test_failing_rank_is_reported_by_root_cause(tmp_path, world, rank, mode, status, what):
    proc, elapsed = _train(["--set", f"launch.nproc={world}", "--set", "train.steps=3",
                            "--set", "debug.fail_step=2", "--set", f"debug.fail_rank={rank}",
                            "--set", f'debug.fail_mode="{mode}"'], tmp_path)
    err = proc.stderr
    assert proc.returncode == status, err
    # startup (a few s on 2 busy cores) + one step + the stop limit (parallel.timeout_s) for a stop
    assert elapsed < 60 + (TIMEOUT_S if mode == "stop" else 0), elapsed
    assert f"spartron: [debug] rank {rank} will fail at step 2 (fail_mode = '{mode}')" in err
    log = tmp_path / "runs" / "tiny" / "logs" / f"rank{rank}.log"
    where = "its output is above" if rank == 0 else f"last lines of {log}:"
    assert f"spartron: rank {rank} {what}, the first rank to fail; stopped the other ranks; {where}" in err
    if mode in ("exit", "kill", "stop") and rank != 0:
        assert f"last lines of {log}:\n(the log is empty)\n" in err  # it died without a word
    if mode == "raise":
        assert f"RuntimeError: debug.fail_mode = 'raise' at step 2 on rank {rank}" in \
            err.split("the first rank to fail")[1]  # the tail of the failing rank's own log
    endings = [line for line in err.splitlines() if line.startswith(_ENDINGS)]
    assert len(endings) == 1
    ended = dict(item.split(" ", 2)[1:] for item in endings[0][len(_ENDINGS):].split("; "))
    assert sorted(int(r) for r in ended) == list(range(world))
    assert ended[str(rank)].startswith(what) or ended[str(rank)].startswith("stopped (SIGSTOP), then")
    assert all("status 0" not in how for how in ended.values())  # every rank ended non-zero


# ---- SIGTERM: save a complete step, stop, resume -------------------------------------------------
def _step_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").is_file() else []
    return [r for r in map(json.loads, lines) if r.get("type") == "step"]


def _start_long_run(cwd: Path, nproc: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "spartron.launch.cli", "train", TINY, *FAST,
                             "--set", f"launch.nproc={nproc}", "--set", "train.steps=500"], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(run_dir: Path, proc: subprocess.Popen, n: int) -> None:
    deadline = time.monotonic() + 90
    while len(_step_records(run_dir)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "rank1"])
def test_sigterm_saves_a_complete_step_then_resume_continues(tmp_path, target):
    """SIGTERM to the launcher (forwarded) or to one rank only (the all-reduced flag): every rank saves
    the same step and exits STOPPED_STATUS; a resume continues from that step."""
    run_dir = tmp_path / "runs" / "tiny"
    proc = _start_long_run(tmp_path, 2)
    _wait_for_steps(run_dir, proc, 2)
    pid = proc.pid if target == "launcher" else _children(proc.pid)[1]
    import os
    os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == STOPPED_STATUS, err
    steps = sorted(int(p.name.split("-")[1]) for p in run_dir.glob("step-*"))
    assert len(steps) == 1 and 2 <= steps[0] < 500
    saved = steps[0]
    assert verify_step(run_dir / f"step-{saved:08d}") is None  # complete and intact
    assert f"spartron: SIGTERM: saved step {saved} of 500 in runs/tiny and stopped; resume = true continues " \
           "from it" in err
    assert [r["step"] for r in _step_records(run_dir)][-1] == saved
    resumed, _ = _train(["--set", "launch.nproc=2", "--set", f"train.steps={saved + 1}"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from step {saved}" in resumed.stderr
    assert [r["step"] for r in _step_records(run_dir)][-1] == saved + 1


def test_ranks_of_spartron_train_die_when_the_launcher_is_killed(tmp_path):
    """SIGKILL of `spartron train` (no handler can run): its ranks stop training into the run dir."""
    run_dir = tmp_path / "runs" / "tiny"
    proc = _start_long_run(tmp_path, 2)
    _wait_for_steps(run_dir, proc, 1)
    ranks = _children(proc.pid)
    assert len(ranks) == 2
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 5
    while not all(_gone(pid) for pid in ranks):
        assert time.monotonic() < deadline, f"ranks {ranks} outlived their launcher"
        time.sleep(0.05)
    steps = len(_step_records(run_dir))
    time.sleep(1.0)
    assert len(_step_records(run_dir)) == steps  # nothing trains on


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_sigterm_to_a_single_process_run_saves_and_exits_75(tmp_path):
    """No launcher (launch.nproc = 1, or one task of srun/torchrun): the rank's own handler does it."""
    import os

    run_dir = tmp_path / "runs" / "tiny"
    proc = _start_long_run(tmp_path, 1)
    _wait_for_steps(run_dir, proc, 2)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == STOPPED_STATUS, err
    (saved,) = [int(p.name.split("-")[1]) for p in run_dir.glob("step-*")]
    assert verify_step(run_dir / f"step-{saved:08d}") is None
    assert [r["step"] for r in _step_records(run_dir)][-1] == saved


def _sigterm_bits(pid: int) -> tuple[bool, bool]:
    """(held, caught): whether SIGTERM is blocked in the main thread of `pid`, and has a handler."""
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ":\t" in line)
    bit = 1 << (signal.SIGTERM - 1)
    return bool(int(fields["SigBlk"], 16) & bit), bool(int(fields["SigCgt"], 16) & bit)


def _signal_while_starting(proc: subprocess.Popen) -> None:
    """SIGTERM to `proc` once it holds SIGTERM but before any handler is in place (it is still importing)."""
    import os

    deadline = time.monotonic() + 30
    while _sigterm_bits(proc.pid) != (True, False):
        assert proc.poll() is None and time.monotonic() < deadline, "the process never held SIGTERM"
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGTERM)
    assert _sigterm_bits(proc.pid)[0], "the SIGTERM came after the hold ended: the start was not exercised"


@pytest.mark.parametrize("entry, nproc", [("cli", 1), ("cli", 2), ("rank", 1)])
def test_a_sigterm_while_the_process_starts_is_held_until_the_handler_then_step_1_is_saved(tmp_path, entry, nproc):
    """Slurm's `--signal` can reach a rank (or the local launcher) while it still imports torch, seconds
    before any handler exists: the default action killed it (143) and nothing was saved. Held from the
    first line, the signal reaches the handler: every rank saves step 1 and the run exits 75. The same
    for `python -m spartron.launch.rank` (what torchrun or srun start for a script's own model)."""
    run_dir = tmp_path / "runs" / "tiny"
    if entry == "cli":
        proc = _start_long_run(tmp_path, nproc)
    else:
        proc = subprocess.Popen([sys.executable, "-m", "spartron.launch.rank", TINY, *FAST, "--set", "train.steps=500"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _signal_while_starting(proc)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == STOPPED_STATUS, err
    assert [int(p.name.split("-")[1]) for p in run_dir.glob("step-*")] == [1]
    assert verify_step(run_dir / "step-00000001") is None
    assert "spartron: SIGTERM: saved step 1 of 500 in runs/tiny and stopped; resume = true continues " \
           "from it" in err


def test_commands_other_than_train_release_a_held_sigterm_before_they_run(tmp_path):
    """Only `train` keeps SIGTERM held until its handler: `plan` (as every other command) runs with it
    delivered as usual, so a signal cannot be swallowed by a command that installs no handler."""
    from spartron.launch.cli import main

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        assert main(["plan", TINY, "--world-size", "1"]) == 0
        assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@pytest.mark.parametrize("message, knock_on", [
    ("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242", True),
    ("NCCL error: remote process exited or there was a network error", True),
    ("Connection reset by peer", True),
    ("debug.fail_mode = 'raise' at step 2 on rank 1", False),
    ("CUDA out of memory", False),
])
def test_a_knock_on_failure_waits_before_it_exits_and_a_rank_own_failure_does_not(tmp_path, message, knock_on):
    """A rank whose collective lost a peer yields so the launcher (srun reports exits in the order its slurmds
    report them) sees the peer, the root cause, end first; a rank's own failure exits at once. Both print their
    traceback and exit 1."""
    from spartron.launch.cmd_train import is_knock_on

    assert is_knock_on(RuntimeError(message)) is knock_on
    code = ("import time\n"
            "from spartron.launch.cmd_train import as_rank\n"
            "def body():\n"
            "    print(time.time(), flush=True)\n"
            f"    raise RuntimeError({message!r})\n"
            "as_rank(body, knock_on_delay_s=2.0)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    elapsed = time.time() - float(proc.stdout.split()[0])  # from the failure on, not the interpreter's start
    assert proc.returncode == 1 and message in proc.stderr.splitlines()[-1]
    assert (elapsed >= 2.0) is knock_on, elapsed
