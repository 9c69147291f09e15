"""benchmarks/fp8_gemms.py --smoke runs every primitive on CPU (reference backend) and records every rep
(the GPU numbers: the lead's H200 run of the same script)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fp8_gemms_benchmark_smoke_records_every_primitive(tmp_path):
    spec = importlib.util.spec_from_file_location("fp8_gemms", ROOT / "benchmarks" / "fp8_gemms.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "sub" / "fp8_gemms.json"
    bench.main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["backend"] == "reference" and result["device"] == "cpu" and result["reps"] == 2
    assert set(result) >= {"torch", "triton", "commit", "shapes"} and len(result["commit"]) >= 7
    run = result["runs"]["smoke"]
    assert run["shape"] == {"dim": 256, "inter": 128, "experts": 2, "rows": 256}
    r = run["results"]
    gemms = [f"{p}.{g}.{prec}" for p in ("up", "down") for g in ("fprop", "dgrad", "wgrad") for prec in ("fp8", "bf16")]
    up13 = [f"up13.{g}.{prec}" for g in ("fprop", "dgrad", "wgrad") for prec in ("fp8", "bf16")]
    assert sorted(k for k in r if not k.endswith(".speedup")) == sorted(list(bench.QUANT) + gemms + up13)  # no sweep
    assert "quantize_blocks_cat" in bench.QUANT
    for name in gemms + up13:
        assert len(r[name]["ms"]) == 2 and r[name]["median_ms"] == sorted(r[name]["ms"])[1]
        flops = 2 * 256 * 256 * 128 * (2 if name.startswith("up13") else 1)  # rows x dim x inter (x 2: [w1; w3])
        assert r[name]["tflops"] == flops / r[name]["median_ms"] / 1e9
    assert r["up.wgrad.speedup"] == r["up.wgrad.bf16"]["median_ms"] / r["up.wgrad.fp8"]["median_ms"]
    nbytes = 256 * 256 * 3 + 256 * 256 // 32  # bf16 in, fp8 out, one fp32 scale per 128
    assert r["quantize_rows"]["gbps"] == nbytes / r["quantize_rows"]["median_ms"] / 1e6
    s = run["summary"]
    assert s["fp8_gemms_ms"] == sum(r[g]["median_ms"] for g in gemms if g.endswith("fp8"))  # up + down, not up13
    assert s["speedup"] == s["bf16_gemms_ms"] / s["fp8_gemms_ms"]


def test_the_results_index_has_a_headline_for_fp8_gemms(tmp_path):
    spec = importlib.util.spec_from_file_location("results_index", ROOT / "benchmarks" / "results_index.py")
    index = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(index)
    run = {"summary": {"fp8_gemms_ms": 2.0, "bf16_gemms_ms": 3.0, "speedup": 1.5},
           "results": {"up.wgrad.fp8": {"tflops": 612.4}}}
    headline = index.HEADLINES["fp8_gemms"]({"backend": "triton", "runs": {"v3_8k": run}})
    assert headline == "triton v3_8k expert GEMMs fp8 2.00 ms vs bf16 3.00 ms (1.50x), wgrad 612 TFLOP/s"
