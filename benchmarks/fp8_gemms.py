"""Per-primitive times of the blockwise FP8 expert path (issue 38 item 2): each quantisation kernel and
each grouped GEMM (fprop, dgrad, wgrad) of the routed experts, with bf16 `torch._grouped_mm` of the same
GEMMs beside them, so a slow step of benchmarks/fp8_moe.py can be pinned on one kernel.

Per shape (balanced expert counts): quantize_rows (x [rows, dim]), swiglu_quantize_rows (gate, up
[rows, inter]), quantize_blocks and quantize_blocks_t (w1 [E, inter, dim]), quantize_cols_grouped
(x), quantize_blocks_cat ([w1; w3] into one buffer), quantize_blocks_both (w1's blocks and
transposed blocks from one read, as the experts' weight cache fills itself); then
three GEMM problems, "up" (w1 or w3 alone: K = dim, N = inter), "up13" (the experts' one GEMM over
[w1; w3]: N = 2 inter; its dgrad contracts over 2 inter) and "down" (w2: K = inter, N = dim),
each as fprop [rows, K] x [E, N, K]^T, dgrad [rows, N] x [E, N, K] and wgrad [N, rows] x [rows, K] ->
[E, N, K], on inputs quantised once before timing. On the triton backend each GEMM kernel is also
timed at a few configs (fprop / dgrad: BM 128 or 64 rows per slot, warps, pipeline stages; wgrad:
BN 128 or 64, warps, stages): `up.fprop_bm64w4s4.fp8` and so on, and each quantiser at a few (block, warps)
configs: `quantize_rows_bm64w8` and so on. Every rep is timed alone (CUDA events, L2 flushed
before each); every time is in the JSON, with the median, TFLOP/s (GEMMs) and GB/s (quantisation).

`--backend torch_scaled_mm`: the experts' wgrad as cuBLAS's blockwise `scaled_mm`, one per expert; `--backend
deep_gemm`: that wgrad, fprop and dgrad on DeepGEMM (their operands quantised into its slot layout, their times
include the output's gather back to the packed rows, as the experts run them).

GPU:  python benchmarks/fp8_gemms.py --out benchmarks/results/fp8_gemms/fp8_gemms_<commit>_h200.json
CPU:  python benchmarks/fp8_gemms.py --smoke --out /tmp/fp8_gemms.json   (tiny shape, reference backend)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import elapsed_ms  # noqa: E402

from spartron.layers.fp8 import check_backend  # noqa: E402
from spartron.layers.fp8.ops import backend_impl  # noqa: E402

SHAPES = {
    "v3_8k": dict(dim=7168, inter=2048, experts=8, rows=8192),
    "dsv3_12l": dict(dim=2048, inter=1408, experts=64, rows=8192 * 6),
}
SMOKE = {"smoke": dict(dim=256, inter=128, experts=2, rows=256)}
GEMMS = ("fprop", "dgrad", "wgrad")
# (BM, warps, stages). sm90 ptxas (triton 3.6): 177-179 registers a thread in every config, no spills, so BM 128 /
# 8 warps runs one CTA an SM, BM 64 / 4 warps two (3-4 stages: 74-99 KB of shared memory each): one CTA's
# scaling of its partial product can overlap the other's wgmma (each 128-deep wgmma is waited on before its scales).
GEMM_CONFIGS = ((128, 8, 3), (128, 8, 4), (128, 8, 5), (64, 4, 3), (64, 4, 4))
# (BN, warps, stages): 197 registers at BN 128 / 8 warps (one CTA an SM), 211 at BN 64 / 4 warps (two)
WGRAD_CONFIGS = ((128, 8, 2), (128, 8, 3), (128, 8, 4), (64, 4, 3), (64, 4, 4))
# the quantisers' configs: (BM rows, warps) of quantize_rows (and the SwiGLU one), (BC columns, warps) of
# quantize_cols_grouped, (CHUNK rows at a time, warps) of quantize_blocks (sm_90a ptxas,
# benchmarks/triton_registers.py: rows 202-223 registers at 4 warps, cols 168, blocks of 128 rows at once 255 + a 2 KB
# spill at 4 warps, 128 at 16)
QUANT_ROWS_CONFIGS = ((32, 4), (32, 8), (16, 4), (64, 8), (64, 4))
QUANT_COLS_CONFIGS = ((64, 4), (64, 8), (32, 4), (128, 8))
QUANT_BLOCKS_CONFIGS = ((128, 16), (128, 8), (64, 8), (64, 4), (32, 4), (32, 8), (16, 4))
QUANT = ("quantize_rows", "swiglu_quantize_rows", "quantize_blocks", "quantize_blocks_t", "quantize_cols_grouped",
         "quantize_blocks_cat", "quantize_blocks_both")


def time_ms(fn, device: torch.device, warmup: int, reps: int) -> list[float]:
    """Each rep's time in ms (common.elapsed_ms of one call: CUDA events around it), L2 flushed before it."""
    for _ in range(warmup):
        fn()
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        times.append(elapsed_ms(fn, 1, device))
    return times


def _entry(times: list[float], flops: float | None = None, nbytes: float | None = None) -> dict:
    median = sorted(times)[len(times) // 2]
    out = {"ms": times, "median_ms": median}
    if flops is not None:
        out["tflops"] = flops / median / 1e9
    if nbytes is not None:
        out["gbps"] = nbytes / median / 1e6
    return out


def _gemm_cases(impl, shape: dict, k: int, n: int, device: torch.device, pow2: bool, sweep: bool) -> dict:
    """fn per (kind, precision) of one GEMM problem: x [rows, k], w [E, n, k], grad [rows, n]."""
    rows, experts = shape["rows"], shape["experts"]
    counts = torch.full((experts,), rows // experts, dtype=torch.int32, device=device)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    counts = impl.group_counts(counts)  # as the ops pass them (torch_scaled_mm: read on the host once per op)
    x = torch.randn(rows, k, dtype=torch.bfloat16, device=device)
    w = torch.randn(experts, n, k, dtype=torch.bfloat16, device=device) * 0.02
    grad = torch.randn(rows, n, dtype=torch.bfloat16, device=device)
    xq, wq = impl.quantize_rows(x, pow2, impl.gemm_rows(counts, rows, None)), impl.quantize_blocks(w, pow2)
    gq, wtq = impl.quantize_rows(grad, pow2, impl.gemm_rows(counts, rows, None)), impl.quantize_blocks_t(w, pow2)
    gt, xt = impl.quantize_cols_grouped(grad, counts, pow2), impl.quantize_cols_grouped(x, counts, pow2)
    bf16 = torch.bfloat16
    cases = {
        ("fprop", "fp8"): lambda: impl.fprop(*xq, *wq, counts, bf16),
        ("fprop", "bf16"): lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
        ("dgrad", "fp8"): lambda: impl.dgrad(*gq, *wtq, counts, bf16),
        ("dgrad", "bf16"): lambda: torch._grouped_mm(grad, w, offs=offs),
        ("wgrad", "fp8"): lambda: impl.wgrad(*gt, *xt, counts, bf16),
        ("wgrad", "bf16"): lambda: torch._grouped_mm(grad.t(), x, offs=offs),
    }
    configs = {}
    if sweep:  # the Triton kernels' block / warp / pipeline configs (the defaults are among them)
        for bm, warps, stages in GEMM_CONFIGS:
            kw = dict(block_m=bm, num_warps=warps, num_stages=stages)
            configs[f"fprop_bm{bm}w{warps}s{stages}"] = lambda kw=kw: impl.fprop(*xq, *wq, counts, bf16, **kw)
            configs[f"dgrad_bm{bm}w{warps}s{stages}"] = lambda kw=kw: impl.dgrad(*gq, *wtq, counts, bf16, **kw)
        for bn, warps, stages in WGRAD_CONFIGS:
            kw = dict(block_n=bn, num_warps=warps, num_stages=stages)
            configs[f"wgrad_bn{bn}w{warps}s{stages}"] = lambda kw=kw: impl.wgrad(*gt, *xt, counts, bf16, **kw)
    return {"cases": cases, "configs": configs}


def _quant_cases(impl, shape: dict, device: torch.device, pow2: bool, sweep: bool = False) -> dict:
    """(fn, bytes read + written) per quantisation primitive (sweep: and per config of the Triton kernels)."""
    rows, dim, inter, experts = shape["rows"], shape["dim"], shape["inter"], shape["experts"]
    counts = torch.full((experts,), rows // experts, dtype=torch.int32, device=device)
    x = torch.randn(rows, dim, dtype=torch.bfloat16, device=device)
    gate, up = (torch.randn(rows, inter, dtype=torch.bfloat16, device=device) for _ in range(2))
    w = torch.randn(experts, inter, dim, dtype=torch.bfloat16, device=device) * 0.02
    slots = rows // 128 + experts
    rows_bytes = rows * dim * (2 + 1) + rows * dim // 32
    swiglu_bytes = rows * inter * (2 + 2 + 1) + rows * inter // 32
    cols_bytes = rows * dim * 2 + slots * 128 * dim + slots * dim * 4
    configs = {}
    if sweep:
        for bm, warps in QUANT_ROWS_CONFIGS:
            kw = dict(block_m=bm, num_warps=warps)
            configs[f"quantize_rows_bm{bm}w{warps}"] = (lambda kw=kw: impl.quantize_rows(x, pow2, **kw), rows_bytes)
            configs[f"swiglu_quantize_rows_bm{bm}w{warps}"] = (
                lambda kw=kw: impl.swiglu_quantize_rows(gate, up, pow2, **kw), swiglu_bytes)
        for bc, warps in QUANT_COLS_CONFIGS:
            kw = dict(block_c=bc, num_warps=warps)
            configs[f"quantize_cols_grouped_bc{bc}w{warps}"] = (
                lambda kw=kw: impl.quantize_cols_grouped(x, counts, pow2, **kw), cols_bytes)
        for chunk, warps in QUANT_BLOCKS_CONFIGS:
            cfg = (chunk, warps)
            configs[f"quantize_blocks_c{chunk}w{warps}"] = (
                lambda cfg=cfg: impl.quantize_blocks(w, pow2, config=cfg), w.numel() * 3)
            configs[f"quantize_blocks_t_c{chunk}w{warps}"] = (
                lambda cfg=cfg: impl.quantize_blocks_t(w, pow2, config=cfg), w.numel() * 3)
            configs[f"quantize_blocks_both_c{chunk}w{warps}"] = (
                lambda cfg=cfg: impl.quantize_blocks_both((w,), pow2, config=cfg), w.numel() * 4)
    return configs | {
        "quantize_rows": (lambda: impl.quantize_rows(x, pow2), rows_bytes),
        "swiglu_quantize_rows": (lambda: impl.swiglu_quantize_rows(gate, up, pow2), swiglu_bytes),
        "quantize_blocks": (lambda: impl.quantize_blocks(w, pow2), w.numel() * 3),
        "quantize_blocks_t": (lambda: impl.quantize_blocks_t(w, pow2), w.numel() * 3),
        "quantize_cols_grouped": (lambda: impl.quantize_cols_grouped(x, counts, pow2), cols_bytes),
        "quantize_blocks_cat": (lambda: impl.quantize_blocks_cat((w, w), pow2), 2 * w.numel() * 3),
        "quantize_blocks_both": (lambda: impl.quantize_blocks_both((w,), pow2), w.numel() * 4),
    }


def run_shape(impl, shape: dict, device: torch.device, warmup: int, reps: int, pow2: bool, sweep: bool) -> dict:
    torch.manual_seed(0)
    results = {}
    for name, (fn, nbytes) in _quant_cases(impl, shape, device, pow2, sweep).items():
        results[name] = _entry(time_ms(fn, device, warmup, reps), nbytes=nbytes)
    summary = {"fp8_gemms_ms": 0.0, "bf16_gemms_ms": 0.0}  # "up" + "down" (one of w1 / w3), as before "up13"
    problems = (("up", (shape["dim"], shape["inter"])), ("down", (shape["inter"], shape["dim"])),
                ("up13", (shape["dim"], 2 * shape["inter"])))
    for problem, (k, n) in problems:
        flops = 2 * shape["rows"] * k * n
        built = _gemm_cases(impl, shape, k, n, device, pow2, sweep)
        for (kind, precision), fn in built["cases"].items():
            entry = _entry(time_ms(fn, device, warmup, reps), flops=flops)
            results[f"{problem}.{kind}.{precision}"] = entry
            if problem != "up13":
                summary[f"{precision}_gemms_ms"] += entry["median_ms"]
        for kind in GEMMS:
            results[f"{problem}.{kind}.speedup"] = (results[f"{problem}.{kind}.bf16"]["median_ms"]
                                                    / results[f"{problem}.{kind}.fp8"]["median_ms"])
        for config, fn in built["configs"].items():
            results[f"{problem}.{config}.fp8"] = _entry(time_ms(fn, device, warmup, reps), flops=flops)
        del built
    summary["speedup"] = summary["bf16_gemms_ms"] / summary["fp8_gemms_ms"]
    return {"shape": shape, "results": results, "summary": summary}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shape on CPU, reference backend")
    parser.add_argument("--backend", default="triton", choices=["triton", "torch_scaled_mm", "deep_gemm", "reference"])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default=None, help="the commit measured (default: this checkout's)")
    args = parser.parse_args(argv)
    backend = "reference" if args.smoke else args.backend
    check_backend(backend)
    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    shapes = SMOKE if args.smoke else {k: SHAPES[k] for k in args.shapes}
    warmup, reps = (1, 2) if args.smoke else (args.warmup, max(args.reps, 10))
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "triton": triton_version, "commit": commit, "backend": backend, "pow2": True, "warmup": warmup,
              "reps": reps, "shapes": shapes, "runs": {}}
    impl = backend_impl(backend)
    for name, shape in shapes.items():
        run = run_shape(impl, shape, device, warmup, reps, pow2=True, sweep=backend == "triton")
        result["runs"][name] = run
        r, s = run["results"], run["summary"]
        print(f"{name}: GEMMs fp8 {s['fp8_gemms_ms']:.3f} vs bf16 {s['bf16_gemms_ms']:.3f} ms ({s['speedup']:.2f}x); "
              + ", ".join(
                  f"{p}.{g} {r[f'{p}.{g}.fp8']['tflops']:.0f}/{r[f'{p}.{g}.bf16']['tflops']:.0f}"
                  for p in ("up", "down", "up13") for g in GEMMS) + " TFLOP/s fp8/bf16; " + ", ".join(
                  f"{q} {r[q]['median_ms']:.3f} ms" for q in QUANT), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))  # after every shape: a later OOM loses nothing
    return result


if __name__ == "__main__":
    main()
