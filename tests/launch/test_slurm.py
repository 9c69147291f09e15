"""Slurm: jobs run on a REAL Slurm (2 emulated nodes); hostile values reach the ranks verbatim and run
nothing; SIGTERM saves a complete step; a requeued job resumes. (Rendering alone: test_slurm_script.py.)

The `slurm` tests need a running Slurm with 2 nodes: scripts/test.sh starts one as root with the project's
scripts/slurm.sh. Without it they skip, and the skip names the reason (no Slurm tools, no controller, or
fewer than 2 usable nodes). They share one xdist worker (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shell_payloads import SINGLE_LINE  # next to this file

from spartron.launch.process import STOPPED_STATUS
from spartron.launch.slurm import _parse_exit

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")

HOSTILE = SINGLE_LINE  # multi-line values cannot pass config validation, so no job gets them


def _hostile(marker: Path) -> list[str]:
    return [h.format(m=marker) for h in HOSTILE]


@pytest.mark.parametrize(("state", "code", "expected"), [
    ("COMPLETED", "0:0", 0), ("FAILED", "2:0", 2), ("FAILED", "0:9", 137), ("CANCELLED", "0:0", 1),
    ("TIMEOUT", "0:15", 143),
])
def test_exit_status_from_slurm_state(state, code, expected):
    assert _parse_exit(state, code) == expected


def test_first_failed_task_is_srun_s_first_report(tmp_path):
    from spartron.launch.slurm import first_failed_task

    log = tmp_path / "1.err"
    log.write_text("Traceback ...\nRuntimeError: Connection closed by peer\n"
                   "srun: error: n2: task 1: Exited with exit code 3\n"
                   "srun: launch/slurm: _step_signal: Terminating StepId=1.0\n"
                   "srun: error: n1: tasks 0,2-3: Killed\n")
    assert first_failed_task(log) == "rank 1 on n2: Exited with exit code 3"
    log.write_text("srun: error: n1: tasks 0-1: Killed\n")
    assert first_failed_task(log) == "ranks 0-1 on n1: Killed"
    log.write_text("all fine\n")
    assert first_failed_task(log) is None
    assert first_failed_task(tmp_path / "missing.err") is None


# ---- a real Slurm ------------------------------------------------------------------------------
START_HINT = "start one as root with `scripts/slurm.sh start` (scripts/test.sh does)"


def _slurm_unavailable() -> str | None:
    """Why the Slurm tests cannot run here, or None when a controller answers with 2 usable nodes."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return f"no Slurm: the client tools (sinfo, sbatch) are not installed; {START_HINT}"
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return f"no Slurm: sinfo did not answer within 20 s; {START_HINT}"
    if proc.returncode != 0:
        return f"no Slurm: slurmctld does not answer ({proc.stderr.strip()}); {START_HINT}"
    usable = [line for line in proc.stdout.splitlines() if not line.split()[1].startswith(("down", "drain"))]
    if len(usable) < 2:
        return f"needs 2 usable Slurm nodes, sinfo shows {proc.stdout.strip()!r}; {START_HINT}"
    return None


def test_slurm_tests_share_one_xdist_group(request):
    """tests/conftest.py: under `pytest -n 2 --dist loadgroup` every Slurm test runs on one worker."""
    marked = [item for item in request.session.items if item.get_closest_marker("slurm")]
    if not marked:
        pytest.skip("no Slurm test is selected in this session")
    assert all([m.args for m in item.iter_markers("xdist_group")] == [("slurm",)] for item in marked)
    unmarked = [item for item in request.session.items if not item.get_closest_marker("slurm")]
    assert not any(m.args == ("slurm",) for item in unmarked for m in item.iter_markers("xdist_group"))


@pytest.mark.parametrize(("args", "message"), [
    ([], "slurm.sh: usage: scripts/slurm.sh start [NODES] | stop | status"),
    (["start", "two"], "slurm.sh: NODES must be a positive integer, got 'two'"),
    (["start", "0"], "slurm.sh: NODES must be a positive integer, got '0'"),
])
def test_slurm_script_refuses_bad_arguments_in_one_line(args, message):
    done = subprocess.run(["bash", str(ROOT / "scripts" / "slurm.sh"), *args], capture_output=True, text=True,
                          timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (1, "", message + "\n")


@pytest.fixture(scope="module")
def slurm_reason() -> str | None:
    """Asked once per module: every Slurm test skips for the same reason."""
    return _slurm_unavailable()


@pytest.fixture
def slurm(slurm_reason) -> None:
    if slurm_reason:
        pytest.skip(slurm_reason)


def _spartron(args: list[str], cwd: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "spartron.launch.cli", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(extra_env or {})})


# what a shell inside a torchrun (or after `export MASTER_PORT=...`) holds when it submits
LEAKED = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29577"}


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


TRAIN_ARGS = ["--set", "train.steps=3", "--set", "train.progress=false"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, slurm_reason):
    """Every CLI run of this module, started at once: Slurm queues the jobs while the CLIs start up.

    The local 4-rank training run (the reference for the Slurm one) runs alongside.
    """
    if slurm_reason:
        pytest.skip(slurm_reason)
    root = tmp_path_factory.mktemp("slurm-jobs")
    marker = root / "pwned"
    hostile_env = {f"V{i}": v for i, v in enumerate(_hostile(marker))}
    env_toml = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in hostile_env.items()) + "}"
    procs = {
        "train": _spartron(["sbatch", TINY, "--nodes", "2", "--wait", "--set", "launch.nproc=2",
                            "--set", f"launch.env={env_toml}", *TRAIN_ARGS], root / "train"),
        "local": _spartron(["train", TINY, "--set", "launch.nproc=4", *TRAIN_ARGS], root / "local"),
        "smoke": _spartron(["sbatch", TINY, "--nodes", "2", "--entry", "smoke", "--wait",
                            "--set", "launch.nproc=2", "--set", f"launch.env={env_toml}"], root / "smoke"),
        "failing": _spartron(["sbatch", TINY, "--nodes", "1", "--entry", "smoke", "--wait",
                              "--set", 'parallel.backend="nccl"'], root / "failing"),
        "nowait": _spartron(["sbatch", TINY, "--entry", "smoke", "--set", 'name="nowait"'], root / "nowait"),
        "leaked": _spartron(["sbatch", TINY, "--nodes", "2", "--entry", "smoke", "--wait"], root / "leaked", LEAKED),
    }
    yield {"root": root, "marker": marker, "hostile_env": hostile_env, "procs": procs}
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _steps(metrics: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("type") == "step"]


@pytest.mark.slurm
def test_sbatch_train_on_two_nodes_matches_a_local_four_rank_run(jobs):
    """`spartron sbatch --submit --wait` of the tiny preset, 2 nodes x 2 tasks (4 gloo ranks): the job
    finishes, writes metrics.jsonl into its run dir, and its losses equal a local 4-rank run's."""
    rc, out, err = _finish(jobs["procs"]["train"])
    assert rc == 0, out + err
    assert "COMPLETED with exit status 0" in out
    rc_local, out_local, err_local = _finish(jobs["procs"]["local"])
    assert rc_local == 0, out_local + err_local
    on_slurm = _steps(jobs["root"] / "train" / "runs" / "tiny" / "metrics.jsonl")
    local = _steps(jobs["root"] / "local" / "runs" / "tiny" / "metrics.jsonl")
    assert [r["step"] for r in on_slurm] == [1, 2, 3]
    assert [r["loss"] for r in on_slurm] == [r["loss"] for r in local]
    assert [r["grad_norm"] for r in on_slurm] == [r["grad_norm"] for r in local]
    assert not jobs["marker"].exists()


@pytest.mark.slurm
def test_smoke_job_on_two_nodes_with_hostile_env(jobs):
    """2 nodes x 2 tasks, rank env from SLURM_*: world 4 over n1 and n2; hostile exports arrive verbatim."""
    rc, out, err = _finish(jobs["procs"]["smoke"])
    assert rc == 0, out + err
    assert "spartron: submitted job" in out and "COMPLETED with exit status 0" in out
    result = json.loads((jobs["root"] / "smoke" / "runs" / "tiny" / "smoke.json").read_text())
    assert result["world_size"] == 4 and result["launcher"] == "slurm" and result["all_reduce_sum"] == 10.0
    assert result["master"].startswith("n1:")
    assert sorted(r["slurm_node"] for r in result["ranks"]) == ["n1", "n1", "n2", "n2"]
    assert all(r["env"] == jobs["hostile_env"] for r in result["ranks"])
    assert not jobs["marker"].exists()


@pytest.mark.slurm
def test_the_submitting_shell_s_torchrun_variables_do_not_make_each_task_rank_0_of_1(jobs):
    """F2: sbatch exports the submitting shell's environment to the tasks; its RANK / WORLD_SIZE / MASTER_*
    would beat SLURM_* in discovery. The job script unsets them: 2 nodes make world 2, Slurm's own master."""
    rc, out, err = _finish(jobs["procs"]["leaked"])
    assert rc == 0, out + err
    result = json.loads((jobs["root"] / "leaked" / "runs" / "tiny" / "smoke.json").read_text())
    assert (result["world_size"], result["launcher"], result["all_reduce_sum"]) == (2, "slurm", 3.0)
    assert result["master"].startswith("n1:") and not result["master"].endswith(":29577")
    assert sorted(r["slurm_node"] for r in result["ranks"]) == ["n1", "n2"]


@pytest.mark.slurm
def test_failing_job_returns_its_status_and_shows_its_log(jobs):
    rc, out, err = _finish(jobs["procs"]["failing"])
    assert rc == 2, out + err
    assert "FAILED with exit status 2" in out
    assert "---- last lines of" in err
    assert "spartron: error: parallel.backend = 'nccl' needs CUDA" in err  # the rank's own message, from the job log


@pytest.mark.slurm
def test_sbatch_without_wait_reports_job_and_run_dir(jobs):
    from spartron.launch.slurm import wait

    rc, out, err = _finish(jobs["procs"]["nowait"])
    assert rc == 0, err
    job_id = out.split("submitted job ")[1].split()[0]
    run_dir = jobs["root"] / "nowait" / "runs" / "nowait"
    assert f"run dir {run_dir};" in out
    assert wait(job_id, timeout_s=240) == ("COMPLETED", 0)
    assert (run_dir / "slurm" / f"{job_id}.out").is_file()
    assert json.loads((run_dir / "smoke.json").read_text())["world_size"] == 1


# ---- preemption on the real Slurm: SIGTERM saves a complete step; a requeued job resumes --------
def _job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def _until(what: str, predicate, timeout: float = 180, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


def _submit_long(cwd: Path, name: str, extra: list[str], wait: bool = False) -> tuple[subprocess.Popen, str, Path]:
    """`spartron sbatch` of a 2-node tiny run; returns the CLI process, the job id and the run dir once the
    job has trained 2 steps."""
    cwd.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "spartron.launch.cli", "sbatch", TINY, "--nodes", "2",
                             "--set", f'name="{name}"', "--set", "train.progress=false", *extra,
                             *(["--wait"] if wait else [])],
                            cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    line = proc.stdout.readline()
    assert "spartron: submitted job " in line, line + proc.stderr.read()
    job_id = line.split("submitted job ")[1].split()[0]
    run_dir = cwd / "runs" / name
    try:  # generous: the 2 cores of CI are shared, and the job may wait for the previous test's to finish
        _until("2 trained steps", lambda: (run_dir / "metrics.jsonl").is_file()
               and len(_steps(run_dir / "metrics.jsonl")) >= 2, timeout=400)
    except AssertionError as err:
        raise AssertionError(f"{err}; job {job_id}: {_job(job_id).get('JobState')}, {_job(job_id).get('Reason')}; "
                             f"queue: {subprocess.run(['squeue'], capture_output=True, text=True).stdout}") from None
    return proc, job_id, run_dir


def _release_requeued(job_id: str) -> None:
    """Skip the 2 minutes Slurm holds a requeued job. Not at once: a job restarted within the second its
    credential was revoked (at the requeue) is killed as "Job credential revoked"."""
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)


def _saved_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in run_dir.glob("step-*"))


@pytest.mark.slurm
def test_scancel_sigterm_saves_a_complete_step_and_the_job_ends(tmp_path, slurm):
    """`scancel -s TERM` signals the job's steps: every rank saves the same step and exits 75; the job
    ends (FAILED, exit 75: it did not reach train.steps) and is not requeued."""
    from spartron.launch.slurm import wait
    from spartron.runtime.state import verify_step

    proc, job_id, run_dir = _submit_long(tmp_path, "preempt", ["--set", "train.steps=500"])
    proc.communicate(timeout=30)
    subprocess.run(["scancel", "-s", "TERM", job_id], check=True)
    assert wait(job_id, timeout_s=120) == ("FAILED", STOPPED_STATUS)
    assert _job(job_id).get("Restarts", "0") == "0"
    (saved,) = _saved_steps(run_dir)
    assert 2 <= saved < 500 and verify_step(run_dir / f"step-{saved:08d}") is None
    err = (run_dir / "slurm" / f"{job_id}.err").read_text()
    assert f"spartron: SIGTERM: saved step {saved} of 500 in {run_dir} and stopped" in err
    assert err.count("Exited with exit code 75") == 2  # both ranks (2 nodes x 1 task) saved and stopped
    assert _steps(run_dir / "metrics.jsonl")[-1]["step"] == saved


@pytest.mark.slurm
@pytest.mark.slow
def test_sigterm_to_the_batch_shell_requeues_and_the_job_resumes(tmp_path, slurm):
    """launch.requeue: `scancel -b -s TERM` (what --signal=B:TERM@<s> does before the time limit) reaches
    the batch shell, which forwards it; the ranks save and exit 75, the job requeues itself, and the
    requeued job resumes from that step to train.steps. `spartron sbatch --wait` follows it to the end."""
    proc, job_id, run_dir = _submit_long(tmp_path, "requeue", ["--set", "train.steps=16",
                                                                "--set", "launch.requeue=true"], wait=True)
    subprocess.run(["scancel", "-b", "-s", "TERM", job_id], check=True)
    _until("the requeue", lambda: _job(job_id).get("Restarts") == "1" and _job(job_id)["JobState"] == "PENDING")
    (saved,) = _saved_steps(run_dir)
    _release_requeued(job_id)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out + err
    assert f"spartron: job {job_id} COMPLETED with exit status 0" in out
    log_out = (run_dir / "slurm" / f"{job_id}.out").read_text()
    assert f"spartron: the ranks saved a step and stopped; requeueing job {job_id}" in log_out
    assert f"resumed from step {saved}" in (run_dir / "slurm" / f"{job_id}.err").read_text()
    assert [r["step"] for r in _steps(run_dir / "metrics.jsonl")][-1] == 16


@pytest.mark.slurm
@pytest.mark.slow
def test_scontrol_requeue_of_a_running_job_resumes_from_the_step_saved_on_sigterm(tmp_path, slurm):
    """`scontrol requeue` (an operator, or preemption with PreemptMode=REQUEUE) SIGTERMs the running
    job: the ranks save, and the requeued job resumes from that step."""
    from spartron.launch.slurm import wait

    proc, job_id, run_dir = _submit_long(tmp_path, "requeued", ["--set", "train.steps=16",
                                                                 "--set", "launch.requeue=true"])
    proc.communicate(timeout=30)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    _until("the requeue", lambda: _job(job_id).get("Restarts") == "1" and _job(job_id)["JobState"] == "PENDING")
    (saved,) = _saved_steps(run_dir)
    _release_requeued(job_id)
    assert wait(job_id, timeout_s=240) == ("COMPLETED", 0)
    assert f"resumed from step {saved}" in (run_dir / "slurm" / f"{job_id}.err").read_text()
    assert [r["step"] for r in _steps(run_dir / "metrics.jsonl")][-1] == 16


@pytest.mark.slurm
def test_a_rank_failing_on_slurm_is_named_as_the_first_to_fail(tmp_path, slurm):
    """[debug] rides in the job's frozen config: rank 1 (on n2) exits 3 at step 2; rank 0's knock-on
    traceback fills the log's tail, and `spartron sbatch --wait` names rank 1 from srun's report and exits
    with its status, 3, as the local launcher does (F7: not the 143 of the peers srun stopped)."""
    proc = _spartron(["sbatch", TINY, "--nodes", "2", "--wait", "--set", "train.steps=3", "--set",
                      "train.progress=false", "--set", "debug.fail_step=2", "--set", "debug.fail_rank=1",
                      "--set", 'debug.fail_mode="exit"'], tmp_path)
    rc, out, err = _finish(proc, timeout=240)
    assert rc == 3 and "FAILED with exit status" in out, out + err
    assert err.strip().splitlines()[-1] == "spartron: the first to fail, as srun saw it: rank 1 on n2: Exited " \
        "with exit code 3"


@pytest.mark.slurm
@pytest.mark.slow
def test_the_signal_before_the_time_limit_saves_and_stops_before_the_limit(tmp_path, slurm):
    """launch.signal_before_s = 100 with a 2-minute limit: Slurm signals the batch shell 100 s (up to 60 s
    more) before the limit; the ranks save and stop with 75 well before Slurm's TIMEOUT kill."""
    from spartron.runtime.state import verify_step

    start = time.monotonic()
    proc = _spartron(["sbatch", TINY, "--time", "2", "--wait", "--set", "launch.signal_before_s=100",
                      "--set", "train.steps=100000", "--set", "train.progress=false", "--set", 'name="limit"'],
                     tmp_path)
    rc, out, err = _finish(proc, timeout=300)
    assert rc == STOPPED_STATUS, out + err
    assert time.monotonic() - start < 120  # before the time limit
    assert "FAILED with exit status 75" in out and "saved a complete step and stopped" in out
    run_dir = tmp_path / "runs" / "limit"
    (saved,) = _saved_steps(run_dir)
    assert verify_step(run_dir / f"step-{saved:08d}") is None
    job_id = out.split("submitted job ")[1].split()[0]
    assert "spartron: the batch shell got SIGTERM; forwarding it to the ranks" in \
        (run_dir / "slurm" / f"{job_id}.out").read_text()
