"""Pieces every benchmark script shares: report file, device name, timing, spawning the ranks.

The scripts run as files (`python benchmarks/NAME.py`, as benchmarks/run_gpu.sh does), so they
import this module as `common`: the script's own folder is first on sys.path.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as sorted, disjoint intervals (touching ones merged)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def triton_version() -> str | None:
    """Triton's version for a report, or None where it is not installed (the CPU smoke runs)."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_one(step: Callable[[], object], device: torch.device, top: int = 12) -> dict:
    """`step()` once under torch.profiler: wall ms, kernel ms and launches (device kernels; CPU ops on CPU) and the
    `top` kernels by time."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        wall = (time.perf_counter() - start) * 1e3
    events = [e for e in prof.key_averages() if (e.self_device_time_total if cuda else e.self_cpu_time_total) > 0]
    ms = {e.key: (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3 for e in events}
    kernels = sorted(events, key=lambda e: -ms[e.key])
    return {"wall_ms": wall, "kernel_ms": sum(ms.values()), "launches": sum(e.count for e in events),
            "top": [{"name": e.key[:120], "ms": ms[e.key], "count": e.count} for e in kernels[:top]]}


def write_report(path: Path | None, report: dict) -> None:
    """Write the JSON report (indented, one trailing newline) where --out says; no --out: nothing.

    One writer so every result file that run_gpu.sh brings back has the same form. Written beside and renamed
    over `path`: a call's time limit mid-write leaves the previous report whole, never a truncated one.
    """
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(report, indent=2) + "\n")
    part.replace(path)
    print(f"wrote {path}")


def device_name(cuda: bool) -> str:
    """The GPU's name for the report (the current CUDA device), or "cpu" for a CPU run."""
    return torch.cuda.get_device_name() if cuda else "cpu"


def elapsed_ms(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Milliseconds per call of `calls` back-to-back calls of `fn`, synchronised only at the end.

    CUDA events on the GPU measure the device's time (the host may run ahead between calls, as in a
    training step); on CPU the wall time.
    """
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e3 / calls


def call_times_ms(fn: Callable[[], object], iters: int, device: torch.device) -> list[float]:
    """The ms of each of `iters` single calls of `fn` (elapsed_ms of one call: CUDA events around it on
    the GPU, the wall time on CPU)."""
    return [elapsed_ms(fn, 1, device) for _ in range(iters)]


def median_ms(fn: Callable[[], object], iters: int, warmup: int, device: torch.device,
              setup: Callable[[], object] | None = None) -> float:
    """Median ms of single `fn()` calls after `warmup` untimed ones; `setup()` runs untimed before each.

    The device is synchronised before each timed call so that no earlier work lands in its time.
    """
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    times = []
    for _ in range(iters):
        if setup:
            setup()
        sync(device)
        times.append(elapsed_ms(fn, 1, device))
    return statistics.median(times)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, cuda: bool, tmp_dir: str | None = None) -> list:
    """Run `fn(rank, world, *args)` on `world` ranks with the default process group initialised and
    return each rank's result, in rank order.

    CPU: gloo ranks forked by `spartron.testing.run_distributed` (fast start, a 120 s limit).
    CUDA: freshly spawned NCCL ranks, one GPU each (CUDA cannot be used in a forked child), each
    pinned to its own cores (`bind_to_cores`); the results must be JSON-serialisable, rank 0 hands
    them back through a file in `tmp_dir`.
    """
    if not cuda:
        from spartron.testing import run_distributed

        return run_distributed(fn, world, *args, timeout=120)
    from spartron.launch.rank_env import held_port

    with tempfile.TemporaryDirectory(prefix="spartron-bench-", dir=tmp_dir) as tmp, held_port() as port:
        path = os.path.join(tmp, "ranks.json")
        mp.spawn(_nccl_rank, args=(world, fn, args, port, path), nprocs=world, join=True)
        return json.loads(Path(path).read_text())


def bind_to_cores(rank: int, world: int) -> list[int]:
    """Pin this spawned rank to its slice of the cores it may run on (the launcher's rule,
    `spartron.launch.rank_env.core_slices`, as `launch.bind_cores = true` applies it); returns the slice.

    Unpinned, the slowest rank's host paces both GPUs (see core_slices); a Slurm task launched with
    --cpus-per-task is bound the same way by srun, so pinned numbers are the ones a job sees.
    """
    from spartron.launch.rank_env import core_slices

    mine = core_slices(os.sched_getaffinity(0), world)[rank]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    return mine


def _nccl_rank(rank: int, world: int, fn: Callable[..., Any], args: tuple, port: int, path: str) -> None:
    bind_to_cores(rank, world)
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300),
                            device_id=torch.device("cuda", rank))
    try:
        result = fn(rank, world, *args)
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            Path(path).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()
    # not through interpreter teardown: process groups that DTensor caches still hold could abort it
    # there (spartron/launch/process.py), and mp.spawn would then discard the results of every rank
    from spartron.launch.process import exit_process

    exit_process(0)


MOE_BENCH = Path(__file__).resolve().parents[1] / "configs" / "moe-layer-bench.toml"
# --smoke: the preset shrunk to the tiny preset's MoE sizes (seconds on a CPU); what the layer scripts vary
# model.dim 128: one FP8 tile, so deepep.py's smoke sends FP8 rows too
MOE_SMOKE = ("device=cpu", "model.dim=128", "model.moe.n_routed_experts=8", "model.moe.top_k=2",
             "model.moe.moe_inter_dim=32", "model.moe.n_shared_experts=1", "train.seq_len=256")


def moe_bench_model(smoke: bool, tokens: int, dtype: str, **moe: Any) -> tuple[Any, dict]:
    """(the ModelConfig of configs/moe-layer-bench.toml in `dtype` with `moe` overrides, the report's shape:
    n_experts, top_k, dim, inter, shared, tokens per rank). `tokens` > 0: tokens per rank (train.seq_len)."""
    from spartron.runtime.config import load_config

    overrides = [*(MOE_SMOKE if smoke else ()), f'model.dtype="{dtype}"',
                 *(f"model.moe.{key}={value!r}" for key, value in moe.items())]
    if tokens:
        overrides += [f"train.seq_len={tokens}", f"model.max_seq_len={max(tokens, 16384)}"]
    cfg = load_config(MOE_BENCH, overrides)
    m, t = cfg.model, cfg.train
    shape = {"n_experts": m.moe.n_routed_experts, "top_k": m.moe.top_k, "dim": m.dim, "inter": m.moe.moe_inter_dim,
             "shared": m.moe.n_shared_experts, "tokens": t.seq_len * t.micro_batch_size}
    return m, shape


def fill_attention_shape(args: Any, smoke: bool, names: dict[str, str]) -> None:
    """Give every `args` attribute in `names` that its flag left None the value of the model field it names
    (mla.kv_lora_rank, dsa.index_topk, n_heads, ...) in configs/dsa-12l.toml, or configs/tiny.toml with
    --smoke: the DSA kernel benchmarks measure the shapes the presets train."""
    from spartron.runtime.config import load_config

    preset = Path(__file__).resolve().parents[1] / "configs" / ("tiny.toml" if smoke else "dsa-12l.toml")
    model = load_config(preset).model
    for attr, field in names.items():
        if getattr(args, attr) is None:
            value = model
            for part in field.split("."):
                value = getattr(value, part)
            setattr(args, attr, value)


def start_trainer_benchmark(args: Any) -> bool:
    """The start every Trainer benchmark shares (e2e, precision, memory_plan). `--smoke`: the tiny preset on
    CPU, 3 steps after 1 warm-up where the script steps; on a GPU an unset `--peak-tflops` means 750 (the
    H200's measured bf16 matmul ceiling); the process group comes from the launcher's environment, a
    1-rank one when the script is started directly. Returns whether this call created the group (the
    caller then destroys it)."""
    from spartron.parallel.env import discover, init_distributed

    if args.smoke:
        args.config, args.set = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml", ["device=cpu", *args.set]
        if hasattr(args, "steps"):
            args.steps, args.warmup = 3, 1
    elif hasattr(args, "peak_tflops") and args.peak_tflops is None and torch.cuda.is_available():
        args.peak_tflops = 750.0
    own = not dist.is_initialized()
    if own:
        init_distributed(discover(), "auto")
    return own


def trainer_report_header(benchmark: str, args: Any, world: int) -> dict:
    """The fields every Trainer benchmark's JSON starts with: what ran, where, on which versions and commit
    (`--commit` when given: a device copy's git may lie), and the config it ran."""
    import importlib.util

    from spartron.runtime.metrics import git_commit

    repo = Path(__file__).resolve().parents[1]
    config = args.config.relative_to(repo) if args.config.is_relative_to(repo) else args.config
    return {"benchmark": benchmark, "device": device_name(torch.cuda.is_available() and not args.smoke),
            "world_size": world, "torch": torch.__version__,
            "triton": importlib.import_module("triton").__version__ if importlib.util.find_spec("triton") else None,
            "commit": args.commit or git_commit(), "config": str(config)}

