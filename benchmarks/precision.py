"""Precision modes on one preset: step time and peak memory of bf16-only (parameters, gradients and AdamW
state in bf16) against fp32 masters with bf16 compute (model.master_dtype = "float32"), held two ways:
"fp32_masters" (model.master_weights = "fsdp": sharded fp32 parameters, fp32 gradients and AdamW state,
FSDP2 all-gathering bf16 copies; one rank included) and "fp32_optimizer" (model.master_weights =
"optimizer": bf16 parameters, fp32 masters, main gradients and AdamW state in the optimizer, which writes
the bf16 weight as it updates the master; one rank).

    python benchmarks/precision.py --out benchmarks/results/precision/precision_dsv3-12l.json --commit SHA
    python benchmarks/precision.py --set train.compile=true --set ac.mode=\"none\" --modes fp32_optimizer,fp32_masters
    python benchmarks/precision.py --smoke                      # tiny preset, CPU, seconds

Each mode runs the public Trainer for --steps steps (the first --warmup excluded from the medians) on
the same process group. A mode that does not fit (OOM) is retried with --fallback-layers layers, and
so is the other mode, so both are compared on the same shapes; the JSON says which.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name, start_trainer_benchmark, triton_version, write_report  # noqa: E402

from spartron.layers.costs import count_parameters  # noqa: E402
from spartron.runtime.config import load_config  # noqa: E402
from spartron.runtime.metrics import git_commit  # noqa: E402
from spartron.runtime.trainer import train  # noqa: E402

MODES = {"bf16": ["model.dtype=bfloat16"], "fp32_masters": ["model.dtype=bfloat16", "model.master_dtype=float32"],
         "fp32_optimizer": ["model.dtype=bfloat16", "model.master_dtype=float32", "model.master_weights=optimizer"]}


def run_mode(args: argparse.Namespace, mode: str, layers: int | None, root: Path) -> dict:
    overrides = [*MODES[mode], f"train.steps={args.steps}", "train.save_every=0", "train.resume=false",
                 "train.progress=false", f"train.run_dir={root / f'{mode}_{layers}'}", *args.set]
    if layers is not None:
        overrides.append(f"model.n_layers={layers}")
    if args.peak_tflops:
        overrides.append(f"train.peak_tflops={args.peak_tflops}")
    cfg = load_config(args.config, overrides)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    records = train(cfg).records
    timed = records[args.warmup:]
    params = count_parameters(cfg.model)
    return {"mode": mode, "n_layers": cfg.model.n_layers, "dtype": cfg.model.dtype,
            "master_dtype": cfg.model.stored_dtype, "master_weights": cfg.model.master_weights,
            "reduce_dtype": cfg.model.reduce_dtype, "compile": cfg.train.compile,
            "parameters": params.total, "ac_mode": cfg.ac.mode, "seq_len": cfg.train.seq_len,
            "micro_batch_size": cfg.train.micro_batch_size, "timed_steps": len(timed),
            "step_time_s": statistics.median(r["step_time_s"] for r in timed),
            "step_times_s": [r["step_time_s"] for r in records],
            "tokens_per_s_per_gpu": statistics.median(r["tokens_per_s_per_gpu"] for r in timed),
            "mfu": statistics.median(r["mfu"] for r in timed),
            "peak_memory_allocated_gib": max(r["peak_memory_allocated_bytes"] for r in records) / 2**30,
            "peak_memory_reserved_gib": max(r["peak_memory_reserved_bytes"] for r in records) / 2**30,
            "losses": [r["loss"] for r in records]}


def _oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "dsv3-12l.toml")
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--fallback-layers", type=int, default=8)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, in order (of {', '.join(MODES)})")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--commit", default=None, help="the commit measured (a device copy's git may lie)")
    parser.add_argument("--smoke", action="store_true", help="tiny preset on CPU for 3 steps")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: each of {', '.join(MODES)}, got {args.modes!r}")
    own = start_trainer_benchmark(args)
    rows, notes, layers = [], [], None
    with tempfile.TemporaryDirectory(prefix="spartron-precision-") as tmp:
        for mode in modes:
            try:
                rows.append(run_mode(args, mode, layers, Path(tmp)))
            except Exception as err:  # noqa: BLE001 - an OOM is a result here
                if not _oom(err) or layers is not None or dist.get_world_size() > 1:
                    raise
                notes.append(f"{mode} at the preset's layers: {type(err).__name__}: {str(err)[:300]}")
                layers = args.fallback_layers
                rows = [run_mode(args, m, layers, Path(tmp)) for m in modes]
                break
    rank, world = dist.get_rank(), dist.get_world_size()
    if own:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    for r in rows:
        print(f"{r['mode']:>14} layers {r['n_layers']:>2}: step {r['step_time_s'] * 1e3:8.1f} ms, "
              f"peak alloc {r['peak_memory_allocated_gib']:6.2f} GiB, MFU {r['mfu']:.1%}")
    write_report(args.out, {
        "benchmark": "precision", "device": device_name(torch.cuda.is_available() and not args.smoke),
        "world_size": world, "torch": torch.__version__,
        "triton": triton_version(),
        "cuda": torch.version.cuda, "commit": args.commit or git_commit(),
        "config": str(args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config),
        "overrides": args.set, "steps": args.steps, "warmup_steps_excluded": args.warmup,
        "peak_tflops_per_gpu": args.peak_tflops, "gpu_memory_gib": (torch.cuda.get_device_properties(0).total_memory
                                                                   / 2**30 if torch.cuda.is_available() else None),
        "notes": notes, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
