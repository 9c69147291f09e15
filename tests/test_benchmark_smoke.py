"""The CPU smoke mode of every benchmark runs (the GPU numbers come from the same scripts on a lent machine).

Each script runs as a file, as benchmarks/run_gpu.sh runs it, with --smoke (tiny shapes, gloo); matrix.py's
cells train with `spartron train` into the test's own folder (--runs). Scripts whose smoke run a test of their
own already makes and checks further are not run a second time here: megatron_gpt.py
(tests/interop/megatron/test_megatron_training_benchmark.py), indexer.py (tests/layers/attention/test_indexer_topk.py),
convergence.py and dsa_stages.py (tests/benchmarks/test_convergence.py), fp8_moe.py (tests/layers/test_fp8_bench.py),
rehearse_sweep.py (tests/runtime/test_rehearse_sweep.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# One intra-op thread per process, as the test harness's ranks: the machine's cores are shared.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


SLOW = pytest.mark.slow  # over ~20 s on the 2-core CI machine (pyproject.toml)


@pytest.mark.parametrize("script", [
    "e2e", pytest.param("profile_step", marks=SLOW), pytest.param("offload", marks=SLOW), "ac_block", "moe_layer",
    "collectives", "deepep", "overhead_cpu", "sparse_mla", pytest.param("matrix", marks=SLOW), "doc_mask",
    "precision", "memory_plan", "ac_validation_cost", "adamw", "dsa_e2e", "kl_sparse", "kl_dense", "dsa_id_overlap",
    "dsa_saved"])
def test_smoke_mode_runs(script, tmp_path):
    out = tmp_path / f"{script}.json"
    args = ["--out", str(out)] if script in ("e2e", "profile_step", "matrix", "precision", "memory_plan",
                                             "ac_validation_cost", "dsa_e2e", "kl_sparse", "kl_dense",
                                             "dsa_id_overlap", "dsa_saved", "deepep") else []
    if script == "matrix":
        args += ["--runs", str(tmp_path / "runs")]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--smoke", *args], cwd=tmp_path,
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    if args:
        report = json.loads(out.read_text())
        assert report, script
    if script == "dsa_e2e":  # both configs trained; the ratio is of their medians
        rows = {name: run["results"][0] for name, run in report["runs"].items()}
        assert sorted(rows) == ["dense", "dsa"] and not any("error" in r for r in rows.values())
        assert report["dsa_over_dense_step_time"] == rows["dsa"]["step_time_s"] / rows["dense"]["step_time_s"]
        assert all(0 < run["predicted_peak_gib"] < 0.1 for run in report["runs"].values())  # spartron plan's
    if script == "deepep":  # gloo: the all_to_all side with and without the FP8 wire (dim 128: 128 + 4 bytes a row)
        for rank in report["ranks"]:
            bf16, fp8 = rank["all_to_all"], rank["all_to_all_fp8"]
            assert bf16["dispatch_bytes"] == bf16["combine_bytes"] == fp8["combine_bytes"]
            assert fp8["dispatch_bytes"] * 256 == bf16["dispatch_bytes"] * 132
        assert report["summary"]["all_to_all_fp8"]["dispatch_bytes_over_bf16"] == 132 / 256
    if script == "kl_dense":  # on CPU both inputs take the float32 products: the same values, the grads rounded
        assert report["rel_diff_bf16_vs_float32"] == {"kl": 0.0, "dq": 0.0, "dw": 0.0, "dk": 0.0}
        assert len(report["results"]["bf16_inputs"]["steps_ms"]) == report["iters"] == 2
        # B 2, S 48: 4,608 query-key pairs x (4 heads x 24 + 3 index heads x 8) x 2, forward and recompute,
        # and the backward's float32 dq / dk products over the index heads
        main, index = 2 * 4608 * 4 * 24, 2 * 4608 * 3 * 8
        assert report["gemm_flops"] == {"products": 2 * (main + index), "float32_products": 2 * index,
                                        "total": 2 * (main + index) + 2 * index}
        r = report["results"]["bf16_inputs"]
        assert r["gemm_tflops_per_s"] == report["gemm_flops"]["total"] / (r["ms"] * 1e-3) / 1e12
        assert "triton" in report and report["bf16_matmul_ceiling_tflops"] > 0
    if script == "dsa_id_overlap":  # the tiny model's one source layer, measured at steps 1 and 2
        rows = report["results"]
        assert [(r["step"], r["source"]) for r in rows] == [(1, 0), (2, 0)]
        assert all(1.0 <= r["reuse_factor_g2"] <= 2.0 and 0.0 <= r["adjacent_jaccard"] <= 1.0 for r in rows)
    if script == "ac_validation_cost":  # tiny: 4 micro-batches x (4 layers + the shared MTP block twice) a step
        assert [(r["region_calls"], r["replays"]) for r in report["steps"]] == [(24, 24)] * 3
        step = report["steps"][-1]
        assert step["ops_original"] > 0 and report["timing"]["ns_per_op"] > 0
        assert step["validation_host_us"] == pytest.approx(step["ops_original"] * report["timing"]["ns_per_op"] / 1e3
                                                           + 24 * report["timing"]["us_finish_replay"])
        assert report["fraction"] == pytest.approx(report["median_validation_host_us"]
                                                   / (report["median_step_time_ms"] * 1e3))
    if script == "matrix":  # every cell trained, and each one compared with the baseline passes
        assert [c["rc"] for c in report["cells"]] == [0, 0, 0, 0]
        assert [c.get("regression", {}).get("passed") for c in report["cells"][2:]] == [True, True]


def test_muon_benchmark_times_both_optimizers_and_profiles_one_more_step_apart(tmp_path):
    """benchmarks/muon.py --smoke --profile: --steps timed steps per optimizer, the extra profiled step outside
    them, its kernels listed (Muon's Newton-Schulz GEMMs among them); the ratio is of the two medians."""
    out = tmp_path / "muon.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "muon.py"), "--smoke", "--profile", "--steps", "3",
                           "--out", str(out)], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = {r["optimizer"]: r for r in report["rows"]}
    assert sorted(rows) == ["adamw", "muon"]
    for r in rows.values():
        assert r["steps"] == 3 and len(r["optimizer_step_ms"]) == len(r["optimizer_phase_ms"]) == 3
        assert r["profile"]["launches"] > 0 and r["profile"]["top"]
    assert any(k["name"] == "aten::baddbmm" for k in rows["muon"]["profile"]["top"])
    assert report["muon_over_adamw_optimizer_step"] == (rows["muon"]["median_optimizer_step_ms"]
                                                       / rows["adamw"]["median_optimizer_step_ms"])
    assert report["newton_schulz"]["tflop_per_step_whole_model"] > 0
