"""benchmarks/megatron_gpt.py --smoke: the CPU path of the GPU benchmark runs, and its parity section holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core==0.16.1)")

REPO = Path(__file__).resolve().parents[3]


def test_benchmark_smoke_records_parity_and_every_step(tmp_path):
    out = tmp_path / "megatron_gpt.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "megatron_gpt.py"), "--smoke", "--out", str(out)],
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert {"device", "torch", "megatron_core", "commit", "shapes", "parity", "cases"} <= set(report)
    assert report["device"] == "cpu" and report["smoke"] is True
    parity = report["parity"]  # Spartron's Trainer vs Megatron's machinery around Spartron's layers, fp32
    assert len(parity["spartron_trainer_losses"]) == len(parity["megatron_losses"]) == 4
    assert parity["max_abs_diff"] < 1e-6
    ours, megatron_moe = report["cases"]
    assert ours["case"] == "spartron-layers" and len(ours["losses"]) == len(ours["step_times_s"]) == 3
    assert ours["timed_steps"] == 1 and ours["step_time_s"] == ours["step_times_s"][2]
    assert ours["loss_decreased"] and ours["peak_memory_allocated_gib"] is None
    assert megatron_moe == {"case": "spartron-mla+megatron-moe",
                            "skipped": "CPU: Megatron's alltoall dispatcher creates a torch.cuda.Stream"}
