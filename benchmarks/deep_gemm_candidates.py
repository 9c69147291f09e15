"""DeepGEMM's sm90 FP8 GEMMs as candidates for the routed experts (issue 38: "measure each candidate"), fed the
operands Spartron's Triton quantisers write, beside Spartron's Triton kernels and bf16 `torch._grouped_mm` in one
process: fprop and dgrad as `m_grouped_fp8_gemm_nt_contiguous` (each expert's rows 128-aligned, the per-row group
layout), wgrad as `k_grouped_fp8_gemm_nt_contiguous` (its 1x128-by-1x128 kernel; it accumulates into an fp32
output and takes the group sizes on the host). Shapes: DeepSeek-V3's per-rank experts (dim 7168, moe_inter 2048,
8 experts) at 8k and 32k routed rows, balanced; "up13" is the experts' [w1; w3] GEMM, "down" w2's. `rel` is the
relative difference from the Triton kernel's output. Times: benchmarks/fp8_gemms.py's (each rep alone, L2 flushed).

GPU:  python benchmarks/deep_gemm_candidates.py --commit C --out benchmarks/results/deep_gemm_candidates/...json
      (DeepGEMM installed: benchmarks/build_deep_gemm.sh)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_gemms import _entry, time_ms  # noqa: E402

SHAPES = {"v3_8k": (7168, 2048, 8, 8192), "v3_32k": (7168, 2048, 8, 32768)}  # dim, inter, experts, rows
WARMUP, REPS = 3, 10


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _problem(deep_gemm, tb, results: dict, rec, p: str, rows: int, k: int, n: int, experts: int) -> None:
    """fprop / dgrad / wgrad of one GEMM problem: x [rows, k], w [experts, n, k], grad [rows, n]."""
    dev, bf16, flops, per = torch.device("cuda"), torch.bfloat16, 2 * rows * k * n, rows // experts
    counts = torch.full((experts,), per, dtype=torch.int32, device=dev)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    layout = torch.repeat_interleave(torch.arange(experts, dtype=torch.int32, device=dev), per)
    x = torch.randn(rows, k, dtype=bf16, device=dev)
    w = torch.randn(experts, n, k, dtype=bf16, device=dev) * 0.02
    g = torch.randn(rows, n, dtype=bf16, device=dev)
    xq, xs = tb.quantize_rows(x, True)
    wq, ws = tb.quantize_blocks(w, True)
    gq, gs = tb.quantize_rows(g, True)
    wtq, wts = tb.quantize_blocks_t(w, True)
    grouped = {  # kind: (DeepGEMM's operands, output columns, the Triton kernel, bf16)
        "fprop": ((xq, xs.t()), (wq, ws), n, lambda: tb.fprop(xq, xs, wq, ws, counts, bf16),
                  lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)),
        "dgrad": ((gq, gs.t()), (wtq, wts), k, lambda: tb.dgrad(gq, gs, wtq, wts, counts, bf16),
                  lambda: torch._grouped_mm(g, w, offs=offs)),
    }
    for kind, (a, b, cols, triton_fn, bf16_fn) in grouped.items():
        out = torch.empty(rows, cols, dtype=bf16, device=dev)

        def deep(a=a, b=b, out=out):
            deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, out, layout)
        deep()
        results[f"{p}.{kind}.rel"] = _rel(out, triton_fn())
        rec(f"{p}.{kind}.deep_gemm", deep, flops)
        rec(f"{p}.{kind}.triton", triton_fn, flops)
        rec(f"{p}.{kind}.bf16", bf16_fn, flops)
    # wgrad: dw[e] = g_e^T [n, per] @ x_e [per, k]; DeepGEMM's k-grouped layout: per group [n, per], [k, per]
    gt, gts = tb.quantize_cols_grouped(g, counts, True)
    xt, xts = tb.quantize_cols_grouped(x, counts, True)
    used = rows // 128
    a_flat = torch.cat([gt[:, i * per:(i + 1) * per].contiguous().flatten() for i in range(experts)])
    b_flat = torch.cat([xt[:, i * per:(i + 1) * per].contiguous().flatten() for i in range(experts)])
    c = torch.zeros(experts, n, k, dtype=torch.float32, device=dev)
    ks = [per] * experts
    ks_dev = torch.tensor(ks, dtype=torch.int32, device=dev)

    def wgrad():
        deep_gemm.k_grouped_fp8_gemm_nt_contiguous((a_flat, gts[:, :used]), (b_flat, xts[:, :used]), c, ks, ks_dev, c)
    wgrad()
    c.zero_()
    wgrad()
    results[p + ".wgrad.rel"] = _rel(c, tb.wgrad(gt, gts, xt, xts, counts, bf16))
    rec(p + ".wgrad.deep_gemm_fp32acc", wgrad, flops)
    rec(p + ".wgrad.triton", lambda: tb.wgrad(gt, gts, xt, xts, counts, bf16), flops)
    rec(p + ".wgrad.bf16", lambda: torch._grouped_mm(g.t(), x, offs=offs), flops)


def run(out: dict) -> None:
    import deep_gemm

    from spartron.layers.fp8 import triton_backend as tb

    dev, results = torch.device("cuda"), out["results"]

    def rec(name, fn, flops):
        t0 = time.time()
        fn()
        torch.cuda.synchronize()
        entry = _entry(time_ms(fn, dev, WARMUP, REPS), flops=flops)
        entry["first_call_s"] = time.time() - t0
        results[name] = entry
        print(f"{name:40s} {entry['median_ms']:.3f} ms {entry['tflops']:.0f} TFLOP/s", flush=True)

    for sname, (dim, inter, experts, rows) in SHAPES.items():
        torch.manual_seed(0)
        for prob, (k, n) in (("up13", (dim, 2 * inter)), ("down", (inter, dim))):
            _problem(deep_gemm, tb, results, rec, f"{sname}.{prob}", rows, k, n, experts)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", required=True, help="the commit measured (a device copy's git may lie)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("deep_gemm_candidates: needs a CUDA GPU (sm90) with DeepGEMM installed")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": args.commit,
           "shapes": SHAPES, "warmup": WARMUP, "reps": REPS, "results": {}}
    run(out)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
