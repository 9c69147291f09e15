"""Where one training step's peak memory goes: the public Trainer runs --steps steps; the CUDA allocator's
history is recorded over the last one, and the blocks live at that step's peak are attributed. Blocks that
hold the model's parameters, their fp32 masters and main gradients, gradients or the optimizer's state are
named so (matched by address); every other block by the source line that allocated it (its innermost
frame in spartron/ or in a compiled graph, else its innermost frame).

    python benchmarks/memory_peak.py --set model.master_dtype=float32 --set model.master_weights=optimizer \\
        --set ac.mode=full --set train.compile=true --commit SHA --out benchmarks/results/memory_peak/....json

CUDA only (the allocator's history); elsewhere it says so and stops. The replayed peak is checked against
torch.cuda.max_memory_allocated of the same step (`replay_matches`); the phase at the peak (forward,
backward, optimizer) comes from the Trainer's phase marks and the history's timestamps.
"""

from __future__ import annotations

import argparse
import bisect
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import start_trainer_benchmark, trainer_report_header, write_report  # noqa: E402

from spartron.runtime.config import load_config  # noqa: E402
from spartron.runtime.trainer import StepProbe, Trainer  # noqa: E402

INTERESTING = ("/spartron/", "torchinductor", "/torch/_inductor/")


def site(frames: list[dict]) -> str:
    """A block's allocation site: its innermost frame in spartron/ or a compiled graph, else its innermost."""
    for f in frames:
        if any(mark in f["filename"] for mark in INTERESTING):
            return f"{f['filename'].split('/spartron/')[-1]}:{f['line']} {f['name']}"
    return f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}" if frames else "(no frames recorded)"


def live_at_peak(trace: list[dict], before: dict[int, int]) -> tuple[int, int, dict[int, tuple[int, str]]]:
    """Replay an allocator trace (torch.cuda.memory._snapshot()'s device trace) from the blocks live when it
    started (`before`: address -> size). Returns (peak bytes, the index of the event that reached it, or -1 when
    nothing rose above the start, and the blocks live then: address -> (size, site)). An allocation counts from
    its "alloc" to its "free_requested", where torch's allocated-bytes statistic drops."""
    def replay(upto: int):  # noqa: ANN202 - (live blocks, peak, peak index) after events [0, upto]
        live = {addr: (size, "(allocated before the recorded step)") for addr, size in before.items()}
        current = peak = sum(before.values())
        peak_at = -1
        for i, event in enumerate(trace[:upto + 1]):
            action, addr = event["action"], event["addr"]
            if action == "alloc":
                live[addr] = (event["size"], site(event.get("frames") or []))
                current += event["size"]
                if current > peak:
                    peak, peak_at = current, i
            elif action == "free_requested" and addr in live:
                current -= live.pop(addr)[0]
        return live, peak, peak_at

    _, peak, peak_at = replay(len(trace) - 1)
    return peak, peak_at, replay(peak_at)[0]


def blocks_before(snapshot: dict, trace: list[dict], device: int) -> dict[int, int]:
    """Blocks live when the trace started: those live at its end that it never allocated, and those it frees
    without having allocated them."""
    allocated, before = set(), {}
    for event in trace:
        if event["action"] == "alloc":
            allocated.add(event["addr"])
        elif event["action"] == "free_requested" and event["addr"] not in allocated:
            before[event["addr"]] = event["size"]
    for segment in snapshot["segments"]:
        if segment.get("device", device) != device:
            continue
        addr = segment["address"]
        for block in segment["blocks"]:
            addr = block.get("address", addr)
            if block["state"] in ("active_allocated", "active_pending_free") and addr not in allocated:
                before[addr] = block["size"]
            addr += block["size"]
    return before


def owners(trainer: Trainer) -> list[tuple[int, str]]:
    """(data pointer, what it is) of every tensor the model and optimizer hold now (gradients: before the
    optimizer phase), sorted."""
    out = []

    def add(t: torch.Tensor | None, what: str) -> None:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.is_cuda and local.numel():
                out.append((local.data_ptr(), what))

    for p in trainer.model.parameters():
        add(p, f"parameters ({p.dtype})".replace("torch.", ""))
        add(p.grad, "gradients (p.grad)")
        add(getattr(p, "main_param", None), "fp32 masters")
        add(getattr(p, "main_grad", None), "main gradients")
    for b in trainer.model.buffers():
        add(b, "buffers")
    for state in trainer.optimizer.state.values():
        for value in state.values():
            add(value, "optimizer state")
    return sorted(out)


def attribute(peak_live: dict[int, tuple[int, str]], held: list[tuple[int, str]]) -> dict[str, dict]:
    """Bytes and block counts by owner (a held tensor whose data starts inside the block) or else by site."""
    starts = [ptr for ptr, _ in held]
    out: dict[str, dict] = defaultdict(lambda: {"bytes": 0, "blocks": 0})
    for addr, (size, where) in peak_live.items():
        i = bisect.bisect_left(starts, addr)
        name = held[i][1] if i < len(held) and held[i][0] < addr + size else where
        out[name]["bytes"] += size
        out[name]["blocks"] += 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "dsv3-12l.toml")
    parser.add_argument("--steps", type=int, default=3, help="steps in all; the last one is recorded")
    parser.add_argument("--max-entries", type=int, default=2_000_000, help="allocator history entries kept")
    parser.add_argument("--top", type=int, default=30, help="owners and sites printed")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--commit", default=None, help="the commit to record (a device copy's git may lie)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny preset: refused without CUDA")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if not torch.cuda.is_available():
        print("spartron: error: memory_peak records the CUDA allocator's history: no CUDA device here", file=sys.stderr)
        return 2
    start_trainer_benchmark(args)
    report = trainer_report_header("memory_peak", args, 1)
    run_dir = tempfile.TemporaryDirectory(prefix="spartron-memory-peak-")  # as the other Trainer benchmarks
    overrides = [f"train.steps={args.steps}", "train.save_every=0", "train.resume=false", "train.progress=false",
                 f"train.run_dir={Path(run_dir.name) / 'run'}", *args.set]
    cfg = load_config(args.config, overrides)
    trainer = Trainer(cfg).setup()
    records, marks = [], []
    try:
        while trainer.step_no + 1 < args.steps:
            records.append(trainer.step())
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=args.max_entries, stacks="python")
        held: list[tuple[int, str]] = []

        def mark(phase: str) -> None:
            marks.append((time.time() * 1e6, phase))
            if phase == "optimizer":  # every gradient exists now; the step drops them
                held.extend(owners(trainer))

        records.append(trainer.step(StepProbe(on_phase=mark)))
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        device = torch.cuda.current_device()
        trace = snapshot["device_traces"][device]
        peak, peak_at, peak_live = live_at_peak(trace, blocks_before(snapshot, trace, device))
        by_owner = attribute(peak_live, sorted(dict(held + owners(trainer)).items()))
    finally:
        trainer.close()
        run_dir.cleanup()
    measured = records[-1]["peak_memory_allocated_bytes"]
    when = trace[peak_at].get("time_us") if peak_at >= 0 else None
    phase = max((m for m in marks if when is not None and m[0] <= when), default=(None, None))[1]
    report |= {"overrides": overrides, "steps": args.steps, "trace_events": len(trace),
               "trace_full": len(trace) >= args.max_entries, "peak_bytes_replayed": peak,
               "peak_memory_allocated_bytes": measured, "replay_matches": peak == measured,
               "phase_at_peak": phase, "step_time_s": [r["step_time_s"] for r in records],
               "by_owner_or_site": by_owner}
    print(f"peak {peak / 2**30:.3f} GiB replayed, {measured / 2**30:.3f} GiB measured, phase {phase}, "
          f"{len(trace)} events")
    for name, row in list(by_owner.items())[:args.top]:
        print(f"{row['bytes'] / 2**30:9.3f} GiB {row['blocks']:6d}  {name}")
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
