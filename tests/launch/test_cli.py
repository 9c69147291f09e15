"""The `spartron` command: help everywhere, one-line user errors, plan output, sbatch --dry-run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spartron.launch.cli import main
from spartron.layers.costs import state_bytes_per_rank
from spartron.parallel.dims import GROUP_DIMS, ParallelDims
from spartron.runtime.config import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")


@pytest.mark.parametrize("command", [[], ["train"], ["smoke"], ["sbatch"], ["regress"],
                                     ["regress", "compare"], ["regress", "run"], ["plan"]])
def test_help_on_every_command(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: " + " ".join(["spartron", *command]))


def test_console_script_runs_and_lists_commands():
    exe = Path(sys.executable).parent / "spartron"
    proc = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for command in ("train", "smoke", "sbatch", "regress", "plan"):
        assert command in proc.stdout


def test_user_error_in_a_subprocess_is_one_line_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "spartron.launch.cli", "train", "missing.toml"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["spartron: error: config file 'missing.toml' does not exist"]


@pytest.mark.parametrize(("argv", "message"), [
    (["plan", "nope.toml"], "spartron: error: config file 'nope.toml' does not exist"),
    (["plan", TINY, "--set", "model.bogus=1"], "spartron: error: invalid config: model.bogus: unknown key"),
    (["plan", TINY, "--set", "nonsense"],
     "spartron: error: override 'nonsense' must look like dotted.key=value"),
    (["plan", TINY, "--world-size", "x"],
     "spartron: error: argument --world-size: invalid int value: 'x' (see `spartron plan --help`)"),
    (["plan", TINY, "--world-size", "3", "--set", "parallel.cp=2"],
     "spartron: error: parallel: world size 3 is not divisible by dp_replicate * cp = 2, so "
     "parallel.fsdp = -1 cannot fill it"),
    ([], "spartron: error: the following arguments are required: COMMAND (see `spartron --help`)"),
    (["frobnicate"], "spartron: error: argument COMMAND: invalid choice: 'frobnicate'"),
    (["sbatch", TINY, "--dry-run", "--wait"],
     "spartron: error: --wait needs a submitted job; drop --dry-run"),
    (["sbatch", TINY, "--dry-run", "--submit"],
     "spartron: error: argument --submit: not allowed with argument"),
    (["sbatch", TINY, "--dry-run", "--nodes", "3", "--set", "launch.nproc=2", "--set", "parallel.cp=4"],
     "spartron: error: parallel: world size 6 is not divisible by dp_replicate * cp = 4"),
    (["regress", "compare", "no-run", "no-base"],
     "spartron: error: run 'no-run' is neither a metrics JSONL nor a run directory with metrics.jsonl"),
    (["regress", "run", TINY], "spartron: error: give --baseline, or --repeats >= 2"),
])
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(message), err


def test_plan_prints_config_groups_and_memory(capsys, tmp_path):
    argv = ["plan", TINY, "--world-size", "8", "--set", "parallel.ep=2", "--set", "parallel.cp=2",
            "--set", "parallel.dp_replicate=2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    cfg = load_config(TINY, argv[5::2])
    dims = ParallelDims(8, fsdp=2, cp=2, ep=2, dp_replicate=2)
    # The resolved config is TOML that loads back to the same config.
    toml_text = out.split("# parallel layout")[0].removeprefix("# resolved config\n")
    (tmp_path / "resolved.toml").write_text(toml_text)
    assert load_config(tmp_path / "resolved.toml") == cfg
    assert "# parallel layout: world 8 = dp_replicate 2 x fsdp 2 x cp 2; ep 2 (expert_fsdp 2)" in out
    for name in GROUP_DIMS:
        groups = " ".join("[" + ",".join(map(str, g)) + "]" for g in dims.rank_groups(name))
        assert f"{groups}\n" in out.split(f"\n{name} ", 1)[1], name
    assert "cp            size 2    4 group(s): [0,1] [2,3] [4,5] [6,7]" in out
    mem = state_bytes_per_rank(cfg.model, dims, cfg.train.optimizer)
    assert f"total            {mem['total'] / 2**20:.2f} MiB" in out


def test_sbatch_dry_run_prints_script_and_writes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["sbatch", TINY, "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu,debug", "--time",
            "1-02:00:00", "--account", "proj_1", "--qos", "high", "--cpus-per-task", "12", "--dry-run",
            "--set", "parallel.ep=8", "--set", 'launch.env={NCCL_DEBUG="WARN"}',
            "--set", 'launch.venv="/opt/v"', "--set", "train.global_batch_size=32"]  # divides 4 x 8 ranks
    assert main(argv) == 0
    script = capsys.readouterr().out
    lines = script.splitlines()
    run_dir = tmp_path / "runs" / "tiny"
    for expected in ["#!/bin/bash", "#SBATCH --job-name=tiny", "#SBATCH --nodes=4",
                     "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=12",
                     "#SBATCH --time=1-02:00:00",
                     "#SBATCH --partition=gpu,debug", "#SBATCH --account=proj_1", "#SBATCH --qos=high",
                     f"#SBATCH --output={run_dir}/slurm/%j.out", f"#SBATCH --error={run_dir}/slurm/%j.err",
                     f"#SBATCH --chdir={tmp_path}", "export NCCL_DEBUG=WARN", "export OMP_NUM_THREADS=12",
                     "source /opt/v/bin/activate",
                     "unset GROUP_RANK LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT RANK WORLD_SIZE"]:
        assert expected in lines, expected
    srun = re.escape(f"srun --kill-on-bad-exit=1 /opt/v/bin/python -m spartron.launch.cli train {run_dir}/slurm/")
    # the submission's own frozen config, named by its content; in the background: the SIGTERM trap runs at once
    assert sum(bool(re.fullmatch(srun + r"config-[0-9a-f]{16}\.toml &", line)) for line in lines) == 1
    assert not any(tmp_path.iterdir()), "a dry run must not write anything"


def test_sbatch_dry_run_defaults_to_this_venv_and_cpu_tasks_from_nproc(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["sbatch", TINY, "--dry-run", "--nodes", "2", "--set", "launch.nproc=2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "#SBATCH --ntasks-per-node=2" in lines
    assert not any(line.startswith("#SBATCH --gpus") for line in lines)
    if sys.prefix != sys.base_prefix:
        assert f"source {sys.prefix}/bin/activate" in lines
        srun = f"srun --kill-on-bad-exit=1 {sys.prefix}/bin/python -m spartron.launch.cli train "
        assert any(line.startswith(srun) for line in lines)


def test_sbatch_dry_run_container(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["sbatch", TINY, "--dry-run", "--set", 'launch.container="nvcr.io/nvidia/pytorch:25.01-py3"',
                 "--entry", "smoke"]) == 0
    lines = capsys.readouterr().out.splitlines()
    srun = re.escape(f"srun --kill-on-bad-exit=1 --container-image=nvcr.io/nvidia/pytorch:25.01-py3 "
                     f"--container-mounts={tmp_path} --container-workdir={tmp_path} python -m spartron.launch.cli "
                     f"smoke {tmp_path}/runs/tiny/slurm/")
    assert sum(bool(re.fullmatch(srun + r"config-[0-9a-f]{16}\.toml &", line)) for line in lines) == 1
    assert not any(line.startswith("source ") for line in lines)


def _write_metrics(path: Path, losses: list[float]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    records = [{"type": "header", "deterministic": True}]
    records += [{"type": "step", "step": i + 1, "loss": loss, "grad_norm": 1.0, "lr": 1e-3,
                 "tokens_per_s": 1000.0, "peak_memory_allocated_bytes": 0} for i, loss in enumerate(losses)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_regress_compare_pass_fail_tolerance_and_plot(tmp_path, capsys):
    base = _write_metrics(tmp_path / "base", [5.0, 4.0, 3.0])
    same = _write_metrics(tmp_path / "same", [5.0, 4.0, 3.0])
    worse = _write_metrics(tmp_path / "worse", [5.0, 4.0, 3.3])
    assert main(["regress", "compare", str(same), str(base / "metrics.jsonl")]) == 0
    assert "result: PASS" in capsys.readouterr().out
    assert main(["regress", "compare", str(worse), str(base)]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] loss" in out and "result: FAIL" in out
    plot = tmp_path / "plot.png"
    assert main(["regress", "compare", str(worse), str(base), "--loss-rel", "0.2", "--plot", str(plot)]) == 0
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert main(["regress", "compare", str(worse), str(base), "--loss-rel", "-1"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "spartron: error: --loss-rel must be >= 0, got -1.0"
    assert main(["regress", "compare", str(tmp_path), str(base)]) == 2
    assert "is neither a metrics JSONL nor a run directory with metrics.jsonl" in capsys.readouterr().err


def test_regress_run_repeats_and_compares_with_baseline(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["--set", "train.steps=1", "--set", "train.progress=false", "--set", "train.seq_len=32"]
    assert main(["regress", "run", TINY, "--repeats", "2", "--throughput-rel", "1.0", *args]) == 0
    out = capsys.readouterr().out
    assert f"regression: {tmp_path}/runs/tiny-r1/metrics.jsonl" in out
    assert f"baseline: {tmp_path}/runs/tiny-r0/metrics.jsonl" in out
    assert "[PASS] first-step loss (exact)" in out and "result: PASS" in out
    # Running again would write into the recorded runs (now baselines): refused before training.
    assert main(["regress", "run", TINY, "--baseline", "runs/tiny-r0", *args]) == 2
    assert capsys.readouterr().err.startswith(f"spartron: error: run directory {tmp_path}/runs/tiny-r0 exists")


@pytest.mark.parametrize("nproc", [1, 2], ids=["in-process", "spawned-ranks"])
def test_regress_run_a_failing_repeat_is_named_and_exits_apart_from_a_fail(tmp_path, nproc):
    """A repeat that raises (audit ops F7): with nproc 1 it runs in this process, whose rank ended the command
    with its own status (1, read as a comparison FAIL) and without the repeat's line. Both paths now print the
    line and exit REPEAT_FAILED_STATUS; no comparison runs."""
    from spartron.launch.cmd_regress import REPEAT_FAILED_STATUS

    settings = ("name=\"rfail\"", "train.steps=2", "train.seq_len=32", f"launch.nproc={nproc}",
                "train.progress=false", "debug.fail_step=2")
    proc = subprocess.run([sys.executable, "-m", "spartron.launch.cli", "regress", "run", TINY, "--repeats", "2",
                           *(x for kv in settings for x in ("--set", kv))],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert REPEAT_FAILED_STATUS == 4
    assert proc.returncode == 4, proc.stderr
    assert proc.stderr.splitlines()[-1] == "spartron: repeat 0 failed with exit status 1"
    assert "RuntimeError: debug.fail_mode = 'raise' at step 2 on rank 0" in proc.stderr
    assert "result:" not in proc.stdout and not (tmp_path / "runs" / "rfail-r1").exists()


_TEARDOWN_PROBE = ("import atexit, sys\n"
                   "from spartron.launch import cli\n"
                   "atexit.register(lambda: print('interpreter teardown ran', flush=True))\n"
                   "sys.argv = ['spartron', *sys.argv[1:]]\n"
                   "print('buffered before the end')\n"
                   "cli.run()\n")


def test_cli_process_ends_without_interpreter_teardown_and_keeps_the_exit_code(tmp_path):
    """DTensor caches keep gloo groups alive past destroy_process_group; finalizing them could abort."""
    ok = subprocess.run([sys.executable, "-c", _TEARDOWN_PROBE, "plan", TINY, "--world-size", "2"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("buffered before the end\n")  # buffered output is flushed, not lost
    assert "fsdp" in ok.stdout  # the plan itself was printed
    assert "interpreter teardown ran" not in ok.stdout
    bad = subprocess.run([sys.executable, "-c", _TEARDOWN_PROBE, "regress", "compare", str(tmp_path),
                          str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.startswith("spartron: error: ")
    assert "interpreter teardown ran" not in bad.stdout


def test_a_requeued_slurm_job_whose_run_already_finished_ends_with_0_and_one_note(tmp_path):
    """Slurm audit F4: a requeue landing after the final step was saved (while the job finishes) starts the
    ranks again with SLURM_RESTART_COUNT = 1; they find step train.steps saved and end with status 0 and one
    note (a failure would reach Slurm's accounting and afterok dependencies for a finished run). The same
    run started without a requeue (restart count 0, or outside Slurm) is still refused: nothing to train."""
    from spartron.parallel.env import DistEnvError, slurm_restart_count

    args = [sys.executable, "-m", "spartron.launch.cli", "train", TINY, "--set", "train.steps=2", "--set",
            "train.save_every=2", "--set", "train.resume=true", "--set", "train.progress=false"]
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                "MASTER_PORT") and not k.startswith("SLURM_")}
    first = subprocess.run(args, cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / "runs" / "tiny"
    task = {**clean, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7",
            "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "localhost"}  # a 1-node, 1-task job's srun step
    requeued = subprocess.run(args, cwd=tmp_path, env={**task, "SLURM_RESTART_COUNT": "1"}, capture_output=True,
                              text=True, timeout=120)
    assert (requeued.returncode, requeued.stdout, requeued.stderr) == (0, "", (
        "spartron: note: this Slurm job was requeued (restart 1) after its run had saved step 2 of train.steps = 2 "
        f"({run_dir}/step-00000002): nothing is left to train; ending with status 0\n"))
    for env in ({**task, "SLURM_RESTART_COUNT": "0"}, clean):
        again = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert (again.returncode, again.stderr) == (2, (
            "spartron: error: runs/tiny/step-00000002: this run already reached step 2 and train.steps = 2, so "
            "nothing is left to train: raise train.steps to continue it, or start a new run (another run "
            "directory)\n"))
    assert slurm_restart_count({}) == 0 and slurm_restart_count({"SLURM_RESTART_COUNT": "3"}) == 3
    with pytest.raises(DistEnvError, match=r"^SLURM_RESTART_COUNT='x' is not an integer$"):
        slurm_restart_count({"SLURM_RESTART_COUNT": "x"})
