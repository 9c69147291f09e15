"""Offload windows and intra-layer micro-batches on the reference GPU model.

    python benchmarks/offload.py --out benchmarks/results/offload/offload.json     # CUDA (H200), dsv3-12l
    python benchmarks/offload.py --smoke                                   # tiny preset, CPU, seconds

Everything runs through the public Trainer (`Trainer.step(StepProbe(...))` picks the step's offloader
and observes its phases); a step is the trainer's whole step: forward, backward and the optimizer.
Part 1 (one GPU): step time and peak allocated memory for full and selective AC,
offload off and on (window all_but_last), with the bytes offloaded per step, the peak reduction as a
fraction of those bytes (target >= 0.8), the step-time ratio on/off (target <= 1.05) and the D2H
throughput of the offload copies (timed with events on the D2H stream) against the measured
pinned-copy ceiling (target >= 0.7 of ~54 GB/s).
Part 2 (two ranks, EP=2, spawned): step time with train.intra_layer_micro_batches = 1 vs 2
(all_to_all dispatcher, or DeepEP with --set model.moe.dispatcher=deepep; either
train.intra_layer_micro_batch_scope, set with --set; target: 2 is faster
because one micro-batch's exchange overlaps the other's experts), with the host time to issue a
step and, from a profiled step per setting (kernels only, so the profiler barely slows the host;
a second one with host ops gives the per-operator table and --trace), the GPU time split into compute kernels,
communication kernels (`is_comm_kernel`: NCCL's, DeepEP's, copy-engine peer copies and their barrier),
their overlap and idle time (why 2 is or is not faster).
Off and on run on the same model, alternating step by step (drift hits both alike).
Memory by phase: one extra step per AC mode x offload off/on records allocated / peak memory at
phase boundaries (embedding; each checkpoint region's forward; backward of loss + head; the backward
of each region, told by the offload session's observers; the optimizer) with the region tensors the session holds
there, so the output says where the peak is and how much the window could lower it.
On CPU (--smoke) both parts run on the tiny preset with gloo (no allocator stats, no profile).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py

from common import merge_intervals, run_ranks  # noqa: E402

from spartron.checkpointing.apply import checkpoint_region_of  # noqa: E402
from spartron.checkpointing.offload import ActivationOffloader  # noqa: E402
from spartron.runtime.config import load_config  # noqa: E402
from spartron.runtime.metrics import git_commit  # noqa: E402
from spartron.runtime.trainer import StepProbe, Trainer  # noqa: E402


def pinned_ceiling_gbps(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Best-of-5 device->pinned-host copy bandwidth (the D2H ceiling the offload copies aim at)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = 0.0
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return best


def _grad_bytes(model) -> int:
    total = 0
    for p in model.parameters():
        g = p.grad
        if g is not None:
            g = g.to_local() if hasattr(g, "to_local") else g
            total += g.numel() * g.element_size()
    return total


def _trainer(cfg, run_root: str, name: str) -> Trainer:
    """A Trainer of this benchmark: a fresh run in `run_root`, no saves, no progress lines."""
    overrides = {"name": name, "train": cfg.train.model_copy(update={
        "run_dir": str(Path(run_root) / name), "save_every": 0, "resume": False, "progress": False,
        "peak_tflops": cfg.train.peak_tflops or 1.0, "steps": 10_000})}  # peak: MFU is not reported here
    return Trainer(cfg.model_copy(update=overrides)).setup()


def memory_by_phase(trainer: Trainer, offloader: ActivationOffloader) -> list[dict]:
    """One extra step: allocated memory at phase boundaries and the peak inside each phase.

    The boundaries come from the step's phases and the offload session's observers (a region call
    starts; a region's backward starts); the last forward region's row runs until the forward
    returns, so it includes the final norm, head and loss. With offload off a session with an empty
    window observes the same points, so off and on are comparable row by row. `held` = bytes of saved
    region tensors alive on device at the start of the phase (what a window can move to the host),
    `grads` = parameter gradients allocated.
    """
    model, device = trainer.model, trainer.device
    cuda = device.type == "cuda"
    names = {id(checkpoint_region_of(m)): n for n, m in model.named_modules() if checkpoint_region_of(m) is not None}
    key_names = {k: names.get(id(r), "?") for k, r in enumerate(offloader.regions)}
    rows: list[dict] = []

    def mark(label: str | None) -> None:
        if cuda:
            torch.cuda.synchronize(device)
        now = {"allocated": torch.cuda.memory_allocated(device) if cuda else None,
               "held": trainer.offload_session.held_device_bytes(), "grads": _grad_bytes(model)}
        if rows:
            rows[-1]["peak"] = torch.cuda.max_memory_allocated(device) if cuda else None
            rows[-1]["end"] = now
        if label is not None:
            repeats = sum(r["phase"] == label or r["phase"].startswith(f"{label} #") for r in rows)
            rows.append({"phase": label if not repeats else f"{label} #{repeats + 1}", "start": now})
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def region_marker(direction: str):
        return lambda key: mark(f"{direction} region {key} ({key_names[key]})")

    step_phases = {"forward": "forward: embedding", "backward": "bwd loss + head", "optimizer": "optimizer",
                   "end": None}
    trainer.step(StepProbe(offloader=offloader, on_phase=lambda name: mark(step_phases[name]),
                           on_region_forward=region_marker("fwd"), on_region_backward=region_marker("bwd")))
    return rows


def measure_off_and_on(trainer: Trainer, steps: int, warmup: int) -> dict:
    """Step time and peak memory of one Trainer's steps with offload off and on. The same model runs
    both (offload is a property of the step's session, not of the model), alternating off/on step by
    step with the order swapped every step, so host or clock drift during the run hits both alike.
    Peak = the highest of the measured steps'."""
    offloaders = {"off": None, "on": trainer.offloader}
    times: dict[str, list[float]] = {"off": [], "on": []}
    peaks: dict[str, list[int]] = {"off": [], "on": []}
    d2h_bytes, d2h_seconds, summary = 0, 0.0, None
    for step in range(warmup + steps):
        for name in (("off", "on") if step % 2 == 0 else ("on", "off")):
            record = trainer.step(StepProbe(offloader=offloaders[name]))
            if step < warmup:
                continue
            times[name].append(record["step_time_s"])
            if record["peak_memory_allocated_bytes"] is not None:
                peaks[name].append(record["peak_memory_allocated_bytes"])
            session = trainer.offload_session
            if session is not None:
                summary = session.summary()
                for copy in session.host_copies():
                    d2h_bytes += copy.buffer.numel()
                    if copy.d2h_started is not None:
                        d2h_seconds += copy.d2h_started.elapsed_time(copy.d2h_done) / 1e3
    observer = ActivationOffloader.for_model(trainer.model, trainer.cfg.offload.model_copy(update={"enabled": False}),
                                             trainer.device)
    out = {}
    for name in ("off", "on"):
        out[name] = {"step_ms": 1e3 * statistics.median(times[name]),
                     "step_ms_each": [round(1e3 * t, 2) for t in times[name]],
                     "peak_allocated_bytes": max(peaks[name]) if peaks[name] else None,
                     "memory_by_phase": memory_by_phase(trainer, trainer.offloader if name == "on" else observer)}
    out["on"]["offloaded_bytes_per_step"] = summary["session"]["offloaded_bytes"]
    out["on"]["offload"] = summary
    out["on"]["d2h_gbps"] = d2h_bytes / d2h_seconds / 1e9 if d2h_seconds else None
    return out


def _offload_rank(rank: int, world: int, config: str, overrides: list[str], steps: int, warmup: int) -> dict:
    """Part 1 on one rank (common.run_ranks starts it with its process group): every mode's Trainer."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    ceiling = pinned_ceiling_gbps(device)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="spartron-offload-") as tmp:
        for i, (label, mode) in enumerate(OFFLOAD_MODES.items()):
            cfg = load_config(config, [*overrides, *mode, "offload.enabled=true"])
            trainer = _trainer(cfg, tmp, f"offload{i}")
            rows[label] = _compare(measure_off_and_on(trainer, steps, warmup), ceiling)
            trainer.close()
            del trainer
            gc.collect()  # modules, regions and the offloader form cycles: free them before the next mode runs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"pinned_d2h_ceiling_gbps": ceiling, "modes": rows}


def part_offload(config: Path, overrides: list[str], steps: int, warmup: int) -> dict:
    (result,) = run_ranks(_offload_rank, 1, str(config), overrides, steps, warmup, cuda=torch.cuda.is_available())
    return result


# The offload comparisons: AC mode, and whether gradients are freed after each step (torch's default,
# the trainer's `train.keep_grad_buffers = false`) or kept as persistent buffers (Megatron's DDP layout).
# Which one holds matters for full AC: with freed gradients its peak comes late in backward, when the
# gradients have been rebuilt and the offloaded inputs are consumed; with kept buffers it comes at the
# end of forward, where the window's inputs are live.
OFFLOAD_MODES: dict[str, list[str]] = {
    "full AC": ["ac.mode=full"],
    "selective AC": ["ac.mode=selective"],
    "full AC, grads kept": ["ac.mode=full", "train.keep_grad_buffers=true"],
    "selective AC, grads kept": ["ac.mode=selective", "train.keep_grad_buffers=true"],
}


def _compare(measured: dict, ceiling: float | None) -> dict:
    """One mode with offload off and on."""
    off, on = measured["off"], measured["on"]
    row = {"off": off, "on": on, "step_time_ratio": on["step_ms"] / off["step_ms"]}
    if off["peak_allocated_bytes"] is not None:
        saved = off["peak_allocated_bytes"] - on["peak_allocated_bytes"]
        row["peak_reduction_bytes"] = saved
        row["peak_reduction_over_offloaded"] = saved / max(on["offloaded_bytes_per_step"], 1)
    if ceiling and on.get("d2h_gbps"):
        row["d2h_fraction_of_ceiling"] = on["d2h_gbps"] / ceiling
    row["peak_phase"] = peak_phase(off["memory_by_phase"], on["memory_by_phase"])
    return row


def peak_phase(off: list[dict], on: list[dict]) -> dict:
    """Where the off run peaks, and how much of that peak the window could remove (the region
    tensors held there with offload off minus those held with it on)."""
    by_peak = [r for r in off if r.get("peak") is not None]
    i = (max(range(len(off)), key=lambda j: off[j]["peak"]) if by_peak
         else max(range(len(off)), key=lambda j: off[j]["start"]["held"]))  # CPU: most held bytes
    row_on = next((r for r in on if r["phase"] == off[i]["phase"]), None)
    held_off = max(off[i]["start"]["held"], off[i]["end"]["held"])
    held_on = max(row_on["start"]["held"], row_on["end"]["held"]) if row_on else None
    return {"phase": off[i]["phase"], "peak_off": off[i].get("peak"),
            "peak_on": row_on.get("peak") if row_on else None,
            "held_off": held_off, "held_on": held_on,
            "removable_at_peak": None if held_on is None else held_off - held_on,
            "grads_at_peak": off[i]["end"]["grads"], "allocated_before_phase": off[i]["start"]["allocated"]}


def _mb_worker(rank: int, world: int, config: str, overrides: list[str], steps: int, warmup: int,
               trace_dir: str | None) -> dict:
    """One rank of the micro-batch comparison (common.run_ranks starts the ranks and their group)."""
    cuda = torch.cuda.is_available()
    # all_to_all unless --set model.moe.dispatcher=deepep (DeepEP built: benchmarks/build_deepep.sh)
    configs = {n: load_config(config, ["model.moe.dispatcher=all_to_all", *overrides, f"parallel.ep={world}",
                                       f"train.intra_layer_micro_batches={n}"]) for n in (1, 2)}
    results = {}
    shared = [tempfile.mkdtemp(prefix="spartron-mb-") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)  # one run directory for all ranks, as a job has
    try:
        for n, cfg in configs.items():
            trainer = _trainer(cfg, shared[0], f"mb{n}")
            times, host = [], []
            for step in range(warmup + steps):
                marks: dict[str, float] = {}
                dist.barrier()
                probe = StepProbe(on_phase=lambda name, marks=marks: marks.setdefault(name, time.perf_counter()))
                record = trainer.step(probe)
                if step >= warmup:
                    times.append(record["step_time_s"])
                    host.append(marks["optimizer"] - marks["forward"])
            results[f"micro_batches_{n}"] = {"step_ms": 1e3 * statistics.median(times),
                                             "host_issue_ms": 1e3 * statistics.median(host)}
            trace = os.path.join(trace_dir, f"mb{n}_rank{rank}.json.gz") if trace_dir else None
            gpu = profile_step(trainer, rank == 0, trace) if cuda else None
            if gpu and "gpu_busy_ms" in gpu:  # idle against the unprofiled step (the profiler slows the host)
                gpu["gpu_idle_ms"] = results[f"micro_batches_{n}"]["step_ms"] - gpu["gpu_busy_ms"]
            results[f"micro_batches_{n}"]["gpu"] = gpu
            trainer.close()  # collective: releases the EP group's communication buffers
            del trainer
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(shared[0], ignore_errors=True)
    results["dispatcher"] = configs[1].model.moe.dispatcher
    results["scope"] = configs[2].train.intra_layer_micro_batch_scope
    results["transport"] = configs[1].model.moe.all_to_all_transport
    results["copy_engine_sync"] = configs[1].model.moe.copy_engine_sync
    results["speedup_2_over_1"] = results["micro_batches_1"]["step_ms"] / results["micro_batches_2"]["step_ms"]
    return results


def _intersection_ns(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def profile_step(trainer: Trainer, analyse: bool, trace: str | None = None) -> dict | None:
    """One Trainer step under the CUDA profiler: GPU time split into compute kernels (incl. copies),
    communication kernels (`is_comm_kernel`), the part of that hidden under compute, and idle time
    (GPU waiting for the host)."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        trainer.step()  # synchronises the device before it returns
        wall_ns = (time.perf_counter() - start) * 1e9
    ops = _device_time_by_op(trainer, trace)  # a step with collectives: every rank runs it
    if not analyse:
        return None
    try:
        events = [e for e in prof.profiler.kineto_results.events()
                  if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0]
    except AttributeError as err:  # profiler internals moved: say so in the JSON
        return {"error": f"cannot read kineto events: {err}"}
    spans = [((e.start_ns(), e.start_ns() + e.duration_ns()), is_comm_kernel(e.name())) for e in events]
    comm = merge_intervals([span for span, is_comm in spans if is_comm])
    comp = merge_intervals([span for span, is_comm in spans if not is_comm])
    busy = merge_intervals(comm + comp)
    ms = lambda ns: ns / 1e6  # noqa: E731
    length = lambda u: sum(b - a for a, b in u)  # noqa: E731
    families: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}  # name -> [count, total ms, ms of it while a comm kernel ran]
    for e in events:
        family = kernel_family(e.name())
        families[family] = families.get(family, 0.0) + ms(e.duration_ns())
        if not is_comm_kernel(e.name()):
            span = [(e.start_ns(), e.start_ns() + e.duration_ns())]
            row = by_name.setdefault(e.name()[:_NAME_CHARS], [0, 0.0, 0.0])
            row[0] += 1
            row[1] += ms(e.duration_ns())
            row[2] += ms(_intersection_ns(span, comm))
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:_TOP_KERNELS]
    out = {"profiled_step_ms": ms(wall_ns), "kernels": len(events), "compute_busy_ms": ms(length(comp)),
           "comm_busy_ms": ms(length(comm)), "comm_hidden_under_compute_ms": ms(_intersection_ns(comp, comm)),
           "gpu_busy_ms": ms(length(busy)), "kernel_ms_by_family": dict(sorted(families.items())),
           "top_compute_kernels": [{"name": name, "count": int(c), "ms": total, "ms_under_comm": under}
                                   for name, (c, total, under) in top],
           "top_ops_by_device_time": ops}
    return out


def _device_time_by_op(trainer: Trainer, trace: str | None = None) -> list[dict]:
    """Another step under the profiler with host ops recorded: device time per operator (its own
    kernels, not its children's), the largest first. Says which op issues the kernels that grow.
    `trace`: also write this step's Chrome trace there (host ops and kernels, for offline analysis)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.step()
    if trace:
        prof.export_chrome_trace(trace)
    rows = [{"name": e.key[:_NAME_CHARS], "count": int(e.count), "ms": e.self_device_time_total / 1e3}
            for e in prof.key_averages() if e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r["ms"])[:_TOP_KERNELS]


_NAME_CHARS, _TOP_KERNELS = 120, 40  # how much of the per-kernel table the JSON keeps


# Kernel name fragments -> family, first match wins (lower-case). Only for explaining where the time
# of micro-batch 2 vs 1 goes; the busy/overlap numbers above do not depend on it.
_FAMILIES = (("nccl", "nccl"), ("deep_ep", "deepep"), ("memcpy ptop", "peer_copy"),
             ("symmetric_memory::barrier", "peer_sync"), ("memcpy", "copy"),
             ("memset", "copy"), ("flash", "attention"),
             ("fmha", "attention"), ("attention", "attention"), ("softmax", "softmax"),
             ("grouped", "grouped_gemm"), ("gemm", "gemm"), ("nvjet", "gemm"), ("xmma", "gemm"),
             ("cutlass", "gemm"), ("sort", "sort_topk"), ("topk", "sort_topk"), ("scan", "sort_topk"),
             ("index", "index_scatter_gather"), ("scatter", "index_scatter_gather"),
             ("gather", "index_scatter_gather"), ("reduce", "reduction"), ("norm", "norm"),
             ("elementwise", "elementwise"), ("vectorized", "elementwise"), ("cat", "elementwise"))


def is_comm_kernel(name: str) -> bool:
    """NCCL's kernels, DeepEP's (namespace deep_ep), peer-to-peer copies (copy engines) and the
    symmetric-memory barrier that orders them (it spins while it waits for a peer) communicate;
    every other kernel computes."""
    return kernel_family(name) in ("nccl", "deepep", "peer_copy", "peer_sync")


def kernel_family(name: str) -> str:
    """A coarse family for a CUDA kernel name ('other' when no fragment matches)."""
    low = name.lower()
    return next((family for fragment, family in _FAMILIES if fragment in low), "other")


def part_microbatch(config: Path, overrides: list[str], steps: int, warmup: int, trace_dir: Path | None = None) -> dict:
    world = 2
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        return {"skipped": f"needs {world} GPUs, found {torch.cuda.device_count()}"}
    ranks = run_ranks(_mb_worker, world, str(config), overrides, steps, warmup, str(trace_dir) if trace_dir else None,
                      cuda=torch.cuda.is_available())
    return {"ep": world, **ranks[0]}  # rank 0's times (the ranks step together)


def print_report(report: dict) -> None:
    """The human-readable report: targets, where the memory peak is, where the micro-batch time goes."""
    unit, scale = ("KiB", 2**10) if report["device"] == "cpu" else ("MiB", 2**20)

    def size(x: int | None, width: int = 8) -> str:
        return f"{'-':>{width}}" if x is None else f"{x / scale:{width}.0f}"

    print_offload(report.get("offload"), unit, size)
    print_microbatch(report.get("microbatch"))


def print_offload(off: dict | None, unit: str, size) -> None:
    if off is None:
        return
    ceiling = off["pinned_d2h_ceiling_gbps"]
    print(f"== offload window (1 GPU): step time, peak allocated ({unit}), D2H throughput")
    for ac, row in off["modes"].items():
        print(f"{ac:>24}: step {row['off']['step_ms']:7.1f} -> {row['on']['step_ms']:7.1f} ms "
              f"(x{row['step_time_ratio']:.3f}, target <= 1.05); offloaded "
              f"{size(row['on']['offloaded_bytes_per_step'], 0)}; peak {size(row['off']['peak_allocated_bytes'], 0)} "
              f"-> {size(row['on']['peak_allocated_bytes'], 0)}, reduction/offloaded "
              f"{row.get('peak_reduction_over_offloaded', float('nan')):.2f} (target >= 0.8); "
              f"D2H {row['on'].get('d2h_gbps') or float('nan'):.1f} GB/s (ceiling {ceiling or float('nan'):.1f})")
    for ac, row in off["modes"].items():
        print(f"\n== {ac}: memory by phase, {unit} (start = allocated when the phase starts, peak = max "
              "inside it, held = saved region tensors on device at its start, grads = parameter gradients)")
        print(f"{'phase':<36}|{'off start':>10}{'peak':>8}{'held':>8}{'grads':>8} |{'on start':>10}{'peak':>8}"
              f"{'held':>8}{'grads':>8}")
        on_rows = {r["phase"]: r for r in row["on"]["memory_by_phase"]}
        for r in row["off"]["memory_by_phase"]:
            cells = []
            for x in (r, on_rows.get(r["phase"])):
                cells.append("" if x is None else f"{size(x['start']['allocated'], 10)}{size(x.get('peak'))}"
                                                  f"{size(x['start']['held'])}{size(x['start']['grads'])}")
            print(f"{r['phase'][:36]:<36}|{cells[0]} |{cells[1]}")
        pk = row["peak_phase"]
        where = ("peaks in" if pk["peak_off"] is not None
                 else "(no allocator stats on CPU: the phase holding the most region bytes) is")
        print(f"-> the off run {where} '{pk['phase']}' ({size(pk['peak_off'], 0)} {unit}; on: "
              f"{size(pk['peak_on'], 0)}). Region tensors held there: off {size(pk['held_off'], 0)}, on "
              f"{size(pk['held_on'], 0)}, so the window can lower this peak by about "
              f"{size(pk['removable_at_peak'], 0)} of the {size(row['on']['offloaded_bytes_per_step'], 0)} {unit} it "
              f"offloads; parameter gradients hold {size(pk['grads_at_peak'], 0)} {unit} there.")
        if pk["removable_at_peak"] is not None and row["on"]["offloaded_bytes_per_step"]:
            frac = pk["removable_at_peak"] / row["on"]["offloaded_bytes_per_step"]
            verdict = ("the peak is where offloaded inputs would be live, so the window lowers it"
                       if frac >= 0.8 else
                       "the peak comes after most offloaded inputs are consumed (late backward, gradients "
                       "accumulated): offloading region inputs cannot lower it by more than this")
            print(f"   removable/offloaded = {frac:.2f}: {verdict}")


def print_microbatch(mb: dict | None) -> None:
    if mb is None:
        return
    print("\n== intra-layer micro-batches, EP=2 on 2 ranks (rank 0)")
    if "skipped" in mb:
        print("   skipped:", mb["skipped"])
        return
    for n in (1, 2):
        r = mb[f"micro_batches_{n}"]
        line = f"   {n} micro-batch(es): step {r['step_ms']:7.1f} ms, host issues it in {r['host_issue_ms']:7.1f} ms"
        g = r.get("gpu")
        if g and "gpu_busy_ms" in g:
            line += (f"; GPU busy {g['gpu_busy_ms']:.1f} ms (compute {g['compute_busy_ms']:.1f}, comm "
                     f"{g['comm_busy_ms']:.1f}, of it hidden under compute {g['comm_hidden_under_compute_ms']:.1f}),"
                     f" idle {g['gpu_idle_ms']:.1f} ms, {g['kernels']} kernels")
        elif g:
            line += f"; profile: {g}"
        print(line)
    transport = mb.get("transport", "nccl")
    if transport == "copy_engine":
        transport += f", {mb.get('copy_engine_sync', 'barrier')}"
    print(f"   dispatcher {mb.get('dispatcher', 'all_to_all')} ({transport}), scope "
          f"{mb.get('scope', 'layer')}; speedup 2 over 1: "
          f"{mb['speedup_2_over_1']:.3f} (target > 1)")
    g1, g2 = (mb[f"micro_batches_{n}"].get("gpu") or {} for n in (1, 2))
    if "gpu_busy_ms" in g1 and "gpu_busy_ms" in g2:
        hidden = g2["comm_hidden_under_compute_ms"] - g1["comm_hidden_under_compute_ms"]
        print(f"   2 vs 1: compute kernels {g2['compute_busy_ms'] - g1['compute_busy_ms']:+.1f} ms (smaller GEMMs/"
              f"attention per micro-batch), comm hidden under compute {hidden:+.1f} ms (the overlap), GPU idle "
              f"{g2['gpu_idle_ms'] - g1['gpu_idle_ms']:+.1f} ms (host-bound: 2x launches, host syncs)")
        f1, f2 = g1.get("kernel_ms_by_family", {}), g2.get("kernel_ms_by_family", {})
        deltas = sorted(((f2.get(k, 0.0) - f1.get(k, 0.0), k) for k in {*f1, *f2}), reverse=True)
        print("   kernel time by family, 1 -> 2 micro-batches (ms): " + ", ".join(
            f"{k} {f1.get(k, 0.0):.1f} -> {f2.get(k, 0.0):.1f}" for _, k in deltas))
        print_growth(f"compute kernels that grow most (of the top {_TOP_KERNELS} by time)",
                     g1.get("top_compute_kernels", []), g2.get("top_compute_kernels", []), rows=12)
        print_growth("operators whose device time grows most", g1.get("top_ops_by_device_time", []),
                     g2.get("top_ops_by_device_time", []), rows=15)


def print_growth(title: str, top1: list[dict], top2: list[dict], rows: int) -> None:
    """The rows (kernels or operators, by name) whose time grows most from 1 to 2 micro-batches: count
    and ms for each, and the ms while a communication kernel ran where the rows have it."""
    if not top1 or not top2:
        return
    one, two = ({r["name"]: r for r in top} for top in (top1, top2))
    zero = {"count": 0, "ms": 0.0, "ms_under_comm": 0.0}
    under = "ms_under_comm" in top1[0]
    grown = sorted(one.keys() | two.keys(), key=lambda k: -(two.get(k, zero)["ms"] - one.get(k, zero)["ms"]))
    print(f"   {title}: count, ms{' (ms while comm ran)' if under else ''} for 1 -> 2")

    def cell(r: dict) -> str:
        return f"{r['count']:>5} {r['ms']:7.2f}" + (f" ({r['ms_under_comm']:6.2f})" if under else "")

    for name in grown[:rows]:
        a, b = one.get(name, zero), two.get(name, zero)
        print(f"     {b['ms'] - a['ms']:+6.2f} ms  {cell(a)} -> {cell(b)}  {name[:70]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs/dsv3-12l.toml")
    parser.add_argument("--layers", type=int, default=6, help="model.n_layers (the preset has 12)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny preset on CPU, seconds")
    parser.add_argument("--skip-microbatch", action="store_true")
    parser.add_argument("--skip-offload", action="store_true", help="only the micro-batch part")
    parser.add_argument("--trace", type=Path, help="micro-batch part: write each rank's Chrome trace of one step "
                        "with 1 and 2 micro-batches here (mbN_rankR.json.gz)")
    args = parser.parse_args()
    if args.smoke:
        config, device = REPO / "configs/tiny.toml", torch.device("cpu")
        overrides = ["device=cpu", "train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=4",
                     "model.dtype=float32"]
        args.steps, args.warmup = 2, 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/offload.py needs CUDA (use --smoke on CPU)")
        config, device = args.config, torch.device("cuda", 0)
        overrides = [f"model.n_layers={args.layers}"]
    # The micro-batch part uses 4 sequences per step unless --set says otherwise (--set comes last).
    mb_overrides = [*overrides, *([] if args.smoke else ["train.global_batch_size=4"]), *args.set]
    overrides += args.set
    cfg = load_config(config, overrides)
    report = {
        "benchmark": "offload", "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "commit": git_commit(), "config": str(config), "overrides": overrides,
        "shapes": {"layers": cfg.model.n_layers, "dim": cfg.model.dim, "seq_len": cfg.train.seq_len,
                   "micro_batch_size": cfg.train.micro_batch_size, "dtype": cfg.model.dtype},
        "targets": {"step_time_ratio_max": 1.05, "peak_reduction_over_offloaded_min": 0.8,
                    "d2h_fraction_of_ceiling_min": 0.7, "micro_batch_speedup_min": 1.0},
    }
    if not args.skip_offload:
        report["offload"] = part_offload(config, overrides, args.steps, args.warmup)
    if not args.skip_microbatch:
        if args.trace:
            args.trace.mkdir(parents=True, exist_ok=True)
        report["microbatch"] = part_microbatch(config, mb_overrides, args.steps, args.warmup, args.trace)
    print_report(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
