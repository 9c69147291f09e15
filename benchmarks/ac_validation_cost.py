"""Host cost of the eager replay validation (issue 22: at most 1% of the step's wall time).

    python benchmarks/ac_validation_cost.py \
        --out benchmarks/results/ac_validation_cost/ac_validation_cost_SHA.json  # dsv3-12l, GPU
    python benchmarks/ac_validation_cost.py --smoke                                             # tiny, CPU

What is validated: every op an eager checkpoint region dispatches in its original pass is recorded
(`saved.trace.append(func)` in `PolicyMode`, spartron/checkpointing/saved_ops.py) and every op of its
replay is compared with it (the cursor check), then `finish_replay` checks the replay reached the end.
Compiled regions run no such check (their replay is the traced backward graph).

1. The public Trainer runs `--steps` eager steps with ac.mode = selective; each checkpoint region's
   `on_call` observer collects the RegionStats of every region call of every step (a block that runs
   several times per step, the shared MTP block, is counted per call). `ops_original` is the number of
   ops the original pass recorded, which is also the number of ops its replay compares.
2. On the same host the exact validation statements are timed per op with real OpOverload objects
   (the op mix of the regions, or a fixed mix), over a trace as long as an average region call's,
   minus the same loop with an empty body, and `SavedOps.finish_replay` per call.
3. Reported: validated ops per step, validation host µs per step (assuming none of it is hidden
   behind GPU work: an upper bound), the median step time of the timed steps, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import timeit
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py

from common import start_trainer_benchmark, trainer_report_header, write_report  # noqa: E402

from spartron.checkpointing import RegionStats, build_policy, checkpoint_region_of  # noqa: E402
from spartron.checkpointing.saved_ops import SavedOps  # noqa: E402
from spartron.runtime.config import load_config  # noqa: E402
from spartron.runtime.trainer import Trainer  # noqa: E402

BUDGET = 0.01  # issue 22: validation <= 1% of the step's wall time
FALLBACK_OPS = (torch.ops.aten.mm.default, torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor,
                torch.ops.aten.silu.default, torch.ops.aten._to_copy.default, torch.ops.aten.rsqrt.default)


# ---- 1. what the regions dispatched ------------------------------------------------------------

def observed_steps(trainer: Trainer, steps: int) -> list[tuple[dict, list[RegionStats]]]:
    """Run `steps` Trainer steps; each with its record and the RegionStats of every region call."""
    calls: list[RegionStats] = []
    regions = [r for b in trainer.model.blocks() if (r := checkpoint_region_of(b.module)) is not None]
    if not regions:
        raise ValueError("ac_validation_cost: the model has no checkpoint regions (set ac.mode = 'selective')")
    for region in regions:
        region.on_call = calls.append
    out = []
    try:
        for _ in range(steps):
            calls.clear()
            record = trainer.step()
            out.append((record, list(calls)))
    finally:
        for region in regions:
            region.on_call = None
    return out


def step_counts(calls: list[RegionStats]) -> dict:
    return {"region_calls": len(calls), "replays": sum(s.replay_count for s in calls),
            "ops_original": sum(s.ops_original for s in calls), "ops_saved": sum(s.ops_saved for s in calls),
            "ops_recomputed": sum(s.ops_recomputed for s in calls)}


def op_mix(calls: list[RegionStats]) -> list[torch._ops.OpOverload]:
    """Real OpOverloads of the ops the regions ran (by their packet names), else a fixed mix."""
    names = set()
    for s in calls:
        names.update(s.saved_by_op)
        names.update(s.recomputed_by_op)
    ops = []
    for name in sorted(names):
        namespace, _, op = name.partition("::")
        packet = getattr(getattr(torch.ops, namespace, None), op, None)
        overloads = packet.overloads() if packet is not None else []
        if overloads:
            ops.append(getattr(packet, overloads[0]))
    return ops or list(FALLBACK_OPS)


# ---- 2. the validation statements, timed -------------------------------------------------------
# These are PolicyMode.__torch_dispatch__'s statements, copied verbatim; keep them in step with it.

def _original(saved: SavedOps, ops: list) -> None:
    for func in ops:
        saved.trace.append(func)


def _replay(saved: SavedOps, ops: list) -> None:
    for func in ops:
        pos = saved.trace_pos
        if pos >= len(saved.trace) or saved.trace[pos] is not func:
            raise saved.diverged(func, (), {})
        saved.trace_pos = pos + 1


def _loop(saved: SavedOps, ops: list) -> None:
    for _func in ops:
        pass


def time_validation(ops_per_call: int, mix: list, repeats: int, number: int) -> dict:
    """Per-op ns of the original-pass record and the replay check, net of the bare loop, and µs of
    one finish_replay; best of `repeats` (timeit's convention: the least disturbed run)."""
    saved = SavedOps(build_policy("selective"), RegionStats("timing"))
    ops = [mix[i % len(mix)] for i in range(max(ops_per_call, 1))]

    def one_call() -> None:
        saved.release()
        _original(saved, ops)
        _replay(saved, ops)

    def bare() -> None:
        saved.release()
        _loop(saved, ops)
        _loop(saved, ops)

    def finish() -> None:
        saved.trace, saved.trace_pos = ops, len(ops)  # a replay that reached the end, as in a step
        saved.finish_replay()

    n = len(ops)
    full = min(timeit.repeat(one_call, repeat=repeats, number=number)) / number
    base = min(timeit.repeat(bare, repeat=repeats, number=number)) / number
    fin = min(timeit.repeat(finish, repeat=repeats, number=number * 10)) / (number * 10)
    return {"ops_per_call": n, "op_mix": sorted({str(o) for o in ops}), "repeats": repeats, "number": number,
            "ns_per_op": max(full - base, 0.0) / n * 1e9, "ns_per_op_with_loop": full / n * 1e9,
            "ns_per_op_bare_loop": base / n * 1e9, "us_finish_replay": fin * 1e6}


# ---- 3. the report -----------------------------------------------------------------------------

def report_rows(steps: list[tuple[dict, list[RegionStats]]], warmup: int, timing: dict) -> dict:
    timed = steps[warmup:] or steps[-1:]
    rows = []
    for record, calls in steps:
        counts = step_counts(calls)
        host_us = counts["ops_original"] * timing["ns_per_op"] / 1e3 + counts["replays"] * timing["us_finish_replay"]
        rows.append({"step": record["step"], "step_time_ms": record["step_time_s"] * 1e3, **counts,
                     "validation_host_us": host_us,
                     "fraction": host_us / (record["step_time_s"] * 1e6)})
    rows_timed = rows[len(steps) - len(timed):]
    step_ms = statistics.median(r["step_time_ms"] for r in rows_timed)
    host_us = statistics.median(r["validation_host_us"] for r in rows_timed)
    return {"steps": rows, "timed_steps": len(rows_timed), "median_step_time_ms": step_ms,
            "median_validation_host_us": host_us, "fraction": host_us / (step_ms * 1e3),
            "budget_fraction": BUDGET, "within_budget": host_us / (step_ms * 1e3) <= BUDGET}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "dsv3-12l.toml")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7, help="timeit repeats (the best is kept)")
    parser.add_argument("--number", type=int, default=200, help="region calls per timeit repeat")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--out", type=Path, default=None, help="JSON result file")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's; a device copy's may lie)")
    parser.add_argument("--smoke", action="store_true", help="tiny preset on CPU for 3 steps")
    args = parser.parse_args()
    own = start_trainer_benchmark(args)
    if args.smoke:
        args.repeats, args.number = 2, 20
    with tempfile.TemporaryDirectory(prefix="spartron-acval-") as tmp:
        overrides = ["ac.mode=selective", "train.compile=false", "ac.debug_summary=false",
                     f"train.steps={args.steps}", "train.save_every=0", "train.resume=false", "train.progress=false",
                     f"train.run_dir={Path(tmp) / 'run'}", *args.set]
        cfg = load_config(args.config, overrides)
        trainer = Trainer(cfg).setup()
        try:
            steps = observed_steps(trainer, args.steps)
        finally:
            trainer.close()
    calls = [c for _, step_calls in steps for c in step_calls]
    per_call = round(statistics.mean(s.ops_original for s in calls)) if calls else 0
    timing = time_validation(per_call, op_mix(calls), args.repeats, args.number)
    result = report_rows(steps, args.warmup, timing)
    rank, world = dist.get_rank(), dist.get_world_size()
    if own:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    print(f"ac validation: {result['steps'][-1]['ops_original']} ops validated per step in "
          f"{result['steps'][-1]['region_calls']} region calls; {timing['ns_per_op']:.1f} ns/op "
          f"(record + replay check), {timing['us_finish_replay']:.2f} µs per finish_replay -> "
          f"{result['median_validation_host_us']:.0f} µs of a {result['median_step_time_ms']:.1f} ms step = "
          f"{result['fraction']:.4%} (budget {BUDGET:.0%})")
    report = {
        **trainer_report_header("ac_validation_cost", args, world),
        "overrides": overrides,
        "ac_reentrant": cfg.ac.reentrant,
        "shapes": {"n_layers": cfg.model.n_layers, "dim": cfg.model.dim, "mtp_depth": cfg.model.mtp.depth,
                   "seq_len": cfg.train.seq_len, "global_batch_size": cfg.train.global_batch_size,
                   "micro_batch_size": cfg.train.micro_batch_size},
        "timing": timing,
        **result,
    }
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
