"""Loss curves on real text, Spartron against torchtitan 0.2.2 (issue 38 item 4): the same Hugging Face initial
weights, the same data in the same order, the same schedule, at a DeepSeek-V3-like shape
(configs/converge-dsv3.toml) on one GPU, bf16 and fp32 masters, compiled, selective AC.

    python benchmarks/convergence.py --prepare                               # corpus, tokens, initial weights
    python benchmarks/convergence.py --case spartron-bf16 --steps-to 500     # one piece of one case
    python benchmarks/convergence.py --report --out benchmarks/results/convergence/convergence.json
    python benchmarks/convergence.py --recompare OLD.json --out NEW.json     # its comparisons with today's rules
    python benchmarks/convergence.py --smoke --out /tmp/c.json               # CPU, tiny, seconds

Machines' /usr/share/doc differ (the GPU images since a5fcf68 hold 682 files, sha256 9aac6079241a; the 7daec4c
H100 report read 2,233, e6559cb4aa30, which this repository's CPU machine reproduces): to add cases to a report of
another corpus, `--prepare --root DIR` where that corpus is and carry DIR/tok, DIR/tokenizer and
DIR/corpus/corpus.json (44 MB; not corpus.jsonl or init-hf/) with the call, run with `--root DIR`: a root whose
token folder exists is read, not rebuilt, and --previous checks the corpus's sha256.

Cases (CASES): spartron-{bf16,fp32}; titan-{bf16,fp32} read the data in Spartron's order (train.seed);
titan-{bf16,fp32}-seed1 in another order (train.seed + 1): the reference's run-to-run noise band;
spartron-fp32-optimizer (fp32 masters held by the optimizer, model.master_weights = "optimizer") against the
same fp32 pair;
spartron-fp8 (blockwise FP8 with fp32 masters, GPU only) against spartron-bf16 and spartron-fp32 (the same
masters) within DeepSeek's < 0.25% gap; spartron-fp8-wgrad-bf16 and spartron-fp8-edges-bf16 (FP8_VARIANTS) against
spartron-fp32 the same way.
Everything lives under --root (default runs/converge): the corpus, tokenizer and token folder
(converge_corpus.py), the initial weights (init-hf/, from Spartron's initialisation at train.seed) and one
folder per case. A case resumes from its last saved step: Spartron from its run directory (train.resume),
torchtitan from titan-state.pt; each invocation trains up to --steps-to (default: train.steps), so a
case runs in pieces that fit a time limit. --report reads every case's metrics (train loss every step,
val_loss every train.eval_every on the same held-out batches) and writes the JSON and a PNG beside it;
with --previous, the cases this root lacks come from an earlier report of the same corpus (cases run on
other machines), each case's commit and device recorded.
torchtitan absent (or no CUDA): the torchtitan cases are recorded as not run, with the reason, and no
comparison is claimed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import converge_corpus  # noqa: E402
import converge_titan  # noqa: E402

CASES = {name: (side, precision, seed) for precision in ("bf16", "fp32") for name, side, seed in (
    (f"spartron-{precision}", "spartron", 0), (f"titan-{precision}", "torchtitan", 0),
    (f"titan-{precision}-seed1", "torchtitan", 1))} | {"spartron-fp32-optimizer": ("spartron", "fp32", 0),
                                                       "spartron-fp8": ("spartron", "fp8", 0)}
# FP8 as Megatron users also run it: the weight gradients in bf16 (fp8_wgrad = False), the first and last decoder
# layers in bf16 (first_last_layers_bf16); each compared with the fp32-master curve like spartron-fp8
FP8_VARIANTS = {"spartron-fp8-wgrad-bf16": ['model.fp8.wgrad="model_dtype"'],
                "spartron-fp8-edges-bf16": ["model.fp8.layers_at_start_in_bf16=1", "model.fp8.layers_at_end_in_bf16=1"]}
CASES |= {name: ("spartron", "fp8", 0) for name in FP8_VARIANTS}
PRECISION = {"bf16": ['model.dtype="bfloat16"'], "fp32": ['model.dtype="bfloat16"', 'model.master_dtype="float32"'],
             "fp8": ['model.dtype="bfloat16"', 'model.master_dtype="float32"', 'model.fp8.backend="triton"']}
# how a case holds its fp32 masters when not FSDP2's way: the optimizer's (the fast one-rank path)
HOLDING = {"spartron-fp32-optimizer": ['model.master_weights="optimizer"']}
FP8_GAP = 0.0025  # DeepSeek-V3's reported FP8-vs-bf16 relative loss gap: below 0.25%
AC = {"selective": "selective", "full": "full", "none": "none"}  # Spartron ac.mode -> torchtitan's mode
# --smoke: the DeepSeek-V3 architecture at the tiny preset's sizes, on CPU, 4 steps
SMOKE = ["device=cpu", "model.vocab_size=512", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
         "model.dense_inter_dim=128", "model.max_seq_len=64", "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=32",
         "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16",
         "model.moe.n_routed_experts=8", "model.moe.top_k=2", "model.moe.moe_inter_dim=32", "model.moe.n_groups=2",
         "model.moe.topk_groups=1", "train.seq_len=64", "train.global_batch_size=4", "train.micro_batch_size=4",
         "train.steps=4", "train.warmup_steps=1", "train.eval_every=2", "train.eval_steps=1", "train.compile=false",
         "train.data.val_fraction=0.2"]


def fail(message: str) -> None:
    """One line `spartron: error: ...`, exit status 2 (the project's refusal)."""
    print(f"spartron: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def load_run_config(args: argparse.Namespace, extra: list[str] = ()):  # noqa: ANN201 - RunConfig
    from spartron.runtime.config import load_config

    overrides = [*(SMOKE if args.smoke else ()), *args.set, f'train.data.path="{args.root / "tok"}"', *extra]
    return load_config(args.config, overrides)


def init_weights(cfg, root: Path) -> Path:  # noqa: ANN001
    """root/init-hf: Spartron's initialisation at train.seed in float32, exported in the Hugging Face layout (once)."""
    from spartron.interop.hf import export_hf
    from spartron.layers.model import build_model

    out = root / "init-hf"
    if not (out / "config.json").is_file():
        m = cfg.model.model_copy(update={"dtype": "float32", "master_dtype": None})
        export_hf(build_model(m, seed=cfg.train.seed, device="cpu"), out)
    return out


def run_spartron(cfg, steps_to: int, stop_when: Callable[[dict], bool] | None = None) -> None:  # noqa: ANN001
    """Spartron's Trainer from train.init_from (or its newest saved step) to steps_to, saving there; or, when
    `stop_when(record)` says so after a step, through one more step that saves (dsa_stages' plateau rule)."""
    import torch.distributed as dist

    from spartron.runtime.preemption import StopOnSigterm
    from spartron.runtime.rank_setup import init_process_group
    from spartron.runtime.trainer import Trainer

    t = cfg.train
    own = init_process_group(cfg)
    with StopOnSigterm() as on_sigterm:  # installed: a time limit's SIGTERM saves the step, as `spartron train`
        trainer = Trainer(cfg, stop=on_sigterm)
        try:
            trainer.setup()
            stop = False
            while not trainer.done and trainer.step_no < steps_to:
                if stop or trainer.step_no + 1 == steps_to < t.steps:
                    trainer.stop.request()  # this step saves, the next invocation resumes from it
                record = trainer.step()
                stop = stop_when is not None and stop_when(record)
            trainer.close()
        finally:
            trainer.release_run_dir()
    if own:
        dist.destroy_process_group()


def prepare(args: argparse.Namespace):  # noqa: ANN201 - (RunConfig, the initial weights' folder)
    """The corpus, its token folder and the initial weights under --root, each made once (what every case reads)."""
    probe = load_run_config(args)
    info = converge_corpus.prepare(args.root, probe.model.vocab_size, args.max_bytes)
    print(f"corpus: {info['documents']} files, {info['text_bytes']} bytes, {info['tokens']['n_tokens']} tokens")
    problems = converge_titan.comparable_problems(probe.model)
    if problems:
        fail("torchtitan cannot compute this [model]: " + "; ".join(problems))
    return probe, init_weights(probe, args.root)


def run_case(args: argparse.Namespace, name: str) -> None:
    side, precision, seed = CASES[name]
    case_dir = args.root / name
    probe, hf_dir = prepare(args)
    steps_to = args.steps_to or probe.train.steps
    reached = max(read_metrics(case_dir / "metrics.jsonl"), default=0)
    if reached >= steps_to:  # a finished piece: a call that runs every case again resumes only the others
        print(f"case {name}: already at step {reached} (asked: {steps_to}), nothing to run")
        return
    if side == "spartron":
        cfg = load_run_config(args, [*PRECISION[precision], *HOLDING.get(name, ()), *FP8_VARIANTS.get(name, ()),
                                     f'train.run_dir="{case_dir}"',
                                     f'train.init_from="hf:{hf_dir}"', f"train.save_every={probe.train.steps}",
                                     "train.resume=true"])
        run_spartron(cfg, steps_to)
        return
    why = converge_titan.unavailable()
    if why:
        fail(f"case {name}: torchtitan cannot run here: {why}")
    cfg = load_run_config(args, PRECISION[precision])
    converge_titan.run(cfg, case_dir, hf_dir, precision, cfg.train.seed + seed, steps_to, AC[cfg.ac.mode])


def measured_on(commit: str | None, root: Path | None = None) -> dict:
    """A report's commit (--commit, else this checkout's), torch version and device: those a Spartron run under
    `root` recorded in its metrics header (the cases ran there, the report may be written on another machine),
    else this machine's (common.device_name)."""
    import torch
    from common import device_name

    from spartron.runtime.metrics import git_commit

    out = {"commit": commit or git_commit(), "torch": torch.__version__,
           "device": device_name(torch.cuda.is_available())}
    for metrics in sorted(root.glob("*/metrics.jsonl")) if root is not None else ():
        with metrics.open() as f:
            header = json.loads(f.readline() or "{}")
        if header.get("type") == "header" and header.get("hardware", {}).get("device_name"):
            return out | {"torch": header["versions"]["torch"], "device": header["hardware"]["device_name"]}
    return out


def read_metrics(path: Path) -> dict[int, dict]:
    """Step records by step (the last one written wins: a piece that died after logging is re-run)."""
    out: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("type", "step") == "step" and "step" in record:
                out[int(record["step"])] = record
    return out


def curves(case_dir: Path, side: str) -> dict:
    records = read_metrics(case_dir / "metrics.jsonl")
    steps = sorted(records)
    key = "lm_loss" if side == "spartron" else "loss"
    return {"steps": steps, "loss": [records[s][key] for s in steps],
            "val_steps": [s for s in steps if records[s].get("val_loss") is not None],
            "val_loss": [records[s]["val_loss"] for s in steps if records[s].get("val_loss") is not None],
            "median_step_time_s": sorted(records[s]["step_time_s"] for s in steps)[len(steps) // 2] if steps else None,
            "peak_memory_allocated_gib": max((records[s].get("peak_memory_allocated_bytes") or 0 for s in steps),
                                             default=0) / 2**30}


def window_means(c: dict, width: int) -> dict[int, float]:
    """Mean training loss over each full window of `width` steps, keyed by the window's last step."""
    by_step = dict(zip(c["steps"], c["loss"], strict=True))
    out = {}
    for end in range(width, max(c["steps"], default=0) + 1, width):
        window = [by_step[s] for s in range(end - width + 1, end + 1) if s in by_step]
        if len(window) == width:
            out[end] = sum(window) / width
    return out


def band(ours: dict[int, float], ref: dict[int, float], other: dict[int, float]) -> dict | None:
    """|ours - ref| against the reference's own |ref - other| (two data orders) over the second half of the
    points all three have: max and root-mean-square of each, and whether ours is within (rms <= the band's)."""
    common = sorted(set(ours) & set(ref) & set(other))
    tail = common[len(common) // 2:]
    if not tail:
        return None
    rms = lambda xs: (sum(x * x for x in xs) / len(xs)) ** 0.5  # noqa: E731
    diff = [ours[s] - ref[s] for s in tail]
    noise = [ref[s] - other[s] for s in tail]
    return {"points": tail, "diff": diff, "noise": noise, "diff_max": max(map(abs, diff)),
            "noise_max": max(map(abs, noise)), "diff_rms": rms(diff), "noise_rms": rms(noise),
            "within_noise_band": rms(diff) <= rms(noise)}


def fp8_gap(fp8: dict, base: dict, width: int, base_name: str = "spartron-bf16", name: str = "spartron-fp8") -> dict:
    """FP8 against another Spartron curve (the issue's: bf16; also fp32 masters, FP8's own master recipe): the
    relative difference of the training-loss window means over the second half of the points both have, and
    of the validation losses there, against DeepSeek's < 0.25% (FP8_GAP)."""
    if "not run" in (fp8["status"], base["status"]):
        return {"status": "not compared: " + ", ".join(n for n, c in ((name, fp8), (base_name, base))
                                                        if c["status"] == "not run") + " not run"}
    out = {"against": base_name, "limit_relative": FP8_GAP}
    for key, (a, b) in {"train_loss_windows": (window_means(fp8, width or 50), window_means(base, width or 50)),
                        "val_loss": (dict(zip(fp8["val_steps"], fp8["val_loss"], strict=True)),
                                     dict(zip(base["val_steps"], base["val_loss"], strict=True)))}.items():
        common = sorted(set(a) & set(b))
        tail = common[len(common) // 2:]
        rel = [(a[s] - b[s]) / b[s] for s in tail]
        out[key] = {"points": tail, "relative": rel, "mean_relative": sum(rel) / len(rel) if rel else None,
                    "within": bool(rel) and abs(sum(rel) / len(rel)) < FP8_GAP}
    return out


def read_previous(path: Path, flag: str = "--previous") -> dict:
    """An earlier report (--previous, --recompare): a regular JSON file with the fields a report has, or one error
    line naming `flag`."""
    try:
        if not path.is_file() or path.is_symlink():
            raise ValueError("not a regular file")
        out = json.loads(path.read_text())
        corpus = out.get("corpus") if isinstance(out, dict) else None
        if not isinstance(out, dict) or not isinstance(out.get("cases"), dict) or "commit" not in out \
                or "device" not in out or not isinstance(corpus, dict) or not isinstance(corpus.get("sha256"), str):
            raise ValueError("no cases, corpus sha256, commit or device")
        if any(not isinstance(c, dict) or "status" not in c for c in out["cases"].values()):
            raise ValueError("a case without a status")
    except (OSError, UnicodeDecodeError, ValueError) as err:
        fail(f"{flag} {path}: not a convergence report ({err})")
    return out


def report(args: argparse.Namespace) -> dict:
    cfg = load_run_config(args)
    corpus = json.loads((args.root / "corpus" / "corpus.json").read_text())
    t = cfg.train
    tokens_read = t.steps * t.global_batch_size * t.seq_len
    out = {"benchmark": "convergence", **measured_on(args.commit, args.root), "config": str(args.config),
           "overrides": args.set, "smoke": args.smoke, "steps": t.steps, "eval_every": t.eval_every,
           "ac_mode": cfg.ac.mode,
           "compile": t.compile, "corpus": corpus, "epochs": tokens_read / max(1, corpus["tokens"]["n_tokens"]),
           "torchtitan_unavailable": converge_titan.unavailable(), "torchtitan_settings": converge_titan.DIFFERENCES,
           "cases": {}, "case_commits": {}, "case_devices": {}, "comparisons": {}}
    previous = read_previous(args.previous) if args.previous else {"cases": {}}
    if args.previous and previous["corpus"]["sha256"] != corpus["sha256"]:
        fail(f"--previous {args.previous} read another corpus (sha256 {previous['corpus']['sha256'][:12]}, "
             f"this root's {corpus['sha256'][:12]}): its curves cannot be compared with these")
    for name, (side, precision, seed) in CASES.items():
        case_dir = args.root / name
        if not (case_dir / "metrics.jsonl").is_file():
            earlier = previous["cases"].get(name, {"status": "not run"})
            out["cases"][name] = {"side": side, "precision": precision, **earlier}
            if earlier["status"] != "not run":
                out["case_commits"][name] = previous.get("case_commits", {}).get(name, previous["commit"])
                out["case_devices"][name] = previous.get("case_devices", {}).get(name, previous["device"])
            continue
        out["case_commits"][name], out["case_devices"][name] = out["commit"], out["device"]
        if side == "torchtitan":  # it ran where the cases ran, whatever this machine has
            out["torchtitan_unavailable"] = None
        c = curves(case_dir, side)
        last = c["steps"][-1] if c["steps"] else 0
        done = "complete" if last >= t.steps else f"partial (to step {last})"
        out["cases"][name] = {"side": side, "precision": precision, "data_seed": t.seed + seed, "status": done, **c}
    out["comparisons"] = compare(out["cases"], t.eval_every)
    write(out, args.out)
    return out


def compare(cases: dict[str, dict], eval_every: int) -> dict:
    """Every comparison a report makes from its cases: FP8 against Spartron's bf16 and fp32-master curves, and each
    Spartron curve against the torchtitan pair's noise band."""
    out = {"fp8": fp8_gap(cases["spartron-fp8"], cases["spartron-bf16"], eval_every),
           "fp8_vs_fp32": fp8_gap(cases["spartron-fp8"], cases["spartron-fp32"], eval_every, "spartron-fp32")}
    out |= {f"{name}_vs_fp32": fp8_gap(cases[name], cases["spartron-fp32"], eval_every, "spartron-fp32", name)
            for name in FP8_VARIANTS}
    against_reference = {p: [f"spartron-{p}", f"titan-{p}", f"titan-{p}-seed1"] for p in ("bf16", "fp32")}
    against_reference |= {name: [name, "titan-fp32", "titan-fp32-seed1"] for name in HOLDING}
    for key, names in against_reference.items():
        chosen = [cases[n] for n in names]
        if any(c["status"] == "not run" for c in chosen):
            out[key] = {"status": "not compared: " + ", ".join(
                n for n, c in zip(names, chosen, strict=True) if c["status"] == "not run") + " not run"}
            continue
        val = [dict(zip(c["val_steps"], c["val_loss"], strict=True)) for c in chosen]
        train = [window_means(c, eval_every or 50) for c in chosen]
        out[key] = {"val_loss": band(*val), "train_loss_windows": band(*train)}
    return out


def recompare(args: argparse.Namespace) -> dict:
    """--recompare: an earlier report's comparisons made again from its recorded cases with this commit's rules
    (a comparison added since, such as FP8 against the fp32-master curve), written with its plot to --out; the
    cases, their commits and devices are the report's, untouched."""
    from spartron.runtime.metrics import git_commit

    out = read_previous(args.recompare, "--recompare")
    cases = {name: out["cases"].get(name, {"side": side, "precision": precision, "status": "not run"})
             for name, (side, precision, _) in CASES.items()}
    out = {**out, "cases": cases, "comparisons": compare(cases, out["eval_every"]),
           "recompared": {"from": args.recompare.name, "commit": args.commit or git_commit()}}
    write(out, args.out)
    return out


def write(out: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        plot(out, path.with_suffix(".png"))
        out["plot"] = str(path.with_suffix(".png").name)
    except ImportError as err:
        out["plot"] = f"not drawn: {err}"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


def plot(out: dict, path: Path) -> None:
    """Training loss (window means) and validation loss per precision, every case that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [p for p in PRECISION if any(c["precision"] == p and c["status"] != "not run" for c in out["cases"].values())]
    columns = ran or list(PRECISION)  # a precision none of whose cases ran gets no empty panel
    fig, axes = plt.subplots(2, len(columns), figsize=(6 * len(columns), 8), squeeze=False)
    for col, precision in enumerate(columns):
        for name, case in out["cases"].items():
            # FP8 is compared with Spartron's bf16 and fp32-master curves
            beside = precision == "fp8" and name in ("spartron-bf16", "spartron-fp32")
            if (case["precision"] != precision and not beside) or case["status"] == "not run":
                continue
            means = window_means(case, out["eval_every"] or 1)
            axes[0][col].plot(list(means), list(means.values()), label=name)
            axes[1][col].plot(case["val_steps"], case["val_loss"], marker=".", label=name)
        axes[0][col].set_title(f"{precision}: training loss (mean of {out['eval_every']} steps)")
        axes[1][col].set_title(f"{precision}: validation loss")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("step")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "converge-dsv3.toml")
    parser.add_argument("--root", type=Path, default=REPO / "runs" / "converge")
    parser.add_argument("--case", choices=sorted(CASES), action="append", default=[], help="run this case (repeatable)")
    parser.add_argument("--steps-to", type=int, default=None, help="train each case up to this step (default: all)")
    parser.add_argument("--report", action="store_true", help="write the JSON (and PNG) from the cases' metrics")
    parser.add_argument("--previous", type=Path, default=None,
                        help="--report: take the cases this root has not run from this earlier report (same corpus)")
    parser.add_argument("--recompare", type=Path, default=None,
                        help="make an earlier report's comparisons again from its cases (with this commit's rules)")
    parser.add_argument("--prepare", action="store_true",
                        help="make the corpus, tokens and initial weights, then stop (before cases run side by side)")
    parser.add_argument("--max-bytes", type=int, default=128 << 20, help="corpus text at most (bytes)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--out", type=Path, default=None, help="the report's JSON (default ROOT/convergence.json)")
    parser.add_argument("--commit", default=None, help="the commit measured (a device copy's git may lie)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the Spartron cases, then --report")
    args = parser.parse_args()
    if args.steps_to is not None and args.steps_to < 1:
        parser.error(f"--steps-to must be >= 1, got {args.steps_to}")
    args.root = args.root.resolve()
    args.out = args.out or args.root / "convergence.json"
    if args.smoke:
        args.max_bytes = min(args.max_bytes, 1_000_000)
        args.case = args.case or [n for n, (side, p, _) in CASES.items() if side == "spartron" and p != "fp8"]
        args.report = True
    if args.recompare is not None:
        if args.case or args.report or args.prepare or args.smoke:
            parser.error("--recompare reads a report alone: no --case, --report, --prepare or --smoke")
        recompare(args)
        return 0
    if not args.case and not args.report and not args.prepare:
        parser.error("give --case NAME (repeatable), --prepare, --report, --recompare or --smoke")
    if args.prepare:
        prepare(args)
    for name in args.case:
        run_case(args, name)
    if args.report:
        report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
