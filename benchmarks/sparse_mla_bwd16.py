"""The 16-head sparse-MLA backward's kernel configs on the GPU: float64 errors at small shapes, then time.

    python benchmarks/sparse_mla_bwd16.py --out benchmarks/results/sparse_mla_bwd16.json --commit SHA

Each `--configs` entry BKxWARPSxSTAGES is a one-walk, [keys, columns] dkv-tile backward config
(block_h 16). Per config: norm-wise errors of dq and dkv against the float64 reference at small
shapes (odd lengths, 16 and 12 heads, -1 padding and holes, an out-of-range id, an empty query), the
deterministic int64 dkv mode's errors and run-to-run bitwise equality, then at SEQ x HEADS (top-k
2048, ascending random causal ids as in benchmarks/sparse_mla.py) the error against the first config
and every timed call (CUDA events, after warm-up). The forward is the Triton kernel at a fixed config
(FWD), so only the backward varies. FLOPs as sparse_mla.py counts them: backward 2.5 x 2 x pairs x
heads x (576 + 512). The compiled kernels' registers and spills are listed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from spartron.layers.attention import sparse_mla_triton
from spartron.layers.attention.sparse_mla import reference_backward, reference_forward

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import call_times_ms, device_name, write_report  # noqa: E402
from sparse_mla import causal_random_ids, sorted_ids  # noqa: E402

FWD = sparse_mla_triton.KernelConfig(16, 64, 4, 2)  # the Triton forward, fixed: only the backward varies
SMALL = [(1, 333, 333, 16, 100), (2, 257, 300, 12, 200), (1, 190, 2100, 16, 2048)]  # (b, s_q, s_kv, h, k)


def parse(spec: str) -> sparse_mla_triton.KernelConfig:
    """'32x4x3' -> KernelConfig(16, BK=32, WARPS=4, STAGES=3, dkv_key_rows=True)."""
    bk, warps, stages = (int(x) for x in spec.split("x"))
    return sparse_mla_triton.KernelConfig(16, bk, warps, stages, dkv_key_rows=True)


def small_ids(b, s_q, s_kv, k, g):
    t = torch.arange(s_q, device="cuda")[:, None] + (s_kv - s_q)
    scores = torch.rand(b, s_q, s_kv, device="cuda", generator=g)
    scores = scores.masked_fill(torch.arange(s_kv, device="cuda")[None, None] > t, float("-inf"))
    vals, ids = scores.topk(min(k, s_kv), dim=-1)
    ids = torch.where(torch.isfinite(vals), ids, -1).to(torch.int32)
    ids = torch.where(torch.rand(ids.shape, device="cuda", generator=g) < 0.05, -1, ids)
    ids[0, 3, 0] = s_kv  # out of range: skipped
    ids[-1, s_q // 2] = -1  # an empty query
    return ids


def small_errors(cfg) -> list[dict]:
    rows = []
    for i, (b, s_q, s_kv, h, k) in enumerate(SMALL):
        g = torch.Generator(device="cuda").manual_seed(11 + i)
        q = torch.randn(b, s_q, h, 576, device="cuda", generator=g).bfloat16()
        kv = torch.randn(b, s_kv, 576, device="cuda", generator=g).bfloat16()
        ids = small_ids(b, s_q, s_kv, k, g)
        go = torch.randn(b, s_q, h, 512, device="cuda", generator=g).bfloat16()
        gl = torch.randn(b, s_q, h, device="cuda", generator=g)
        scale = 192 ** -0.5
        out, lse = sparse_mla_triton.forward(q, kv, ids, scale, 512, FWD)
        _, ref_lse = reference_forward(q.double(), kv.double(), ids, scale, 512, 64)
        ref_dq, ref_dkv = reference_backward(go.double(), gl.double(), q.double(), kv.double(), ids, ref_lse, scale,
                                             512, 64)

        def rel(x, ref):
            return ((x.double() - ref).norm() / ref.norm()).item()
        row = dict(shape=[b, s_q, s_kv, h, k])
        dq, dkv = sparse_mla_triton.backward(go, gl, q, kv, ids, out, lse, scale, 512, cfg)
        row.update(dq=rel(dq, ref_dq), dkv=rel(dkv, ref_dkv), finite=bool(dq.isfinite().all() and dkv.isfinite().all()),
                   empty_query_dq_zero=bool((dq[-1, s_q // 2] == 0).all()))
        d1 = sparse_mla_triton.backward(go, gl, q, kv, ids, out, lse, scale, 512, cfg, deterministic=True)
        d2 = sparse_mla_triton.backward(go, gl, q, kv, ids, out, lse, scale, 512, cfg, deterministic=True)
        row.update(det_dq=rel(d1[0], ref_dq), det_dkv=rel(d1[1], ref_dkv),
                   det_bitwise_equal=bool(torch.equal(d1[0], d2[0]) and torch.equal(d1[1], d2[1])))
        row["ok"] = bool(row["finite"] and row["empty_query_dq_zero"] and row["det_bitwise_equal"]
                         and max(row["dq"], row["dkv"], row["det_dq"], row["det_dkv"]) <= 1e-2)
        rows.append(row)
    return rows


def compiled(kernel) -> list[dict]:
    found = []
    for cache in kernel.device_caches.values():
        for c in cache[0].values():
            m = c.metadata
            consts = getattr(getattr(c, "src", None), "constants", {})  # keyed by argument position
            found.append(dict(n_regs=c.n_regs, n_spills=c.n_spills, shared=m.shared, num_warps=m.num_warps,
                              num_stages=m.num_stages, constants={str(k): str(v) for k, v in consts.items()}))
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--configs", nargs="+", default=["32x4x3", "32x4x2", "16x4x3"])
    p.add_argument("--commit", default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    s, h = args.seq, args.heads
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, s, h, 576, device=device, dtype=torch.bfloat16, generator=g)
    kv = torch.randn(1, s, 576, device=device, dtype=torch.bfloat16, generator=g)
    ids = sorted_ids(causal_random_ids(s, args.topk, device))
    go = torch.randn(1, s, h, 512, device=device, dtype=torch.bfloat16, generator=g)
    scale = 192 ** -0.5
    n_sel = int((ids >= 0).sum())
    flops = 2.5 * 2 * n_sel * h * 1088
    out, lse = sparse_mla_triton.forward(q, kv, ids, scale, 512, FWD)
    gl = torch.zeros_like(lse)
    rows, first = [], None
    for spec in args.configs:
        cfg = parse(spec)
        row = dict(spec=spec, config=vars(cfg))
        try:
            row["small_errors_vs_float64"] = small_errors(cfg)
            row["small_ok"] = all(r["ok"] for r in row["small_errors_vs_float64"])

            def fn(cfg=cfg):
                return sparse_mla_triton.backward(go, gl, q, kv, ids, out, lse, scale, 512, cfg)
            dq, dkv = fn()
            if first is None:
                first = (dq, dkv)
            row["rel_err_vs_first_config"] = {
                n: ((x.double() - r.double()).norm() / r.double().norm()).item()
                for n, x, r in (("dq", dq, first[0]), ("dkv", dkv, first[1]))}
            del dq, dkv
            for _ in range(args.warmup):
                fn()
            times = call_times_ms(fn, args.iters, device)
            ms = sorted(times)[len(times) // 2]
            row.update(ms=ms, steps_ms=times, tflops=flops / ms / 1e9)
        except Exception as err:  # a config that fails to compile or run is recorded, not fatal
            row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
        print(json.dumps({k: v for k, v in row.items() if k not in ("steps_ms", "small_errors_vs_float64")}),
              flush=True)
        rows.append(row)
    report = dict(benchmark="sparse_mla_bwd16", device=device_name(True), torch=torch.__version__,
                  triton=__import__("triton").__version__, cuda=torch.version.cuda, commit=args.commit, seq=s,
                  heads=h, topk=args.topk, selected_pairs=n_sel, flops=flops, iters=args.iters,
                  warmup=args.warmup, default_config=vars(sparse_mla_triton.backward_config(h)),
                  results=rows, compiled=compiled(sparse_mla_triton._kernels().sparse_mla_bwd_kernel))
    write_report(args.out, report)


if __name__ == "__main__":
    main()
