"""The rehearsal's report: measured compute and memory, modelled communication, the planner beside them.

Step time, three ways (communication from spartron.runtime.linktable, compute measured):
- `no_overlap`: compute + every collective, one after the other;
- `headline`: only the overlaps the runtime implements: FSDP2's all-gathers (prefetched on their own
  stream), reduce-scatters (their own stream) and, with HSDP, the gradient all-reduces it runs right after
  each reduce-scatter in backward hide under compute (the last ones' exposure is not modelled); the MoE
  all-to-alls too when train.intra_layer_micro_batches > 1 (spartron.layers.overlap interleaves them with the other
  micro-batch's compute), otherwise they are exposed; CP's all-gathers and the step's small all-reduces
  (loss normalisation, step stats, grad norm, expert bias, SIGTERM agreement) are exposed:
  max(compute, overlapped) + exposed. Each collective's category is what its caller says it is for
  (spartron.comm.labelled, `category`), never its group;
- `full_overlap`: max(compute, all communication), a bound no runtime reaches.
Tokens/s per GPU = global_batch_size x seq_len / world / step time; MFU over the trainer's peak FLOP/s
(train.peak_tflops, else the measured matmul ceiling of the device).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from spartron.layers.costs import model_parameter_bytes
from spartron.runtime.linktable import ClusterConfig, collective_time
from spartron.runtime.memory import plan_memory

CATEGORIES = ("fsdp", "ep", "cp", "other")
HGX_GPUS = 8  # GPUs per node when launch.gpus_per_node is 0 (an HGX H100 / H200 node)


PURPOSE_CATEGORY = {"cp_sequence": "cp", "ep_counts": "ep"}
"""Labelled collectives (spartron.comm.labelled) outside "other": CP's sequence (KV) all-gathers and their
backward reduce-scatters, the MoE dispatch's count all-gather. Every other label (loss_norm, step_stats,
grad_norm, expert_bias, stop_agreement, fp8_amax, indexer_metrics) is one of the step's small exposed
collectives."""


def category(kind: str, purpose: str) -> str:
    """What a collective is, from what its caller said it is for (`purpose`), never from its group: identical
    rank sets share one group (with fsdp = 1 CP's group is FSDP's). Unlabelled: all-to-alls are the MoE
    dispatch (ep); all-gathers, reduce-scatters and all-reduces are FSDP2's parameter all-gathers, gradient
    reduce-scatters and HSDP gradient all-reduces over dp_replicate (fsdp), the only collectives of a step the
    project does not issue itself; anything else is other."""
    if purpose:
        return PURPOSE_CATEGORY.get(purpose, "other")
    if kind == "all_to_all":
        return "ep"
    return "fsdp" if kind in ("all_gather", "reduce_scatter", "all_reduce") else "other"


WARM_UP_FACTOR = 2.0  # a first step slower than this many times the last one ran one-time work


def _weights(n_segments: int, n_micro: int, rehearsed: int) -> list[float]:
    """Per segment (first forward, each backward->next forward, last backward, optimizer): how many
    times a step of `n_micro` micro-batches runs it."""
    middle = rehearsed - 1
    per_middle = (n_micro - 1) / middle if middle else 0.0
    return [1.0] + [per_middle] * middle + [1.0, 1.0][: n_segments - 1 - middle]


def step_report(step: dict, measured: dict, cluster: ClusterConfig, gpus_per_node: int) -> dict[str, Any]:
    cfg, rank = measured["config"], measured["rank"]
    segments = step["segments"]
    weights = _weights(len(segments), measured["n_micro"], measured["rehearsed_micro"])
    compute = sum(w * s.seconds for w, s in zip(weights, segments, strict=True))
    comm = {c: {"bytes": 0.0, "seconds": 0.0, "calls": 0.0} for c in CATEGORIES}
    detail: dict[tuple[str, str], dict] = {}
    for w, seg in zip(weights, segments, strict=True):
        for r in seg.records:
            t = collective_time(cluster, r.kind, r.ranks, r.calls, r.bytes, rank, gpus_per_node)
            cat = category(r.kind, r.purpose)
            comm[cat]["bytes"] += w * r.bytes
            comm[cat]["seconds"] += w * t.seconds
            comm[cat]["calls"] += w * r.calls
            row = detail.setdefault((r.kind, r.group, r.purpose), {
                "kind": r.kind, "group": r.group, "purpose": r.purpose, "group_size": r.size, "category": cat,
                "link": t.link, "calls": 0.0, "bytes": 0.0, "seconds": 0.0, "reduce_ops": []})
            row["reduce_ops"] += [op for op in r.reduce_ops if op not in row["reduce_ops"]]
            row["calls"] += w * r.calls
            row["bytes"] += w * r.bytes
            row["seconds"] += w * t.seconds
    total_comm = sum(c["seconds"] for c in comm.values())
    overlapped = comm["fsdp"]["seconds"] + (comm["ep"]["seconds"] if cfg.train.intra_layer_micro_batches > 1 else 0.0)
    exposed = total_comm - overlapped
    headline = max(compute, overlapped) + exposed
    tokens_per_gpu = cfg.train.global_batch_size * cfg.train.seq_len / measured["world"]
    rec = step["record"]

    def rate(seconds: float) -> dict[str, float]:
        tps = tokens_per_gpu / seconds
        return {"seconds": seconds, "tokens_per_s_per_gpu": tps,
                "mfu": measured["flops_per_token"] * tps / measured["peak_flops"]}

    return {"step": rec["step"], "loss": rec["loss"], "rehearsed_step_s": rec["step_time_s"],
            "compute_s": compute, "optimizer_s": segments[-1].seconds,
            "peak_allocated_bytes": rec["peak_memory_allocated_bytes"],
            "peak_reserved_bytes": rec["peak_memory_reserved_bytes"],
            "alloc_retries": rec.get("alloc_retries"),
            "comm": comm,
            "comm_detail": sorted(detail.values(), key=lambda d: (d["category"], d["group"], d["kind"], d["purpose"])),
            "compute_only": rate(compute), "no_overlap": rate(compute + total_comm), "headline": rate(headline),
            "full_overlap": rate(max(compute, total_comm))}


def build_report(measured: dict, cluster: ClusterConfig) -> dict[str, Any]:
    """The JSON report of a rehearsal (`measured`: spartron.launch.rehearse.run_rehearsal's result)."""
    cfg, world, rank = measured["config"], measured["world"], measured["rank"]
    dims = cfg.parallel.dims(world)
    gpus = cfg.launch.gpus_per_node or HGX_GPUS  # a CPU config sets none: the nodes of the run it stands for
    steps = [step_report(s, measured, cluster, gpus) for s in measured["steps"]]
    last = steps[-1]
    plan = plan_memory(cfg, world, rank)
    planned_params = model_parameter_bytes(cfg.model, dims, rank)  # like the held side: no optimizer-held masters
    peak = max(s["peak_allocated_bytes"] for s in steps)
    return {
        "config": cfg.name, "world_size": world, "rank": rank, "layout": dims.describe(),
        "device": measured["device"], "device_name": measured["device_name"], "torch": measured["torch"],
        "gpus_per_node": gpus, "setup_s": measured["setup_s"],
        "routing": ("balanced: every expert slot receives the mean of what this rank sends" if measured["balanced"]
                    else "the model's own, every rank routing as this one; its gathered router rows are copies of "
                         "this rank's shard, so experts tie and the first ones take the tokens (a worst case)"),
        "micro_batches": {"per_step": measured["n_micro"], "rehearsed": measured["rehearsed_micro"]},
        "measured": ["compute time", "peak allocated / reserved memory", "bytes of every collective",
                     "optimizer_s: the stretch after the last backward (gradient norm, clip, optimizer update)"],
        "modelled": ["communication time (link table)", "step time with communication", "tokens/s per GPU",
                     "MFU", "compute of the micro-batches not rehearsed (the second one's time)"],
        "overlaps_in_headline": ["fsdp"] + (["ep"] if cfg.train.intra_layer_micro_batches > 1 else []),
        "steps": steps, "headline": last,
        "planner": {"predicted_peak_bytes": plan.peak, "measured_peak_bytes": peak,
                    # on CPU the measured peak is the process's lifetime peak RSS (metrics.peak_memory): no comparison
                    "difference_percent": (100.0 * (plan.peak - peak) / peak if peak and measured["device"] == "cuda"
                                           else None),
                    "phase": plan.phase, "parameter_bytes": planned_params,
                    "measured_parameter_bytes": measured["param_bytes"]},
        "link_table": cluster.model_dump(), "peak_tflops": measured["peak_flops"] / 1e12,
        "notes": measured["notes"] + _warm_up_note(steps) + _alloc_retry_note(steps),
        "kernels": measured.get("kernels"),
    }


def _warm_up_note(steps: list[dict[str, Any]]) -> list[str]:
    """A line when the first step's compute is far above the reported (last) one's: one-time work ran in it
    (compiles, kernels built at first use such as DeepGEMM's, autotuning), so its row is not a step's cost."""
    first, last = steps[0], steps[-1]
    if first["compute_s"] <= WARM_UP_FACTOR * last["compute_s"]:  # one step: it is the last one
        return []
    ratio = first["compute_s"] / last["compute_s"]
    return [f"step {first['step']}'s compute ({first['compute_s']:.1f} s) is {ratio:.0f}x step {last['step']}'s: "
            "it ran one-time work (compiles, kernels built at first use, autotuning); the headline is step "
            f"{last['step']}"]


def _alloc_retry_note(steps: list[dict[str, Any]]) -> list[str]:
    """A line when the caching allocator freed its cache and retried allocations during the rehearsed steps (a
    process-cumulative CUDA count; None on CPU): the rank ran near its memory, and a real rank's steps would
    stall there (each retry synchronises), which the measured compute of those steps includes."""
    counts = [s.get("alloc_retries") for s in steps]
    if not counts or counts[-1] is None or not counts[-1]:
        return []
    at = [s["step"] for s, before, now in zip(steps, [0, *counts], counts, strict=False) if now > before]
    return [f"the CUDA caching allocator freed its cache and retried {counts[-1]} allocations (at steps "
            f"{', '.join(map(str, at))}; peak reserved {_gb(max(s['peak_reserved_bytes'] for s in steps))} against "
            f"{_gb(max(s['peak_allocated_bytes'] for s in steps))} allocated): the rank runs near its memory and "
            "such steps stall; expandable segments usually avoid it (launch.env = {PYTORCH_CUDA_ALLOC_CONF = "
            "\"expandable_segments:True\"})"]


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def render(report: dict[str, Any]) -> str:
    """A readable summary of `report` (rich tables, as text)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(record=True, width=132, file=io.StringIO())  # recorded, returned as text
    h, p = report["headline"], report["planner"]
    console.print(f"spartron rehearse: {report['config']} rank {report['rank']} of {report['world_size']} "
                  f"({report['layout']}) on {report['device']}; routing: {report['routing']}; "
                  f"{report['micro_batches']['rehearsed']} of {report['micro_batches']['per_step']} micro-batches "
                  f"run per step; set-up {report['setup_s']:.1f} s")
    steps = Table(title="per step (compute and memory measured, communication modelled)")
    for col in ("step", "loss", "compute s", "peak alloc", "peak reserved", "comm s", "step s (headline)",
                "step s (no overlap)", "tok/s/GPU", "MFU", "MFU (compute)"):
        steps.add_column(col, justify="right")
    for s in report["steps"]:
        comm = sum(c["seconds"] for c in s["comm"].values())
        steps.add_row(str(s["step"]), f"{s['loss']:.4f}", f"{s['compute_s']:.3f}", _gb(s["peak_allocated_bytes"]),
                      _gb(s["peak_reserved_bytes"]), f"{comm:.3f}", f"{s['headline']['seconds']:.3f}",
                      f"{s['no_overlap']['seconds']:.3f}", f"{s['headline']['tokens_per_s_per_gpu']:.1f}",
                      f"{100 * s['headline']['mfu']:.1f}%", f"{100 * s['compute_only']['mfu']:.1f}%")
    console.print(steps)
    hidden = ", ".join(report["overlaps_in_headline"])
    comm = Table(title=f"communication per step (last step; hidden under compute in the headline: {hidden})")
    for col in ("category", "kind", "purpose", "group", "size", "link", "calls", "bytes", "modelled s"):
        comm.add_column(col, justify="right")
    for d in h["comm_detail"]:
        comm.add_row(d["category"], d["kind"], d["purpose"] or "-", d["group"], str(d["group_size"]), d["link"],
                     f"{d['calls']:.0f}", _gb(d["bytes"]), f"{d['seconds']:.4f}")
    console.print(comm)
    diff = (f"{p['difference_percent']:+.1f}%" if p["difference_percent"] is not None else
            "the process's peak RSS on CPU, not the step's allocation: not compared" if report["device"] == "cpu"
            else "n/a")
    console.print(f"planner: predicted peak {_gb(p['predicted_peak_bytes'])} at {p['phase']}, measured "
                  f"{_gb(p['measured_peak_bytes'])} ({diff}); model parameter shards {_gb(p['parameter_bytes'])} "
                  f"planned, {_gb(p['measured_parameter_bytes'])} held (the model's own parameters: optimizer-held "
                  "masters are in neither)")
    if report.get("kernels"):
        k = report["kernels"]
        top = Table(title=f"profiled step (one more, not reported): {k['what']}, {k['device_ms']:.1f} ms in all")
        for col in ("name", "ms", "share", "calls"):
            top.add_column(col, justify="left" if col == "name" else "right")
        for r in k["top"]:
            top.add_row(r["name"][:70], f"{r['ms']:.2f}", f"{100 * r['ms'] / k['device_ms']:.1f}%", str(r["calls"]))
        console.print(top)
    for note in report["notes"]:
        console.print(f"note: {note}")
    return console.export_text()


def write_report(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=1) + "\n")
