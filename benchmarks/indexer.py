"""The lightning indexer on the GPU: `spartron::indexer_topk` (Triton scores + Triton top-k) timed and checked.

    python benchmarks/indexer.py --out benchmarks/results/indexer/indexer_SHA.json --commit SHA   # CUDA
    python benchmarks/indexer.py --smoke                                              # tiny, CPU (reference)

Per case SEQ (default 16k and 64k; 32 index heads x 128, top-k 2048, batch 1, causal): the score
kernel alone (every chunk, as the op runs them) in bf16 and fp8 (operands quantised beforehand), the
fp8 quantisation alone (the Triton pass and the PyTorch formula), the top-k kernel alone on the last
chunk's scores (the fullest rows; at 16k the only chunk), and the whole op in bf16 and fp8, every timed
step recorded, and (`_x10`, first case) ten back-to-back calls of the op per timed step. FLOPs: 2 x visible
(query, key) pairs x heads x head dim (the MMA work; ReLU, weights and top-k are not counted), against
the bf16 matmul ceiling measured in the same run. Agreement on sampled queries: the op's ids against a
float64 oracle (set equal except keys within 1e-3 relative of the k-th score; fp8 against the oracle
of its quantised operands) and fp8's ids against bf16's (fraction of shared ids). First case on CUDA:
the host's enqueue time of a call and of its parts (a single call's device time waits on it), and a
torch.profiler trace of three single calls (each kernel's ms, the idle time before it, the host-start to
first-kernel time). `--sweep` also
times top-k settings at each case (`--tile-sweep`: score tiles too, first case) and the whole op with
the fastest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py / sparse_mla.py, also under -m
from common import device_name, fill_attention_shape, write_report  # noqa: E402
from sparse_mla import git_commit, matmul_ceiling, timed  # noqa: E402

from spartron.layers.attention.indexer_fp8 import fp8_operands  # noqa: E402
from spartron.layers.attention.indexer_topk import index_scores, indexer_topk  # noqa: E402


def sampled_rows(s: int, n: int, device) -> torch.Tensor:
    """n query rows spread over the sequence, the last one included (it sees every key)."""
    g = torch.Generator(device="cpu").manual_seed(5)
    rows = torch.randperm(s, generator=g)[: n - 1]
    return torch.cat([rows, torch.tensor([s - 1])]).unique().to(device)


def oracle_mismatch(q, w, k, rows, ids, topk: int, rel_tol: float = 1e-3, k_scale=None) -> dict:
    """Float64 scores of the sampled rows; the op's ids may differ from the exact top-k only in keys whose
    exact score lies within rel_tol (relative) of the k-th score. k_scale: per-key factor (fp8 operands)."""
    pos = torch.arange(k.shape[1], device=k.device)
    bad, checked = 0, 0
    for r in rows.tolist():
        vis = (pos <= r)[None]
        exact = index_scores(q[:, r:r + 1].double(), w[:, r:r + 1].double(), k.double(), vis)[0, 0]
        if k_scale is not None:
            exact = exact * k_scale[0].double()
        kk = min(topk, r + 1)
        top = exact.topk(kk)
        kth = top.values[-1]
        got = ids[0, r][ids[0, r] >= 0].long()
        want = top.indices
        diff = torch.cat([got[~torch.isin(got, want)], want[~torch.isin(want, got)]])
        near = (exact[diff] - kth).abs() <= rel_tol * kth.abs()
        bad += int((~near).sum()) + abs(got.numel() - kk)
        checked += kk
    return dict(rows=rows.numel(), ids_checked=checked, ids_outside_tolerance=bad)


SWEEP = [  # score tile configs (block_m, block_n, num_warps, num_stages, head_pairs)
    (64, 128, 4, 2, True), (64, 128, 4, 3, False),
]


TOPK_SWEEP = [  # top-k selection settings over the default config (IndexerKernelConfig field: value)
    {}, dict(topk_prefetch=False),
]


def host_enqueue(fn, n: int = 20) -> dict:
    """Host ms of single calls of `fn` with the device idle (synchronised before each, not after): the
    host's time to enqueue the call's work, which a single call's device time waits on before its
    first kernel."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return dict(ms=sorted(times)[n // 2], steps_ms=times)


def kernel_profile(fn, path: Path, calls: int = 3) -> dict:
    """torch.profiler over `calls` single calls: per call, the ms from the call's start on the host to
    its first kernel's start on the device, and its kernels in order (name, ms, ms idle before it)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            with record_function(f"indexer_call_{i}"):
                fn()
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())["traceEvents"]
    marks = sorted((e["ts"], e["name"]) for e in trace if str(e.get("name", "")).startswith("indexer_call_")
                   and e.get("ph") == "X")
    kernels = sorted((e["ts"], e["dur"], e["name"]) for e in trace if e.get("cat") == "kernel")
    out = []
    for i, (t0, _) in enumerate(marks):
        t1 = marks[i + 1][0] if i + 1 < len(marks) else float("inf")
        ks = [k for k in kernels if t0 <= k[0] < t1]
        if not ks:
            continue
        rows, end = [], ks[0][0]
        for ts, dur, name in ks:
            rows.append(dict(name=name[:60], ms=dur / 1e3, idle_before_ms=max(0.0, ts - end) / 1e3))
            end = max(end, ts + dur)
        out.append(dict(host_start_to_first_kernel_ms=(ks[0][0] - t0) / 1e3, device_span_ms=(end - ks[0][0]) / 1e3,
                        kernels=rows))
    return dict(calls=out)


def case(args, device, s: int, sweep: bool, first: bool, save=lambda partial: None) -> dict:
    h, d, topk = args.heads, args.dim, args.topk
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, s, h, d, device=device, generator=g).to(dtype)
    k = torch.randn(1, s, d, device=device, generator=g).to(dtype)
    w = torch.randn(1, s, h, device=device, generator=g).to(dtype) * (h * d) ** -0.5
    pos = torch.arange(s, device=device)
    pairs = s * (s + 1) // 2
    flops = 2 * pairs * h * d
    rows = {}

    def full(fp8=False):
        return indexer_topk(q, w, k, pos, pos, topk, fp8)

    steps = [("indexer_topk_bf16", lambda: full(False), flops)]
    if device.type == "cuda":
        from spartron.layers.attention import indexer_triton as it
        cfg = it.IndexerKernelConfig()
        chunk = it.chunk_rows(1, s, s, cfg.block_m)
        buf = torch.empty(chunk * it.padded(s), device=device)
        w32, qpos = w.float(), pos.to(torch.int32)
        q8, w8, k8, ks = it.quantize_fp8(q, w, k)
        ids_buf = torch.empty(1, s, min(topk, s), dtype=torch.int32, device=device)

        def chunk_view(c0, c):  # as the op lays a chunk out: rows of padded(S_kv)
            return buf[: c * it.padded(s)].view(1, c, it.padded(s))[..., :s]

        def scores_only(fp8=False, tile=cfg):
            for c0 in range(0, s, chunk):
                c = min(chunk, s - c0)
                if fp8:
                    it.scores(q8, w8, k8, ks, qpos, qpos, c0, c, chunk_view(c0, c), None, True, tile)
                else:
                    it.scores(q, w32, k, None, qpos, qpos, c0, c, chunk_view(c0, c), None, True, tile)

        last = (s - 1) // chunk * chunk

        def topk_only(sel=cfg):  # the last chunk (its scores are in buf after scores_only)
            return it.select(chunk_view(last, s - last), ids_buf, qpos, last, 0, s - last, None, True, sel)

        steps = [("scores_kernel_bf16", scores_only, flops), ("select_topk_last_chunk", topk_only, 0),
                 ("scores_kernel_fp8", lambda: scores_only(True), flops),
                 ("quantize_fp8_triton", lambda: it.quantize_fp8(q, w, k), 0),
                 ("quantize_fp8_torch", lambda: fp8_operands(q, w, k), 0)] + steps
        steps.append(("indexer_topk_fp8", lambda: full(True), flops))
        if first:  # ten back-to-back calls per timed step (no host sync between them), the first case only
            steps.append(("indexer_topk_bf16_x10", lambda: [it.indexer_topk(q, w, k, pos, pos, topk, False, None, cfg)
                                                             for _ in range(10)], 10 * flops))
            steps.append(("indexer_topk_fp8_x10", lambda: [it.indexer_topk(q, w, k, pos, pos, topk, True, None, cfg)
                                                            for _ in range(10)], 10 * flops))
        rows["chunk_rows"] = chunk
        rows["config"] = dataclasses.asdict(cfg)
        if sweep:
            scores_only()
            radix = []
            for over in TOPK_SWEEP:
                sel = dataclasses.replace(cfg, **over)
                entry = {k: v for k, v in dataclasses.asdict(sel).items() if k.startswith("topk_")}
                try:
                    r = timed(lambda sel=sel: topk_only(sel), device, args.iters, args.warmup)
                    entry.update(ms=r["ms"], steps_ms=r["steps_ms"])
                    handles = topk_only(sel)  # bracket, search, write, whole-row fallback launches
                    entry.update(n_regs=[getattr(h, "n_regs", None) for h in handles],
                                 n_spills=[getattr(h, "n_spills", None) for h in handles])
                except Exception as e:  # noqa: BLE001 - a config the compiler refuses is recorded
                    entry["error"] = repr(e)[:300]
                print("topk sweep", entry, flush=True)
                radix.append((entry, sel))
            rows["topk_sweep"] = [e for e, _ in radix]
            ok = [(e["ms"], sel) for e, sel in radix if "ms" in e]
            best_sel = min(ok, key=lambda x: x[0])[1] if ok else cfg
            rows["best_topk"] = dataclasses.asdict(best_sel)
            table = []
            for bm, bn, nw, ns, pairs in (SWEEP if args.tile_sweep and first else SWEEP[:1]):
                tile = dataclasses.replace(best_sel, block_m=bm, block_n=bn, num_warps=nw, num_stages=ns,
                                           head_pairs=pairs, fp8_num_stages=ns, fp8_head_pairs=pairs)
                entry = dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, head_pairs=pairs)
                for name, fp8 in (("bf16", False), ("fp8", True)):
                    try:
                        r = timed(lambda fp8=fp8, tile=tile: scores_only(fp8, tile), device, args.iters, args.warmup)
                        entry[name] = dict(ms=r["ms"], steps_ms=r["steps_ms"], tflops=flops / r["ms"] / 1e9)
                    except Exception as e:  # noqa: BLE001 - a config the compiler refuses is recorded
                        entry[name] = dict(error=repr(e)[:300])
                print("sweep", entry, flush=True)
                table.append((entry, tile))
            rows["score_tile_sweep"] = [e for e, _ in table]
            for name, fp8 in (("bf16", False), ("fp8", True)):  # the whole op with the fastest score tile
                ok = [(e[name]["ms"], e, tile) for e, tile in table if "ms" in e[name]]
                if ok:
                    _, e, tile = min(ok, key=lambda x: x[0])
                    rows[f"best_tile_{name}"] = dataclasses.asdict(tile)
                    steps.append((f"indexer_topk_{name}_best_tile", lambda fp8=fp8, tile=tile: it.indexer_topk(
                        q, w, k, pos, pos, topk, fp8, None, tile), flops))
    for name, fn, fl in steps:
        try:
            r = timed(fn, device, args.iters, args.warmup)
        except Exception as e:  # noqa: BLE001 - one failing step is recorded, the others still run
            rows[name] = dict(error=repr(e)[:500])
            print(name, "failed:", repr(e)[:500], flush=True)
            continue
        rows[name] = dict(r, flops=fl, tflops=fl / r["ms"] / 1e9 if fl else None)
        print(name, f"{r['ms']:.3f} ms", flush=True)
    if device.type == "cuda" and first:  # where a single call's time goes: host enqueue, kernels, idle gaps
        c_out = chunk_view(0, chunk)
        rows["host_enqueue"] = {
            "op_bf16": host_enqueue(lambda: full(False)), "op_fp8": host_enqueue(lambda: full(True)),
            "launcher_bf16": host_enqueue(lambda: it.indexer_topk(q, w, k, pos, pos, topk, False, None, cfg)),
            "keys_at_columns": host_enqueue(lambda: it.keys_at_columns(pos)),
            "scores_launch": host_enqueue(lambda: it.scores(q, w32, k, None, pos, pos, 0, chunk, c_out, None, True,
                                                            cfg)),
            "select_launches": host_enqueue(lambda: it.select(c_out, ids_buf, qpos, 0, 0, chunk, None, True, cfg))}
        for name, fp8 in (("bf16", False), ("fp8", True)):
            try:
                rows[f"profile_{name}"] = kernel_profile(lambda fp8=fp8: full(fp8),
                                                         Path(tempfile.gettempdir()) / f"indexer_trace_{name}.json")
            except Exception as e:  # noqa: BLE001 - the profile is diagnostic; the timed steps stand without it
                rows[f"profile_{name}"] = dict(error=repr(e)[:300])
        for name in ("host_enqueue", "profile_bf16", "profile_fp8"):
            print(name, json.dumps(rows[name])[:3000], flush=True)
    save(dict(seq=s, heads=h, head_dim=d, topk=topk, visible_pairs=pairs, results=rows, partial=True))
    ids = full(False)
    sample = sampled_rows(s, args.check_rows, device)
    rows["bf16_vs_float64_oracle"] = oracle_mismatch(q, w, k, sample, ids, topk)
    if device.type == "cuda":
        ids8 = full(True)
        shared = [torch.isin(ids8[0, r][ids8[0, r] >= 0], ids[0, r][ids[0, r] >= 0]).float().mean().item()
                  for r in sample.tolist()]
        rows["fp8_vs_bf16_shared_fraction"] = dict(mean=sum(shared) / len(shared), min=min(shared))
        rows["fp8_vs_its_float64_oracle"] = oracle_mismatch(q8.float(), w8, k8.float(), sample, ids8, topk,
                                                            k_scale=ks)
        rows["fp8_vs_bf16_float64_oracle"] = oracle_mismatch(q, w, k, sample, ids8, topk)
    return dict(seq=s, heads=h, head_dim=d, topk=topk, visible_pairs=pairs, results=rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (the reference path)")
    p.add_argument("--seqs", type=int, nargs="+", default=[16384, 65536])
    shape_help = "(default: configs/dsa-12l.toml's, --smoke: configs/tiny.toml's)"
    p.add_argument("--heads", type=int, default=None, help=f"model.dsa.n_index_heads {shape_help}")
    p.add_argument("--dim", type=int, default=None, help=f"model.dsa.index_head_dim {shape_help}")
    p.add_argument("--topk", type=int, default=None, help=f"model.dsa.index_topk {shape_help}")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--check-rows", dest="check_rows", type=int, default=256)
    p.add_argument("--sweep", action="store_true", help="also time top-k configs")
    p.add_argument("--tile-sweep", dest="tile_sweep", action="store_true", help="with --sweep: score tiles too")
    p.add_argument("--commit", default=None, help="git commit to record (the GPU copy's git metadata lies)")
    args = p.parse_args()
    if args.smoke:
        args.seqs, args.iters, args.warmup, args.check_rows = [96], 2, 1, 8
    fill_attention_shape(args, args.smoke, {"heads": "dsa.n_index_heads", "dim": "dsa.index_head_dim",
                                            "topk": "dsa.index_topk"})
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    ceiling = matmul_ceiling(device, dtype, 8192 if cuda else 256, 20 if cuda else 2)
    print(f"bf16 matmul ceiling {ceiling:.1f} TFLOP/s", flush=True)
    triton_version = None
    if cuda:
        import triton
        triton_version = triton.__version__
    cases = []
    report = dict(benchmark="indexer", device=device_name(cuda), torch=torch.__version__, triton=triton_version,
                  cuda=torch.version.cuda, commit=args.commit or git_commit(), smoke=args.smoke, iters=args.iters,
                  warmup=args.warmup, flop_model="2 * visible causal pairs * heads * head_dim",
                  ceiling_bf16_matmul_tflops=ceiling, cases=cases)
    def save(partial):  # a case's timed steps before its agreement checks: a run cut short keeps them
        write_report(args.out, dict(report, cases=[*cases, partial]))

    for i, s in enumerate(args.seqs):
        print(f"case seq {s}", flush=True)
        c = case(args, device, s, args.sweep, i == 0, save)
        for r in [*c["results"].values(), *(e.get(n, {}) for e in c["results"].get("score_tile_sweep", [])
                                            for n in ("bf16", "fp8"))]:
            if isinstance(r, dict) and r.get("tflops"):
                r["fraction_of_bf16_ceiling"] = r["tflops"] / ceiling
        cases.append(c)
        for name, r in c["results"].items():
            if name in ("score_tile_sweep", "topk_sweep", "config"):
                continue
            if isinstance(r, dict) and "ms" in r:
                frac = r.get("fraction_of_bf16_ceiling")
                print(f"{c['seq']:6d} {name:30s} {r['ms']:9.3f} ms" + (f" {frac:6.1%} of ceiling" if frac else ""))
            elif isinstance(r, dict):
                print(f"{c['seq']:6d} {name:30s} {r}")
        write_report(args.out, report)  # after every case: a run cut short keeps what it measured
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
