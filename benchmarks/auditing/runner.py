"""The prepared inputs cases start from (real runs, an exported checkpoint, a token folder), running many cases
at once, and the results written as audit.md / audit.json."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.auditing.core import (
    CATEGORIES,
    CATEGORY_TITLES,
    CLASSES,
    GOOD,
    ROOT,
    TINY,
    TINY_HF,
    Case,
    Result,
    env_for,
    run_case,
    stubs,
    train,
)


def _cli(argv: list[str], cwd: Path, root: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "spartron.launch.cli", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=env_for(stubs(root), root / "_bases.log"))
    if proc.returncode != 0:
        raise RuntimeError(f"preparing the audit's inputs failed: spartron {' '.join(argv)}\n{proc.stderr[-3000:]}")


def _train(cwd: Path, root: Path, preset: str, name: str, *extra: str) -> None:
    argv = [a.replace("{tiny}", TINY) for a in train("train.steps=2", "train.save_every=1", f"name={name}",
                                                     *extra, preset=preset)]
    _cli(argv, cwd, root)


def build_bases(root: Path, needed: set[str]) -> dict[str, Path]:
    """state: runs/base (tiny, steps 1-2); hfrun: runs/hfbase (tiny-hf, steps 1-2); hf: its Hugging Face export;
    tok: a `spartron data` token folder (with tokenizer.json and corpus/ next to it in tokdata)."""
    bases: dict[str, Path] = {}
    top = root / "_bases"
    if "state" in needed:
        base = top / "state"
        if not (base / "runs" / "base" / "step-00000002" / "COMPLETE").is_file():
            base.mkdir(parents=True, exist_ok=True)
            _train(base, root, TINY, "base")
        bases["state"] = base
    if needed & {"hfrun", "hf"}:
        base = top / "hfrun"
        if not (base / "runs" / "hfbase" / "step-00000002" / "COMPLETE").is_file():
            base.mkdir(parents=True, exist_ok=True)
            _train(base, root, TINY_HF, "hfbase")
        bases["hfrun"] = base
        hf = top / "hf" / "hf"
        if not (hf / "config.json").is_file():
            hf.parent.mkdir(parents=True, exist_ok=True)
            _cli(["convert", "--from", str(base / "runs" / "hfbase"), "--to-hf", str(hf)], hf.parent, root)
        bases["hf"] = hf
    if "tok" in needed:
        from benchmarks.auditing.tokenize import corpus_and_tokenizer

        data = top / "tokdata"
        if not (data / "tok" / "tokens.json").is_file():
            data.mkdir(parents=True, exist_ok=True)
            corpus_and_tokenizer(data)
            _cli(["data", "corpus", "--tokenizer", "tokenizer.json", "--eos", "<eos>", "--out", "tok"], data, root)
        bases["tok"] = data / "tok"
    return bases


def _log(line: str) -> None:
    print(line, flush=True)


def run_audit(cases: list[Case], root: Path, jobs: int = 1, log=_log) -> list[Result]:
    stub_dir = stubs(root)
    bases = build_bases(root, {part for c in cases for part in c.base})

    def one(case: Case) -> Result:
        result = run_case(case, root, stub_dir, bases)
        log(f"{result.cls:<17} {result.seconds:5.1f}s {case.id}: {result.detail[:140]}")
        return result

    # the slow cases first, so the pool does not end on one long case
    order = sorted(range(len(cases)), key=lambda i: -cases[i].timeout)
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # each case is its own subprocess and folder
        done = dict(zip(order, pool.map(one, [cases[i] for i in order]), strict=True))
    return [done[i] for i in range(len(cases))]


def summary(results: list[Result]) -> dict:
    counts = Counter(r.cls for r in results)
    by_surface: dict[str, Counter] = {}
    by_category: dict[str, Counter] = {}
    for r in results:
        by_surface.setdefault(r.surface, Counter())[r.cls] += 1
        by_category.setdefault(r.category, Counter())[r.cls] += 1
    one_line = {}
    for surface in by_surface:
        refusals = [r for r in results if r.surface == surface and r.rc not in (0, None) and not r.report]
        one_line[surface] = {"refusals": len(refusals), "one_line": sum(r.one_line for r in refusals)}
    good = counts["clear"] + counts["accepted safely"]
    return {"cases": len(results), "counts": {c: counts[c] for c in CLASSES},
            "clear_or_safe_fraction": round(good / max(len(results), 1), 4),
            "escapes": counts["escape"], "silent_harmful": counts["silent harmful"], "hangs": counts["hang"],
            "by_surface": {a: {c: n[c] for c in CLASSES} for a, n in sorted(by_surface.items())},
            "by_category": {a: {c: n[c] for c in CLASSES} for a, n in sorted(by_category.items())},
            "one_line_refusals": one_line}


def _share(entry: dict) -> str:
    n = entry["refusals"]
    return "-" if n == 0 else f"{entry['one_line']}/{n} ({100 * entry['one_line'] / n:.1f}%)"


def write_results(results: list[Result], out_md: Path, out_json: Path, wall_s: float | None, jobs: int) -> None:
    """`wall_s` None: not known (results collected from an earlier run's case folders)."""
    s = summary(results)
    wall = None if wall_s is None else round(wall_s, 1)
    s.update(case_seconds=round(sum(r.seconds for r in results), 1), wall_seconds=wall, jobs=jobs,
             commit=_commit())
    out_json.write_text(json.dumps({"summary": s, "results": [r.__dict__ for r in results]}, indent=1) + "\n")
    total_refusals = sum(e["refusals"] for e in s["one_line_refusals"].values())
    total_one = sum(e["one_line"] for e in s["one_line_refusals"].values())
    good = s["counts"]["clear"] + s["counts"]["accepted safely"]
    lines = ["# Adversarial audit (`python benchmarks/audit.py`)", "",
             f"{s['cases']} cases in "
             + (f"{wall} s" if wall is not None else f"{s['case_seconds']} s of cases (collected: wall not recorded)")
             + f" ({jobs} at a time) at commit {s['commit']}. "
             f"Clear or accepted safely: {good} ({100 * good / max(s['cases'], 1):.1f}%). "
             f"**Escapes: {s['escapes']}, silent harmful: {s['silent_harmful']}, hangs: {s['hangs']}**; "
             f"one-line errors among refusals: {_share({'refusals': total_refusals, 'one_line': total_one})}.", "",
             "Classes: clear (exit != 0, one `spartron: error:` line naming the key, file, tensor or value, no "
             "traceback); accepted safely (exit 0 where accepting is right, its checks held); unclear (refused "
             "without a traceback, but not one line or not naming the thing); traceback; silent harmful (accepted, "
             "or a check found damage: a concurrent run broken, an output unusable); silent harmless (accepted, "
             "should have been refused, no harm); hang (the timeout expired); escape (something outside the case's "
             "work folder written, truncated or deleted: a hashed decoy tree, new files next to the work folder, "
             "a payload's marker). A refusal is a non-zero exit for bad input; a rank fault's report and a "
             "`regress` FAIL verdict are answers by design, not refusals, and are left out of the one-line share.",
             "Out of reach of any checksum: tampering that rewrites a saved step's files and its COMPLETE manifest "
             "to match (the manifest guards against damage, not against an author with write access).", "",
             "## Per surface", "", "| surface | " + " | ".join(CLASSES) + " | one-line refusals |",
             "| --- |" + " --- |" * (len(CLASSES) + 1)]
    for surface, n in s["by_surface"].items():
        lines.append(f"| {surface} | " + " | ".join(str(n[c]) for c in CLASSES)
                     + f" | {_share(s['one_line_refusals'][surface])} |")
    lines += ["| **all** | " + " | ".join(str(s["counts"][c]) for c in CLASSES) + " | "
              + _share({"refusals": total_refusals, "one_line": total_one}) + " |"]
    lines += ["", "## Per category", "", "| category | " + " | ".join(CLASSES) + " |",
              "| --- |" + " --- |" * len(CLASSES)]
    for cat in CATEGORIES:
        if cat in s["by_category"]:
            n = s["by_category"][cat]
            lines.append(f"| {CATEGORY_TITLES[cat]} | " + " | ".join(str(n[c]) for c in CLASSES) + " |")
    bad = [r for r in results if r.cls not in GOOD]
    lines += ["", f"## Every case that is not clear or accepted safely ({len(bad)})", "",
              "| case | surface | category | class | exit | what the user saw |",
              "| --- | --- | --- | --- | --- | --- |"]
    lines += [_row(r, with_input=False) for r in bad]
    lines += ["", "## Every case", "",
              "Inputs: `spartron` arguments (a case may also prepare files first: a corrupt saved step, a "
              "hostile Hugging Face folder, links into the decoy tree; see its code in benchmarks/auditing/).", "",
              "| case | surface | category | class | exit | input | what the user saw |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [_row(r, with_input=True) for r in results]
    out_md.write_text("\n".join(lines) + "\n")


def _row(r: Result, with_input: bool) -> str:
    detail = r.detail.replace("|", "\\|").replace("\n", " ")
    shown = " ".join(r.argv).replace("|", "\\|").replace("\n", "\\n").replace("\r", "\\r").replace("`", "'")
    middle = f" `{shown[:160]}` |" if with_input else ""
    return f"| `{r.id}` | {r.surface} | {r.category} | {r.cls} | {r.rc} |{middle} {detail} |"


def _commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return proc.stdout.strip() + (" + uncommitted changes" if dirty else "")
