"""The `spartron` command: train, smoke, sbatch, regress, plan.

One config, one code path: `spartron train run.toml` runs `launch.nproc` ranks here, and the job that
`spartron sbatch run.toml --nodes 16` submits runs the same `spartron train` once per Slurm task.
User mistakes (bad key, missing file, impossible layout, value Slurm would misread) are one line on
stderr and exit status 2; failures of the run itself keep their traceback.
Heavy modules (torch, the trainer) are imported inside the command that needs them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from spartron.parallel.dims import ParallelDimsError
from spartron.runtime.config import ConfigError, RunConfig, load_config

USAGE_ERROR = 2
DEFAULT_CONFIG = "configs/tiny.toml"


class UsageError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + error
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _add_config(p: argparse.ArgumentParser, default: str | None = None) -> None:
    if default is None:
        p.add_argument("config", help="run config TOML")
    else:
        p.add_argument("config", nargs="?", default=default, help=f"run config TOML (default {default})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set parallel.ep=2 (repeatable; TOML literals)")


def _load(args: argparse.Namespace) -> RunConfig:
    return load_config(args.config, args.set)


def _world_layout(cfg: RunConfig, world_size: int):
    """The ParallelDims for this world size; raises ConfigError/ParallelDimsError before any launch."""
    from spartron.parallel.dims import ParallelDims

    p = cfg.parallel
    return ParallelDims(world_size=world_size, fsdp=p.resolve_fsdp(world_size), cp=p.cp, ep=p.ep,
                        dp_replicate=p.dp_replicate, order=p.order)


# ---- train / smoke ---------------------------------------------------------------------------
def _run_ranks(args: argparse.Namespace, entry: str) -> int:
    """Run `entry` in this process when already a rank (or nproc = 1), else spawn launch.nproc ranks."""
    from spartron.launch.local import existing_launcher, launch_local
    from spartron.launch.slurm import run_dir_of
    from spartron.parallel.env import process_environ

    cfg = _load(args)
    environ = process_environ()
    run_dir = run_dir_of(cfg, Path.cwd())
    if existing_launcher(environ) is None and cfg.launch.nproc > 1:
        _world_layout(cfg, cfg.launch.nproc)
        command = [sys.executable, "-m", "spartron.launch.cli", entry, args.config]
        for item in args.set:
            command += ["--set", item]
        print(f"spartron: launching {cfg.launch.nproc} local ranks; logs of ranks 1.. in {run_dir / 'logs'}",
              file=sys.stderr)
        return launch_local(command, cfg.launch.nproc, environ, run_dir / "logs")
    if entry == "smoke":
        from spartron.launch.smoke import run_smoke

        return _as_rank(lambda: run_smoke(cfg, environ, run_dir))
    from spartron.runtime.trainer import train

    return _as_rank(lambda: train(cfg))


def _as_rank(body) -> int:
    """Run one rank's work; on failure report it and end the process at once.

    A failed rank must not run interpreter teardown: destroying a process group can block on peers
    still waiting in a collective, and the launcher (local or srun) stops the others.
    """
    try:
        body()
        return 0
    except BaseException as err:  # noqa: BLE001 - every failure must surface and end this rank
        if isinstance(err, Exception) and _is_user_error(err):
            print(f"spartron: error: {err}", file=sys.stderr)
            code = USAGE_ERROR
        else:
            traceback.print_exc()
            code = 130 if isinstance(err, KeyboardInterrupt) else 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def cmd_train(args: argparse.Namespace) -> int:
    return _run_ranks(args, "train")


def cmd_smoke(args: argparse.Namespace) -> int:
    return _run_ranks(args, "smoke")


# ---- sbatch ----------------------------------------------------------------------------------
def _sbatch_overrides(args: argparse.Namespace) -> list[str]:
    """CLI flags become `launch.*` overrides, so they pass the same validation as the config."""
    out = []
    for flag, key in (("nodes", "nodes"), ("gpus_per_node", "gpus_per_node"),
                      ("cpus_per_task", "cpus_per_task")):
        if getattr(args, flag) is not None:
            out.append(f"launch.{key}={int(getattr(args, flag))}")
    for flag in ("partition", "account", "time", "job_name", "qos"):
        if getattr(args, flag) is not None:
            out.append(f"launch.{flag}={json.dumps(getattr(args, flag))}")
    return out


def cmd_sbatch(args: argparse.Namespace) -> int:
    from spartron.launch import slurm

    if args.dry_run and args.wait:
        raise UsageError("--wait needs a submitted job; drop --dry-run")
    cfg = load_config(args.config, args.set + _sbatch_overrides(args))
    _world_layout(cfg, cfg.launch.nodes * slurm.tasks_per_node(cfg))
    job = slurm.render_job(cfg, Path.cwd(), entry=args.entry)
    if args.dry_run:
        sys.stdout.write(job.script)
        return 0
    job_id = slurm.submit(job)
    out, err = job.log_paths(job_id)
    print(f"spartron: submitted job {job_id} ({cfg.launch.nodes} node(s) x {slurm.tasks_per_node(cfg)} "
          f"task(s)); run dir {job.run_dir}; log {out}")
    if not args.wait:
        return 0
    state, status = slurm.wait(job_id, timeout_s=args.wait_timeout)
    print(f"spartron: job {job_id} {state} with exit status {status}; run dir {job.run_dir}")
    if status != 0:
        for path in (out, err):
            print(f"---- last lines of {path} ----\n{slurm.log_tail(path)}", file=sys.stderr)
    return status


# ---- regress ---------------------------------------------------------------------------------
def _add_tolerances(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tolerance", action="append", default=[], metavar="METRIC=TOL",
                   help="per-metric tolerance, e.g. --tolerance loss=0.01 (repeatable; "
                        "defaults are the regression module's)")
    p.add_argument("--plot", metavar="PNG", help="also write a run-vs-baseline plot")


def _tolerances(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise UsageError(f"--tolerance {item!r} must look like METRIC=NUMBER") from None
        if not sep or not key.strip():
            raise UsageError(f"--tolerance {item!r} must look like METRIC=NUMBER")
    return out


def cmd_regress_compare(args: argparse.Namespace) -> int:
    from spartron.runtime import regression

    for path in (args.run, args.baseline):
        if not Path(path).exists():
            raise UsageError(f"{path!r} does not exist (give a run directory or a metrics JSONL)")
    report = regression.compare_runs(args.run, args.baseline, tolerances=_tolerances(args.tolerance))
    print(report.render() if hasattr(report, "render") else report)
    if args.plot:
        regression.plot_runs(args.run, args.baseline, args.plot)
        print(f"spartron: wrote {args.plot}")
    return 0 if report.passed else 1


def cmd_regress_run(args: argparse.Namespace) -> int:
    """Train the config `repeats` times (run dirs <run dir>-r<i>) and compare each with the baseline."""
    from spartron.runtime import regression

    cfg = _load(args)
    if args.baseline and not Path(args.baseline).exists():
        raise UsageError(f"baseline {args.baseline!r} does not exist")
    from spartron.launch.slurm import run_dir_of

    base_dir = run_dir_of(cfg, Path.cwd())
    runs = []
    for i in range(args.repeats):
        run_dir = base_dir.with_name(f"{base_dir.name}-r{i}")
        overrides = [f"train.run_dir={json.dumps(str(run_dir))}", "train.resume=false"]
        run_args = argparse.Namespace(config=args.config, set=args.set + overrides)
        status = _run_ranks(run_args, "train")
        if status:
            print(f"spartron: repeat {i} failed with exit status {status}", file=sys.stderr)
            return status
        runs.append(run_dir)
    if not args.baseline:
        report = regression.compare_runs(runs[-1], runs[0], tolerances=_tolerances(args.tolerance)) \
            if len(runs) > 1 else None
        print(f"spartron: no baseline given; recorded {', '.join(map(str, runs))}"
              + (f"\nrepeat-to-repeat comparison:\n{report.render()}" if report else ""))
        return 0 if report is None or report.passed else 1
    passed = True
    for run_dir in runs:
        report = regression.compare_runs(run_dir, args.baseline, tolerances=_tolerances(args.tolerance))
        print(f"# {run_dir} vs {args.baseline}\n{report.render()}")
        passed &= report.passed
    if args.plot:
        regression.plot_runs(runs[0], args.baseline, args.plot)
        print(f"spartron: wrote {args.plot}")
    return 0 if passed else 1


# ---- plan ------------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    from spartron.launch.plan import render_plan

    cfg = _load(args)
    world = args.world_size or cfg.launch.nproc
    if world < 1:
        raise UsageError(f"--world-size must be >= 1, got {world}")
    _world_layout(cfg, world)
    sys.stdout.write(render_plan(cfg, world, max_groups=args.max_groups))
    return 0


# ---- parser ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="spartron", description="Distributed training of sparse MoE models with MLA+DSA.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser, required=True)

    p = sub.add_parser("train", help="train a config (launch.nproc local ranks, or a rank of torchrun/srun)",
                       description="Train a run config. With launch.nproc > 1 spawns that many local ranks; "
                                   "under torchrun or srun runs as the rank the launcher made.")
    _add_config(p, DEFAULT_CONFIG)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("smoke", help="bring-up check: init distributed, all_reduce, write smoke.json",
                       description="Init distributed like training does, run one all_reduce and one "
                                   "all_gather, and write <run dir>/smoke.json.")
    _add_config(p, DEFAULT_CONFIG)
    p.set_defaults(func=cmd_smoke)

    p = sub.add_parser("sbatch", help="render and submit a Slurm job running the config",
                       description="Render an sbatch script (one task per GPU, or launch.nproc per node on "
                                   "CPU) and submit it. Flags override the [launch] section.")
    _add_config(p)
    p.add_argument("--nodes", type=int, help="number of nodes (launch.nodes)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs and tasks per node (launch.gpus_per_node)")
    p.add_argument("--cpus-per-task", type=int, help="launch.cpus_per_task")
    p.add_argument("--partition", help="launch.partition")
    p.add_argument("--account", help="launch.account")
    p.add_argument("--qos", help="launch.qos")
    p.add_argument("--time", help="time limit, e.g. 04:00:00 or 1-00:00:00 (launch.time)")
    p.add_argument("--job-name", help="launch.job_name (default: the run name)")
    p.add_argument("--entry", choices=("train", "smoke"), default="train",
                   help="what every task runs (default train; smoke for cluster bring-up)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--submit", dest="dry_run", action="store_false", help="submit the job (default)")
    mode.add_argument("--dry-run", dest="dry_run", action="store_true",
                      help="print the script to stdout and submit nothing")
    p.add_argument("--wait", action="store_true", help="wait for the job; exit with its exit status")
    p.add_argument("--wait-timeout", type=float, metavar="SECONDS", help="give up waiting after this long")
    p.set_defaults(func=cmd_sbatch, dry_run=False)

    p = sub.add_parser("regress", help="regression runs and comparisons against a baseline",
                       description="Run a config and compare its metrics with a baseline run.")
    rsub = p.add_subparsers(dest="regress_command", metavar="ACTION", parser_class=_Parser, required=True)
    r = rsub.add_parser("compare", help="compare a run (dir or metrics JSONL) with a baseline",
                        description="Compare a run's metrics with a baseline's; exit 1 if out of tolerance.")
    r.add_argument("run", help="run directory or metrics.jsonl")
    r.add_argument("baseline", help="baseline run directory or metrics.jsonl")
    _add_tolerances(r)
    r.set_defaults(func=cmd_regress_compare)
    r = rsub.add_parser("run", help="train a config N times and compare with a baseline",
                        description="Train the config --repeats times (run dirs <run dir>-r<i>) and compare "
                                    "each with --baseline; without a baseline, compare the repeats.")
    _add_config(r)
    r.add_argument("--baseline", help="baseline run directory or metrics.jsonl")
    r.add_argument("--repeats", type=int, default=1, help="how many runs (default 1)")
    _add_tolerances(r)
    r.set_defaults(func=cmd_regress_run)

    p = sub.add_parser("plan", help="print the resolved config, rank groups and memory per rank",
                       description="Print the resolved config as TOML, which ranks form each parallel group, "
                                   "and an estimate of parameter/gradient/optimizer memory per rank.")
    _add_config(p, DEFAULT_CONFIG)
    p.add_argument("--world-size", type=int, help="number of ranks (default launch.nproc)")
    p.add_argument("--max-groups", type=int, default=16, help="groups listed per dimension (default 16)")
    p.set_defaults(func=cmd_plan)
    return parser


def _is_user_error(err: Exception) -> bool:
    """Mistakes in the config, the flags or the launch environment (not bugs in a run)."""
    kinds: tuple[type, ...] = (UsageError, ConfigError, ParallelDimsError)
    for module, name in (("spartron.launch.slurm", "SlurmError"), ("spartron.parallel.env", "DistEnvError")):
        if module in sys.modules:  # not imported means it cannot have raised; keeps --help free of torch
            kinds += (getattr(sys.modules[module], name),)
    return isinstance(err, kinds)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except Exception as err:
        if not _is_user_error(err):
            raise
        print(f"spartron: error: {err}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
