"""Regression matrix on the GPUs of one host: EP x CP x AC x offload x micro-batch cells.

Each cell is a real `spartron train` run (the local launcher spawns one rank per GPU, NCCL), on the
GPU preset reduced by `--set` overrides so a cell takes seconds. Every cell trains on the same
global batches, so its loss and grad-norm traces are compared with the EP1/CP1 baseline (no AC) by
`spartron.launch.regression` (loss and grad norm only: throughput and memory differ by layout by
design); a second baseline run measures the noise floor. Writes one JSON with every cell (tokens/s
per GPU, MFU, peak memory, loss trace, the comparison) and a PNG of the loss traces.

    python benchmarks/matrix.py --gpus 2 --out benchmarks/results/matrix/matrix_2gpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spartron.launch.regression import Tolerances, compare_runs  # noqa: E402
from spartron.runtime.metrics import git_commit, read_metrics  # noqa: E402

AC = {"none": ["ac.mode=none"], "full": ["ac.mode=full"], "selective": ["ac.mode=selective"],
      "selective+offload": ["ac.mode=selective", "offload.enabled=true"]}


def cells(gpus: int) -> list[dict]:
    """The cells that fit `gpus` ranks: EP and CP in {1, 2, 4, 8} dividing the world, FSDP fills the rest."""
    out = []
    for ep in (1, 2, 4, 8):
        for cp in (1, 2):
            if gpus % cp or ep > gpus:
                continue
            for ac in AC:
                out.append({"ep": ep, "cp": cp, "ac": ac, "mb": 1})
            if ep > 1:
                out.append({"ep": ep, "cp": cp, "ac": "selective", "mb": 2})
    return out


def cell_name(c: dict) -> str:
    return f"ep{c['ep']}-cp{c['cp']}-{c['ac'].replace('+', '-')}-mb{c['mb']}"


def run_cell(config: Path, gpus: int, c: dict, base: list[str], name: str, timeout: float, runs: Path) -> dict:
    """One cell as a fresh `spartron train` run in runs/<name> (an earlier matrix's run there is replaced)."""
    overrides = [*base, f"launch.nproc={gpus}", f"parallel.ep={c['ep']}", f"parallel.cp={c['cp']}",
                 f"train.intra_layer_micro_batches={c['mb']}", f"name={name}", "train.progress=false",
                 "train.save_every=0", f"train.run_dir={json.dumps(str(runs.resolve() / name))}",
                 "train.resume=false", "train.overwrite=true", *AC[c["ac"]]]
    if c["ep"] > 1:
        overrides.append("model.moe.dispatcher=all_to_all")
    cmd = [sys.executable, "-m", "spartron.launch.cli", "train", str(config)]
    for o in overrides:
        cmd += ["--set", o]
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    result = {"cell": c, "name": name, "rc": proc.returncode, "wall_s": time.time() - start}
    if proc.returncode != 0:
        result["error"] = (proc.stdout + proc.stderr)[-3000:]
    return result


def summarise(run_dir: Path, warmup: int) -> dict:
    _, steps = read_metrics(run_dir / "metrics.jsonl")
    timed = steps[warmup:] or steps
    mean = lambda key: sum(s[key] for s in timed if s.get(key) is not None) / max(1, len(timed))  # noqa: E731
    return {"losses": [s["loss"] for s in steps], "grad_norms": [s["grad_norm"] for s in steps],
            "tokens_per_s_per_gpu": mean("tokens_per_s_per_gpu"), "mfu": mean("mfu"),
            "peak_memory_allocated_gib": max(s["peak_memory_allocated_bytes"] for s in steps) / 2**30}


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=False))


def plot(results: list[dict], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        if "summary" in r:
            ax.plot(range(1, len(r["summary"]["losses"]) + 1), r["summary"]["losses"], label=r["name"], lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("regression matrix: loss per cell")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO / "configs" / "dsv3-12l.toml")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the throughput means")
    p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                   help="overrides for every cell (default: 4 layers, global batch 4, micro-batch 2)")
    p.add_argument("--only", default=None, help="comma-separated cell names to run (default all)")
    p.add_argument("--cell-timeout", type=float, default=240)
    p.add_argument("--loss-rel", type=float, default=1e-2, help="allowed relative loss difference (bf16)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny CPU preset on 2 gloo ranks, 3 steps, 3 cells")
    p.add_argument("--runs", type=Path, default=REPO / "runs", help="folder of the cells' run directories")
    args = p.parse_args()
    if args.smoke:
        args.config, args.gpus, args.steps, args.warmup = REPO / "configs" / "tiny.toml", 2, 3, 1
        base = [f"train.steps={args.steps}", "train.global_batch_size=4"]
        todo = [{"ep": 1, "cp": 1, "ac": "none", "mb": 1}, {"ep": 2, "cp": 1, "ac": "selective", "mb": 1},
                {"ep": 1, "cp": 2, "ac": "full", "mb": 1}]
    else:
        base = args.set or ["model.n_layers=4", "train.global_batch_size=4", "train.micro_batch_size=2"]
        base = [*base, f"train.steps={args.steps}"]
        todo = cells(args.gpus)
        if args.only:
            keep = set(args.only.split(","))
            todo = [c for c in todo if cell_name(c) in keep]
    baseline = {"ep": 1, "cp": 1, "ac": "none", "mb": 1}
    runs = args.runs
    results = [run_cell(args.config, args.gpus, baseline, base, "matrix-baseline2", args.cell_timeout, runs)]
    for c in todo:
        results.append(run_cell(args.config, args.gpus, c, base, "matrix-" + cell_name(c), args.cell_timeout,
                                runs))
    base_dir = runs / ("matrix-" + cell_name(baseline))
    tol = Tolerances(loss_rel=args.loss_rel, memory_abs_bytes=math.inf, throughput_rel=math.inf,
                     exact_first_step=False)
    for r in results:
        run_dir = runs / r["name"]
        if r["rc"] != 0 or not (run_dir / "metrics.jsonl").exists():
            continue
        r["summary"] = summarise(run_dir, args.warmup)
        if base_dir.exists() and run_dir != base_dir:
            r["max_rel_loss_diff"] = max_rel(r["summary"]["losses"], summarise(base_dir, 0)["losses"])
            if r["name"] != "matrix-baseline2":  # the noise-floor run itself: its difference IS the floor
                report = compare_runs(run_dir / "metrics.jsonl", base_dir / "metrics.jsonl", tol,
                                      noise_floor_from=[runs / "matrix-baseline2" / "metrics.jsonl"])
                r["regression"] = {"passed": report.passed, "text": report.text()}
    print(f"{'cell':34s} {'rc':>3s} {'tok/s/GPU':>10s} {'MFU':>6s} {'peak GiB':>9s} {'dloss rel':>10s} regress")
    for r in results:
        s = r.get("summary")
        if s is None:
            print(f"{r['name']:34s} {r['rc']:3d}  error: {r.get('error', '')[-200:]!r}")
            continue
        reg = r.get("regression", {}).get("passed")
        print(f"{r['name']:34s} {r['rc']:3d} {s['tokens_per_s_per_gpu']:10.0f} {100 * (s['mfu'] or 0):5.1f}% "
              f"{s['peak_memory_allocated_gib']:9.2f} {r.get('max_rel_loss_diff', 0):10.2e} "
              f"{'-' if reg is None else ('PASS' if reg else 'FAIL')}")
    report = {"benchmark": "matrix", "gpus": args.gpus, "config": str(args.config.relative_to(REPO)),
              "overrides": base, "commit": git_commit(), "smoke": args.smoke, "loss_rel": args.loss_rel,
              "cells": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        plot(results, args.out.with_suffix(".png"))
        print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
