"""benchmarks/fp8_moe.py --smoke runs on CPU and writes every step; the Triton backend matches the
reference on the GPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from spartron.layers.fp8 import reference

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
    assert run["speedup"] == run["bf16"]["median_ms"] / run["fp8"]["median_ms"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Hopper)")
@pytest.mark.parametrize("counts", [[130, 0, 382], [512, 0, 0]])
def test_triton_grouped_gemms_match_the_reference(counts):
    from spartron.layers.fp8 import quant, triton_backend

    g = torch.Generator(device="cuda").manual_seed(0)
    c = torch.tensor(counts, dtype=torch.int32, device="cuda")
    x = torch.randn(512, 256, device="cuda", generator=g).bfloat16()
    w = (torch.randn(3, 384, 256, device="cuda", generator=g) * 0.05).bfloat16()
    grad = torch.randn(512, 384, device="cuda", generator=g).bfloat16()
    for fn in ("quantize_rows", "quantize_blocks"):
        arg = x if fn == "quantize_rows" else w
        (q, s), (rq, rs) = getattr(triton_backend, fn)(arg, True), getattr(quant, fn)(arg, True)
        assert torch.equal(s, rs) and torch.equal(q.float(), rq.float()), fn
    (q, s), (rq, rs) = triton_backend.quantize_cols_grouped(x, c, True), quant.quantize_cols_grouped(x, c, True)
    assert torch.equal(s, rs) and torch.equal(q.float(), rq.float())
    out, ref = triton_backend.grouped_forward(x, w, c, True), reference.grouped_forward(x, w, c, True)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    dx, dw = triton_backend.grouped_backward(grad, x, w, c, True)
    rdx, rdw = reference.grouped_backward(grad, x, w, c, True)
    torch.testing.assert_close(dx.float(), rdx.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dw.float(), rdw.float(), rtol=1e-2, atol=5e-2)
