"""DSA against dense MLA end to end: the same model, with and without `[model.dsa]`, at one sequence length.

    python benchmarks/dsa_e2e.py --seq 16384 --commit SHA \
        --out benchmarks/results/dsa_e2e/dsa_e2e_16384_SHA.json  # H200
    python benchmarks/dsa_e2e.py --seq 65536 --set model.n_heads=64 --out ...   # another head count
    python benchmarks/dsa_e2e.py --smoke                                         # CPU, seconds
    python benchmarks/dsa_e2e.py --seq 131072 --mode full --dsa-set KEY=VALUE    # AC mode; DSA-only overrides
    python benchmarks/dsa_e2e.py --seq 131072 --only dsa --dsa-set model.dsa.attention_chunk=8192  # DSA alone

Runs benchmarks/e2e.py (the public Trainer) once per config, each in its own process so the two share no
allocator state: `configs/dsa-4l.toml` (DSA on the three MoE layers) and `configs/dsa-4l-dense.toml` (the
same model, dense MLA), selective AC, MTP off (`model.mtp.depth=0` for both), --steps steps of which the
first --warmup are excluded from the medians; `--set model.dsa.*` overrides apply to the DSA config only
(the dense one has no such section), and so do `--dsa-set` overrides (e.g. an `ac.targets` list without
`spartron::sparse_mla`, which recomputes the sparse attention in the replay instead of keeping its
[S, H, 512] output; or `model.dsa.attention_chunk`, the query-chunked attention that keeps [S, H x 128]);
`--mode` is the e2e.py AC mode of both (default selective). Writes both reports, each with `spartron plan`'s
predicted peak (`predicted_peak_gib`, beside the measured `peak_memory_allocated_gib`), and the DSA / dense
step-time ratio (`--only dsa`: the DSA run alone, no ratio) against the target for that length
(issue 39: 32k <= 1.0x, 64k <= 0.6x; issue 23: 16k <= 1.25x). `--smoke` runs both configs at tiny sizes on
CPU (the reference kernels), which checks the wiring, not the speed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py

from common import write_report  # noqa: E402

TARGETS = {16384: 1.25, 32768: 1.0, 65536: 0.6}  # DSA step time over dense (16k: issue 23; 32k, 64k: issue 39)
CONFIGS = {"dsa": REPO / "configs" / "dsa-4l.toml", "dense": REPO / "configs" / "dsa-4l-dense.toml"}
SMOKE = ["device=cpu", "model.dim=64", "model.n_heads=4", "model.dense_inter_dim=128", "model.vocab_size=512",
         "model.moe.n_routed_experts=4", "model.moe.top_k=2", "model.moe.moe_inter_dim=32",
         "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=16",
         "model.mla.v_head_dim=16", "model.dsa.n_index_heads=2", "model.dsa.index_head_dim=32",
         "model.dsa.index_topk=16", "model.loss_chunk_size=64"]


def run_one(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    """One config through e2e.py; its report (an `error` key when the run failed)."""
    out = tmp / f"{name}.json"
    overrides = ["model.mtp.depth=0", f"train.seq_len={args.seq}", f"model.max_seq_len={args.seq}", *args.set]
    if name == "dsa":
        overrides += args.dsa_set
    if args.smoke:
        overrides = [*SMOKE, *overrides]
    if name == "dense":  # the dense model has no [model.dsa] section to override
        overrides = [o for o in overrides if not o.startswith("model.dsa.")]
    cmd = [sys.executable, str(REPO / "benchmarks" / "e2e.py"), "--config", str(CONFIGS[name]), "--modes",
           args.mode, "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out)]
    cmd += [a for o in overrides for a in ("--set", o)]
    if args.commit:
        cmd += ["--commit", args.commit]
    predicted = predicted_peak_gib(name, args.mode, overrides)
    print(f"dsa_e2e {name}: planner's predicted peak {predicted:.2f} GiB", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    print(done.stdout[-2000:], done.stderr[-2000:] if done.returncode else "", flush=True)
    if not out.exists():
        return {"error": f"e2e.py exited {done.returncode}: {done.stderr[-1000:]}", "predicted_peak_gib": predicted}
    return {**json.loads(out.read_text()), "predicted_peak_gib": predicted}


def predicted_peak_gib(name: str, mode: str, overrides: list[str]) -> float:
    """`spartron plan`'s peak allocated GiB for this run (rank 0 of one), with the AC keys e2e.py sets."""
    from e2e import MODES  # noqa: PLC0415 - e2e.py imports torch and the trainer: only when a run is planned

    from spartron.runtime.config import load_config  # noqa: PLC0415
    from spartron.runtime.memory import plan_memory  # noqa: PLC0415

    return plan_memory(load_config(CONFIGS[name], [*MODES[mode], *overrides]), 1, 0).peak / 2**30


def step_time(report: dict) -> float | None:
    rows = report.get("results") or [{}]
    return rows[0].get("step_time_s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for both configs")
    parser.add_argument("--dsa-set", action="append", default=[], metavar="KEY=VALUE", help="override for DSA only")
    parser.add_argument("--mode", default="selective", choices=["none", "full", "selective", "selective+offload"],
                        help="e2e.py's AC mode for both configs")
    parser.add_argument("--out", type=Path, default=None, help="JSON result file")
    parser.add_argument("--commit", default=None, help="the commit measured (a device copy's git may lie)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, 3 steps")
    parser.add_argument("--only", default="dsa,dense", help="comma-separated configs to run (dsa, dense); a "
                        "length where dense does not fit runs dsa only (no ratio then)")
    args = parser.parse_args()
    args.only = [n.strip() for n in args.only.split(",") if n.strip()]
    if not args.only or any(n not in CONFIGS for n in args.only):
        parser.error(f"--only must be a comma-separated subset of {','.join(CONFIGS)}, got {','.join(args.only)!r}")
    if args.smoke:
        args.seq, args.steps, args.warmup = 64, 3, 1
    with tempfile.TemporaryDirectory(prefix="spartron-dsa-e2e-") as tmp:
        runs = {name: run_one(name, args, Path(tmp)) for name in args.only}
    dsa, dense = (step_time(runs[n]) if n in runs else None for n in ("dsa", "dense"))
    ratio = dsa / dense if dsa and dense else None
    target = TARGETS.get(args.seq)
    result = {"benchmark": "dsa_e2e", "seq_len": args.seq, "commit": args.commit, "overrides": args.set,
              "dsa_overrides": args.dsa_set, "ac_mode": args.mode,
              "command": "benchmarks/dsa_e2e.py " + " ".join(sys.argv[1:]), "dsa_over_dense_step_time": ratio,
              "target": None if target is None else f"<= {target}x dense",
              "target_met": None if ratio is None or target is None else ratio <= target, "runs": runs}
    print(f"dsa_e2e seq {args.seq}: DSA {dsa} s, dense {dense} s, ratio {ratio} (target {target})", flush=True)
    write_report(args.out, result)
    return 0 if all(step_time(r) for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
