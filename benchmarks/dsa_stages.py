"""DeepSeek-V3.2's two stages on real text (issue 39 item 2), from a dense model Spartron trains first.

    python benchmarks/dsa_stages.py --phase dense --steps-to 500      # one piece of one phase
    python benchmarks/dsa_stages.py --phase warmup                     # until the captured mass plateaus
    python benchmarks/dsa_stages.py --phase sparse
    python benchmarks/dsa_stages.py --phase dense-baseline
    python benchmarks/dsa_stages.py --report --out benchmarks/results/dsa_stages/dsa_stages.json
    python benchmarks/dsa_stages.py --smoke --out /tmp/d.json          # CPU, tiny, every phase then the report

Phases, each a Spartron run directory under --root (default runs/dsa-stages), each resumable in pieces
(--steps-to) like benchmarks/convergence.py, whose corpus (converge_corpus.py) they share:
1. dense: configs/converge-dsv3.toml at 4096 tokens a sequence (DENSE), trained from scratch; exported
   with `spartron convert --to-hf` (dense-hf/).
2. warmup: the same model plus DSA ([model.dsa]: DSA): its backbone loaded from dense-hf, its lightning
   indexers from Spartron's initialisation (dsa-init-hf/). One [[train.stages]] stage: dense attention,
   only `*.indexer.*` trains (by KL towards the dense attention), constant lr; `[train.indexer_metrics]`
   measures the dense attention mass the top-k captures every --metric-every steps. It runs until that
   mass plateaus (`plateau`: the mean over layers, averaged over the last --plateau-window measurements,
   gained less than --plateau-tol over the window before) or --warmup-max steps; then one more step saves.
   Exported as warmup-hf/; its backbone is checked bitwise equal to dense-hf's (the boundary holds).
3. sparse: from warmup-hf, top-k sparse attention, every parameter trained, the indexer by KL over its
   selection (kl_sparse).
4. dense-baseline: the same run with dense attention: the dense model from dense-hf (the same backbone),
   the same data order, schedule and steps.
The report: each phase's losses, the warm-up's captured mass and KL per measurement, the plateau step, and
the sparse stage's training and validation loss against the dense baseline's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import converge_corpus  # noqa: E402
from convergence import SMOKE, fail, measured_on, read_metrics, run_spartron, window_means  # noqa: E402

PHASES = ("dense", "warmup", "sparse", "dense-baseline")
DENSE = ["train.seq_len=4096", "model.max_seq_len=4096", "train.global_batch_size=8", "train.micro_batch_size=8",
         "train.compile=false"]  # compile off in every phase: the indexer metric hooks the DSA layers
DSA = """
[model.dsa]
n_index_heads = {heads}
index_head_dim = {head_dim}
index_topk = {topk}
layers = "all"
indexer_mode = "kl_sparse"
indexer_loss_coeff = 1.0
share_indexer_across_mtp = false  # no MTP here; what the exported checkpoint says
"""
DSA_SHAPE = {"heads": 16, "head_dim": 128, "topk": 512}
DSA_SMOKE = {"heads": 4, "head_dim": 16, "topk": 16}
WARMUP_STAGE = """
[[train.stages]]
name = "dense_warmup"
steps = {steps}
lr = {lr}
warmup_steps = 0
min_lr_ratio = 1.0
trainable = ["*.indexer.*"]
dsa_mode = "dense_warmup"

[train.indexer_metrics]
queries = {queries}
every = {every}
"""
PHASE_SEED = {"dense": 0, "warmup": 1, "sparse": 2, "dense-baseline": 2}  # data order (and the indexers' init)


def phase_config(args: argparse.Namespace, phase: str, extra: list[str] = ()):  # noqa: ANN201 - RunConfig
    """The phase's RunConfig: the base config (+ [model.dsa] and the warm-up stage where the phase has them)."""
    from spartron.runtime.config import load_config

    text = args.config.read_text()
    if phase in ("warmup", "sparse"):
        text += DSA.format(**(DSA_SMOKE if args.smoke else DSA_SHAPE))
    if phase == "warmup":
        text += WARMUP_STAGE.format(steps=args.warmup_max, lr=args.warmup_lr, queries=args.metric_queries,
                                    every=args.metric_every)
    generated = args.root / f"{phase}.toml"
    generated.parent.mkdir(parents=True, exist_ok=True)
    generated.write_text(text)
    steps = {"dense": args.dense_steps, "warmup": args.warmup_max}.get(phase, args.sparse_steps)
    overrides = [*(SMOKE if args.smoke else DENSE), *args.set, f'train.data.path="{args.root / "tok"}"',
                 f"train.steps={steps}", f"train.seed={PHASE_SEED[phase]}", f"train.save_every={steps}",
                 f'train.run_dir="{args.root / phase}"', *extra]
    if phase in ("sparse", "dense-baseline"):
        overrides += [f"train.lr={args.sparse_lr}", "train.warmup_steps=0", "train.min_lr_ratio=0.1"]
    if phase == "sparse":
        overrides += [f"train.indexer_metrics.every={args.metric_every}",
                      f"train.indexer_metrics.queries={args.metric_queries}"]
    return load_config(generated, overrides)


def mean_recall(record: dict) -> float | None:
    per_layer = record.get("indexer_recall_per_layer")
    return sum(per_layer) / len(per_layer) if per_layer else None


class RecallHistory:
    """The warm-up's captured-mass measurements by step, as the run being trained has them. A record at step
    s replaces every measurement from step s on: a run that resumes from an earlier saved step, or starts
    afresh because none was complete, re-trains those steps, so what an earlier invocation measured there
    is not this run's (mixing them once stopped a restarted warm-up at step 30 on the first run's history)."""

    def __init__(self, records: dict[int, dict] | None = None) -> None:
        self._by_step: dict[int, float] = {}
        for step in sorted(records or {}):
            self.add(records[step])

    def add(self, record: dict) -> bool:
        """Take one step's record; True when it carried a measurement."""
        step = record["step"]
        self._by_step = {s: r for s, r in self._by_step.items() if s < step}
        recall = mean_recall(record)
        if recall is not None:
            self._by_step[step] = recall
        return recall is not None

    def values(self) -> list[float]:
        return [self._by_step[s] for s in sorted(self._by_step)]


def plateau(recalls: list[float], window: int, tol: float) -> bool:
    """The mean of the last `window` measurements gained less than `tol` over the mean of the `window` before."""
    if len(recalls) < 2 * window:
        return False
    last, before = recalls[-window:], recalls[-2 * window:-window]
    return sum(last) / window - sum(before) / window < tol


def export(run_dir: Path, out: Path) -> Path:
    """`spartron convert --from RUN --to-hf OUT` of the run's newest saved step (once)."""
    if not (out / "config.json").is_file():
        converge_corpus.cli("convert", "--from", str(run_dir), "--to-hf", str(out))
    return out


def dsa_init(args: argparse.Namespace, dense_hf: Path) -> Path:
    """dsa-init-hf: the DSA model with dense-hf's backbone and freshly initialised indexers (once)."""
    from spartron.interop.hf import export_hf, import_hf
    from spartron.layers.model import build_model

    out = args.root / "dsa-init-hf"
    if not (out / "config.json").is_file():
        cfg = phase_config(args, "warmup")
        checkpoint, load = import_hf(dense_hf)
        model = build_model(cfg.model.model_copy(update={"master_dtype": None, "dtype": checkpoint.dtype}),
                            seed=PHASE_SEED["warmup"], device="cpu")
        load(model, check_config=False)  # the backbone's tensors; the indexers are not in a dense checkpoint
        export_hf(model, out)
    return out


def backbone_identical(a: Path, b: Path) -> dict:
    """Whether every tensor of checkpoint `a` equals the same-named tensor of `b` bitwise (the names of `a`)."""
    from converge_titan import read_hf

    ta, tb = read_hf(a), read_hf(b)
    differ = [n for n, t in ta.items() if n not in tb or tb[n].dtype != t.dtype or not bool((tb[n] == t).all())]
    return {"tensors": len(ta), "differ": differ[:10], "identical": not differ}


def run_phase(args: argparse.Namespace, phase: str) -> None:
    probe = phase_config(args, "dense")
    converge_corpus.prepare(args.root, probe.model.vocab_size, args.max_bytes)
    if phase == "dense":
        run_spartron(probe, args.steps_to or probe.train.steps)
        return
    if not (args.root / "dense" / "metrics.jsonl").is_file() or not _finished(args.root / "dense", args.dense_steps):
        fail(f"--phase {phase} needs the dense phase trained to its {args.dense_steps} steps first (--phase dense)")
    dense_hf = export(args.root / "dense", args.root / "dense-hf")
    if phase == "warmup":
        init = dsa_init(args, dense_hf)
        cfg = phase_config(args, "warmup", [f'train.init_from="hf:{init}"'])
        found = args.root / "warmup" / "plateau.json"
        if found.is_file():
            return
        recalls = RecallHistory(read_metrics(args.root / "warmup" / "metrics.jsonl"))

        def stop_when(record: dict) -> bool:
            if not recalls.add(record):
                return False
            if not found.is_file() and plateau(recalls.values(), args.plateau_window, args.plateau_tol):
                found.write_text(json.dumps({"step": record["step"], "recall": mean_recall(record)}) + "\n")
                return True
            return False

        run_spartron(cfg, args.steps_to or cfg.train.steps, stop_when)
        return
    if not (args.root / "warmup" / "plateau.json").is_file() and not _finished(args.root / "warmup", args.warmup_max):
        fail(f"--phase {phase} needs the warm-up done first (--phase warmup until it plateaus or reaches "
             f"{args.warmup_max} steps)")
    # only the sparse phase reads warmup-hf: dense-baseline exporting it too raced the sparse phase's export
    # when the two ran side by side ("appeared or filled while exporting")
    init = export(args.root / "warmup", args.root / "warmup-hf") if phase == "sparse" else dense_hf
    cfg = phase_config(args, phase, [f'train.init_from="hf:{init}"'])
    run_spartron(cfg, args.steps_to or cfg.train.steps)


def _finished(run_dir: Path, steps: int) -> bool:
    return max(read_metrics(run_dir / "metrics.jsonl"), default=0) >= steps


def phase_curves(run_dir: Path) -> dict:
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = sorted(records)
    out = {"steps": steps, "lm_loss": [records[s]["lm_loss"] for s in steps],
           "val_steps": [s for s in steps if records[s].get("val_loss") is not None]}
    out["val_loss"] = [records[s]["val_loss"] for s in out["val_steps"]]
    measured = [s for s in steps if records[s].get("indexer_recall_per_layer")]
    if measured:
        out.update(metric_steps=measured, recall_per_layer=[records[s]["indexer_recall_per_layer"] for s in measured],
                   kl_per_layer=[records[s].get("indexer_kl_per_layer") for s in measured],
                   mean_recall=[mean_recall(records[s]) for s in measured])
    return out


def report(args: argparse.Namespace) -> dict:
    out = {"benchmark": "dsa_stages", **measured_on(args.commit), "config": str(args.config), "overrides": args.set,
           "smoke": args.smoke, "dsa": DSA_SMOKE if args.smoke else DSA_SHAPE, "dense_steps": args.dense_steps,
           "warmup": {"max_steps": args.warmup_max, "lr": args.warmup_lr, "plateau_window": args.plateau_window,
                      "plateau_tol": args.plateau_tol, "metric_every": args.metric_every},
           "sparse_steps": args.sparse_steps, "sparse_lr": args.sparse_lr,
           "corpus": json.loads((args.root / "corpus" / "corpus.json").read_text()), "phases": {}}
    for phase in PHASES:
        run_dir = args.root / phase
        out["phases"][phase] = phase_curves(run_dir) if (run_dir / "metrics.jsonl").is_file() else {"status": "not run"}
    found = args.root / "warmup" / "plateau.json"
    out["warmup"]["plateau"] = json.loads(found.read_text()) if found.is_file() else None
    if (args.root / "warmup-hf").is_dir() and (args.root / "dense-hf").is_dir():
        out["warmup"]["backbone_equals_dense"] = backbone_identical(args.root / "dense-hf", args.root / "warmup-hf")
    sparse, base = out["phases"]["sparse"], out["phases"]["dense-baseline"]
    if "steps" in sparse and "steps" in base:
        width = max(1, min(50, args.sparse_steps // 10))
        ws, wb = (window_means({"steps": c["steps"], "loss": c["lm_loss"]}, width) for c in (sparse, base))
        vs, vb = (dict(zip(c["val_steps"], c["val_loss"], strict=True)) for c in (sparse, base))
        common = sorted(set(vs) & set(vb))
        out["sparse_vs_dense"] = {
            "window": width, "train_window_diff": {s: ws[s] - wb[s] for s in sorted(set(ws) & set(wb))},
            "val_diff": {s: vs[s] - vb[s] for s in common},
            "final_val_relative": (vs[common[-1]] - vb[common[-1]]) / vb[common[-1]] if common else None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        plot(out, args.out.with_suffix(".png"))
        out["plot"] = args.out.with_suffix(".png").name
    except ImportError as err:
        out["plot"] = f"not drawn: {err}"
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return out


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    dense = out["phases"]["dense"]
    if "steps" in dense:
        axes[0].plot(dense["steps"], dense["lm_loss"], label="dense pre-training")
    axes[0].set_title("dense model: LM loss")
    warm = out["phases"]["warmup"]
    if "metric_steps" in warm:
        axes[1].plot(warm["metric_steps"], warm["mean_recall"], marker=".", label="captured mass (mean of layers)")
        if out["warmup"]["plateau"]:
            axes[1].axvline(out["warmup"]["plateau"]["step"], color="gray", linestyle="--", label="plateau")
    axes[1].set_title("indexer warm-up: dense attention mass in the top-k")
    for name in ("sparse", "dense-baseline"):
        c = out["phases"][name]
        if "steps" in c:
            axes[2].plot(c["steps"], c["lm_loss"], alpha=0.5, label=f"{name} (train)")
            axes[2].plot(c["val_steps"], c["val_loss"], marker="o", label=f"{name} (val)")
    axes[2].set_title("sparse stage against dense attention: LM loss")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO / "configs" / "converge-dsv3.toml")
    p.add_argument("--root", type=Path, default=REPO / "runs" / "dsa-stages")
    p.add_argument("--phase", choices=PHASES, action="append", default=[], help="run this phase (repeatable, in order)")
    p.add_argument("--steps-to", type=int, default=None, help="train the phase up to this step (default: all)")
    p.add_argument("--dense-steps", type=int, default=1000)
    p.add_argument("--warmup-max", type=int, default=1000, help="warm-up steps at most (V3.2: 1,000)")
    p.add_argument("--warmup-lr", type=float, default=1e-3, help="warm-up learning rate (V3.2: 1e-3)")
    p.add_argument("--plateau-window", type=int, default=5, help="measurements per window of the plateau rule")
    p.add_argument("--plateau-tol", type=float, default=0.005, help="captured-mass gain below which it plateaued")
    p.add_argument("--metric-every", type=int, default=10, help="[train.indexer_metrics] every")
    p.add_argument("--metric-queries", type=int, default=256, help="[train.indexer_metrics] queries")
    p.add_argument("--sparse-steps", type=int, default=1000)
    p.add_argument("--sparse-lr", type=float, default=1e-4)
    p.add_argument("--max-bytes", type=int, default=128 << 20, help="corpus text at most (bytes)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (every phase)")
    p.add_argument("--report", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="the report's JSON (default ROOT/dsa_stages.json)")
    p.add_argument("--commit", default=None, help="the commit measured (a device copy's git may lie)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, a few steps: every phase, then --report")
    args = p.parse_args()
    for name in ("steps_to", "dense_steps", "warmup_max", "plateau_window", "metric_every", "sparse_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    args.root = args.root.resolve()
    args.out = args.out or args.root / "dsa_stages.json"
    if args.smoke:
        args.max_bytes = min(args.max_bytes, 1_000_000)
        args.dense_steps, args.warmup_max, args.sparse_steps = 4, 8, 4
        args.metric_every, args.metric_queries, args.plateau_window, args.plateau_tol = 1, 16, 2, 1.0
        args.phase, args.report = args.phase or list(PHASES), True
    if not args.phase and not args.report:
        p.error("give --phase NAME (repeatable), --report or --smoke")
    for phase in args.phase:
        run_phase(args, phase)
    if args.report:
        report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
