"""Host-side (Python) overhead of two thin boundaries, measured on CPU with tiny tensors.

    python benchmarks/overhead_cpu.py --out benchmarks/results/overhead_cpu/overhead_cpu.json

Tiny tensors make the Python work per call dominate, so this compares versions of the code on any
machine (it is not a GPU number; the GPU runs see this cost only where the host does not run ahead).

(a) collectives: `spartron_collectives::all_to_all` (through `collectives.all_to_all`, splits as a
    list, None and an int64 tensor) vs raw `dist.all_to_all_single` with the same splits, on 2 gloo
    ranks, over the 2-rank group and over each rank's own 1-rank group (`self_*`: gloo without the
    network, so the host cost of the boundary is not buried in transfer time). Also forward+backward.
(b) checkpointing: a chain of ~50 tiny aten ops under `PolicyMode` (full policy) in the original
    and the replay pass vs no mode, giving µs per intercepted op (the floor: a Python dispatch mode
    that only forwards each op; selective: both passes with the 10 mm outputs saved and handed
    back); and whole-region forward+backward of the chain: Spartron full (non-reentrant,
    reentrant) vs `torch.utils.checkpoint` non-reentrant, the same with forwarding-only dispatch
    modes in both passes (the floor for any per-op policy), and no checkpointing.

Every number is the minimum over blocks of the mean µs per call (variants interleaved block by
block; the minimum is the least disturbed by other load on a shared machine); collectives take the
max over ranks.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from spartron.checkpointing import CheckpointOptions, CheckpointRegion, build_policy
from spartron.checkpointing.replay import ReplayFrame, active_frame
from spartron.checkpointing.saved_ops import PolicyMode, RegionStats, SavedOps
from spartron.comm import collectives as C
from spartron.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also under `python -m benchmarks.NAME`
from common import write_report  # noqa: E402


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e6 / calls


def _alternating(variants: dict[str, Callable[[], object]], calls: int, blocks: int,
                 barrier: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Best-of-`blocks` µs per call, variants interleaved so drift hits all alike."""
    for fn in variants.values():  # warm up
        _per_call_us(fn, max(calls // 10, 5))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(blocks):
        for name, fn in variants.items():
            barrier()
            samples[name].append(_per_call_us(fn, calls))
    return {name: min(s) for name, s in samples.items()}


# --- (a) collectives --------------------------------------------------------------------------

def _collectives_worker(rank: int, world: int, calls: int, blocks: int) -> dict[str, float]:
    own = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    both = _collective_variants(world, dist.group.WORLD, calls, blocks, dist.barrier)
    alone = _collective_variants(1, own, calls, blocks)
    return {**both, **{f"self_{k}": v for k, v in alone.items()}}


def _collective_variants(world: int, group, calls: int, blocks: int, barrier=lambda: None) -> dict[str, float]:
    rows = 4 * world
    x = torch.randn(rows, 8)
    xg = x.clone().requires_grad_()
    out = torch.empty_like(x)
    splits = [rows // world] * world
    in_tensor, out_tensor = torch.tensor(splits), torch.tensor(splits)  # two tensors, as in MoE dispatch

    def raw():
        dist.all_to_all_single(out, x, splits, splits, group=group)

    def raw_alloc():  # the op returns a fresh tensor (on gloo a new output buffer costs extra)
        dist.all_to_all_single(torch.empty_like(x), x, splits, splits, group=group)

    def raw_tensor_splits():  # the raw call needs host lists too: count the .tolist()
        dist.all_to_all_single(out, x, out_tensor.tolist(), in_tensor.tolist(), group=group)

    def fwd_bwd():
        C.all_to_all(xg, splits, splits, group).sum().backward()

    variants = {
        "raw_all_to_all_single": raw,
        "raw_all_to_all_single_new_output": raw_alloc,
        "spartron_all_to_all_list": lambda: C.all_to_all(x, splits, splits, group),
        "spartron_all_to_all_none": lambda: C.all_to_all(x, None, None, group),
        "raw_all_to_all_single_tensor_splits": raw_tensor_splits,
        "spartron_all_to_all_tensor": lambda: C.all_to_all(x, out_tensor, in_tensor, group),
        "spartron_all_to_all_fwd_bwd_list": fwd_bwd,
    }
    return _alternating(variants, calls, blocks, barrier=barrier)


def bench_collectives(calls: int, blocks: int) -> dict[str, float]:
    per_rank = run_distributed(_collectives_worker, 2, calls, blocks, timeout=600)
    times = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
    for p in ("", "self_"):
        raw = times[f"{p}raw_all_to_all_single"]
        times[f"{p}extra_us_list"] = times[f"{p}spartron_all_to_all_list"] - raw
        times[f"{p}extra_us_none"] = times[f"{p}spartron_all_to_all_none"] - raw
        times[f"{p}extra_us_tensor"] = times[f"{p}spartron_all_to_all_tensor"] \
            - times[f"{p}raw_all_to_all_single_tensor_splits"]
    return times


# --- (b) checkpoint policy mode ---------------------------------------------------------------

def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """50 tiny aten ops: 10 rounds of mm, add, mul, tanh, sub (a stand-in for a block's op mix)."""
    for _ in range(10):
        x = torch.mm(x, w)
        x = x + 1.0
        x = x * 0.5
        x = torch.tanh(x)
        x = x - 0.25
    return x


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def bench_policy_mode(calls: int, blocks: int) -> dict[str, float]:
    torch.manual_seed(0)
    x, w = torch.randn(4, 4), torch.randn(4, 4) * 0.3
    with _CountOps() as counter:
        chain(x, w)
    n_ops = counter.count
    saved = SavedOps(build_policy("full"), RegionStats("bench"))
    frame = ReplayFrame("bench")

    def plain():
        chain(x, w)

    def passthrough_mode():  # the floor: a Python dispatch mode that only forwards the op
        with _CountOps():
            chain(x, w)

    with torch.no_grad(), active_frame(frame, "original"), PolicyMode(saved, "original"):
        chain(x, w)
    one_pass = list(saved.trace)  # the op sequence each timed replay is checked against
    saved.release()

    def original():
        with active_frame(frame, "original"), PolicyMode(saved, "original"):
            chain(x, w)
        saved.release()  # timed alone, many times: keep one pass's record, not all of them

    def replay():
        saved.trace = list(one_pass)
        with active_frame(frame, "replay"), PolicyMode(saved, "replay"):
            chain(x, w)
        saved.finish_replay()

    selective = SavedOps(build_policy("selective"), RegionStats("bench"))

    def selective_both():  # selective saves the 10 mm outputs, then the replay hands them back
        with active_frame(frame, "original"), PolicyMode(selective, "original"):
            chain(x, w)
        with active_frame(frame, "replay"), PolicyMode(selective, "replay"):
            chain(x, w)
        selective.finish_replay()

    with torch.no_grad():
        pass_us = _alternating({"plain": plain, "passthrough_mode": passthrough_mode,
                                "policy_original": original, "policy_replay": replay,
                                "selective_original_and_replay": selective_both}, calls, blocks)
    per_op = {f"{k}_us_per_op": (pass_us[k] - pass_us["plain"]) / n_ops
              for k in ("passthrough_mode", "policy_original", "policy_replay")}
    per_op["selective_original_and_replay_us_per_op"] = \
        (pass_us["selective_original_and_replay"] - 2 * pass_us["plain"]) / (2 * n_ops)

    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    full_nr = CheckpointRegion(CheckpointOptions(policy=build_policy("full"), reentrant=False))
    full_r = CheckpointRegion(CheckpointOptions(policy=build_policy("full"), reentrant=True))
    steps = {
        "step_none": lambda: chain(xg, wg).sum().backward(),
        "step_torch_full_nonreentrant": lambda: torch_checkpoint(chain, xg, wg, use_reentrant=False)
        .sum().backward(),
        "step_torch_full_nonreentrant_passthrough_modes": lambda: torch_checkpoint(
            chain, xg, wg, use_reentrant=False, context_fn=lambda: (_CountOps(), _CountOps())).sum().backward(),
        "step_spartron_full_nonreentrant": lambda: full_nr(chain, xg, wg).sum().backward(),
        "step_spartron_full_reentrant": lambda: full_r(chain, xg, wg).sum().backward(),
    }
    step_us = _alternating(steps, max(calls // 4, 10), blocks)
    torch_full = step_us["step_torch_full_nonreentrant"]
    return {"ops_per_pass": n_ops, **{f"{k}_us": v for k, v in pass_us.items()}, **per_op,
            **{f"{k}_us": v for k, v in step_us.items()},
            "spartron_full_nonreentrant_extra_us_vs_torch": step_us["step_spartron_full_nonreentrant"] - torch_full,
            "spartron_full_nonreentrant_vs_torch": step_us["step_spartron_full_nonreentrant"] / torch_full}


# --- report -----------------------------------------------------------------------------------

def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--label", default="current", help="key of this run in the JSON (e.g. baseline)")
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--blocks", type=int, default=9)
    parser.add_argument("--smoke", action="store_true", help="few calls (checks the script runs)")
    args = parser.parse_args()
    calls, blocks = (20, 2) if args.smoke else (args.calls, args.blocks)
    torch.set_num_threads(1)

    run = {"commit": _commit(), "spartron_imported_from": str(Path(C.__file__).parents[3]),
           "collectives": bench_collectives(calls, blocks), "policy_mode": bench_policy_mode(calls, blocks)}
    print(f"spartron from {run['spartron_imported_from']} (commit of the working tree: {run['commit']})")
    for section in ("collectives", "policy_mode"):
        print(f"[{section}]")
        for name, value in run[section].items():
            print(f"  {name:48s} {value:10.2f}")

    if args.out:
        report = json.loads(args.out.read_text()) if args.out.exists() else {}
        report.update({"benchmark": "overhead_cpu", "device": "cpu (not a GPU measurement)",
                       "machine": f"{_cpu_name()}, {torch.get_num_threads()} torch thread(s), "
                                  f"{platform.system()} {platform.machine()}",
                       "torch": torch.__version__, "units": "microseconds per call (per op where named)",
                       "calls_per_block": calls, "blocks": blocks})
        report.setdefault("runs", {})[args.label] = run
        write_report(args.out, report)


if __name__ == "__main__":
    main()
