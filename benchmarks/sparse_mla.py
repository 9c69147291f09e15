"""Sparse MLA on the GPU: the Triton kernels behind `spartron::sparse_mla` against dense causal SDPA.

    python benchmarks/sparse_mla.py --out benchmarks/results/sparse_mla/sparse_mla_triton_SHA.json   # CUDA, V3.2 shapes
    python benchmarks/sparse_mla.py --smoke                                           # tiny, CPU, seconds

Sparse: absorbed MLA form, q [1, S, H, kv_lora + rope], kv [1, S, kv_lora + rope], random causal
top-k ids (unique per query, ascending as the indexer returns them, -1 padding last for early
queries), value dim kv_lora. The backward is also
timed with the deterministic dkv (model.dsa.deterministic_dkv). Dense: the per-head
form the dense MLA layer runs, SDPA causal with q/k head dim nope + rope and v head dim v.
Cases: each `--cases` entry SEQxHEADS (default 16k x 16 and 16k x 64 forward, backward and
forward+backward; 64k x 64 forward only) with dense SDPA at the same length and heads; `--reference`
adds the PyTorch reference op (the CPU path; slow) at the first case. The bf16 matmul ceiling is
measured in the same run. FLOPs count valid (query, key) pairs: forward 2 x pairs x H x (d_qk + d_v),
backward 2.5x that. Every timed step is recorded (CUDA events, after warm-up) with the median.
`--sweep` (CUDA) adds, at every case: the default configs on ids in score order, the gather alone
(the bandwidth bound of the kernels at this head count), and each kernel config of --sweep-configs
(default DEFAULT_SWEEP; forward ones only at forward-only cases) with its float64 errors at a small
shape and its time.
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
from common import call_times_ms, device_name, fill_attention_shape, write_report  # noqa: E402


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
    score_order = causal_random_ids(s, k, device)
    ids = sorted_ids(score_order)  # ascending, as the indexer returns them (indexer_topk.topk_ids)
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
    if args.sweep and device.type == "cuda":
        timings = [("sparse_fwd_score_order_ids", lambda: sparse_mla_triton.forward(
            q.detach(), kv.detach(), score_order, scale, lat), fwd_flops)]
        rows["sweep"] = sweep(q.detach(), kv.detach(), ids, grad_out, out, scale, device, args, fwd_only)
        if not fwd_only:
            timings.append(("sparse_bwd_score_order_ids", lambda: sparse_mla_triton.backward(
                grad_out, zero_lse, q.detach(), kv.detach(), score_order, out, lse, scale, lat), 2.5 * fwd_flops))
        for name, fn, flops in timings:
            r = timed(fn, device, args.sweep_iters, 1)
            rows[name] = dict(r, flops=flops, tflops=flops / r["ms"] / 1e9)
        rows["gather_only"] = gather_ceiling(kv.detach(), score_order, device, args)
    return dict(seq=s, heads=h, topk=k, selected_pairs=n_sel, sparse_q=[1, s, h, d], sparse_kv=[1, s, d],
                dense_qk_head_dim=nope + rope, dense_v_dim=v, chunk_size=chunk, results=rows)


DEFAULT_SWEEP = {  # per head block: configs timed by --sweep (kind:BHxBKxWARPSxSTAGES[xWALKSxSTAGES2][:flags])
    64: ["fwd:64x64x8x2", "bwd:64x64x8x1"],  # the Triton forward and the one-walk backward: the defaults before
    16: ["bwd:16x32x4x1", "bwd:16x32x4x2:keyrows", "bwd:16x32x4x4:keyrows", "fwd:16x64x4x3", "fwd:16x32x4x3",
         "fwd:16x64x4x4"],  # the backward before [keys, columns] dkv tiles; pipeline depths around the defaults
}
# The exploration of these kernels' configs: benchmarks/results/archive/sparse_mla/sparse_mla_sweep_c944a37.json ran
# ["bwd:64x32x8x2x3x2", "fwd:64x64x8x2:gluon", "fwd:64x32x8x3:gluon", "bwd:64x64x8x1x3x2",
#  "fwd:64x64x8x2:gluon:late", "fwd:64x32x8x3:gluon:late", "bwd:64x32x8x2x3x1"] at 64 heads and
# ["bwd:16x32x4x2x3x2", "bwd:16x64x4x2x3x2"] at 16.


def parse_spec(spec: str) -> tuple[str, sparse_mla_triton.KernelConfig]:
    """'fwd:64x64x8x2[:gluon[:late]]' or 'bwd:64x32x8x2x3x2[:keyrows]' -> (kind, config)."""
    kind, dims, *flags = spec.split(":")
    unknown = set(flags) - {"gluon", "late", "keyrows"}
    if unknown:
        raise ValueError(f"--sweep-configs {spec!r}: unknown flag(s) {sorted(unknown)}; known: gluon, late, keyrows")
    cfg = sparse_mla_triton.KernelConfig(*(int(x) for x in dims.split("x")), gluon="gluon" in flags,
                                         gather_early="late" not in flags, dkv_key_rows="keyrows" in flags)
    return kind, cfg


def small_case_errors(kind: str, cfg, h: int, device) -> dict:
    """Norm-wise errors against float64 at a small shape (top-k 2048 as timed, so the same compiled
    kernel) with holes, an out-of-range id and an empty query."""
    g = torch.Generator(device=device).manual_seed(5)
    b, s_q, s_kv, k = 2, 200, 2400, 2048
    q = torch.randn(b, s_q, h, 576, device=device, generator=g).bfloat16()
    kv = torch.randn(b, s_kv, 576, device=device, generator=g).bfloat16()
    ids = torch.cat([causal_random_ids(s_kv, k, device)[:, -s_q:] for _ in range(b)])
    ids = torch.where(torch.rand(ids.shape, device=device, generator=g) < 0.05, -1, ids)
    ids[0, 3, 0] = s_kv
    ids[1, 7] = -1
    scale = 192 ** -0.5
    ref_out, ref_lse = reference_forward(q.double(), kv.double(), ids, scale, 512, 64)
    fin = torch.isfinite(ref_lse)

    def rel(x, ref):
        return ((x.double() - ref).norm() / ref.norm()).item()
    if kind == "fwd":
        out, lse = sparse_mla_triton.forward(q, kv, ids, scale, 512, cfg)
        return dict(out=rel(out, ref_out), lse=rel(lse[fin], ref_lse[fin]),
                    empty_ok=bool(torch.isneginf(lse[1, 7]).all() and (out[1, 7] == 0).all()))
    out, lse = sparse_mla_triton.forward(q, kv, ids, scale, 512)
    go = torch.randn(b, s_q, h, 512, device=device, generator=g).bfloat16()
    gl = torch.zeros(b, s_q, h, device=device)
    dq, dkv = sparse_mla_triton.backward(go, gl, q, kv, ids, out, lse, scale, 512, cfg)
    ref_dq, ref_dkv = reference_backward(go.double(), gl.double(), q.double(), kv.double(), ids, ref_lse, scale,
                                         512, 64)
    return dict(dq=rel(dq, ref_dq), dkv=rel(dkv, ref_dkv),
                finite=bool(torch.isfinite(dq).all() and torch.isfinite(dkv).all()))


def sweep(q, kv, ids, grad_out, out, scale, device, args, fwd_only: bool = False) -> list[dict]:
    """Each config of --sweep-configs (or DEFAULT_SWEEP for this head count; at a forward-only case
    its forward configs only): its float64 errors at a small shape, then its time at this case;
    registers / spills of the Triton kernels where found."""
    h = q.shape[2]
    n_sel = int((ids >= 0).sum())
    fwd_flops = 2 * n_sel * h * 1088
    specs = args.sweep_configs or DEFAULT_SWEEP[64 if h > 32 else 16]
    specs = [spec for spec in specs if spec.startswith("fwd:") or not fwd_only]
    rows = []
    o, lse = sparse_mla_triton.forward(q, kv, ids, scale, 512)
    gl = torch.zeros_like(lse)
    for spec in specs:
        kind, cfg = parse_spec(spec)
        row = dict(spec=spec, kind=kind, **vars(cfg))
        try:
            row["errors_vs_float64"] = small_case_errors(kind, cfg, h, device)
            if kind == "fwd":
                def fn(cfg=cfg):
                    sparse_mla_triton.forward(q, kv, ids, scale, 512, cfg)
                flops = fwd_flops
            else:
                def fn(cfg=cfg):
                    sparse_mla_triton.backward(grad_out, gl, q, kv, ids, o, lse, scale, 512, cfg)
                flops = 2.5 * fwd_flops
            r = timed(fn, device, args.sweep_iters, 1)
            row.update(ms=r["ms"], steps_ms=r["steps_ms"], tflops=flops / r["ms"] / 1e9)
            if not cfg.gluon:
                kern = sparse_mla_triton._kernels()
                kernel = kern.sparse_mla_fwd_kernel if kind == "fwd" else kern.sparse_mla_bwd_kernel
                row["compiled"] = compiled_stats(kernel, cfg.block_h, cfg.block_k, cfg.num_warps, cfg.num_stages)
        except Exception as err:  # out of shared memory / registers, or a wrong result: recorded, not fatal
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        print("sweep", {k: v for k, v in row.items() if k != "steps_ms"}, flush=True)
        rows.append(row)
    return rows


def sorted_ids(ids: torch.Tensor) -> torch.Tensor:
    """Each row's ids ascending, the -1 padding last (same sets, so the same results up to rounding)."""
    big = torch.iinfo(torch.int32).max
    srt = torch.where(ids < 0, big, ids).sort(-1).values
    return torch.where(srt == big, -1, srt)


def gather_ceiling(kv, ids, device, args) -> dict:
    """The kernels' gather alone: every selected kv row read once per query (8 rows at a time, small
    programs so many are resident per SM) and summed; its bandwidth times 2 x heads x 1088 FLOP per
    1152-byte row estimates the attention kernels' bandwidth bound. (A first form, one 8-warp program
    per query summing 64 rows at a time, reached 2.39 TB/s in sparse_mla_sweep_c944a37.json, below the
    5.1 TB/s the 16-head forward itself moves: latency-bound, no bound. This form reached 8.8 TB/s at
    16k, sparse_mla_triton_9d26062.json.) `ids` in score order; they are also timed sorted."""
    kern = gather_kernel()
    s, k = ids.shape[1], ids.shape[2]
    out = torch.empty(s, 576, device=device, dtype=torch.float32)
    n_sel = int((ids >= 0).sum())
    found = {}
    for name, idv in (("random_order", ids), ("sorted", sorted_ids(ids))):
        idc = idv[0].contiguous()
        r = timed(lambda idc=idc: kern[(s,)](kv, idc, out, k, BK=8, num_warps=4), device, args.sweep_iters, 1)
        gbs = n_sel * 1152 / r["ms"] / 1e6
        found[name] = dict(ms=r["ms"], steps_ms=r["steps_ms"], gb_per_s=gbs,
                           tflops_bound_16_heads=gbs * 2 * 16 * 1088 / 1152 / 1e3,
                           tflops_bound_64_heads=gbs * 2 * 64 * 1088 / 1152 / 1e3)
        print("gather", name, {k_: v for k_, v in found[name].items() if k_ != "steps_ms"}, flush=True)
    return found


def gather_kernel():
    """A Triton kernel that reads each query's selected kv rows, BK at a time, and sums them: built on
    first use, so CPU runs never import triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def gather_sum(kv_ptr, ids_ptr, out_ptr, topk, BK: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, 512)
        colr = tl.arange(0, 64)
        acc = tl.zeros([BK, 512], tl.float32)
        accr = tl.zeros([BK, 64], tl.float32)
        for k0 in range(0, topk, BK):
            ids = tl.load(ids_ptr + tok * topk + k0 + tl.arange(0, BK))
            valid = ids >= 0
            rows = kv_ptr + tl.where(valid, ids, 0).to(tl.int64)[:, None] * 576
            acc += tl.load(rows + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            accr += tl.load(rows + 512 + colr[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        tl.store(out_ptr + tok * 576 + cols, tl.sum(acc, 0))
        tl.store(out_ptr + tok * 576 + 512 + colr, tl.sum(accr, 0))
    return gather_sum


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
    shape_help = "(default: configs/dsa-12l.toml's, --smoke: configs/tiny.toml's)"
    p.add_argument("--topk", type=int, default=None, help=f"model.dsa.index_topk {shape_help}")
    p.add_argument("--kv-lora", dest="kv_lora", type=int, default=None, help=f"model.mla.kv_lora_rank {shape_help}")
    p.add_argument("--rope", type=int, default=None, help=f"model.mla.qk_rope_head_dim {shape_help}")
    p.add_argument("--nope", type=int, default=None, help=f"model.mla.qk_nope_head_dim {shape_help}")
    p.add_argument("--v-dim", dest="v_dim", type=int, default=None, help=f"model.mla.v_head_dim {shape_help}")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reference", action="store_true", help="also time the PyTorch reference at the first case")
    p.add_argument("--sweep", action="store_true",
                   help="at every case: time kernel configs (with their float64 errors at a small shape), "
                        "ids in score order (random) instead of ascending, and the gather alone")
    p.add_argument("--sweep-configs", dest="sweep_configs", nargs="*", default=[],
                   help="kind:BHxBKxWARPSxSTAGES[xWALKSxSTAGES2][:gluon[:late]][:keyrows] (default: DEFAULT_SWEEP)")
    p.add_argument("--sweep-iters", dest="sweep_iters", type=int, default=10)
    p.add_argument("--commit", default=None, help="git commit to record (the GPU machine's copy has no .git)")
    args = p.parse_args()
    if args.smoke:
        args.cases, args.iters, args.warmup = ["64x4"], 2, 1
    fill_attention_shape(args, args.smoke, {"topk": "dsa.index_topk", "kv_lora": "mla.kv_lora_rank",
                                            "rope": "mla.qk_rope_head_dim", "nope": "mla.qk_nope_head_dim",
                                            "v_dim": "mla.v_head_dim"})
    result = run(args)
    print(f"bf16 matmul ceiling {result['ceiling_bf16_matmul_tflops']:.0f} TFLOP/s")
    print(f"{'seq':>6s} {'H':>4s} {'case':28s} {'ms':>10s} {'TFLOP/s':>9s} {'peak GiB':>9s}")
    for c in result["cases"]:
        for name, r in c["results"].items():
            if name in ("sweep", "gather_only"):
                continue
            peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
            print(f"{c['seq']:6d} {c['heads']:4d} {name:28s} {r['ms']:10.2f} {r['tflops']:9.3f} {peak:>9s}")
        speedup = c["results"].get("sparse_fwd", {}).get("speedup_vs_dense_fwd")
        if speedup is not None:
            print(f"{'':12s} sparse fwd speedup vs dense SDPA fwd: {speedup:.2f}x")
    write_report(args.out, result)


if __name__ == "__main__":
    main()
