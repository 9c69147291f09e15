"""Offload windows and intra-layer micro-batches on the reference GPU model.

    python benchmarks/offload.py --out benchmarks/results/offload.json     # CUDA (H200), dsv3-12l
    python benchmarks/offload.py --smoke                                   # tiny preset, CPU, seconds

Part 1 (one GPU): forward+backward step time and peak allocated memory for full and selective AC,
offload off and on (window all_but_last), with the bytes offloaded per step, the peak reduction as a
fraction of those bytes (target >= 0.8), the step-time ratio on/off (target <= 1.05) and the D2H
throughput of the offload copies (timed with events on the D2H stream) against the measured
pinned-copy ceiling (target >= 0.7 of ~54 GB/s).
Part 2 (two ranks, EP=2, spawned): step time with train.intra_layer_micro_batches = 1 vs 2
(all_to_all dispatcher; target: 2 is faster because one micro-batch's exchange overlaps the other's
experts). On CPU (--smoke) both parts run on the tiny preset with gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spartron.checkpointing.offload import ActivationOffloader  # noqa: E402
from spartron.layers.model import build_model  # noqa: E402
from spartron.runtime.config import load_config  # noqa: E402
from spartron.runtime.metrics import git_commit  # noqa: E402
from spartron.runtime.parallelize import parallelize  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def _batch(cfg, device, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (n, cfg.train.seq_len)
    return (torch.randint(0, cfg.model.vocab_size, shape, generator=g).to(device),
            torch.randint(0, cfg.model.vocab_size, shape, generator=g).to(device))


def measure_single(cfg, device: torch.device, steps: int, warmup: int, groups) -> dict:
    """Step time (forward + backward, no optimizer) and peak memory for one config on one device."""
    torch.manual_seed(0)
    with device:
        model = parallelize(build_model(cfg.model, groups), groups, cfg)
    offloader = ActivationOffloader.for_model(model, cfg.offload, device) if cfg.offload.enabled else None
    tokens, labels = _batch(cfg, device, cfg.train.micro_batch_size)
    times, d2h_bytes, d2h_seconds, summary = [], 0, 0.0, None
    for step in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        if offloader is None:
            model(tokens, labels)["loss"].backward()
        else:
            with offloader.session() as session:
                model(tokens, labels)["loss"].backward()
        _sync(device)
        if step < warmup:
            continue
        times.append(time.perf_counter() - start)
        if offloader is not None:
            summary = session.summary()
            for copy in session.host_copies():
                d2h_bytes += copy.buffer.numel()
                if copy.d2h_started is not None:
                    d2h_seconds += copy.d2h_started.elapsed_time(copy.d2h_done) / 1e3
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    out = {"step_ms": 1e3 * statistics.median(times), "peak_allocated_bytes": peak}
    if summary is not None:
        out["offloaded_bytes_per_step"] = summary["session"]["offloaded_bytes"]
        out["offload"] = summary
        out["d2h_gbps"] = d2h_bytes / d2h_seconds / 1e9 if d2h_seconds else None
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _one_rank_groups(device: torch.device, tmp: str):
    """A 1-rank group on CUDA: parallelize then applies FSDP2's bf16 mixed precision, as the trainer does."""
    if device.type != "cuda":
        return None
    from spartron.parallel.dims import ParallelDims
    from spartron.parallel.groups import ParallelGroups

    dist.init_process_group("nccl", store=dist.FileStore(os.path.join(tmp, "store1"), 1), rank=0, world_size=1)
    return ParallelGroups.build(ParallelDims(1, fsdp=1), "cuda")


def part_offload(config: Path, overrides: list[str], device: torch.device, steps: int, warmup: int) -> dict:
    ceiling = pinned_ceiling_gbps(device)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        groups = _one_rank_groups(device, tmp)
        for ac in ("full", "selective"):
            rows[ac] = _compare(config, overrides, ac, device, steps, warmup, groups, ceiling)
        if groups is not None:
            groups.destroy()
            dist.destroy_process_group()
    return {"pinned_d2h_ceiling_gbps": ceiling, "modes": rows}


def _compare(config, overrides, ac, device, steps, warmup, groups, ceiling) -> dict:
    """One AC mode with offload off and on."""
    off = measure_single(load_config(config, [*overrides, f"ac.mode={ac}", "offload.enabled=false"]),
                         device, steps, warmup, groups)
    on = measure_single(load_config(config, [*overrides, f"ac.mode={ac}", "offload.enabled=true"]),
                        device, steps, warmup, groups)
    row = {"off": off, "on": on, "step_time_ratio": on["step_ms"] / off["step_ms"]}
    if off["peak_allocated_bytes"] is not None:
        saved = off["peak_allocated_bytes"] - on["peak_allocated_bytes"]
        row["peak_reduction_bytes"] = saved
        row["peak_reduction_over_offloaded"] = saved / max(on["offloaded_bytes_per_step"], 1)
    if ceiling and on.get("d2h_gbps"):
        row["d2h_fraction_of_ceiling"] = on["d2h_gbps"] / ceiling
    return row


def _mb_worker(rank: int, world: int, store_path: str, config: str, overrides: list[str], steps: int,
               warmup: int, result_path: str) -> None:
    from spartron.parallel.dims import ParallelDims
    from spartron.parallel.groups import ParallelGroups

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store_path, world),
                            rank=rank, world_size=world)
    groups = ParallelGroups.build(ParallelDims(world, fsdp=world, ep=world), device.type)
    results = {}
    for n in (1, 2):
        cfg = load_config(config, [*overrides, f"parallel.ep={world}", "model.moe.dispatcher=all_to_all",
                                   f"train.intra_layer_micro_batches={n}"])
        torch.manual_seed(0)
        with device:
            model = parallelize(build_model(cfg.model, groups), groups, cfg)
        tokens, labels = _batch(cfg, device, cfg.train.micro_batch_size, seed=rank)
        times = []
        for step in range(warmup + steps):
            model.zero_grad(set_to_none=True)
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            model(tokens, labels)["loss"].backward()
            _sync(device)
            if step >= warmup:
                times.append(time.perf_counter() - start)
        results[f"micro_batches_{n}"] = {"step_ms": 1e3 * statistics.median(times)}
        del model
    if rank == 0:
        results["speedup_2_over_1"] = results["micro_batches_1"]["step_ms"] / results["micro_batches_2"]["step_ms"]
        Path(result_path).write_text(json.dumps(results))
    groups.destroy()
    dist.destroy_process_group()


def part_microbatch(config: Path, overrides: list[str], steps: int, warmup: int) -> dict:
    world = 2
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        return {"skipped": f"needs {world} GPUs, found {torch.cuda.device_count()}"}
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "mb.json")
        mp.spawn(_mb_worker, args=(world, os.path.join(tmp, "store"), str(config), overrides, steps, warmup,
                                   result), nprocs=world, join=True)
        return {"ep": world, **json.loads(Path(result).read_text())}


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
    overrides += args.set
    cfg = load_config(config, overrides)
    report = {
        "benchmark": "offload", "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "git_commit": git_commit(), "config": str(config), "overrides": overrides,
        "shapes": {"layers": cfg.model.n_layers, "dim": cfg.model.dim, "seq_len": cfg.train.seq_len,
                   "micro_batch_size": cfg.train.micro_batch_size, "dtype": cfg.model.dtype},
        "targets": {"step_time_ratio_max": 1.05, "peak_reduction_over_offloaded_min": 0.8,
                    "d2h_fraction_of_ceiling_min": 0.7, "micro_batch_speedup_min": 1.0},
        "offload": part_offload(config, overrides, device, args.steps, args.warmup),
    }
    if not args.skip_microbatch:
        mb_overrides = overrides if args.smoke else [*overrides, "train.global_batch_size=4"]
        report["microbatch"] = part_microbatch(config, mb_overrides, args.steps, args.warmup)
    for ac, row in report["offload"]["modes"].items():
        print(f"{ac:>9}: step {row['off']['step_ms']:8.1f} -> {row['on']['step_ms']:8.1f} ms "
              f"(x{row['step_time_ratio']:.3f}), offloaded {row['on']['offloaded_bytes_per_step'] / 2**20:9.1f} MiB, "
              f"peak reduction/offloaded {row.get('peak_reduction_over_offloaded', float('nan')):.2f}, "
              f"D2H {row['on'].get('d2h_gbps') or float('nan'):.1f} GB/s "
              f"(ceiling {report['offload']['pinned_d2h_ceiling_gbps'] or float('nan'):.1f})")
    if "microbatch" in report:
        print("micro-batches (EP=2):", json.dumps(report["microbatch"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
