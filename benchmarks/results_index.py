"""The results index: which file under benchmarks/results/ holds the current number of each benchmark.

    python benchmarks/results_index.py           # rewrite LATEST.json, README.md (there) and docs/RESULTS.md
    python benchmarks/results_index.py --check   # exit 1 naming each generated file that is out of date (CI)

Layout: benchmarks/results/<benchmark>/ holds the current results of one benchmark (the folder is named
after benchmarks/<benchmark>.py; gpu_pytest/ holds `run_gpu.sh ... pytest` logs); superseded ones live
under benchmarks/results/archive/<benchmark>/. Every JSON names the commit it measured in `commit` (null
only with a `commit_note` saying why). A .log or .png belongs to the JSON whose name its own starts with;
one with no JSON is a result by itself (its commit in its name). To record a new result, write it into
its folder, move the file it supersedes into archive/, and rerun this script.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUTS = ("benchmarks/results/LATEST.json", "benchmarks/results/README.md", "docs/RESULTS.md")
TOP_LEVEL = {"LATEST.json", "README.md", "archive", "audit.json", "audit.md"}  # audit.*: benchmarks/audit.py's
NON_SCRIPT_FOLDERS = {"gpu_pytest": "run_gpu.sh's pytest step", "eval_observe_gpu": "a by-hand GPU check",
                      "rehearse": "`spartron rehearse --out` (the command, not a script)"}
COMMIT_IN_NAME = re.compile(r"_([0-9a-f]{7,40})(?=_|$)")


class ResultsError(Exception):
    """A results tree the index cannot describe; the message names the file or folder."""


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _e2e(d: dict) -> str:
    if "ratios" in d:  # a same-call comparison of two commits
        return "; ".join(f"mb{r['micro_batches']} {r['mode']} {r['head_ms']:.1f} vs {r['base_ms']:.1f} ms "
                         f"({r['head_over_base']:.3f}x)" for r in d["ratios"])
    if "rows" in d:  # a summary over several runs
        return "; ".join(f"{r['targets'].split(' (')[0]} {r['step_ms']:.1f} ms" for r in d["rows"])
    if "results" not in d:
        return f"{d['mode']} {d['step_time_ms_median_of_timed']:.1f} ms"
    return "; ".join(f"{r['mode']} {_ms(r['step_time_s'])}" for r in d["results"])


def _indexer(d: dict) -> str:
    return "; ".join(f"{c['seq'] // 1024}k fp8 scores + top-k {c['results']['indexer_topk_fp8']['ms']:.2f} ms "
                     f"({c['results']['indexer_topk_fp8']['fraction_of_bf16_ceiling']:.1%} of the bf16 ceiling)"
                     for c in d["cases"])


def _offload(d: dict) -> str:
    m = d["microbatch"]
    parts = [f"mb2 / mb1 {m['speedup_2_over_1']:.3f}x ({m['micro_batches_2']['step_ms']:.1f} vs "
             f"{m['micro_batches_1']['step_ms']:.1f} ms)"]
    for mode, r in d.get("offload", {}).get("modes", {}).items():
        parts.append(f"offload, {mode}: step x{r['step_time_ratio']:.3f}")
    return "; ".join(parts)


def _sparse_mla(d: dict) -> str:
    if isinstance(d.get("results"), list):  # a backward config sweep
        best = min(d["results"], key=lambda r: r["ms"])
        return f"{d['seq'] // 1024}k x {d['heads']} heads bwd {best['ms']:.1f} ms ({best['tflops']:.0f} TFLOP/s)"
    out = []
    for c in d["cases"]:
        r = c["results"]
        line = f"{c['seq'] // 1024}k x {c['heads']} heads fwd {r['sparse_fwd']['ms']:.1f} ms"
        out.append(line + (f", bwd {r['sparse_bwd']['ms']:.1f} ms" if "sparse_bwd" in r else ""))
    return "; ".join(out)


def _dsa_id_overlap(d: dict) -> str:
    mean = statistics.mean(r["reuse_factor_g8"] for r in d["results"])
    base = d.get("random_baseline", {}).get("reuse_factor_g8")
    return f"reuse factor over 8 queries {mean:.2f}" + (f" (random ids {base:.2f})" if base is not None else "")


def _collectives(d: dict) -> str:
    r = d["results"][-1]
    return f"{r['size_mb']:g} MB: spartron op {r['median_ms']['custom']:.3f} ms vs raw {r['median_ms']['raw']:.3f} ms"


def _doc_mask(d: dict) -> str:
    if "cases" in d:
        c = d["cases"]
        return (f"flex documents fwd+bwd {c['flex_documents']['forward_backward']['median_ms']:.2f} ms vs SDPA causal "
                f"{c['sdpa_causal']['forward_backward']['median_ms']:.2f} ms")
    name, best = min(d["builds"].items(), key=lambda kv: kv[1]["median_ms"])
    return f"block mask build {best['median_ms']:.2f} ms ({name})"


def _rehearse(d: dict) -> str:
    return "; ".join(f"{e['case']} N={e['world_size']} seq {e['seq_len']}: "
                     f"planner {e['planner_peak_bytes'] / 2**30:.1f} GiB, "
                     + (f"measured {e['measured_peak_allocated_bytes'] / 2**30:.1f} GiB, "
                        f"{e['tokens_per_s_per_gpu']:.0f} tokens/s/GPU" if e.get("rehearsed") else "not rehearsed")
                     for e in d["entries"])


def _muon(d: dict) -> str:
    return "; ".join(f"{r['optimizer']} optimizer step {r['median_optimizer_step_ms']:.1f} ms"
                     if "median_optimizer_step_ms" in r else f"{r['optimizer']} error" for r in d["rows"])


HEADLINES: dict[str, Callable[[dict], str]] = {
    "ac_block": lambda d: (f"selective AC block step "
                           f"{d['results']['spartron_selective_nonreentrant']['step_ms']:.2f} ms vs torch SAC "
                           f"{d['results']['torch_selective']['step_ms']:.2f} ms"),
    "ac_validation_cost": lambda d: (f"AC validation {d['fraction']:.3%} of a {d['median_step_time_ms']:.1f} ms step"),
    "adamw": lambda d: (f"Triton AdamW {d['summary']['best_triton_ms']:.1f} ms vs clip + torch fused "
                        f"{d['summary']['clip_plus_torch_fused_ms']:.1f} ms"),
    "attention": lambda d: "; ".join(f"{a['variant'].split(' (')[0]} fwd+bwd {a['fwd_bwd_ms']:.2f} ms"
                                     for a in d["attention"]),
    "collectives": _collectives,
    "deepep": lambda d: (f"MoE layer fwd+bwd DeepEP {d['summary']['deepep']['layer_fwd_bwd_ms']:.1f} ms vs all_to_all "
                         f"{d['summary']['all_to_all']['layer_fwd_bwd_ms']:.1f} ms"),
    "dkv_atomics_floor": lambda d: "; ".join(f"{kind} {min(r['ms'] for r in d['results'] if r['kind'] == kind):.2f} ms"
                                             for kind in dict.fromkeys(r["kind"] for r in d["results"])),
    "doc_mask": _doc_mask,
    "dsa_saved": lambda d: ("attention layer kept under selective AC, KiB/token: dense "
                            + ", ".join(f"{k} {v['selective_kept_bytes_per_token'] / 1024:.1f}"
                                        for k, v in d["variants"].items()) + f" (CPU, S {d['seq_len']})"),
    "dsa_e2e": lambda d: (f"DSA / dense step time {d['dsa_over_dense_step_time']:.2f}x (target {d['target']})"
                          if d["dsa_over_dense_step_time"] is not None
                          else f"{' and '.join(d['runs'])} alone at seq {d['seq_len']} (no ratio)"),
    "dsa_id_overlap": _dsa_id_overlap,
    "dsa_stages": lambda d: (f"warm-up to step {d['warmup']['plateau']['step']} (captured mass "
                             f"{d['warmup']['plateau']['recall']:.3f}); sparse vs dense val loss "
                             f"{d['sparse_vs_dense']['final_val_relative']:+.2%} at step {d['sparse_steps']}"),
    "muon": _muon,
    "fp8_gemms": lambda d: f"{d['backend']} " + "; ".join(
        f"{name} expert GEMMs fp8 {r['summary']['fp8_gemms_ms']:.2f} ms vs bf16 {r['summary']['bf16_gemms_ms']:.2f} ms "
        f"({r['summary']['speedup']:.2f}x), wgrad {r['results']['up.wgrad.fp8']['tflops']:.0f} TFLOP/s"
        for name, r in d["runs"].items()) if "runs" in d else "quantisers alone (no GEMMs): " + "; ".join(
        f"{name} {r['median_ms']:.3f} ms" for name, r in d["results"].items() if name.startswith("quantize_blocks")),
    "deep_gemm_candidates": lambda d: "; ".join(
        f"{shape} up13 " + ", ".join(
            f"{kind} {d['results'][f'{shape}.up13.{kind}.{best}']['tflops']:.0f}/"
            f"{d['results'][f'{shape}.up13.{kind}.triton']['tflops']:.0f}/"
            f"{d['results'][f'{shape}.up13.{kind}.bf16']['tflops']:.0f}"
            for kind, best in (("fprop", "deep_gemm"), ("dgrad", "deep_gemm"), ("wgrad", "deep_gemm_fp32acc")))
        + " TFLOP/s DeepGEMM/Triton/bf16" for shape in d["shapes"]),
    "fp8_moe": lambda d: f"{d['backend']} " + "; ".join(
        f"{name} fp8 {r['fp8']['median_ms']:.2f} ms vs bf16 {r['bf16']['median_ms']:.2f} ms ({r['speedup']:.2f}x)"
        for name, r in d["runs"].items()),
    "fp8_gather_write": lambda d: "; ".join(
        f"{name} kernel {r['triton_kernel']['median_ms']:.3f} ms vs torch copies "
        f"{r['torch_copies']['median_ms']:.3f} ms "
        f"({r['torch_copies']['median_ms'] / r['triton_kernel']['median_ms']:.1f}x)" for name, r in d["runs"].items()),
    "rehearse_sweep": _rehearse,
    "rehearse": lambda d: (f"{d['config']} N={d['world_size']}: {d['wall_s']:.0f} s wall, measured peak "
                           f"{d['planner']['measured_peak_bytes'] / 2**30:.1f} GiB (planner "
                           f"{d['planner']['difference_percent']:+.1f}%), "
                           f"{d['headline']['headline']['tokens_per_s_per_gpu']:.0f} tokens/s/GPU predicted"),
    "convergence": lambda d: "; ".join(
        f"{p}: " + (c["status"] if "status" in c else
                    f"val diff rms {c['val_loss']['diff_rms']:.4f} vs noise {c['val_loss']['noise_rms']:.4f}"
                    if "diff_rms" in c["val_loss"] else
                    f"train {c['train_loss_windows']['mean_relative']:+.2%}, val {c['val_loss']['mean_relative']:+.2%} "
                    f"vs {c.get('against', 'spartron-bf16')}")
        for p, c in d["comparisons"].items() if not c.get("status", "").startswith("not compared")),
    "e2e": _e2e,
    "eval_observe_gpu": lambda d: (f"eval at step 8 val_loss {d['spartron_eval_step_8']['val_loss']:.4f}, equals the "
                                   f"logged value: {d['eval_equals_logged']}"),
    "indexer": _indexer,
    "kl_dense": lambda d: (f"dense-warm-up KL fwd+bwd {d['results']['bf16_inputs']['ms']:.1f} ms on bf16 inputs, "
                           f"{d['float32_over_bf16']:.2f}x faster than on float32"),
    "kl_sparse": lambda d: (f"indexer KL target {d['results']['target']['op']['ms']:.1f} ms vs PyTorch "
                            f"{d['results']['target']['pytorch_path']['ms']:.1f} ms"),
    "matrix": lambda d: (f"{sum(c['rc'] == 0 for c in d['cells'])} of {len(d['cells'])} cells ran; "
                         f"{sum(c.get('regression', {}).get('passed') is True for c in d['cells'])} passed the "
                         "regression check"),
    "megatron_gpt": lambda d: "; ".join(f"{c['case']} {_ms(c['step_time_s'])}" if "step_time_s" in c
                                        else f"{c['case']} failed" for c in d["cases"]),
    "memory_peak": lambda d: (f"peak {d['peak_memory_allocated_bytes'] / 2**30:.2f} GiB in the {d['phase_at_peak']}: "
                              + ", ".join(f"{name} {row['bytes'] / 2**30:.2f}" for name, row
                                          in list(d["by_owner_or_site"].items())[:4]) + " GiB"),
    "memory_plan": lambda d: "; ".join(f"{r['mode']} planned {r['predicted_peak_gib']:.1f} vs measured "
                                       f"{r['measured_peak_gib']:.1f} GiB" for r in d["results"]),
    "moe_layer": lambda d: (f"EP1 layer fwd+bwd {d['ep1_layer']['fwd_bwd_ms']:.1f} ms; grouped GEMM "
                            f"{d['grouped_gemm']['achieved_fwd_bwd_tflops']:.0f} TFLOP/s"),
    "offload": _offload,
    "overhead_cpu": lambda d: (f"spartron full AC host cost "
                               f"{d['runs']['after_run1']['policy_mode']['spartron_full_nonreentrant_vs_torch']:.2f}x "
                               "torch's"),
    "overlap": lambda d: "best hidden {hidden_fraction:.0%} of comm ({transport}, {sm_carveout} SMs kept)".format(
        **max(d["ranks"][0]["rows"], key=lambda r: r["hidden_fraction"])),
    "precision": lambda d: "; ".join(f"{r['mode']} {_ms(r['step_time_s'])}" for r in d["results"]),
    "profile_step": lambda d: "; ".join(f"{r['mode']}{'+compile' if r.get('compile') else ''} {r['step_ms']:.1f} ms"
                                        for r in d["results"]),
    "sparse_mla": _sparse_mla,
}
LOG_HEADLINE = re.compile(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$")


def device(d: dict) -> str:
    """The GPU (or CPU) a result ran on, from the fields the benchmarks write; "unrecorded" when none says."""
    for candidate in (d.get("device_name"), d.get("device")):
        if isinstance(candidate, str) and not candidate.startswith("cuda"):
            return candidate
    runs = d.get("runs")
    if isinstance(runs, dict):
        found = {device(r) for r in runs.values() if isinstance(r, dict)} - {"unrecorded"}
        if len(found) == 1:
            return found.pop()
    return "unrecorded"


def log_headline(path: Path) -> str:
    """The last pytest summary line of a log (`29 passed, 7 skipped ... in 61.09s`), or "log"."""
    lines = [m.group(1) for m in map(LOG_HEADLINE.match, path.read_text(errors="replace").splitlines()) if m]
    return lines[-1] if lines else "log"


def entries(root: Path = ROOT) -> list[dict]:
    """One entry per current result under root/benchmarks/results: benchmark, file (relative to root), device,
    commit, headline and the files beside it (its .log / .png)."""
    results = root / "benchmarks" / "results"
    stray = sorted(p.name for p in results.iterdir() if p.name not in TOP_LEVEL and not p.is_dir())
    if stray:
        raise ResultsError(f"{', '.join(stray)}: results belong in benchmarks/results/<benchmark>/")
    out = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir() and p.name != "archive"):
        if folder.name not in HEADLINES and folder.name not in NON_SCRIPT_FOLDERS:
            raise ResultsError(f"benchmarks/results/{folder.name}/: no headline for this benchmark "
                             "(add one to HEADLINES in benchmarks/results_index.py)")
        jsons = sorted(folder.glob("*.json"))
        stems = [p.stem for p in jsons]
        others = [p for p in sorted(folder.iterdir()) if p.suffix != ".json"]
        for p in jsons:
            d = json.loads(p.read_text())
            beside = [o.name for o in others if _owner(o.stem, stems) == p.stem]
            if "commit" not in d or (d["commit"] is None and not d.get("commit_note")):
                raise ResultsError(f"{_rel(p, root)}: no 'commit' (null only with a 'commit_note')")
            try:
                headline = HEADLINES[folder.name](d)
            except (KeyError, IndexError, TypeError, ValueError) as e:
                raise ResultsError(f"{_rel(p, root)}: no headline ({type(e).__name__}: {e})") from None
            out.append(dict(benchmark=folder.name, file=_rel(p, root), device=device(d), commit=d["commit"],
                            headline=headline, beside=beside))
        for o in others:
            if _owner(o.stem, stems) is None:
                m = COMMIT_IN_NAME.findall(o.stem)
                out.append(dict(benchmark=folder.name, file=_rel(o, root), device="unrecorded",
                                commit=m[-1] if m else None, headline=log_headline(o) if o.suffix == ".log" else "",
                                beside=[]))
    return out


def _owner(stem: str, json_stems: list[str]) -> str | None:
    """The JSON a .log / .png belongs to: the longest JSON stem its own stem starts with."""
    owners = [s for s in json_stems if stem == s or stem.startswith(s + "_")]
    return max(owners, key=len) if owners else None


def _rel(p: Path, root: Path) -> str:
    return p.relative_to(root).as_posix()


def _short(commit: str | None) -> str:
    return commit[:7] if commit else "none"


def render_latest(rows: list[dict]) -> str:
    return json.dumps({"generated_by": "benchmarks/results_index.py", "results": rows}, indent=2) + "\n"


def _table(rows: list[dict], link_prefix: str) -> list[str]:
    lines = ["| benchmark | file | device | commit | headline |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        name = r["file"].removeprefix("benchmarks/results/")
        lines.append(f"| {r['benchmark']} | [{name}]({link_prefix}{name}) | {r['device']} | {_short(r['commit'])} | "
                     f"{r['headline']} |")
    return lines


def render_readme(rows: list[dict], archived: int) -> str:
    head = [
        "# Benchmark results",
        "",
        "Generated by `python benchmarks/results_index.py` (checked by `tests/test_results_index.py`); do not edit.",
        "One folder per benchmark (`benchmarks/<name>.py` writes `<name>/`); each row is a current result, with",
        f"the commit it measured (`commit` in every JSON). {archived} superseded files are under `archive/<name>/`;",
        "`audit.md` / `audit.json` are `benchmarks/audit.py`'s report. Machine-readable: `LATEST.json`.",
        "",
    ]
    return "\n".join(head + _table(rows, "")) + "\n"


def render_results_doc(rows: list[dict]) -> str:
    head = [
        "# Measured results",
        "",
        "Generated from the results index (`python benchmarks/results_index.py`; the raw files and the archive:",
        "[benchmarks/results/](../benchmarks/results/README.md)); do not edit. Devices are as each run recorded",
        "them; times are medians of the timed steps or calls unless the file says otherwise. The headline tables",
        "and what the numbers mean: [GPU_NOTES.md](GPU_NOTES.md).",
        "",
    ]
    body: list[str] = []
    for bench in sorted({r["benchmark"] for r in rows}):
        body += [f"## {bench}", ""]
        for r in (r for r in rows if r["benchmark"] == bench):
            name = r["file"].removeprefix(f"benchmarks/results/{bench}/")
            what = f": {r['headline']}" if r["headline"] else ""
            body.append(f"- `{name}` ({r['device']}, {_short(r['commit'])}){what}")
        body.append("")
    return "\n".join(head + body)


def generate(root: Path = ROOT) -> dict[str, str]:
    """The text of each generated file, by its path relative to the repository root."""
    rows = entries(root)
    archived = sum(1 for p in (root / "benchmarks" / "results" / "archive").rglob("*") if p.is_file())
    texts = render_latest(rows), render_readme(rows, archived), render_results_doc(rows)
    return dict(zip(OUTPUTS, texts, strict=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if a generated file is out of date")
    p.add_argument("--root", type=Path, default=ROOT, help="the repository (default: the one holding this script)")
    args = p.parse_args(argv)
    stale = []
    try:
        generated = generate(args.root)
    except ResultsError as e:
        print(f"spartron: error: {e}", file=sys.stderr)
        return 2
    for rel, text in generated.items():
        path = args.root / rel
        if path.exists() and path.read_text() == text:
            continue
        stale.append(rel)
        if not args.check:
            path.write_text(text)
            print(f"wrote {rel}")
    if args.check and stale:
        print(f"spartron: error: {', '.join(stale)} out of date: run python benchmarks/results_index.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
