"""Local launcher: rank variables, detection of an existing launcher, failure propagation, real ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spartron.launch.local import core_slices, existing_launcher, free_port, launch_local, rank_environ

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


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


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
    assert "rank 1 failed with exit status 3" in err
    assert "rank one says boom" in err  # the failing rank's log is shown


def test_rank_killed_by_signal_is_128_plus_signal(tmp_path, capfd):
    code = "import os, signal\nif os.environ['RANK'] == '0': os.kill(os.getpid(), signal.SIGKILL)\n"
    assert launch_local([sys.executable, "-c", code], 2, {"PATH": "/usr/bin:/bin"}, tmp_path) == 128 + 9
    assert "rank 0 failed with exit status 137" in capfd.readouterr().err


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


def test_cli_under_existing_launcher_does_not_spawn(tmp_path):
    import os

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    proc = _cli(["smoke", TINY, "--set", "launch.nproc=4"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "runs" / "tiny" / "smoke.json").read_text())
    assert result["world_size"] == 1  # ran as the one rank it was given, not 4 new ones
    assert not (tmp_path / "runs" / "tiny" / "logs").exists()


def test_cli_rank_with_a_launch_mistake_exits_2_with_one_line(tmp_path):
    """A rank that cannot start (NCCL asked for on CPU) says why in one line; launch_local passes the
    status on (tested above with plain ranks)."""
    import os

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    proc = _cli(["smoke", TINY, "--set", 'parallel.backend="nccl"'], tmp_path, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "spartron: error: backend 'nccl' needs CUDA, but torch.cuda.is_available() is False; "
        "use backend 'gloo' (or 'auto') on CPU"]


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
