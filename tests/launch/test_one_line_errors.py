"""Intended stops and refusals are one `spartron: error: ...` line with exit status 2 and no traceback:
the loss guards through `spartron train` on 1 and 2 local ranks, and the launcher's report of a rank that
refused (rank logs keep the detail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spartron.launch.local import REFUSAL_GRACE_S, launch_local

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")


def _train(tmp_path: Path, nproc: int, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "spartron.launch.cli", "train", TINY, "--set", f"launch.nproc={nproc}",
               "--set", f"train.run_dir={json.dumps(str(tmp_path / 'run'))}", "--set", "train.progress=false"]
    for item in overrides:
        command += ["--set", item]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "first rank to fail" not in proc.stderr, proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith("spartron: error:")]


@pytest.mark.parametrize("nproc", [1, 2])
def test_max_loss_stop_is_one_line_naming_step_value_and_key(tmp_path, nproc):
    proc = _train(tmp_path, nproc, "train.max_loss=1.0", "train.steps=2")
    assert _errors(proc) == ["spartron: error: loss 8.12279 at step 1 is above train.max_loss = 1"]
    assert proc.stderr.endswith("spartron: error: loss 8.12279 at step 1 is above train.max_loss = 1\n")
    if nproc == 2:  # rank 1 stopped at the same step and says so in its log
        assert "loss 8.12279 at step 1 is above train.max_loss = 1" in (tmp_path / "run/logs/rank1.log").read_text()


@pytest.mark.parametrize("nproc", [1, 2])
def test_non_finite_loss_stop_is_one_line_naming_step_and_value(tmp_path, nproc):
    proc = _train(tmp_path, nproc, "train.lr=1e30", "train.loss_spike_factor=0", "train.steps=4")
    (line,) = _errors(proc)
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if r["type"] == "step"]
    assert steps and all(r["step"] == i for i, r in enumerate(steps, 1))  # the steps before it were logged
    assert line.startswith(f"spartron: error: non-finite values at step {len(steps) + 1}: loss "), line
    assert ", grad norm nan (lm " in line, line


def _ranks(tmp_path: Path, body: str) -> list[str]:
    """A fake rank: `body` runs with r = its rank."""
    return [sys.executable, "-c", f"import os, sys, time\nr = int(os.environ['RANK'])\n{body}"]


def test_launcher_prints_the_refusing_rank_line_alone(tmp_path, capfd):
    body = ("if r == 1: print('detail'); print('spartron: error: data.bin:3 is bad', file=sys.stderr); sys.exit(2)\n"
            "time.sleep(60)")
    assert launch_local(_ranks(tmp_path, body), 2, os.environ, tmp_path / "logs") == 2
    assert capfd.readouterr().err == "spartron: error: data.bin:3 is bad\n"
    assert (tmp_path / "logs" / "rank1.log").read_text() == "detail\nspartron: error: data.bin:3 is bad\n"


def test_launcher_adds_nothing_when_rank_0_refused(tmp_path, capfd):
    """The ranks end as a real one does (exit_process: os._exit right after the line). sys.exit's interpreter
    teardown after the line was a window of milliseconds in which the launcher, woken by rank 1's exit, killed
    rank 0 and added rank 1's line: 15 of 200 runs on 2 loaded cores printed two lines, 0 of 200 with os._exit."""
    body = "print('spartron: error: a guard stop', file=sys.stderr); sys.stderr.flush(); os._exit(2)"
    assert launch_local(_ranks(tmp_path, body), 2, os.environ, tmp_path / "logs") == 2
    assert capfd.readouterr().err == "spartron: error: a guard stop\n"  # rank 0's own line, once


def test_launcher_adds_nothing_when_rank_0_printed_its_refusal_before_rank_1_refused(tmp_path, capfd):
    """The race's order held open: rank 0 prints its refusal and is still on its way out (the sleep, well inside
    the launcher's REFUSAL_GRACE_S) when rank 1 refuses (after rank 0's line: the FIFO) and exits first. Killed at
    once, rank 0 read as not refused and rank 1's line followed its own (a strict xfail until the grace)."""
    fifo = tmp_path / "rank0-printed"
    os.mkfifo(fifo)
    body = (f"if r == 0:\n"
            f"    print('spartron: error: rank 0 stop', file=sys.stderr, flush=True)\n"
            f"    open({str(fifo)!r}, 'w').close()\n"
            f"    time.sleep(0.3)\n"
            f"    os._exit(2)\n"
            f"open({str(fifo)!r}).read()\n"
            f"print('spartron: error: rank 1 stop', file=sys.stderr, flush=True)\n"
            f"os._exit(2)")
    assert launch_local(_ranks(tmp_path, body), 2, os.environ, tmp_path / "logs") == 2
    assert capfd.readouterr().err == "spartron: error: rank 0 stop\n"


def test_launcher_waits_for_a_refusal_only_the_grace(tmp_path, capfd):
    """A rank that refused alone (its peers would wait in a collective until their timeout) ends the run within
    REFUSAL_GRACE_S: the others are killed then, and its line is the one printed."""
    body = "if r == 1: print('spartron: error: rank 1 stop', file=sys.stderr, flush=True); os._exit(2)\ntime.sleep(60)"
    start = time.monotonic()
    assert launch_local(_ranks(tmp_path, body), 2, os.environ, tmp_path / "logs") == 2
    assert REFUSAL_GRACE_S <= time.monotonic() - start < REFUSAL_GRACE_S + 20
    assert capfd.readouterr().err == "spartron: error: rank 1 stop\n"


def test_launcher_reports_a_status_2_without_an_error_line_as_a_failure(tmp_path, capfd):
    body = "if r == 1: print('no line'); sys.exit(2)\ntime.sleep(60)"
    assert launch_local(_ranks(tmp_path, body), 2, os.environ, tmp_path / "logs") == 2
    err = capfd.readouterr().err
    assert err.startswith("spartron: rank 1 exited with status 2, the first rank to fail; stopped the other "
                          f"ranks; last lines of {tmp_path / 'logs' / 'rank1.log'}:\nno line\n"), err


def test_version(capsys):
    from spartron import __version__
    from spartron.launch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"spartron {__version__}\n"


def test_python_dash_m_spartron_is_the_command():
    from spartron import __version__

    done = subprocess.run([sys.executable, "-m", "spartron", "--version"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"spartron {__version__}\n", "")


def test_ctrl_c_of_a_single_rank_run_is_one_line_and_keeps_the_saved_steps(tmp_path):
    """SIGINT (the user's Ctrl-C) stops a one-rank run with one line and status 130, no traceback; the steps
    it completed stay and a resume continues from the newest (the child restores SIGINT's default, as at a
    terminal: a test runner started in the background would pass SIG_IGN on)."""
    import signal
    import time

    run = tmp_path / "run"
    command = [sys.executable, "-m", "spartron.launch.cli", "train", TINY, "--set", "launch.nproc=1", "--set",
               f"train.run_dir={json.dumps(str(run))}", "--set", "train.progress=false", "--set", "train.steps=200",
               "--set", "train.save_every=1"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while not (run / "step-00000002" / "COMPLETE").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert err.splitlines()[-1] == "spartron: stopped by SIGINT; complete saved steps are kept"
    assert (run / "step-00000002" / "COMPLETE").is_file()
