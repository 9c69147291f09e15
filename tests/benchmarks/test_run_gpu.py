"""benchmarks/run_gpu.sh's call budget and its packed output (what a device call brings back), and the report
writer every benchmark shares."""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_gpu(out: Path, *steps: str, budget: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RUN_GPU_BUDGET"}
    if budget is not None:
        env["RUN_GPU_BUDGET"] = budget
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "run_gpu.sh"), str(out), *steps], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_step_with_too_little_budget_left_is_skipped_and_the_output_is_packed(tmp_path):
    done = run_gpu(tmp_path / "r", "env:5", budget="10")
    assert done.returncode == 0, done.stderr
    # the seconds left: 10 less the time since the call started (a second boundary may pass on a busy machine)
    left = re.search(r"env skipped: (\d+)s of RUN_GPU_BUDGET left", done.stdout)
    assert left is not None and 0 <= int(left.group(1)) <= 10, done.stdout
    assert not (tmp_path / "r" / "env.log").exists()
    with tarfile.open(tmp_path / "r.tgz") as packed:
        assert "r" in packed.getnames()


def test_without_a_budget_every_step_runs_and_its_log_is_packed(tmp_path):
    done = run_gpu(tmp_path / "r", "env:30", budget=None)
    assert done.returncode == 0, done.stderr
    assert "=== env (rc=" in done.stdout and "skipped" not in done.stdout
    with tarfile.open(tmp_path / "r.tgz") as packed:
        assert "r/env.log" in packed.getnames()


def test_a_report_replaces_the_previous_one_whole(tmp_path):
    """benchmarks/common.write_report writes beside the report and renames over it: no partial file is ever the
    report, and none is left behind."""
    from benchmarks.common import write_report

    out = tmp_path / "r" / "x.json"
    write_report(out, {"a": 1})
    write_report(out, {"a": 2, "b": [1, 2]})
    assert out.read_text() == '{\n  "a": 2,\n  "b": [\n    1,\n    2\n  ]\n}\n'
    assert sorted(p.name for p in out.parent.iterdir()) == ["x.json"]
