"""Scale behaviour of one rank: `spartron rehearse` of DeepSeek-V3 at N = 256, 512, 1024 and V3.2 at 256 (CP 8)
over a list of sequence lengths, on the local GPU; one JSON and a PNG beside it.

Per layout: the planner's predicted peak (spartron.runtime.memory.plan_memory); if it exceeds the device's
memory the layout is reported with the planner's answer and "not rehearsed"; otherwise rank 0 is rehearsed
(spartron.launch.rehearse) and the entry holds the measured peak allocated / reserved memory, compute
seconds, the communication bytes and modelled seconds by category (fsdp, ep, cp, other), the predicted step
time and tokens/s per GPU (headline: the runtime's overlaps) and MFU, and planner vs measured peak.

The layouts run one after another in this process (each in its own mirrored world: spartron.comm.mirror).
Each invocation adds its entries to --out (entries of the same case, world and seq_len are replaced) and
redraws the PNG, so the sweep can be split over several calls of a few minutes each:

    python benchmarks/rehearse_sweep.py --case v3-256
    python benchmarks/rehearse_sweep.py --case v3-512
    python benchmarks/rehearse_sweep.py --case v3-1024
    python benchmarks/rehearse_sweep.py --case v32-256 --seq-lens 8192,16384
    python benchmarks/rehearse_sweep.py --case v32-256 --seq-lens 32768,65536

--smoke: the tiny preset at 1, 8 and 16 ranks on CPU (a test runs it; pass --gpu-memory-gib).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py

from common import write_report  # noqa: E402

from spartron.launch.rehearse import run_rehearsal  # noqa: E402
from spartron.launch.rehearse_report import build_report  # noqa: E402
from spartron.runtime.config import load_config  # noqa: E402
from spartron.runtime.memory import plan_memory  # noqa: E402

V3, V32, TINY = (str(ROOT / "configs" / n) for n in ("deepseek-v3-671b.toml", "deepseek-v3.2-671b.toml", "tiny.toml"))
CASES = {  # name: (config, world, overrides)
    "v3-256": (V3, 256, []), "v3-512": (V3, 512, []), "v3-1024": (V3, 1024, []),
    "v32-256": (V32, 256, ["parallel.cp=8"]),
}
SMOKE = {f"tiny-{w}": (TINY, w, ["parallel.ep=2" if w > 1 else "parallel.ep=1", "train.global_batch_size=16",
                                 "train.seq_len=32", "train.peak_tflops=1.0"]) for w in (1, 8, 16)}
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "rehearse_sweep" / "rehearse_sweep.json"


def entry(name: str, config: str, world: int, overrides: list[str], seq_len: int | None, device_bytes: int,
          steps: int, balanced: bool, profile: bool = False) -> dict:
    """One layout: the planner's answer, and the rehearsal's report when the planner fits it on the device."""
    sets = overrides + ([f"train.seq_len={seq_len}"] if seq_len else [])
    cfg = load_config(config, sets)
    plan = plan_memory(cfg, world)
    out = {"case": name, "config": cfg.name, "world_size": world, "seq_len": cfg.train.seq_len, "overrides": sets,
           "layout": cfg.parallel.dims(world).describe(), "device_bytes": device_bytes,
           "planner_peak_bytes": plan.peak, "planner_phase": plan.phase}
    if plan.peak > device_bytes:
        return {**out, "rehearsed": False,
                "note": f"not rehearsed: the planner puts rank 0 at {plan.peak / 2**30:.1f} GiB, above the device's "
                        f"{device_bytes / 2**30:.1f} GiB"}
    report = build_report(run_rehearsal(cfg, world, 0, steps, balanced, profile), cfg.cluster)
    h = report["headline"]
    gc.collect()
    _empty_cache()
    return {**out, "rehearsed": True, "routing": report["routing"],
            "measured_peak_allocated_bytes": h["peak_allocated_bytes"],
            "measured_peak_reserved_bytes": h["peak_reserved_bytes"],
            "planner_minus_measured_percent": report["planner"]["difference_percent"],
            "parameter_bytes": report["planner"]["measured_parameter_bytes"], "compute_s": h["compute_s"],
            "comm": h["comm"], "step_s": {k: h[k]["seconds"] for k in ("compute_only", "headline", "no_overlap")},
            "tokens_per_s_per_gpu": h["headline"]["tokens_per_s_per_gpu"], "mfu": h["headline"]["mfu"],
            "mfu_compute_only": h["compute_only"]["mfu"],
            "micro_batches": report["micro_batches"], "setup_s": report["setup_s"],
            **({"kernels": report["kernels"]} if profile else {})}


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def merge(path: Path, entries: list[dict], device: str, commit: str | None) -> dict:
    """`path`'s entries with `entries` added (same case, world and seq_len replaced); each entry keeps the
    commit it measured, the top-level commit is this run's."""
    old = json.loads(path.read_text()) if path.is_file() else {"benchmark": "rehearse_sweep", "entries": []}
    keys = {(e["case"], e["world_size"], e["seq_len"]) for e in entries}
    kept = [e for e in old["entries"] if (e["case"], e["world_size"], e["seq_len"]) not in keys]
    return {**old, "device": device, "commit": commit, "entries": kept + entries}


def plot(data: dict, png: Path) -> None:
    """Per-rank memory (planner and measured) and predicted tokens/s per GPU, by case and world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, tps) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = sorted(data["entries"], key=lambda e: (e["case"], e["world_size"], e["seq_len"]))
    labels = [f"{e['case']}\nN={e['world_size']} s={e['seq_len']}" for e in rows]
    x = range(len(rows))
    mem.bar([i - 0.2 for i in x], [e["planner_peak_bytes"] / 2**30 for e in rows], 0.4, label="planner")
    mem.bar([i + 0.2 for i in x], [e.get("measured_peak_allocated_bytes", 0) / 2**30 for e in rows], 0.4,
            label="measured (0: not rehearsed)")
    if rows:
        mem.axhline(rows[0]["device_bytes"] / 2**30, color="k", linestyle="--", label="device")
    mem.set_ylabel("peak allocated per rank (GiB)")
    tps.bar(list(x), [e.get("tokens_per_s_per_gpu", 0) for e in rows])
    tps.set_ylabel("predicted tokens/s per GPU (headline)")
    for ax in (mem, tps):
        ax.set_xticks(list(x), labels, fontsize=7)
    mem.legend(fontsize=8)
    fig.suptitle(f"spartron rehearse: one rank per layout on {data.get('device', '?')} (communication modelled)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", choices=sorted(CASES), help="repeatable (default: all)")
    p.add_argument("--seq-lens", default="8192,16384,32768,65536", help="V3.2's sequence lengths (comma-separated)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--routing", choices=("balanced", "model"), default="balanced", help="as spartron rehearse")
    p.add_argument("--gpu-memory-gib", type=float, help="device memory (default: the local GPU's)")
    p.add_argument("--smoke", action="store_true", help="the tiny preset at 1, 8, 16 ranks on CPU")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--profile", action="store_true", help="one more step per case under torch.profiler (kernels)")
    p.add_argument("--commit", default=None, help="the commit measured (default: this checkout's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override for every case (e.g. a smaller train.global_batch_size: fewer micro-batches a "
                        "step, the same per-micro-batch shapes and peak)")
    args = p.parse_args(argv)
    import torch

    from spartron.runtime.metrics import git_commit

    commit = args.commit or git_commit()

    if args.gpu_memory_gib is not None:
        device_bytes = int(args.gpu_memory_gib * 2**30)
    elif torch.cuda.is_available():
        device_bytes = torch.cuda.get_device_properties(0).total_memory
    else:
        p.error("--gpu-memory-gib is needed without a GPU")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.smoke else "cpu"
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    todo = SMOKE if args.smoke else {n: CASES[n] for n in (args.case or sorted(CASES))}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, (config, world, overrides) in todo.items():
        for seq in (seq_lens if name.startswith("v32") else [None]):
            e = entry(name, config, world, [*overrides, *args.set], seq, device_bytes, args.steps,
                      args.routing == "balanced", args.profile)
            e.update(commit=commit, torch=torch.__version__)
            print(json.dumps({k: e.get(k) for k in ("case", "world_size", "seq_len", "planner_peak_bytes",
                                                    "measured_peak_allocated_bytes", "tokens_per_s_per_gpu",
                                                    "rehearsed")}), flush=True)
            data = merge(out, [e], device, commit)  # written per entry: a sweep cut short keeps what it measured
            write_report(out, data)
    plot(data, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
