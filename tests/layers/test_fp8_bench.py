"""benchmarks/fp8_moe.py --smoke runs on CPU and writes every step (the GPU checks of the kernels:
tests/layers/test_fp8_gpu.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fp8_moe_benchmark_smoke_writes_every_step(tmp_path):
    spec = importlib.util.spec_from_file_location("fp8_moe", ROOT / "benchmarks" / "fp8_moe.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "fp8.json"
    bench.main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    run = result["runs"]["smoke"]
    assert result["backend"] == "reference" and result["device"] == "cpu"
    assert run["shape"] == {"dim": 128, "inter": 128, "experts": 2, "rows": 256}
    assert len(run["bf16"]["step_ms"]) == 2 and len(run["fp8"]["step_ms"]) == 2
    assert len(run["fp8_nocache"]["step_ms"]) == 2 and len(run["fp8_mb4"]["step_ms"]) == 4  # whole 4-step cycles
    assert run["speedup"] == run["bf16"]["median_ms"] / run["fp8"]["median_ms"]
    assert run["speedup_nocache"] == run["bf16"]["median_ms"] / run["fp8_nocache"]["median_ms"]
    assert run["speedup_mb4"] == run["bf16"]["mean_ms"] / run["fp8_mb4"]["mean_ms"]
    assert run["fp8_mb4"]["mean_ms"] == sum(run["fp8_mb4"]["step_ms"]) / 4
    assert run["fp8"]["peak_gib"] is None  # measured on CUDA only
    layer = result["runs"]["layer_smoke"]  # a whole MoELayer: router, local dispatch, experts, combine
    assert layer["shape"] == {"dim": 128, "inter": 128, "experts": 4, "top_k": 2, "tokens": 128}
    assert set(layer) == {"shape", "bf16", "fp8", "fp8_mb4", "speedup", "speedup_mb4"}
    assert len(layer["fp8_mb4"]["step_ms"]) == 4
    assert layer["speedup"] == layer["bf16"]["median_ms"] / layer["fp8"]["median_ms"]
    assert layer["bf16"]["tflops"] == 3 * 3 * 2 * (128 * 2) * 128 * 128 / layer["bf16"]["median_ms"] / 1e9
    ffn = result["runs"]["ffn_smoke"]
    assert ffn["shape"] == {"dim": 128, "inter": 256, "rows": 256}
    assert set(ffn) == {"shape", "bf16", "fp8", "speedup"}  # dense weights are not cached: no cache modes
    assert len(ffn["bf16"]["step_ms"]) == 2 and len(ffn["fp8"]["step_ms"]) == 2
    assert ffn["speedup"] == ffn["bf16"]["median_ms"] / ffn["fp8"]["median_ms"]


def test_fp8_moe_benchmark_profile_records_one_step_per_mode(tmp_path):
    spec = importlib.util.spec_from_file_location("fp8_moe", ROOT / "benchmarks" / "fp8_moe.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "fp8.json"
    bench.main(["--smoke", "--profile", "--out", str(out)])
    run = json.loads(out.read_text())["runs"]["smoke"]
    for mode in ("bf16", "fp8", "fp8_nocache", "fp8_mb4"):
        profiled = run[mode]["profile"]
        assert profiled["wall_ms"] > 0 and 0 < profiled["kernel_ms"] and profiled["launches"] >= len(profiled["top"])
        assert 0 < len(profiled["top"]) <= 12 and profiled["top"][0]["ms"] == max(k["ms"] for k in profiled["top"])
