"""Profile ONE training step per activation-checkpointing mode: where does the step time go?

    python benchmarks/profile_step.py --out benchmarks/results/profile_step/profile_step.json     # H200, 4-layer dsv3
    python benchmarks/profile_step.py --set model.n_layers=12 --modes none,selective ...
    python benchmarks/profile_step.py --smoke                                         # tiny preset, CPU

For each mode the model is built exactly as the trainer builds it, warmed up, timed without the
profiler (median of --timed steps), then one step runs under torch.profiler (CPU + CUDA) and, on
CUDA, one more under `torch.cuda.set_sync_debug_mode("warn")` to locate host syncs by file:line.
The step is `Trainer.step` itself (data, forward, backward, grad norm, clip, optimizer,
expert-bias update, final synchronize), so what is profiled is what e2e.py times.

Reported per mode (from the exported kineto trace):
- step wall time (unprofiled median and profiled), GPU busy time (union of kernel/memcpy/memset
  intervals) and the GPU idle fraction: a large idle fraction means the step is CPU/sync bound;
- GPU time split by launch window: forward, backward (inside autograd's evaluate_function), the
  checkpoint replay (inside a reentrant region's backward, before its inner backward starts),
  and after backward (grad norm, clipping, optimizer);
- top CUDA kernels, GPU time by kernel category and by the aten op that launched the kernel;
- top CPU ops by self CPU time; host syncs (cudaStreamSynchronize / cudaDeviceSynchronize /
  blocking memcpy, with the aten op they happened in) and sync sites (file:line);
- for full / selective: the checkpoint regions' saved/recomputed op counters
  (`checkpoint_region_of(block).last_stats`) and the GPU time of the replayed ops.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import gc
import json
import re
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py

from common import merge_intervals  # noqa: E402

from spartron.checkpointing import checkpoint_region_of  # noqa: E402
from spartron.layers.costs import training_flops_per_token  # noqa: E402
from spartron.runtime.config import load_config  # noqa: E402
from spartron.runtime.metrics import git_commit  # noqa: E402
from spartron.runtime.trainer import Trainer  # noqa: E402

MODES = {
    "none": ["ac.mode=none", "offload.enabled=false"],
    "full": ["ac.mode=full", "offload.enabled=false"],
    "selective": ["ac.mode=selective", "offload.enabled=false"],
    "selective+offload": ["ac.mode=selective", "offload.enabled=true"],
}
STEP_RANGE = "spartron_profiled_step"
EVALUATE = "autograd::engine::evaluate_function: "
REGION_BACKWARD = "_ReentrantRegionBackward"
SYNC_APIS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
             "cuStreamSynchronize", "cuCtxSynchronize")
SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::is_nonzero",
            "aten::equal", "aten::masked_select", "aten::unique", "aten::_unique2", "aten::repeat_interleave")
KERNEL_CATEGORIES = (  # first match wins (lower-cased kernel name)
    # inductor's kernels (compiled steps): templates (GEMMs), fused pointwise, fused reductions
    ("gemm", r"^triton_tem_"),
    ("elementwise", r"^triton_poi_"),
    ("reduce", r"^triton_(red|per)_"),
    ("attention", r"flash|fmha|cudnn|attention|sdpa|_mha|mha_"),
    ("grouped_gemm", r"grouped|groupproblemshape"),  # torch._grouped_mm's CUTLASS kernel: GroupProblemShape
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm80_|matmul"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("sort_scan", r"sort|radix|scan|cub::|cumsum|onesweep"),
    ("index_scatter_gather", r"index|scatter|gather|embedding|put_|take"),
    ("softmax_loss", r"softmax|cross_entropy|nll_loss|log_softmax"),
    ("reduce", r"reduce|norm"),
    ("elementwise", r"elementwise|vectorized|unrolled|copy|fill|cat|where|foreach"),
)


# ---- trace analysis (pure functions of the chrome trace, tested on CPU) ------------------------

def _end(e: dict) -> float:
    return e["ts"] + e.get("dur", 0.0)


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of the intervals (trace microseconds), in ms."""
    return sum(e - s for s, e in merge_intervals(intervals)) / 1e3


def _gaps(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """Idle gaps (start, end) of the union of intervals inside [lo, hi]."""
    gaps, cursor = [], lo
    for s, e in merge_intervals(intervals):
        if s > cursor:
            gaps.append((cursor, min(s, hi)))
        cursor = max(cursor, e)
        if cursor >= hi:
            break
    if cursor < hi:
        gaps.append((cursor, hi))
    return [(s, e) for s, e in gaps if e > s]


class _SpanIndex:
    """Per-thread spans, answering 'innermost span containing ts' (spans on a thread nest)."""

    def __init__(self, spans: list[dict]) -> None:
        self.by_tid: dict = collections.defaultdict(list)
        for e in spans:
            self.by_tid[e["tid"]].append(e)
        for lst in self.by_tid.values():
            lst.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
        self.starts = {tid: [e["ts"] for e in lst] for tid, lst in self.by_tid.items()}

    def innermost(self, tid, ts: float) -> dict | None:
        lst = self.by_tid.get(tid)
        if not lst:
            return None
        i = bisect.bisect_right(self.starts[tid], ts) - 1
        # Walking back, the first span that still contains ts is the innermost one (nesting); the
        # walk passes only the already finished spans before it, so it is capped.
        for j in range(i, max(i - 5000, -1), -1):
            if _end(lst[j]) >= ts:
                return lst[j]
        return None


class _Windows:
    """Per-thread merged time windows, answering 'is ts inside one of them'."""

    def __init__(self, spans: dict) -> None:
        self.spans = {tid: merge_intervals(s) for tid, s in spans.items()}
        self.starts = {tid: [s for s, _ in m] for tid, m in self.spans.items()}

    def contains(self, tid, ts: float) -> bool:
        merged = self.spans.get(tid)
        if not merged:
            return False
        i = bisect.bisect_right(self.starts[tid], ts) - 1
        return i >= 0 and merged[i][1] >= ts


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, pattern in KERNEL_CATEGORIES:
        if re.search(pattern, low):
            return category
    return "other"


def _top(counter: dict[str, float], n: int) -> list[tuple[str, float]]:
    return sorted(counter.items(), key=lambda kv: -kv[1])[:n]


def analyze_trace(trace: dict, top_n: int = 15) -> dict:
    """Numbers for one profiled step from a chrome trace (kineto's export_chrome_trace)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    step = [e for e in events if e.get("name") == STEP_RANGE and e.get("cat") in ("user_annotation", "cpu_op")]
    if not step:
        raise RuntimeError(f"the trace has no {STEP_RANGE!r} range")
    step = max(step, key=lambda e: e.get("dur", 0.0))
    lo, hi = step["ts"], _end(step)
    main_tid = step["tid"]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op" and lo <= e["ts"] <= hi]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and lo <= e["ts"] <= hi]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launch_by_corr = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    # only GPU work launched inside the step
    gpu = [g for g in gpu if g.get("args", {}).get("correlation") in launch_by_corr]
    ops = _SpanIndex(cpu_ops)

    # backward windows: autograd evaluate_function spans (on any thread); replay = inside a reentrant
    # region's backward node, before the first nested evaluate_function (its inner backward) starts
    evaluate = [e for e in cpu_ops if e["name"].startswith(EVALUATE)]
    bwd_by_tid: dict = collections.defaultdict(list)
    for e in evaluate:
        bwd_by_tid[e["tid"]].append((e["ts"], _end(e)))
    bwd_windows = _Windows(bwd_by_tid)
    replay_spans: dict = collections.defaultdict(list)
    for region in (e for e in evaluate if e["name"].endswith(REGION_BACKWARD)):
        nested = [e["ts"] for e in evaluate
                  if e is not region and e["tid"] == region["tid"] and region["ts"] < e["ts"] <= _end(region)]
        replay_spans[region["tid"]].append((region["ts"], min(nested) if nested else _end(region)))
    replay_windows = _Windows(replay_spans)
    bwd_start = min((e["ts"] for e in evaluate), default=hi)
    bwd_end = max((_end(e) for e in evaluate), default=hi)

    def window(launch: dict) -> str:
        tid, ts = launch["tid"], launch["ts"]
        if replay_windows.contains(tid, ts):
            return "replay"
        if bwd_windows.contains(tid, ts):
            return "backward"
        return "forward" if ts < bwd_end else "after_backward"

    kernels_by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    by_category: dict[str, float] = collections.defaultdict(float)
    by_launch_op: dict[str, float] = collections.defaultdict(float)
    by_window: dict[str, float] = collections.defaultdict(float)
    replay_by_op: dict[str, float] = collections.defaultdict(float)
    stream_ms: dict[str, float] = collections.defaultdict(float)
    intervals = []
    for g in gpu:
        dur = g.get("dur", 0.0)
        name = g["name"] if g.get("cat") == "kernel" else f"[{g['cat']}] {g['name']}"
        entry = kernels_by_name[name]
        entry[0] += dur / 1e3
        entry[1] += 1
        by_category[kernel_category(g["name"]) if g.get("cat") == "kernel" else g["cat"]] += dur / 1e3
        stream_ms[str(g.get("args", {}).get("stream"))] += dur / 1e3
        intervals.append((g["ts"], _end(g)))
        launch = launch_by_corr[g["args"]["correlation"]]
        op = ops.innermost(launch["tid"], launch["ts"])
        op_name = op["name"] if op is not None else "(no aten op)"
        by_launch_op[op_name] += dur / 1e3
        w = window(launch)
        by_window[w] += dur / 1e3
        if w == "replay":
            replay_by_op[op_name] += dur / 1e3

    busy = _union_ms([(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi])
    wall = (hi - lo) / 1e3
    gaps = _gaps([(s, e) for s, e in intervals], lo, hi) if intervals else []
    gap_ms = [(e - s) / 1e3 for s, e in gaps]

    # host syncs: blocking runtime calls, attributed to the aten op they ran in
    syncs: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for r in runtime:
        name = r["name"]
        if name not in SYNC_APIS:
            continue
        op = ops.innermost(r["tid"], r["ts"])
        key = f"{name} in {op['name'] if op is not None else '(python, no aten op)'}"
        syncs[key][0] += 1
        syncs[key][1] += r.get("dur", 0.0) / 1e3
    sync_ops: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in cpu_ops:
        if e["name"] in SYNC_OPS:
            sync_ops[e["name"]][0] += 1
            sync_ops[e["name"]][1] += e.get("dur", 0.0) / 1e3

    launches = [r for r in runtime if "Launch" in r["name"]]
    memcpy = collections.Counter(g["name"].split(" (")[0] for g in gpu if g.get("cat") == "gpu_memcpy")
    return {
        "step_wall_ms": wall,
        "forward_wall_ms": (bwd_start - lo) / 1e3,
        "backward_wall_ms": (bwd_end - bwd_start) / 1e3 if evaluate else 0.0,
        "after_backward_wall_ms": (hi - bwd_end) / 1e3 if evaluate else 0.0,
        "replay_wall_ms": sum(_union_ms(s) for s in replay_spans.values()),
        "n_cpu_ops": len(cpu_ops),
        "n_cpu_ops_main_thread": sum(1 for e in cpu_ops if e["tid"] == main_tid),
        "n_kernel_launches": len(launches),
        "launch_api_ms": sum(r.get("dur", 0.0) for r in launches) / 1e3,
        "gpu_kernel_sum_ms": sum(v[0] for v in kernels_by_name.values()),
        "gpu_busy_ms": busy,
        "gpu_idle_fraction": 1.0 - busy / wall if wall > 0 and intervals else None,
        "gpu_ms_by_stream": dict(stream_ms),
        "compute_stream_ms": max(stream_ms.values(), default=0.0),
        "gpu_ms_by_window": dict(by_window),
        "gpu_ms_by_category": dict(_top(by_category, 64)),
        "idle_gaps": {
            "count_over_20us": sum(1 for g in gap_ms if g > 0.02),
            "ms_in_gaps_under_1ms": sum(g for g in gap_ms if g <= 1.0),
            "count_over_1ms": sum(1 for g in gap_ms if g > 1.0),
            "ms_in_gaps_over_1ms": sum(g for g in gap_ms if g > 1.0),
            "largest_ms": sorted(gap_ms, reverse=True)[:8],
        },
        "top_kernels": [{"name": k[:160], "ms": v[0], "count": v[1]}
                        for k, v in sorted(kernels_by_name.items(), key=lambda kv: -kv[1][0])[:top_n]],
        "gpu_ms_by_launching_op": [{"op": k, "ms": v} for k, v in _top(by_launch_op, top_n)],
        "replay_gpu_ms_by_op": [{"op": k, "ms": v} for k, v in _top(replay_by_op, top_n)],
        "host_syncs": [{"where": k, "count": v[0], "ms": v[1]}
                       for k, v in sorted(syncs.items(), key=lambda kv: -kv[1][1])],
        "host_sync_count": sum(v[0] for v in syncs.values()),
        "host_sync_ms": sum(v[1] for v in syncs.values()),
        "memcpy_counts": dict(memcpy),
        "sync_prone_ops": [{"op": k, "count": v[0], "ms": v[1]} for k, v in sorted(sync_ops.items())],
    }


def top_cpu_ops(prof, n: int) -> list[dict]:
    """Top ops by self CPU time (all threads) over the profiled step."""
    rows = [(e.key, e.self_cpu_time_total / 1e3, e.cpu_time_total / 1e3, e.count)
            for e in prof.key_averages() if e.key != STEP_RANGE]
    rows.sort(key=lambda r: -r[1])
    return [{"op": k, "self_cpu_ms": s, "cpu_total_ms": t, "count": c} for k, s, t, c in rows[:n]]


# ---- region stats ------------------------------------------------------------------------------

def region_stats(model: torch.nn.Module) -> dict | None:
    """Saved / recomputed op counters summed over every checkpoint region's latest call."""
    stats = [s for b in model.blocks()
             if (r := checkpoint_region_of(b.module)) is not None and (s := r.last_stats) is not None]
    if not stats:
        return None
    saved, recomputed = collections.Counter(), collections.Counter()
    for s in stats:
        saved.update(s.saved_by_op)
        recomputed.update(s.recomputed_by_op)
    return {
        "regions": len(stats),
        "ops_original": sum(s.ops_original for s in stats),
        "ops_saved": sum(s.ops_saved for s in stats),
        "ops_recomputed": sum(s.ops_recomputed for s in stats),
        "bytes_saved": sum(s.bytes_saved for s in stats),
        "bytes_inputs": sum(s.bytes_inputs for s in stats),
        "replays": sum(s.replay_count for s in stats),
        "saved_by_op": dict(saved.most_common()),
        "recomputed_by_op": dict(recomputed.most_common(25)),
    }


# ---- sync sites --------------------------------------------------------------------------------

@contextlib.contextmanager
def sync_sites(sites: collections.Counter):
    """Count CUDA host syncs by the innermost repository frame (torch's sync debug mode, 'warn')."""
    def hook(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if str(REPO) in f.filename
                  and not f.filename.endswith("profile_step.py")]
        where = (f"{Path(frames[-1].filename).relative_to(REPO)}:{frames[-1].lineno} ({frames[-1].name})"
                 if frames else f"{filename}:{lineno}")
        sites[where] += 1

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


# ---- one mode ----------------------------------------------------------------------------------

def profile_mode(config: Path, mode: str, args: argparse.Namespace) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    total_steps = args.warmup + args.timed + 2
    run_dir = tempfile.mkdtemp(prefix="spartron-profile-")  # the trainer's metrics go here, nothing is saved
    compiled = ["train.compile=true"] + (["ac.reentrant=false"] if mode != "none" else []) if args.compile else []
    cfg = load_config(config, MODES[mode] + compiled + [f"train.steps={total_steps}", "train.save_every=0",
                                             "train.progress=false", f"train.run_dir={json.dumps(run_dir)}",
                                             *args.set])
    build_start = time.perf_counter()
    run = Trainer(cfg).setup()  # the trainer itself: the same model, optimizer, loader and step as a run
    cuda = run.device.type == "cuda"
    build_done = time.perf_counter()
    for _ in range(args.warmup):
        run.step()
    timed = [run.step() for _ in range(args.timed)]
    step_ms = statistics.median(r["step_time_s"] for r in timed) * 1e3

    # data loader cost alone (a copy of the loader's source; the real loader's position is untouched)
    from spartron.runtime.data import TokenLoader

    probe = TokenLoader(run.loader.source, run.loader.dp_rank, run.loader.dp_size)
    t0 = time.perf_counter()
    probe.next_batch(cfg.train.micro_batch_size)
    loader_ms = (time.perf_counter() - t0) * 1e3 * run.n_micro

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=False, with_stack=False) as prof:
        with record_function(STEP_RANGE):
            record = run.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        if args.trace_dir:
            args.trace_dir.mkdir(parents=True, exist_ok=True)
            (args.trace_dir / f"profile_{mode.replace('+', '_')}.json").write_text(path.read_text())
    analysis = analyze_trace(trace, args.top)
    regions = region_stats(run.model)

    sites: collections.Counter = collections.Counter()
    if cuda:
        with sync_sites(sites):
            run.step()

    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    flops = training_flops_per_token(cfg.model, cfg.train.seq_len) * tokens
    result = {
        "mode": mode,
        "compile": cfg.train.compile,
        "n_layers": cfg.model.n_layers,
        "seq_len": cfg.train.seq_len,
        "global_batch_size": cfg.train.global_batch_size,
        "micro_batch_size": cfg.train.micro_batch_size,
        "params": sum(p.numel() for p in run.params),
        "flops_per_step": flops,
        "step_ms": step_ms,
        "step_ms_all_timed": [r["step_time_s"] * 1e3 for r in timed],
        "profiled_step_ms": record["step_time_s"] * 1e3,
        "tflops_per_s": flops / (step_ms / 1e3) / 1e12,
        "mfu": flops / (step_ms / 1e3) / (args.peak_tflops * 1e12) if args.peak_tflops else None,
        "peak_memory_allocated_gib": max(r["peak_memory_allocated_bytes"] for r in timed) / 2**30,
        "data_loader_ms": loader_ms,
        "build_s": build_done - build_start,
        **analysis,
        "gpu_idle_fraction_vs_unprofiled": (1.0 - analysis["gpu_busy_ms"] / step_ms) if cuda else None,
        "top_cpu_ops": top_cpu_ops(prof, args.top),
        "sync_sites": [{"where": k, "count": v} for k, v in sites.most_common()],
        "regions": regions,
    }
    run.close()  # the log; the EP buffers, collectively
    del run, prof, trace
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


# ---- output ------------------------------------------------------------------------------------

def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    table = Table(title="profile_step: one training step per AC mode (ms)")
    cols = ("mode", "step", "prof step", "fwd wall", "bwd wall", "replay wall", "after bwd", "GPU busy",
            "GPU idle", "fwd GPU", "bwd GPU", "replay GPU", "after GPU", "syncs", "sync ms", "launches")
    for c in cols:
        table.add_column(c, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["mode"], "error: " + r["error"][:80], *[""] * (len(cols) - 2))
            continue
        w = r["gpu_ms_by_window"]
        table.add_row(r["mode"], _fmt(r["step_ms"]), _fmt(r["profiled_step_ms"]), _fmt(r["forward_wall_ms"]),
                      _fmt(r["backward_wall_ms"]), _fmt(r["replay_wall_ms"]), _fmt(r["after_backward_wall_ms"]),
                      _fmt(r["gpu_busy_ms"]), _fmt(r["gpu_idle_fraction"], ".1%"), _fmt(w.get("forward")),
                      _fmt(w.get("backward")), _fmt(w.get("replay")), _fmt(w.get("after_backward")),
                      str(r["host_sync_count"]), _fmt(r["host_sync_ms"]), str(r["n_kernel_launches"]))
    console.print(table)
    for r in rows:
        if "error" in r:
            continue
        console.rule(f"mode {r['mode']}")
        console.print("GPU ms by category: " + ", ".join(f"{k} {v:.1f}" for k, v in r["gpu_ms_by_category"].items()))
        gaps = r["idle_gaps"]
        console.print(f"idle gaps: {gaps['count_over_20us']} > 20us, {gaps['ms_in_gaps_under_1ms']:.1f} ms in gaps "
                      f"<= 1 ms, {gaps['count_over_1ms']} gaps > 1 ms totalling {gaps['ms_in_gaps_over_1ms']:.1f} ms; "
                      f"largest {[round(g, 2) for g in gaps['largest_ms']]}; data loader {r['data_loader_ms']:.1f} ms")
        t = Table(title="top CUDA kernels")
        for c in ("kernel", "ms", "count"):
            t.add_column(c, justify="left" if c == "kernel" else "right")
        for k in r["top_kernels"]:
            t.add_row(k["name"][:110], f"{k['ms']:.2f}", str(k["count"]))
        console.print(t)
        t = Table(title="GPU ms by launching aten op")
        t.add_column("op")
        t.add_column("ms", justify="right")
        for k in r["gpu_ms_by_launching_op"]:
            t.add_row(k["op"], f"{k['ms']:.2f}")
        console.print(t)
        t = Table(title="top CPU ops by self CPU time (all threads)")
        for c in ("op", "self ms", "total ms", "count"):
            t.add_column(c, justify="left" if c == "op" else "right")
        for k in r["top_cpu_ops"]:
            t.add_row(k["op"][:90], f"{k['self_cpu_ms']:.2f}", f"{k['cpu_total_ms']:.2f}", str(k["count"]))
        console.print(t)
        if r["host_syncs"]:
            console.print("host syncs: " + "; ".join(f"{s['where']} x{s['count']} ({s['ms']:.2f} ms)"
                                                     for s in r["host_syncs"]))
        if r["sync_prone_ops"]:
            console.print("sync-prone ops: " + "; ".join(f"{s['op']} x{s['count']}" for s in r["sync_prone_ops"]))
        if r["sync_sites"]:
            console.print("sync sites: " + "; ".join(f"{s['where']} x{s['count']}" for s in r["sync_sites"][:12]))
        if r["regions"]:
            g = r["regions"]
            console.print(f"regions: {g['regions']}, ops original {g['ops_original']}, saved {g['ops_saved']} "
                          f"({g['bytes_saved'] / 2**20:.0f} MiB), recomputed {g['ops_recomputed']}; saved "
                          f"{g['saved_by_op']}; recomputed (top) {dict(list(g['recomputed_by_op'].items())[:12])}")
            console.print("replay GPU ms by op: " + ", ".join(f"{k['op']} {k['ms']:.2f}"
                                                            for k in r["replay_gpu_ms_by_op"][:10]))


def compare(rows: list[dict]) -> dict:
    """Deltas of every AC mode against 'none' (ms)."""
    base = next((r for r in rows if r.get("mode") == "none" and "error" not in r), None)
    if base is None:
        return {}
    out = {}
    for r in rows:
        if r is base or "error" in r:
            continue
        out[f"{r['mode']}_minus_none"] = {
            key: (r[key] - base[key]) for key in ("step_ms", "profiled_step_ms", "forward_wall_ms",
                                                  "backward_wall_ms", "gpu_busy_ms", "gpu_kernel_sum_ms",
                                                  "n_cpu_ops", "n_kernel_launches")
        } | {f"gpu_{w}_ms": r["gpu_ms_by_window"].get(w, 0.0) - base["gpu_ms_by_window"].get(w, 0.0)
             for w in ("forward", "backward", "replay", "after_backward")}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "dsv3-12l.toml")
    parser.add_argument("--modes", default="none,full,selective", help=f"comma-separated subset of {list(MODES)}")
    parser.add_argument("--layers", type=int, default=4, help="model.n_layers (0: keep the config's)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timed", type=int, default=3, help="unprofiled steps timed (median)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--peak-tflops", type=float, default=None, help="for MFU (default 750 on CUDA)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--trace-dir", type=Path, default=None, help="also keep each mode's chrome trace here")
    parser.add_argument("--out", type=Path, default=None, help="JSON result file")
    parser.add_argument("--compile", action="store_true",
                        help="train.compile = true (checkpointed modes with ac.reentrant = false)")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's; a device copy's may lie)")
    parser.add_argument("--smoke", action="store_true", help="tiny preset on CPU, 1 warmup + 1 timed step")
    args = parser.parse_args()
    if args.smoke:
        args.config, args.warmup, args.timed, args.layers = REPO / "configs" / "tiny.toml", 1, 1, 0
        args.set = ["device=cpu", "train.global_batch_size=2", *args.set]
        torch.set_num_threads(1)  # a shared CPU: oversubscribed intra-op threads make steps erratic
    elif args.peak_tflops is None and torch.cuda.is_available():
        args.peak_tflops = 750.0
    if args.layers:
        args.set = [f"model.n_layers={args.layers}", *args.set]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")

    from spartron.parallel.env import discover, init_distributed

    if discover().world_size != 1:
        parser.error("profile_step.py profiles one process; run it without torchrun")
    started = time.perf_counter()
    init_distributed(discover(), "auto")
    rows = []
    try:
        for mode in modes:
            try:
                rows.append(profile_mode(args.config, mode, args))
            except Exception as err:  # noqa: BLE001 - one mode failing (e.g. OOM) must not hide the others
                traceback.print_exc()
                rows.append({"mode": mode, "error": f"{type(err).__name__}: {err}"})
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    print_report(rows)
    result = {
        "benchmark": "profile_step",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
        "torch": torch.__version__,
        "commit": args.commit or git_commit(),
        "config": str(args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config),
        "overrides": args.set,
        "warmup_steps": args.warmup,
        "timed_steps": args.timed,
        "peak_tflops_per_gpu": args.peak_tflops,
        "total_runtime_s": time.perf_counter() - started,
        "results": rows,
        "vs_none": compare(rows),
    }
    print(f"total runtime {result['total_runtime_s']:.1f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
