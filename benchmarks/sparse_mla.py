"""Baseline for the DSA kernel issue: the reference `spartron::sparse_mla` op vs dense causal SDPA.

    python benchmarks/sparse_mla.py --out benchmarks/results/sparse_mla.json   # CUDA, V3.2 shapes
    python benchmarks/sparse_mla.py --smoke                                    # tiny, CPU, seconds

Sparse: absorbed MLA form, q [1, S, H, kv_lora + rope], kv [1, S, kv_lora + rope], random causal
top-k ids (unique per query, -1 padding for early queries), value dim kv_lora. Dense: the per-head
form the dense MLA layer runs, SDPA causal with q/k head dim nope + rope and v head dim v.
Prints a table and writes JSON (device, torch version, git commit, shapes, ms, TFLOP/s, peak GiB).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from spartron.runtime.metrics import git_commit
from spartron.runtime.ops.sparse_mla import default_chunk_size, sparse_mla

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also under `python -m benchmarks.NAME`
from common import device_name, write_report  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0


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


def timed(fn, device, iters: int, warmup: int) -> tuple[float, float]:
    """(median ms, peak allocated GiB above the pre-call baseline)."""
    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else None
    return sorted(times)[len(times) // 2], peak


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    s, h, k = args.seq, args.heads, args.topk
    lat, rope, nope, v = args.kv_lora, args.rope, args.nope, args.v_dim
    d = lat + rope
    scale = (nope + rope) ** -0.5
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, s, h, d, device=device, dtype=dtype, generator=g).requires_grad_()
    kv = torch.randn(1, s, d, device=device, dtype=dtype, generator=g).requires_grad_()
    ids = causal_random_ids(s, k, device)
    grad_out = torch.randn(1, s, h, lat, device=device, dtype=dtype, generator=g)
    chunk = default_chunk_size(q, kv, ids)

    def sparse_fwd():
        with torch.no_grad():
            sparse_mla(q, kv, ids, scale, lat)

    def sparse_fwd_bwd():
        out, _ = sparse_mla(q, kv, ids, scale, lat)
        out.backward(grad_out)
        q.grad = kv.grad = None

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

    n_sel = int((ids >= 0).sum())  # selected (query, key) pairs
    sparse_flops = 2 * n_sel * h * (d + lat)
    dense_flops = 2 * (s * (s + 1) // 2) * h * (nope + rope + v)
    rows = {}
    for name, fn, flops in [("sparse_mla_fwd", sparse_fwd, sparse_flops),
                            ("sparse_mla_fwd_bwd", sparse_fwd_bwd, 3.5 * sparse_flops),
                            ("dense_sdpa_causal_fwd", dense_fwd, dense_flops),
                            ("dense_sdpa_causal_fwd_bwd", dense_fwd_bwd, 3.5 * dense_flops)]:
        ms, peak = timed(fn, device, args.iters, args.warmup)
        rows[name] = dict(ms=ms, tflops=flops / ms / 1e9, peak_gib=peak,
                          fraction_of_bf16_peak=(flops / ms / 1e9) / H200_BF16_DENSE_TFLOPS)
    commit = git_commit()
    return dict(
        benchmark="sparse_mla", device=device_name(device.type == "cuda"),
        torch=torch.__version__, commit=commit, dtype=str(dtype), smoke=args.smoke,
        shapes=dict(seq=s, heads=h, topk=k, kv_lora_rank=lat, rope_dim=rope, qk_nope_dim=nope, v_dim=v,
                    sparse_q=[1, s, h, d], sparse_kv=[1, s, d], dense_qk_head_dim=nope + rope,
                    chunk_size=chunk),
        flop_model="fwd: 2*pairs*H*(d_qk+d_v); fwd+bwd: 3.5x fwd; dense pairs = causal S(S+1)/2",
        ceiling_tflops=H200_BF16_DENSE_TFLOPS, results=rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--kv-lora", dest="kv_lora", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--nope", type=int, default=128)
    p.add_argument("--v-dim", dest="v_dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    if args.smoke:
        args.seq, args.heads, args.topk = 64, 4, 16
        args.kv_lora, args.rope, args.nope, args.v_dim = 32, 8, 16, 16
        args.iters, args.warmup = 2, 1
    result = run(args)
    print(f"{'case':28s} {'ms':>10s} {'TFLOP/s':>9s} {'peak GiB':>9s}")
    for name, r in result["results"].items():
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"{name:28s} {r['ms']:10.2f} {r['tflops']:9.3f} {peak:>9s}")
    write_report(args.out, result)


if __name__ == "__main__":
    main()
