"""Muon against AdamW on a preset through the public Trainer: the optimizer's time per step, the step time and
peak memory, each optimizer in its own Trainer on the same process group, one after the other.

    python benchmarks/muon.py --out benchmarks/results/muon/muon_dsv3-12l_SHA.json --commit SHA   # one GPU
    python benchmarks/muon.py --smoke                                         # tiny preset, CPU, seconds
    torchrun --nproc-per-node N benchmarks/muon.py --config ... --out ...     # several GPUs: rank 0 writes

`train.optimizer` is the only difference between the two runs. Per step: `optimizer_step_ms`, the
optimizer's `step()` alone (the device synchronised before and after it: the trainer has already read the
gradient norm on the host there, so nothing that overlapped is lost), and `optimizer_phase_ms`, the
trainer's whole optimizer phase (norm, clip, step, zero_grad, expert-bias update). The first --warmup steps
are excluded from the medians; every step is in the JSON. The target (issue 38): Muon's median optimizer
step within 1.5x of AdamW's. Beside it, the Newton-Schulz work Muon cannot avoid: its FLOPs per step (5
quintic iterations per matrix, each 4 m^2 n + 2 m^3 for an m x n matrix, m <= n, every expert one matrix)
and their time at --peak-tflops, divided over the ranks that share them (one data-parallel replica).
`--profile`: one more step per optimizer whose `step()` runs under torch.profiler (left out of the timings): its
wall time, kernel time and launches and the kernels that take the most (`profile` in its row).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import profile_one, start_trainer_benchmark, sync, trainer_report_header, write_report  # noqa: E402

from spartron.layers.costs import muon_takes, param_shapes  # noqa: E402
from spartron.runtime.config import load_config  # noqa: E402
from spartron.runtime.trainer import StepProbe, Trainer  # noqa: E402

TARGET_RATIO = 1.5
NS_STEPS = 5


def newton_schulz_flops(cfg) -> int:  # noqa: ANN001 - a RunConfig
    """FLOPs of one step's Newton-Schulz over every Muon matrix of the whole model (experts one by one)."""
    total = 0
    for shape in param_shapes(cfg.model).values():
        if muon_takes(shape, cfg.model.vocab_size):
            m, n = sorted(shape[-2:])
            matrices = shape[0] if len(shape) == 3 else 1
            total += matrices * NS_STEPS * (4 * m * m * n + 2 * m**3)
    return total


def run_optimizer(name: str, args: argparse.Namespace, run_root: Path) -> dict:
    overrides = [f'train.optimizer="{name}"', f"train.steps={args.steps + int(args.profile)}", "train.save_every=0",
                 "train.resume=false", "train.progress=false", f"train.run_dir={run_root / name}", *args.set]
    cfg = load_config(args.config, overrides)
    gc.collect()  # the previous run's trainer (model, grads, optimizer state) sits in reference cycles until now
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    trainer = Trainer(cfg).setup()
    device, optimizer = trainer.device, trainer.optimizer
    step_ms: list[float] = []
    inner = optimizer.step

    profiled: dict = {}

    def timed_step(*a, **k):  # noqa: ANN002, ANN003, ANN202
        if len(step_ms) == args.steps:  # --profile's extra step
            profiled.update(profile_one(lambda: inner(*a, **k), device))
            return None
        sync(device)
        t0 = time.perf_counter()
        out = inner(*a, **k)
        sync(device)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        return out

    optimizer.step = timed_step  # instance attribute: the trainer's clip_and_step_ calls it
    phase_ms, records = [], []
    try:
        while not trainer.done:
            marks: dict[str, float] = {}

            def mark(phase: str, marks: dict = marks) -> None:
                if phase == "optimizer":
                    sync(device)
                marks[phase] = time.perf_counter()

            records.append(trainer.step(StepProbe(on_phase=mark)))
            phase_ms.append((marks["end"] - marks["optimizer"]) * 1e3)
    finally:
        del optimizer.step  # the class's step again (timed_step -> inner -> optimizer is one of those cycles)
        trainer.close()
    records, phase_ms = records[:args.steps], phase_ms[:args.steps]  # --profile's extra step is not timed
    w = args.warmup if len(records) > args.warmup else 0
    row = {"profile": profiled} if profiled else {}
    return row | {"optimizer": name, "overrides": overrides, "steps": len(records), "timed_steps": len(records) - w,
            "optimizer_step_ms": step_ms, "optimizer_phase_ms": phase_ms,
            "step_time_s": [r["step_time_s"] for r in records], "loss": [r["loss"] for r in records],
            "median_optimizer_step_ms": statistics.median(step_ms[w:]),
            "median_optimizer_phase_ms": statistics.median(phase_ms[w:]),
            "median_step_time_s": statistics.median(r["step_time_s"] for r in records[w:]),
            "peak_memory_allocated_gib": max(r["peak_memory_allocated_bytes"] for r in records) / 2**30}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "dsv3-12l.toml")
    parser.add_argument("--optimizers", default="adamw,muon", help="comma-separated subset of adamw,muon")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="matmul peak for the Newton-Schulz floor (default: 750 on CUDA, the H200's bf16)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (both runs)")
    parser.add_argument("--commit", default=None, help="the commit to record (a device copy's git may lie)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny preset on CPU, 3 steps after 1 warm-up")
    parser.add_argument("--profile", action="store_true", help="one more step per optimizer, its step() profiled")
    args = parser.parse_args()
    own = start_trainer_benchmark(args)
    world = dist.get_world_size()
    report = trainer_report_header("muon", args, world)
    cfg = load_config(args.config, ['train.optimizer="muon"', *args.set])  # the shapes: --set may name Muon's keys
    flops = newton_schulz_flops(cfg)
    replicas = cfg.parallel.dp_replicate
    report["newton_schulz"] = {"tflop_per_step_whole_model": flops / 1e12, "peak_tflops": args.peak_tflops,
                               "floor_ms_per_rank": (flops * replicas / world / (args.peak_tflops * 1e12) * 1e3
                                                     if args.peak_tflops else None)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="spartron-muon-") as tmp:
        root = Path(tmp)
        if world > 1:  # one run directory for every rank: rank 0's
            holder = [str(root)]
            dist.broadcast_object_list(holder, src=0)
            root = Path(holder[0])
        for name in args.optimizers.split(","):
            try:
                rows.append(run_optimizer(name, args, root))
            except Exception as err:  # noqa: BLE001 - the other optimizer's row still counts
                traceback.print_exc()
                rows.append({"optimizer": name, "error": f"{type(err).__name__}: {err}"})
    report["rows"] = rows
    by = {r["optimizer"]: r for r in rows if "error" not in r}
    if "adamw" in by and "muon" in by:
        ratio = by["muon"]["median_optimizer_step_ms"] / by["adamw"]["median_optimizer_step_ms"]
        report["muon_over_adamw_optimizer_step"] = ratio
        report["target"] = {"ratio": TARGET_RATIO, "met": ratio <= TARGET_RATIO}
    if dist.get_rank() == 0:
        for r in rows:
            if "error" in r:
                print(f"{r['optimizer']}: error {r['error']}")
            else:
                print(f"{r['optimizer']}: optimizer step {r['median_optimizer_step_ms']:.1f} ms, phase "
                      f"{r['median_optimizer_phase_ms']:.1f} ms, step {r['median_step_time_s'] * 1e3:.1f} ms, "
                      f"peak {r['peak_memory_allocated_gib']:.2f} GiB")
                if "profile" in r:
                    p = r["profile"]
                    print(f"{r['optimizer']} profiled step(): wall {p['wall_ms']:.1f} ms, kernels "
                          f"{p['kernel_ms']:.1f} ms in {p['launches']} launches; top: " + "; ".join(
                              f"{k['name'][:60]} {k['ms']:.1f} ms / {k['count']}" for k in p["top"]))
        ns = report["newton_schulz"]
        print(f"Newton-Schulz: {ns['tflop_per_step_whole_model']:.4g} TFLOP per step"
              + (f", floor {ns['floor_ms_per_rank']:.1f} ms per rank" if ns["floor_ms_per_rank"] else ""))
        if "target" in report:
            print(f"muon / adamw optimizer step: {report['muon_over_adamw_optimizer_step']:.2f}x "
                  f"(target <= {TARGET_RATIO}x: {'met' if report['target']['met'] else 'missed'})")
        write_report(args.out, report)
    if own:
        dist.destroy_process_group()
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
