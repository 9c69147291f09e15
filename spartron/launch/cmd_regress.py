"""`spartron regress compare` and `regress run`: a run's metrics against a baseline's, within tolerances.

The flags build spartron.launch.regression.Tolerances (unset ones keep its defaults); `regress run` trains
the config through `spartron train`'s own path (cmd_train.run_ranks) into fresh run directories.

Exit status: 0 every comparison passes; 1 a comparison FAILs; 2 a refusal (flags, config, files: one
`spartron: error:` line); REPEAT_FAILED_STATUS (4) a repeat of `regress run` did not finish, whatever its own
status (a traceback's 1 would read as FAIL): `spartron: repeat i failed with exit status s` names it, on every
rank that ran it in-process and from the launcher of spawned ranks alike, and nothing is compared.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

from spartron.launch.cmd_train import run_ranks
from spartron.launch.command import Parser, UsageError, add_config, load

REPEAT_FAILED_STATUS = 4  # distinct from a FAIL (1), a refusal (2) and debug's injected fault exit (3)


def add_tolerances(p: argparse.ArgumentParser) -> None:
    """Tolerance flags; unset ones keep spartron.launch.regression.Tolerances' defaults."""
    p.add_argument("--loss-rel", type=float, help="allowed relative loss difference per step")
    p.add_argument("--grad-norm-abs", type=float,
                   help="allowed absolute grad-norm difference (the noise floor if that is larger)")
    p.add_argument("--memory-abs-gb", type=float, help="allowed peak-memory increase in GB")
    p.add_argument("--throughput-rel", type=float, help="allowed relative drop of median tokens/s")
    p.add_argument("--no-exact-first-step", action="store_true",
                   help="do not require a bit-identical step-1 loss between deterministic runs")
    p.add_argument("--noise-floor-from", action="append", default=[], metavar="RUN",
                   help="a second baseline run of the same config; the grad-norm noise floor is measured "
                        "between it and the baseline (repeatable)")
    p.add_argument("--enforce-throughput", action="store_true",
                   help="fail on a throughput drop also for deterministic (CPU) runs, where it is only reported")
    p.add_argument("--plot", metavar="PNG", help="also write a run-vs-baseline plot (tolerance bands, verdicts)")


def tolerances(args: argparse.Namespace):
    import dataclasses

    from spartron.launch.regression import Tolerances

    given = {"loss_rel": args.loss_rel, "grad_norm_abs": args.grad_norm_abs,
             "memory_abs_bytes": None if args.memory_abs_gb is None else args.memory_abs_gb * 1e9,
             "throughput_rel": args.throughput_rel}
    for key, value in given.items():
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UsageError(f"--{key.replace('_bytes', '_gb').replace('_', '-')} must be >= 0, got {value}")
    given = {k: v for k, v in given.items() if v is not None}
    if args.no_exact_first_step:
        given["exact_first_step"] = False
    if args.enforce_throughput:
        given["enforce_throughput_on_cpu"] = True
    return dataclasses.replace(Tolerances(), **given)


def metrics_file(path: str | Path, what: str) -> Path:
    """A metrics.jsonl given itself or as its run directory."""
    path = Path(path)
    try:
        found = path / "metrics.jsonl" if path.is_dir() else path
        is_file = found.is_file()
    except OSError as err:  # a name too long, a loop of links
        raise UsageError(f"{what} {str(path)[:200]!r}: {err.strerror or err}") from None
    if not is_file:
        raise UsageError(f"{what} {str(path)!r} is neither a metrics JSONL nor a run directory with "
                         "metrics.jsonl")
    return found


def compare(run: str | Path, baseline: str | Path, args: argparse.Namespace) -> bool:
    from spartron.launch import regression

    limits = tolerances(args)  # flags first: a bad flag is reported whatever the files hold
    run_file, base_file = metrics_file(run, "run"), metrics_file(baseline, "baseline")
    noise = [metrics_file(p, "noise-floor run") for p in args.noise_floor_from]
    report = regression.compare_runs(run_file, base_file, limits, noise_floor_from=noise)
    print(report.text())
    if args.plot:
        print(f"spartron: wrote {regression.plot_runs(run_file, base_file, args.plot, limits, report)}")
    return report.passed


def cmd_regress_compare(args: argparse.Namespace) -> int:
    return 0 if compare(args.run, args.baseline, args) else 1


def cmd_regress_run(args: argparse.Namespace) -> int:
    """Train the config `repeats` times (run dirs <run dir>-r<i>) and compare each with the baseline."""

    cfg = load(args)
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.baseline is None and args.repeats < 2:
        raise UsageError("give --baseline, or --repeats >= 2 to compare repeats with each other")
    if args.baseline is not None:
        metrics_file(args.baseline, "baseline")
    base_dir = cfg.run_dir(Path.cwd())
    run_dirs = [base_dir.with_name(f"{base_dir.name}-r{i}") for i in range(args.repeats)]
    for run_dir in run_dirs:  # a regression run never appends to, or overwrites, an earlier one
        if run_dir.exists():
            raise UsageError(f"run directory {run_dir} exists (an earlier regression run?): remove it or "
                             "give this run another name (--set name=...)")
    runs = []
    for i, run_dir in enumerate(run_dirs):
        overrides = [f"train.run_dir={json.dumps(str(run_dir))}", "train.resume=false"]
        failed = _repeat_failed(i)  # the same line and status whether the repeat ran here (nproc 1) or spawned
        status = run_ranks(argparse.Namespace(config=args.config, set=args.set + overrides), "train", failed)
        if status:
            return failed(status)
        runs.append(run_dir)
    baseline = args.baseline or runs[0]
    compared = runs if args.baseline else runs[1:]
    return 0 if all([compare(run, baseline, args) for run in compared]) else 1


def _repeat_failed(i: int) -> Callable[[int], int]:
    """Repeat `i`'s failure report: its line, and REPEAT_FAILED_STATUS for the command's exit."""

    def report(status: int) -> int:
        print(f"spartron: repeat {i} failed with exit status {status}", file=sys.stderr)
        return REPEAT_FAILED_STATUS

    return report


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("regress", help="regression runs and comparisons against a baseline",
                       description="Run a config and compare its metrics with a baseline run.")
    rsub = p.add_subparsers(dest="regress_command", metavar="ACTION", parser_class=Parser, required=True)
    r = rsub.add_parser("compare", help="compare a run (dir or metrics JSONL) with a baseline",
                        description="Compare a run's metrics with a baseline's; exit 1 if out of tolerance.")
    r.add_argument("run", help="run directory or metrics.jsonl")
    r.add_argument("baseline", help="baseline run directory or metrics.jsonl")
    add_tolerances(r)
    r.set_defaults(func=cmd_regress_compare)
    r = rsub.add_parser("run", help="train a config N times and compare with a baseline",
                        description="Train the config --repeats times (run dirs <run dir>-r<i>) and compare "
                                    "each with --baseline; without a baseline, compare repeats 1.. with "
                                    "repeat 0 (a determinism check). Exit 1 if any comparison fails, "
                                    f"{REPEAT_FAILED_STATUS} if a repeat fails (nothing is compared).")
    add_config(r)
    r.add_argument("--baseline", help="baseline run directory or metrics.jsonl")
    r.add_argument("--repeats", type=int, default=1,
                   help="how many runs (default 1; at least 2 without --baseline)")
    add_tolerances(r)
    r.set_defaults(func=cmd_regress_run)
