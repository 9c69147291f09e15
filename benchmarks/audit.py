"""The adversarial audit: bad inputs, hostile files and folders, concurrent runs and interruptions, each run through
the real `spartron` CLI in a subprocess with a timeout and classified automatically, per surface and category.

    python benchmarks/audit.py --jobs 2             # all cases -> benchmarks/results/audit.{md,json}
    python benchmarks/audit.py --only hf-import,rundir   # some surfaces or case-id prefixes (not written unless --out)
    python benchmarks/audit.py --quick              # the subset tests/test_audit.py runs

Surfaces: config, cli, plan, data (token files), tokenize (`spartron data`), hf-import (`convert --from-hf`,
`train.init_from`), hf-export (`convert --to-hf`), convert (its flags), rundir (a hostile or shared run
directory), state (saved steps), eval, regress, launch, slurm. The cases live in benchmarks/auditing/, one module
per surface; benchmarks/auditing/core.py says how one runs and is classified.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/audit.py` from anywhere

from benchmarks.auditing.core import CLASSES, ROOT, Case, Result, classify, run_case  # noqa: E402
from benchmarks.auditing.runner import run_audit, write_results  # noqa: E402

__all__ = ["Case", "Result", "all_cases", "classify", "run_audit", "run_case", "write_results"]


def _legacy_category(cid: str) -> str:
    """The first audit's cases had no category: one from what their id says they do."""
    words = {
        "nonfinite": ("-inf", "-nan", "rank-json-nan"),
        "paths": ("symlink", "link", "traversal", "dotdot", "escape", "-abs", "slash", "fifo", "dev-zero",
                  "directory", "missing", "is-a-file", "run_dir-file", "run_dir-under", "backslash", "-dot",
                  "file-name-too-long", "out-not-empty"),
        "sizes": ("huge", "long", "deep", "fork-bomb", "too-short", "-big"),
        "corrupt": ("truncate", "-empty", "garbage", "flip", "hostile", "binary", "utf16", "latin1", "syntax",
                    "resealed", "bad-record", "wrong-records", "offsets-falling", "truncated", "bom", "nul",
                    "duplicate", "incomplete"),
        "dtypes": ("dtype", "u16", "u32", "odd-size", "-str", "-int", "bool-", "int-float", "section-"),
    }
    if cid.startswith("slurm-"):
        return "injection"
    if cid.startswith("launch-") and not cid.startswith("launch-env"):
        return "signals"
    for category, keys in words.items():
        if any(k in cid for k in keys):
            return category
    return "values"


def _legacy_surface(case: Case) -> str:
    cid = case.id
    if cid.startswith("cli-regress") or cid.startswith("cli-plan"):
        return "regress" if "regress" in cid else "plan"
    if cid.startswith("data-prepare"):
        return "tokenize"
    if cid.startswith("runtime-run_dir"):
        return "rundir"
    return case.surface


def legacy_cases() -> list[Case]:
    from benchmarks.auditing.data_files import data_cases
    from benchmarks.auditing.inputs import cli_cases, config_cases, config_file_cases, runtime_cases
    from benchmarks.auditing.launching import launch_cases, slurm_cases
    from benchmarks.auditing.state import state_cases

    cases = (config_cases() + config_file_cases() + cli_cases() + data_cases() + runtime_cases() + launch_cases()
             + slurm_cases() + state_cases())
    for case in cases:
        case.category = _legacy_category(case.id)
        case.surface = _legacy_surface(case)
        if case.id.startswith("state-"):
            case.base = ("state",)
    return cases


def all_cases() -> list[Case]:
    from benchmarks.auditing import (
        evaluation,
        fp8,
        hf_export,
        hf_import,
        plans,
        precision,
        regress,
        rehearsals,
        rundir,
        runs,
        tokenize,
    )

    return (legacy_cases() + plans.cases() + tokenize.cases() + hf_import.cases() + hf_export.cases()
            + rundir.cases() + runs.cases() + evaluation.cases() + regress.cases() + rehearsals.cases()
            + precision.cases() + fp8.cases())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated surfaces or case-id prefixes")
    parser.add_argument("--quick", action="store_true", help="only the quick subset")
    parser.add_argument("--list", action="store_true", help="print the cases' ids and surfaces, run nothing")
    parser.add_argument("--root", help="folder for the case folders (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="results stem (default benchmarks/results/audit for a full run)")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once (default 1)")
    parser.add_argument("--collect", action="store_true",
                        help="write the results of the cases already run under --root (an interrupted audit)")
    args = parser.parse_args()
    if args.collect:
        import json

        results = [Result(**json.loads(p.read_text())) for p in sorted(Path(args.root).glob("*/result.json"))]
        out = args.out or str(ROOT / "benchmarks" / "results" / "audit")
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_results(results, Path(out + ".md"), Path(out + ".json"), None, args.jobs)
        print(f"wrote {out}.md and {out}.json from {len(results)} cases")
        return 0
    cases = all_cases()
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
    if args.quick:
        cases = [c for c in cases if c.quick]
    if args.only:
        wanted = args.only.split(",")
        cases = [c for c in cases if c.surface in wanted or any(c.id.startswith(w) for w in wanted)]
    if args.list:
        for c in cases:
            print(f"{c.surface:<10} {c.category:<11} {c.id}")
        print(Counter(c.surface for c in cases), len(cases))
        return 0
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="spartron-audit-"))
    root.mkdir(parents=True, exist_ok=True)
    out = args.out or (None if (args.only or args.quick) else str(ROOT / "benchmarks" / "results" / "audit"))
    if out:  # made before the cases run: a full audit takes an hour, and its results must have somewhere to go
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = run_audit(cases, root, jobs=args.jobs)
    wall = time.perf_counter() - start
    if out:
        write_results(results, Path(out + ".md"), Path(out + ".json"), wall, args.jobs)
        print(f"wrote {out}.md and {out}.json")
    counts = Counter(r.cls for r in results)
    print(", ".join(f"{c}: {counts[c]}" for c in CLASSES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
