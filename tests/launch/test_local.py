"""Local launcher: rank variables, detection of an existing launcher, failure propagation, real ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spartron.launch.local import launch_local
from spartron.launch.process import STOPPED_STATUS
from spartron.launch.rank_env import core_slices, existing_launcher, held_port, rank_environ

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, None),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, "torchrun"),
    # An srun step task: has SLURM_STEP_ID.
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4"}, "srun"),
    # The sbatch batch script itself: SLURM_PROCID=0 and SLURM_NTASKS=4 but no step: not a rank.
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}, None),
    # A one-task srun step does not make a multi-rank world: launch.nproc still applies.
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, None),
    # Our own spawned ranks inside a Slurm allocation: rank variables win.
    ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "torchrun"),
])
def test_existing_launcher(environ, expected):
    assert existing_launcher(environ) == expected


def test_rank_environ_sets_torchrun_variables_and_keeps_parent():
    env = rank_environ({"PATH": "/bin", "OMP_NUM_THREADS": "4"}, rank=2, nproc=3, master_addr="127.0.0.1",
                       master_port=1234)
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "4", "RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "3",
                   "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "1234"}
    assert rank_environ({}, 0, 2, "h", 1)["OMP_NUM_THREADS"] == "1"


def test_a_held_port_is_refused_to_others_and_bindable_by_a_store():
    """The launcher holds the master port while its ranks run: rank 0's store binds it, nothing else can."""
    import socket
    import subprocess

    with held_port() as port:
        with socket.socket() as other, pytest.raises(OSError, match="Address already in use"):
            other.bind(("127.0.0.1", port))
        store = ("import datetime, torch.distributed as d; "
                 f"s = d.TCPStore('127.0.0.1', {port}, 1, True, timeout=datetime.timedelta(seconds=10)); "
                 "s.set('k', 'v'); print(s.port, s.get('k').decode())")
        out = subprocess.run([sys.executable, "-c", store], capture_output=True, text=True, timeout=60)
        assert (out.returncode, out.stdout) == (0, f"{port} v\n"), out.stderr
    with socket.socket() as other:  # released at the end of the block
        other.bind(("127.0.0.1", port))


_DUMP = ("import json, os, sys; "
         "json.dump({k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', "
         "'MASTER_PORT')}, open(sys.argv[1] + '/r' + os.environ['RANK'] + '.json', 'w'))")


def test_launch_local_spawns_ranks_with_their_variables(tmp_path):
    status = launch_local([sys.executable, "-c", _DUMP, str(tmp_path)], 3, {"PATH": "/usr/bin:/bin"},
                          tmp_path / "logs")
    assert status == 0
    seen = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(3)]
    assert [s["RANK"] for s in seen] == ["0", "1", "2"]
    assert [s["LOCAL_RANK"] for s in seen] == ["0", "1", "2"]
    assert {s["WORLD_SIZE"] for s in seen} == {"3"}
    assert len({s["MASTER_PORT"] for s in seen}) == 1 and seen[0]["MASTER_ADDR"] == "127.0.0.1"


@pytest.mark.parametrize(("allowed", "nproc", "expected"), [
    ([0, 1, 2, 3], 2, [[0, 1], [2, 3]]),
    ([3, 1, 2, 0, 4], 2, [[0, 1, 2], [3, 4]]),  # sorted; the remainder goes to the first ranks
    ([4, 5, 6, 7], 1, [[4, 5, 6, 7]]),
    ([0, 1], 3, [[0], [1], [0]]),  # more ranks than cores: one core each, round-robin
    ([0, 1], 2, [[0], [1]]),
])
def test_core_slices(allowed, nproc, expected):
    assert core_slices(allowed, nproc) == expected


def test_core_slices_rejects_no_ranks_or_no_cores():
    with pytest.raises(ValueError, match="nproc >= 1"):
        core_slices([0, 1], 0)
    with pytest.raises(ValueError, match="at least one core"):
        core_slices([], 2)


_AFFINITY = ("import json, os, sys; json.dump(sorted(os.sched_getaffinity(0)), "
             "open(sys.argv[1] + '/a' + os.environ['RANK'] + '.json', 'w'))")


@pytest.mark.parametrize("bind", [True, False])
def test_launch_local_binds_each_rank_to_its_cores_only_when_asked(tmp_path, bind):
    allowed = sorted(os.sched_getaffinity(0))
    status = launch_local([sys.executable, "-c", _AFFINITY, str(tmp_path)], 2, {"PATH": "/usr/bin:/bin"},
                          tmp_path / "logs", bind_cores=bind)
    assert status == 0
    seen = [json.loads((tmp_path / f"a{r}.json").read_text()) for r in range(2)]
    assert seen == (core_slices(allowed, 2) if bind else [allowed, allowed])
    assert sorted(os.sched_getaffinity(0)) == allowed  # the launcher itself is not pinned


_FAIL_RANK1 = ("import os, sys, time\n"
               "if os.environ['RANK'] == '1':\n"
               "    print('rank one says boom', flush=True); sys.exit(3)\n"
               "time.sleep(60)\n")


def test_failing_rank_stops_the_others_and_is_surfaced(tmp_path, capfd):
    start = time.monotonic()
    status = launch_local([sys.executable, "-c", _FAIL_RANK1], 3, {"PATH": "/usr/bin:/bin"}, tmp_path)
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    assert status == 3
    assert elapsed < 20, f"the sleeping ranks were not stopped ({elapsed:.1f} s)"
    assert "spartron: rank 1 exited with status 3, the first rank to fail; stopped the other ranks; last lines of " \
        f"{tmp_path / 'rank1.log'}:\nrank one says boom\n" in err  # the failing rank's log is shown
    assert err.strip().splitlines()[-1] == (
        "spartron: how the ranks ended: rank 0 was killed by the launcher (SIGKILL); rank 1 exited with "
        "status 3; rank 2 was killed by the launcher (SIGKILL)")


def test_rank_killed_by_signal_is_128_plus_signal(tmp_path, capfd):
    code = "import os, signal\nif os.environ['RANK'] == '0': os.kill(os.getpid(), signal.SIGKILL)\n"
    assert launch_local([sys.executable, "-c", code], 2, {"PATH": "/usr/bin:/bin"}, tmp_path) == 128 + 9
    assert "spartron: rank 0 was killed by SIGKILL, the first rank to fail; stopped the other ranks; its " \
        "output is above\n" in capfd.readouterr().err


def _cli(args, cwd, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "spartron.launch.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_train_spawns_two_real_ranks(tmp_path):
    proc = _cli(["train", TINY, "--set", "launch.nproc=2", "--set", "train.steps=2", "--set",
                 "train.progress=false"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "runs" / "tiny"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "step"] == [1, 2]
    assert (run_dir / "logs" / "rank1.log").is_file()  # rank 1 ran, with its own log


def test_cli_under_existing_launcher_does_not_spawn(tmp_path, master_port):
    import os

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(master_port))
    proc = _cli(["smoke", TINY, "--set", "launch.nproc=4"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "runs" / "tiny" / "smoke.json").read_text())
    assert result["world_size"] == 1  # ran as the one rank it was given, not 4 new ones
    assert not (tmp_path / "runs" / "tiny" / "logs").exists()


def test_smoke_refuses_a_live_runs_directory_and_a_linked_smoke_json(tmp_path, master_port):
    """smoke writes into the run directory: never while a run owns it, never through a link there."""
    import socket

    from spartron.runtime.rundir import RunDirLock

    run_dir = tmp_path / "runs" / "tiny"
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(master_port))
    live = RunDirLock(run_dir)
    assert live.acquire() is None
    proc = _cli(["smoke", TINY], tmp_path, env=env)
    live.release()
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"spartron: error: {run_dir} is in use by another run (pid {os.getpid()} on {socket.gethostname()}, lock "
        f"{run_dir}/.lock): wait for it to end or stop it, or give this run another directory"]
    assert not (run_dir / "smoke.json").exists()
    outside = tmp_path / "outside.json"
    outside.write_text("keep")
    (run_dir / "smoke.json").symlink_to(outside)
    proc = _cli(["smoke", TINY], tmp_path, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"spartron: error: {run_dir}/smoke.json is a symbolic link (to {outside}): a run reads and writes only "
        "regular files and folders inside its run directory; remove it"]
    assert outside.read_text() == "keep"


def test_cli_rank_with_a_launch_mistake_exits_2_with_one_line(tmp_path, master_port):
    """A rank that cannot start (NCCL asked for on CPU) says why in one line; launch_local passes the
    status on (tested above with plain ranks)."""
    import os

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(master_port))
    proc = _cli(["smoke", TINY, "--set", 'parallel.backend="nccl"'], tmp_path, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "spartron: error: parallel.backend = 'nccl' needs CUDA, but this run is on CPU (device = 'cpu')"]


_PARENT = """
import sys
from pathlib import Path
from spartron.launch.local import launch_local
code = ("import os, time; open(os.environ['OUT'] + os.environ['RANK'], 'w').write(str(os.getpid())); "
        "time.sleep(60)")
sys.exit(launch_local([sys.executable, '-c', code], 2, {'OUT': sys.argv[1], 'PATH': '/usr/bin:/bin'},
                      Path(sys.argv[1] + 'logs')))
"""


def test_sigterm_to_the_launcher_stops_its_ranks(tmp_path):
    import os
    import signal

    prefix = str(tmp_path / "pid")
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, prefix])
    pid_files = [Path(prefix + "0"), Path(prefix + "1")]
    deadline = time.monotonic() + 30
    while not all(p.is_file() and p.read_text() for p in pid_files):
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in pid_files]
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=20) == 143
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ---- root cause, stops, dying with the launcher ----------------------------------------------
def _pid_gone(pid: int) -> bool:
    """Exited (a zombie waiting for init to reap it counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_rank_that_failed_first_is_reported_not_the_lowest(tmp_path, capfd):
    """Rank 1 fails, rank 0 fails 2 s after it (its knock-on error): rank 1 is the root cause. Ordered by a file rank 1
    writes as it exits, not by two timers: under a loaded CI machine rank 1's interpreter started late enough that
    timers 0.2 s apart let rank 0 fail first (a fresh-clone run with the audit beside it)."""
    code = ("import os, sys, time\n"
            "if os.environ['RANK'] == '1':\n"
            "    print('the real error', flush=True); open(sys.argv[1], 'w').close(); os._exit(3)\n"
            "while not os.path.exists(sys.argv[1]):\n"
            "    time.sleep(0.01)\n"
            "time.sleep(2); print('connection closed by peer', flush=True); sys.exit(1)\n")
    status = launch_local([sys.executable, "-c", code, str(tmp_path / "rank1-failed")], 2, {"PATH": "/usr/bin:/bin"},
                          tmp_path)
    err = capfd.readouterr().err
    assert status == 3
    assert ("spartron: rank 1 exited with status 3, the first rank to fail; stopped the other ranks; last "
            f"lines of {tmp_path / 'rank1.log'}:\nthe real error\n") in err
    assert "connection closed by peer" not in err  # rank 0 was killed before its knock-on failure


_STOP_RANK1 = ("import os, signal, sys, time\n"
               "if os.environ['RANK'] == '1':\n"
               "    open(sys.argv[1], 'w').write(str(os.getpid())); os.kill(os.getpid(), signal.SIGSTOP)\n"
               "    sys.exit(0)\n")


def test_a_stopped_rank_fails_the_run_after_the_stop_limit(tmp_path, capfd):
    code = _STOP_RANK1 + "time.sleep(60)\n"
    start = time.monotonic()
    status = launch_local([sys.executable, "-c", code, str(tmp_path / "pid")], 2, {"PATH": "/usr/bin:/bin"},
                          tmp_path, stopped_limit_s=1.0)
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    assert status == 128 + signal.SIGSTOP
    assert 1.0 <= elapsed < 8, elapsed
    assert "spartron: rank 1 stopped (SIGSTOP), the first rank to fail; stopped the other ranks;" in err
    assert err.strip().splitlines()[-1] == (
        "spartron: how the ranks ended: rank 0 was killed by the launcher (SIGKILL); rank 1 stopped "
        "(SIGSTOP), then was killed by the launcher (SIGKILL)")
    assert _pid_gone(int((tmp_path / "pid").read_text()))


def test_a_stopped_rank_is_the_root_cause_of_its_peers_timeout(tmp_path, capfd):
    """Its peer gives up first (as a collective timeout would): the stop, seen earlier, is reported."""
    code = _STOP_RANK1 + "time.sleep(1.0); print('Timed out waiting 1000ms', flush=True); sys.exit(1)\n"
    status = launch_local([sys.executable, "-c", code, str(tmp_path / "pid")], 2, {"PATH": "/usr/bin:/bin"},
                          tmp_path, stopped_limit_s=300)
    err = capfd.readouterr().err
    assert status == 128 + signal.SIGSTOP
    assert "spartron: rank 1 stopped (SIGSTOP), the first rank to fail;" in err
    assert "how the ranks ended: rank 0 exited with status 1; rank 1 stopped (SIGSTOP), then was killed" in err


def test_a_rank_that_continues_is_not_a_failure(tmp_path, capfd):
    """Rank 0 SIGCONTs the stopped rank 1 (a debugger detaching, a job resumed): the run succeeds."""
    code = _STOP_RANK1 + ("pid = sys.argv[1]\n"
                          "while not (os.path.exists(pid) and open(pid).read()): time.sleep(0.01)\n"
                          "time.sleep(0.5); os.kill(int(open(pid).read()), signal.SIGCONT)\n")
    status = launch_local([sys.executable, "-c", code, str(tmp_path / "pid")], 2, {"PATH": "/usr/bin:/bin"},
                          tmp_path, stopped_limit_s=3)
    assert status == 0, capfd.readouterr().err


_LAUNCH_SLEEPERS = """
import sys
from pathlib import Path
from spartron.launch.local import launch_local
code = ("import os, signal, sys, time\\n"
        "if sys.argv[1] == 'save': signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\\n"
        "if sys.argv[1] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
        "open(os.environ['OUT'] + os.environ['RANK'], 'w').write(str(os.getpid()))\\n"
        "time.sleep(60)\\n")
sys.exit(launch_local([sys.executable, '-c', code, sys.argv[2]], 2, {'OUT': sys.argv[1], 'PATH': '/usr/bin:/bin'},
                      Path(sys.argv[1] + 'logs'), terminate_grace_s=1.0))
"""


def _start_launcher(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, list[int]]:
    prefix = str(tmp_path / "pid")
    parent = subprocess.Popen([sys.executable, "-c", _LAUNCH_SLEEPERS, prefix, mode], stderr=subprocess.PIPE,
                              text=True)
    pid_files = [Path(prefix + "0"), Path(prefix + "1")]
    deadline = time.monotonic() + 30
    while not all(p.is_file() and p.read_text() for p in pid_files):
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.05)
    return parent, [int(p.read_text()) for p in pid_files]


def test_ranks_die_when_their_launcher_is_killed(tmp_path):
    """SIGKILL of the launcher (no handler runs): the parent-death signal takes its ranks down."""
    parent, pids = _start_launcher(tmp_path, "sleep")
    parent.kill()
    assert parent.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while not all(_pid_gone(pid) for pid in pids):
        assert time.monotonic() < deadline, f"ranks {pids} outlived their launcher"
        time.sleep(0.05)


def test_sigterm_is_forwarded_and_ranks_that_save_give_the_stopped_status(tmp_path):
    parent, pids = _start_launcher(tmp_path, "save")
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=20) == STOPPED_STATUS
    assert "spartron: got SIGTERM; forwarded it to the ranks" in parent.stderr.read()
    assert all(_pid_gone(pid) for pid in pids)


def test_ranks_that_ignore_a_forwarded_sigterm_are_killed_after_the_grace(tmp_path):
    parent, pids = _start_launcher(tmp_path, "ignore")
    start = time.monotonic()
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=20) == 128 + signal.SIGTERM
    assert 1.0 <= time.monotonic() - start < 10
    assert ("spartron: the ranks did not stop within 1 s of SIGTERM; killed them. rank 0 was killed by the "
            "launcher (SIGKILL); rank 1 was killed by the launcher (SIGKILL)") in parent.stderr.read()
    assert all(_pid_gone(pid) for pid in pids)


def test_a_rank_that_left_early_with_status_0_is_pointed_out(tmp_path, capfd):
    """Rank 1 ends 'successfully' mid-run; rank 0 then fails waiting for it (a timeout): both are named."""
    code = ("import os, sys, time\n"
            "if os.environ['RANK'] == '1': sys.exit(0)\n"
            "time.sleep(0.5); print('Timed out waiting for rank 1', flush=True); sys.exit(1)\n")
    assert launch_local([sys.executable, "-c", code], 2, {"PATH": "/usr/bin:/bin"}, tmp_path) == 1
    err = capfd.readouterr().err
    assert "spartron: rank 0 exited with status 1, the first rank to fail;" in err
    assert err.strip().splitlines()[-1] == ("spartron: note: rank 1 exited with status 0 before rank 0 failed; "
                                            "its peers may have been waiting for it")


_FULL_DISK = """
import resource, sys
from pathlib import Path
from spartron.launch.local import launch_local
code = ("import os, sys, time; os.environ['RANK'] == '1' and [print('x' * 99, flush=True) for _ in range(200)]; "
        "open(sys.argv[1] + os.environ['RANK'], 'w'); time.sleep(60)")
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))  # the disk is full after 4 kB
sys.exit(launch_local([sys.executable, '-c', code, sys.argv[1]], 2, {'PATH': '/usr/bin:/bin'}, Path(sys.argv[1])))
"""


def test_a_rank_log_that_cannot_be_written_ends_the_run_in_one_line(tmp_path):
    """The launcher copies rank 1's output into logs/rank1.log; past RLIMIT_FSIZE (a full disk) that write fails:
    one line naming the log, status 2, the ranks killed (not left sleeping, not a rank's lost traceback)."""
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path / "logs")], capture_output=True, text=True,
                          timeout=50)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (f"spartron: error: {tmp_path / 'logs' / 'rank1.log'}: cannot write this rank log (File "
                           "too large): free space on its disk, then resume the run\n")
    assert (tmp_path / "logs" / "rank1.log").stat().st_size == 4096  # what fitted: lines of the rank's output
    assert (tmp_path / "logs" / "rank1.log").read_text().startswith("x" * 99 + "\n")


def test_temporary_rank_logs_are_removed_or_kept_and_named(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # tempfile's folder, read at each mkdtemp
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    from spartron.launch.local import launch_with_temporary_logs

    env = {"PATH": "/usr/bin:/bin"}
    assert launch_with_temporary_logs([sys.executable, "-c", "print('hi')"], 2, env, "t-") == 0
    assert list(tmp_path.glob("t-*")) == []
    assert launch_with_temporary_logs([sys.executable, "-c", "import sys; sys.exit(3)"], 2, env, "t-") == 3
    (kept,) = tmp_path.glob("t-*")
    assert (kept / "rank1.log").is_file()
    assert capfd.readouterr().err.endswith(f"spartron: the ranks' logs are kept in {kept}\n")


def test_launch_env_reaches_every_local_rank(tmp_path):
    """launch.env was exported by the Slurm job script only: local ranks ran without it, and smoke recorded
    null for each variable while it said the ranks were fine."""
    env = 'launch.env={SPARTRON_TEST_VAR = "from-launch-env"}'
    done = subprocess.run([sys.executable, "-m", "spartron", "smoke", TINY, "--set", "launch.nproc=2", "--set", env,
                           "--set", f"train.run_dir={json.dumps(str(tmp_path / 'run'))}"], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=240)
    assert done.returncode == 0, done.stderr
    ranks = json.loads((tmp_path / "run" / "smoke.json").read_text())["ranks"]
    assert [r["env"] for r in ranks] == [{"SPARTRON_TEST_VAR": "from-launch-env"}] * 2
