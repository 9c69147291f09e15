"""Sparse MLA on the GPU: the Triton kernels behind `spartron::sparse_mla` against dense causal SDPA.

    python benchmarks/sparse_mla.py --out benchmarks/results/sparse_mla_triton.json   # CUDA, V3.2 shapes
    python benchmarks/sparse_mla.py --smoke                                           # tiny, CPU, seconds

Sparse: absorbed MLA form, q [1, S, H, kv_lora + rope], kv [1, S, kv_lora + rope], random causal
top-k ids (unique per query, -1 padding for early queries), value dim kv_lora. The backward is also
timed with the deterministic dkv (model.dsa.deterministic_dkv). Dense: the per-head
form the dense MLA layer runs, SDPA causal with q/k head dim nope + rope and v head dim v.
Cases: each `--cases` entry SEQxHEADS (default 16k x 16 and 16k x 64 forward, backward and
forward+backward; 64k x 64 forward only) with dense SDPA at the same length and heads; `--reference`
adds the PyTorch reference op (the CPU path; slow) at the first case. The bf16 matmul ceiling is
measured in the same run. FLOPs count valid (query, key) pairs: forward 2 x pairs x H x (d_qk + d_v),
backward 2.5x that. Every timed step is recorded (CUDA events, after warm-up) with the median.
`--sweep` also times the kernels' block configs at the first case (registers and spills recorded).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from spartron.layers.attention import sparse_mla_triton
from spartron.layers.attention.sparse_mla import default_chunk_size, reference_backward, reference_forward, sparse_mla

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also under `python -m benchmarks.NAME`
from common import call_times_ms, device_name, write_report  # noqa: E402


def causal_random_ids(seq: int, topk: int, device, chunk: int = 1024) -> torch.Tensor:
    """[1, seq, min(topk, seq)] int32: random distinct visible keys per query, -1 where fewer are visible."""
    k = min(topk, seq)
    parts = []
    g = torch.Generator(device=device).manual_seed(0)
    for c0 in range(0, seq, chunk):
        t = torch.arange(c0, min(c0 + chunk, seq), device=device)
        scores = torch.rand(t.numel(), seq, device=device, generator=g)
        scores = scores.masked_fill(torch.arange(seq, device=device)[None] > t[:, None], float("-inf"))
        values, ids = scores.topk(k, dim=-1)
        parts.append(torch.where(torch.isfinite(values), ids, -1).to(torch.int32))
    return torch.cat(parts)[None]


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def timed(fn, device, iters: int, warmup: int) -> dict:
    """Median and every step's ms (CUDA events around each call), peak GiB above the pre-call baseline."""
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    times = call_times_ms(fn, iters, device)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    return dict(ms=sorted(times)[len(times) // 2], steps_ms=times, peak_gib=peak)


def matmul_ceiling(device, dtype, n: int = 8192, iters: int = 20) -> float:
    """TFLOP/s of an n^3 matrix product on random data in the benchmark's dtype."""
    g = torch.Generator(device=device).manual_seed(1)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    r = timed(lambda: a @ b, device, iters, 3)
    return 2 * n**3 / r["ms"] / 1e9


def sparse_case(args, device, dtype, s: int, h: int, fwd_only: bool, first: bool) -> dict:
    reference = args.reference and first
    k = args.topk
    lat, rope, nope, v = args.kv_lora, args.rope, args.nope, args.v_dim
    d = lat + rope
    scale = (nope + rope) ** -0.5
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, s, h, d, device=device, dtype=dtype, generator=g).requires_grad_()
    kv = torch.randn(1, s, d, device=device, dtype=dtype, generator=g).requires_grad_()
    ids = causal_random_ids(s, k, device)
    grad_out = torch.randn(1, s, h, lat, device=device, dtype=dtype, generator=g)
    chunk = default_chunk_size(q, kv, ids)
    n_sel = int((ids >= 0).sum())  # selected (query, key) pairs
    fwd_flops = 2 * n_sel * h * (d + lat)
    with torch.no_grad():
        out, lse = sparse_mla(q, kv, ids, scale, lat)
    zero_lse = torch.zeros_like(lse)

    def sparse_fwd():
        with torch.no_grad():
            sparse_mla(q, kv, ids, scale, lat)

    def sparse_bwd():  # the backward op alone (Delta and the kernel on CUDA)
        torch.ops.spartron.sparse_mla_backward(grad_out, zero_lse, q.detach(), kv.detach(), ids, out, lse,
                                               scale, lat, chunk)

    def sparse_bwd_deterministic():  # model.dsa.deterministic_dkv: int64 fixed-point dkv
        torch.ops.spartron.sparse_mla_backward(grad_out, zero_lse, q.detach(), kv.detach(), ids, out, lse,
                                               scale, lat, chunk, True)

    def sparse_fwd_bwd():
        o, _ = sparse_mla(q, kv, ids, scale, lat)
        o.backward(grad_out)
        q.grad = kv.grad = None

    def reference_fwd_bwd():
        with torch.no_grad():
            o, ls = reference_forward(q, kv, ids, scale, lat, chunk)
            reference_backward(grad_out, zero_lse, q, kv, ids, ls, scale, lat, chunk)

    cases = [("sparse_fwd", sparse_fwd, fwd_flops)]
    if not fwd_only:
        cases += [("sparse_bwd", sparse_bwd, 2.5 * fwd_flops),
                  ("sparse_bwd_deterministic", sparse_bwd_deterministic, 2.5 * fwd_flops),
                  ("sparse_fwd_bwd", sparse_fwd_bwd, 3.5 * fwd_flops)]
    if reference:
        cases += [("reference_fwd_bwd", reference_fwd_bwd, 3.5 * fwd_flops)]
    qd = torch.randn(1, h, s, nope + rope, device=device, dtype=dtype, generator=g).requires_grad_()
    kd = torch.randn(1, h, s, nope + rope, device=device, dtype=dtype, generator=g).requires_grad_()
    vd = torch.randn(1, h, s, v, device=device, dtype=dtype, generator=g).requires_grad_()
    gd = torch.randn(1, h, s, v, device=device, dtype=dtype, generator=g)

    def dense_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)

    def dense_fwd_bwd():
        F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale).backward(gd)
        qd.grad = kd.grad = vd.grad = None

    dense_flops = 2 * (s * (s + 1) // 2) * h * (nope + rope + v)
    cases.append(("dense_sdpa_causal_fwd", dense_fwd, dense_flops))
    if not fwd_only:
        cases.append(("dense_sdpa_causal_fwd_bwd", dense_fwd_bwd, 3.5 * dense_flops))
    rows = {}
    for name, fn, flops in cases:
        slow = name.startswith("reference")
        r = timed(fn, device, 3 if slow else args.iters, 1 if slow else args.warmup)
        rows[name] = dict(r, flops=flops, tflops=flops / r["ms"] / 1e9)
    if "dense_sdpa_causal_fwd" in rows:
        rows["sparse_fwd"]["speedup_vs_dense_fwd"] = rows["dense_sdpa_causal_fwd"]["ms"] / rows["sparse_fwd"]["ms"]
    if args.sweep and not fwd_only and device.type == "cuda":
        rows["sweep"] = sweep(q.detach(), kv.detach(), ids, grad_out, out, scale, device, args)
    if args.fwd_configs and device.type == "cuda":
        rows["fwd_configs"] = fwd_variants(q.detach(), kv.detach(), ids, scale, fwd_flops, device, args)
    return dict(seq=s, heads=h, topk=k, selected_pairs=n_sel, sparse_q=[1, s, h, d], sparse_kv=[1, s, d],
                dense_qk_head_dim=nope + rope, dense_v_dim=v, chunk_size=chunk, results=rows)


def sweep(q, kv, ids, grad_out, out, scale, device, args) -> list[dict]:
    """Time each block config of the forward and backward kernels directly; record regs / spills."""
    kern = sparse_mla_triton._kernels()
    h = q.shape[2]
    n_sel = int((ids >= 0).sum())
    fwd_flops = 2 * n_sel * h * 1088
    small = h <= 32
    fwd_cfgs = ([(16, 64, 4, 2), (16, 32, 4, 2), (16, 64, 4, 3)] if small else
                [(64, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 1)])
    bwd_cfgs = ([(16, 32, 4, 1), (16, 32, 4, 2), (16, 64, 4, 1)] if small else
                [(64, 64, 8, 1), (64, 32, 8, 1), (64, 16, 8, 2)])
    rows = []
    o, lse = sparse_mla_triton.forward(q, kv, ids, scale, 512)
    gl = torch.zeros_like(lse)
    for kind, cfgs in (("fwd", fwd_cfgs), ("bwd", bwd_cfgs)):
        for spec in cfgs:
            cfg = sparse_mla_triton.KernelConfig(*spec)
            bh, bk, warps, stages = spec[:4]
            row = dict(kind=kind, **vars(cfg))
            try:
                if kind == "fwd":
                    def fn(cfg=cfg):
                        sparse_mla_triton.forward(q, kv, ids, scale, 512, cfg)
                    flops, kernel = fwd_flops, kern.sparse_mla_fwd_kernel
                else:
                    def fn(cfg=cfg):
                        sparse_mla_triton.backward(grad_out, gl, q, kv, ids, o, lse, scale, 512, cfg)
                    flops, kernel = 2.5 * fwd_flops, kern.sparse_mla_bwd_kernel
                r = timed(fn, device, 5, 1)
                row.update(ms=r["ms"], tflops=flops / r["ms"] / 1e9)
                row["compiled"] = compiled_stats(kernel, bh, bk, warps, stages)
            except Exception as err:  # out of shared memory / registers: recorded, not fatal
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            print("sweep", row, flush=True)
            rows.append(row)
    return rows


def parse_config(spec: str) -> sparse_mla_triton.KernelConfig:
    """'BHxBKxWARPSxSTAGES' -> a forward kernel config."""
    bh, bk, warps, stages = (int(x) for x in spec.split("x"))
    return sparse_mla_triton.KernelConfig(bh, bk, warps, stages)


def fwd_variants(q, kv, ids, scale, fwd_flops, device, args) -> list[dict]:
    """Time each --fwd-configs forward and its norm-wise error against float64 on 256 sampled queries."""
    g = torch.Generator(device="cpu").manual_seed(2)
    rows_q = torch.randperm(q.shape[1], generator=g)[:256].sort().values.to(device)
    ref, _ = reference_forward(q[:, rows_q].double(), kv.double(), ids[:, rows_q], scale, 512, 64)
    found = []
    for spec in args.fwd_configs:
        cfg = parse_config(spec)
        row = dict(spec=spec, **vars(cfg))
        try:
            out, _ = sparse_mla_triton.forward(q, kv, ids, scale, 512, cfg)
            row["rel_err_vs_float64"] = ((out[:, rows_q].double() - ref).norm() / ref.norm()).item()
            r = timed(lambda cfg=cfg: sparse_mla_triton.forward(q, kv, ids, scale, 512, cfg), device, args.iters, 1)
            row.update(ms=r["ms"], steps_ms=r["steps_ms"], tflops=fwd_flops / r["ms"] / 1e9)
        except Exception as err:  # out of shared memory / registers: recorded, not fatal
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        print("fwd config", {k: v for k, v in row.items() if k != "steps_ms"}, flush=True)
        found.append(row)
    return found


def compiled_stats(kernel, bh: int, bk: int, warps: int, stages: int) -> list[dict]:
    """Registers / spills / shared memory of the compiled variants matching one config (best effort:
    Triton's cache keys are internal)."""
    found = []
    for cache in kernel.device_caches.values():
        for key, compiled in cache[0].items():
            text = str(key)
            if f"{bh}" in text and f"{bk}" in text:
                meta = getattr(compiled, "metadata", None)
                found.append(dict(n_regs=getattr(compiled, "n_regs", None),
                                  n_spills=getattr(compiled, "n_spills", None),
                                  shared=getattr(meta, "shared", None),
                                  num_warps=getattr(meta, "num_warps", None),
                                  num_stages=getattr(meta, "num_stages", None)))
    return [f for f in found if f["num_warps"] == warps and f["num_stages"] == stages][-1:] or found[-1:]


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cases = []
    for i, spec in enumerate(args.cases):
        seq, heads = (int(x) for x in spec.rstrip("f").split("x"))
        print(f"case {spec}", flush=True)
        try:
            cases.append(sparse_case(args, device, dtype, seq, heads, spec.endswith("f"), i == 0))
        except Exception as err:  # recorded, so the other cases still run
            print(f"case {spec} failed: {type(err).__name__}: {err}", flush=True)
            cases.append(dict(seq=seq, heads=heads, error=f"{type(err).__name__}: {str(err)[:300]}", results={}))
        torch.cuda.empty_cache() if device.type == "cuda" else None
    ceiling = matmul_ceiling(device, dtype, 8192 if device.type == "cuda" else 256, 20 if device.type == "cuda" else 2)
    triton_version = None
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        pass
    return dict(
        benchmark="sparse_mla", device=device_name(device.type == "cuda"), torch=torch.__version__,
        triton=triton_version, cuda=torch.version.cuda, commit=args.commit or git_commit(), dtype=str(dtype),
        smoke=args.smoke, kv_lora_rank=args.kv_lora, rope_dim=args.rope, qk_nope_dim=args.nope,
        v_dim=args.v_dim, iters=args.iters, warmup=args.warmup,
        kernel_configs={f"h{c['heads']}": dict(fwd=vars(sparse_mla_triton.forward_config(c["heads"])),
                                                 bwd=vars(sparse_mla_triton.backward_config(c["heads"])))
                        for c in cases},
        flop_model="fwd: 2*pairs*H*(d_qk+d_v) on valid pairs; bwd: 2.5x fwd; fwd+bwd: 3.5x; dense pairs = "
                   "causal S(S+1)/2 with d_qk=nope+rope, d_v=v",
        ceiling_bf16_matmul_tflops=ceiling, cases=cases)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (the reference path)")
    p.add_argument("--cases", nargs="+", default=["16384x64", "16384x16", "65536x64f"],
                   help="SEQxHEADS, a trailing f: forward only")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--kv-lora", dest="kv_lora", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--nope", type=int, default=128)
    p.add_argument("--v-dim", dest="v_dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reference", action="store_true", help="also time the PyTorch reference at the first case")
    p.add_argument("--sweep", action="store_true", help="time the kernels' block configs at the first case")
    p.add_argument("--fwd-configs", dest="fwd_configs", nargs="*", default=[],
                   help="forward configs BHxBKxWARPSxSTAGES timed at every case, with their float64 error")
    p.add_argument("--commit", default=None, help="git commit to record (the GPU machine's copy has no .git)")
    args = p.parse_args()
    if args.smoke:
        args.cases, args.topk = ["64x4"], 16
        args.kv_lora, args.rope, args.nope, args.v_dim = 32, 8, 16, 16
        args.iters, args.warmup = 2, 1
    result = run(args)
    print(f"bf16 matmul ceiling {result['ceiling_bf16_matmul_tflops']:.0f} TFLOP/s")
    print(f"{'seq':>6s} {'H':>4s} {'case':28s} {'ms':>10s} {'TFLOP/s':>9s} {'peak GiB':>9s}")
    for c in result["cases"]:
        for name, r in c["results"].items():
            if name in ("sweep", "fwd_configs"):
                continue
            peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
            print(f"{c['seq']:6d} {c['heads']:4d} {name:28s} {r['ms']:10.2f} {r['tflops']:9.3f} {peak:>9s}")
        speedup = c["results"].get("sparse_fwd", {}).get("speedup_vs_dense_fwd")
        if speedup is not None:
            print(f"{'':12s} sparse fwd speedup vs dense SDPA fwd: {speedup:.2f}x")
    write_report(args.out, result)


if __name__ == "__main__":
    main()
