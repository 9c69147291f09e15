"""Slurm: rendered scripts are inert for hostile values, and jobs run on a REAL Slurm (2 emulated nodes).

The `slurm` tests need a running Slurm with 2 nodes (scripts/test.sh starts one as root with
`SLURM_CI_NODES=2 ../shared/tools/slurm-ci.sh start`); they skip, saying why, only when `sinfo` is
missing or the controller does not answer.
"""

from __future__ import annotations

import json
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from spartron.launch.cli import main
from spartron.launch.slurm import SlurmError, _parse_exit, render_job
from spartron.runtime.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")

# Each hostile value mentions {m}, the marker file it would create if it ever ran.
HOSTILE = [
    "$(touch {m})",
    "`touch {m}`",
    "x\ntouch {m}",
    "'; touch {m}; echo '",
    '"; touch {m}; echo "',
    ";touch {m}",
    "a b | touch {m} && touch {m}",
    "$((1+1)) ${{HOME}} \\$(touch {m}) \\",
    "--x=$(touch {m})",
    "#SBATCH --wrap='touch {m}'",
]


def _hostile(marker: Path) -> list[str]:
    return [h.format(m=marker) for h in HOSTILE]


# ---- rendering: hostile values never run (no Slurm needed) ----------------------------------
_SRUN_SHIM = """#!/bin/sh
exec {python} -c 'import json, os, sys; json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, \
open(os.environ["SHIM_OUT"], "w"))' "$@"
"""


def _run_script_with_srun_shim(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Execute a rendered job script with bash; `srun` is a shim recording its argv and environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "srun"
    shim.write_text(_SRUN_SHIM.format(python=shlex.quote(sys.executable)))
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "job.sh").write_text(script)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SHIM_OUT": str(tmp_path / "shim.json"), "SLURM_JOB_ID": "1",
           "SLURM_JOB_NODELIST": "n[1-2]"}
    return subprocess.run(["bash", str(tmp_path / "job.sh")], env=env, capture_output=True, text=True,
                          timeout=30)


def test_hostile_env_values_reach_the_ranks_verbatim_and_run_nothing(tmp_path):
    marker = tmp_path / "pwned"
    values = {f"V{i}": v for i, v in enumerate(_hostile(marker))}
    cfg = load_config(TINY)
    cfg.launch.env = values
    job = render_job(cfg, tmp_path)
    for key, value in values.items():
        assert f"export {key}={shlex.quote(value)}" in job.script
    proc = _run_script_with_srun_shim(job.script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads((tmp_path / "shim.json").read_text())
    assert {k: seen["env"][k] for k in values} == values
    assert seen["argv"][-3:] == ["spartron.launch.cli", "train", str(job.config_path)]
    assert not marker.exists()
    # The frozen config the job runs carries the same values back.
    (tmp_path / "frozen.toml").write_text(job.config_text)
    assert load_config(tmp_path / "frozen.toml").launch.env == values


def test_hostile_venv_and_container_paths_are_quoted(tmp_path):
    marker = tmp_path / "pwned"
    for value in _hostile(marker):
        if "\n" in value:
            continue  # rejected by validation (single-line paths), tested below
        cfg = load_config(TINY)
        cfg.launch.venv = "/nonexistent/" + value
        proc = _run_script_with_srun_shim(render_job(cfg, tmp_path).script, tmp_path)
        assert proc.returncode != 0  # `source` of a missing file fails under set -e
        cfg = load_config(TINY)
        cfg.launch.container = value
        script = render_job(cfg, tmp_path).script
        assert shlex.quote(f"--container-image={value}") in script
        assert _run_script_with_srun_shim(script, tmp_path).returncode == 0
        assert json.loads((tmp_path / "shim.json").read_text())["argv"][1] == f"--container-image={value}"
    assert not marker.exists()
    with pytest.raises(ConfigError, match="launch.venv: .*single-line"):
        load_config(TINY, ['launch.venv="/x\\ntouch /tmp/y"'])


@pytest.mark.parametrize("key", ["partition", "account", "qos", "job_name", "time"])
def test_hostile_slurm_directive_values_are_rejected_naming_the_key(key, tmp_path):
    for value in _hostile(tmp_path / "pwned"):
        with pytest.raises(ConfigError, match=rf"^invalid config: launch\.{key}: "):
            load_config(TINY, [f"launch.{key}={json.dumps(value)}"])


def test_hostile_sbatch_args_env_names_and_run_name_are_rejected(tmp_path, capsys, monkeypatch):
    for value in _hostile(tmp_path / "pwned"):
        with pytest.raises(ConfigError, match=r"^invalid config: launch\.sbatch_args: "):
            load_config(TINY, [f"launch.sbatch_args=[{json.dumps('--qos=' + value)}]"])
        with pytest.raises(ConfigError, match=r"^invalid config: launch\.env: environment variable name"):
            load_config(TINY, [f"launch.env={{{json.dumps(value)} = \"x\"}}"])
        cfg = load_config(TINY, [f"name={json.dumps(value)}"])
        with pytest.raises(SlurmError, match="cannot be a Slurm job name"):
            render_job(cfg, tmp_path)
        cfg = load_config(TINY, [f"train.run_dir={json.dumps('/tmp/' + value)}"])
        with pytest.raises(SlurmError, match="cannot go into an #SBATCH directive"):
            render_job(cfg, tmp_path)
    # Through the CLI: one line, exit 2, nothing written.
    monkeypatch.chdir(tmp_path)
    assert main(["sbatch", TINY, "--dry-run", "--job-name", "$(touch x)"]) == 2
    assert capsys.readouterr().err.startswith("spartron: error: invalid config: launch.job_name: ")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("state", "code", "expected"), [
    ("COMPLETED", "0:0", 0), ("FAILED", "2:0", 2), ("FAILED", "0:9", 137), ("CANCELLED", "0:0", 1),
    ("TIMEOUT", "0:15", 143),
])
def test_exit_status_from_slurm_state(state, code, expected):
    assert _parse_exit(state, code) == expected


# ---- a real Slurm ------------------------------------------------------------------------------
def _slurm_unavailable() -> str | None:
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return ("Slurm client tools (sinfo, sbatch) are not installed; scripts/test.sh installs and starts "
                "Slurm when run as root")
    proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        return f"slurmctld is not reachable: {proc.stderr.strip()}"
    usable = [line for line in proc.stdout.splitlines() if not line.split()[1].startswith(("down", "drain"))]
    if len(usable) < 2:
        return f"needs 2 usable Slurm nodes (SLURM_CI_NODES=2), sinfo shows: {proc.stdout.strip()!r}"
    return None


def _spartron(args: list[str], cwd: Path) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "spartron.launch.cli", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


TRAIN_ARGS = ["--set", "train.steps=3", "--set", "train.progress=false"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every CLI run of this module, started at once: Slurm queues the jobs while the CLIs start up.

    The local 4-rank training run (the reference for the Slurm one) runs alongside.
    """
    reason = _slurm_unavailable()
    if reason:
        pytest.skip(reason)
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
def test_failing_job_returns_its_status_and_shows_its_log(jobs):
    rc, out, err = _finish(jobs["procs"]["failing"])
    assert rc == 2, out + err
    assert "FAILED with exit status 2" in out
    assert "---- last lines of" in err
    assert "spartron: error: backend 'nccl' needs CUDA" in err  # the rank's own message, from the job log


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
