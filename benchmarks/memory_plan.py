"""The memory planner against the measured peak: for each AC mode, `spartron.launch.plan.plan_memory`'s
predicted peak allocated bytes per rank next to torch.cuda.max_memory_allocated of every step the
public Trainer runs (its step records reset and read the peak), eager.

    python benchmarks/memory_plan.py --out benchmarks/results/memory_plan/memory_plan_dsv3-12l.json --commit SHA
    python benchmarks/memory_plan.py --smoke        # tiny preset on CPU: the plan only (no allocator peak)
    torchrun --nproc-per-node 2 benchmarks/memory_plan.py --set parallel.ep=2 ...   # rank 0 writes

The measured peak of a mode is the largest of its steps after --warmup (the first step also creates
the optimizer state); every step's peak is in the JSON.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import start_trainer_benchmark, trainer_report_header, write_report  # noqa: E402

from spartron.launch.plan import plan_memory  # noqa: E402
from spartron.runtime.config import load_config  # noqa: E402
from spartron.runtime.trainer import train  # noqa: E402

MODES = {"none": ["ac.mode=none"], "full": ["ac.mode=full"], "selective": ["ac.mode=selective"],
         "selective+offload": ["ac.mode=selective", "offload.enabled=true"]}
GIB = 2**30


def run_mode(config: Path, mode: str, args: argparse.Namespace, root: Path) -> dict:
    overrides = MODES[mode] + [f"train.steps={args.steps}", "train.save_every=0", "train.resume=false",
                               "train.progress=false", "train.peak_tflops=750",
                               f"train.run_dir={root / mode.replace('+', '_')}", *args.set]
    cfg = load_config(config, overrides)
    world = dist.get_world_size()
    plan = plan_memory(cfg, world, dist.get_rank())
    row = {"mode": mode, "overrides": overrides, "predicted_peak_gib": plan.peak / GIB, "predicted_phase": plan.phase,
           "predicted_parts_gib": {k: v / GIB for k, v in plan.parts.items()},
           "predicted_phases_gib": {k: v / GIB for k, v in plan.phases.items()}}
    if args.smoke:
        return row
    gc.collect()
    torch.cuda.empty_cache()
    result = train(cfg)
    steps = [{"step": r["step"], "step_time_ms": 1e3 * r["step_time_s"], "loss": r["loss"],
              "peak_allocated_gib": r["peak_memory_allocated_bytes"] / GIB,
              "peak_reserved_gib": r["peak_memory_reserved_bytes"] / GIB} for r in result.records]
    timed = steps[args.warmup:]
    measured = max(s["peak_allocated_gib"] for s in timed)
    row.update(steps=steps, timed_steps=len(timed), measured_peak_gib=measured,
               error_percent=100 * (row["predicted_peak_gib"] / measured - 1))
    del result
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "dsv3-12l.toml")
    parser.add_argument("--modes", default="none,full,selective")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--commit", default=None, help="the commit measured (a device copy's git may lie)")
    parser.add_argument("--smoke", action="store_true", help="tiny preset on CPU: predictions only")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    own = start_trainer_benchmark(args)  # (its smoke mode predicts only: --steps does not matter there)
    rows: list[dict] = []
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {**trainer_report_header("memory_plan", args, world), "overrides": args.set, "steps": args.steps,
              "warmup_steps_excluded": args.warmup,
              "plan_assumes": "eager steps (train.compile = false)", "results": rows}
    with tempfile.TemporaryDirectory(prefix="spartron-memplan-") as tmp:
        for mode in modes:
            try:
                rows.append(run_mode(args.config, mode, args, Path(tmp)))
            except Exception as err:  # noqa: BLE001 - an OOM in one mode must not hide the others
                if world > 1:
                    raise
                rows.append({"mode": mode, "error": f"{type(err).__name__}: {err}"})
            r = rows[-1]
            if rank == 0:  # after every mode: a run cut short still reports the modes it finished
                print(f"{r['mode']:<18} predicted {r.get('predicted_peak_gib', float('nan')):8.2f} GiB  measured "
                      f"{r.get('measured_peak_gib', float('nan')):8.2f} GiB  error "
                      f"{r.get('error_percent', float('nan')):+6.1f} %  {r.get('error', '')}", flush=True)
                write_report(args.out, report)
    if own:
        dist.destroy_process_group()
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
