"""`spartron sbatch`: render the Slurm job that runs a config, submit it, and optionally wait for it.

The job runs the same `spartron train` (or `smoke`) once per Slurm task; the flags become `launch.*`
overrides, so they pass the same validation as the config file (spartron.launch.slurm renders).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from spartron.launch.command import UsageError, add_config
from spartron.launch.process import STOPPED_STATUS
from spartron.runtime.config import load_config


def sbatch_overrides(args: argparse.Namespace) -> list[str]:
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
    if args.wait_timeout is not None:  # checked before anything is submitted
        if not args.wait:
            raise UsageError("--wait-timeout applies to --wait; add --wait or drop it")
        if not math.isfinite(args.wait_timeout) or args.wait_timeout <= 0:
            raise UsageError(f"--wait-timeout must be a positive number of seconds, got {args.wait_timeout}")
    cfg = load_config(args.config, args.set + sbatch_overrides(args))
    cfg.parallel.dims(cfg.launch.nodes * slurm.tasks_per_node(cfg))
    if args.entry == "train":
        from spartron.runtime.preflight import check_before_submit

        check_before_submit(cfg, cfg.launch.nodes * slurm.tasks_per_node(cfg))  # batch, offload, devices
    job = slurm.render_job(cfg, Path.cwd(), entry=args.entry)
    if args.dry_run:
        sys.stdout.write(job.script)
        return 0
    from spartron.runtime.rundir import check_not_in_use

    check_not_in_use(job.run_dir)  # a run training there now: refused before anything is written or queued
    job_id = slurm.submit(job)
    out, err = job.log_paths(job_id)
    print(f"spartron: submitted job {job_id} ({cfg.launch.nodes} node(s) x {slurm.tasks_per_node(cfg)} "
          f"task(s)); run dir {job.run_dir}; log {out}")
    if not args.wait:
        return 0
    state, status = slurm.wait(job_id, timeout_s=args.wait_timeout)
    print(f"spartron: job {job_id} {state} with exit status {status}; run dir {job.run_dir}")
    first = slurm.first_failure(err)
    if status == STOPPED_STATUS and (first is None or first.status == STOPPED_STATUS):
        print(f"spartron: the ranks got SIGTERM, saved a complete step and stopped (status {STOPPED_STATUS}); "
              "submit again to resume from it")
        return status
    if status != 0:  # a peer's failure makes srun stop the others, which may save and exit 75: not a stop
        for path in (out, err):
            print(f"---- last lines of {path} ----\n{slurm.log_tail(path)}", file=sys.stderr)
        if first:
            print(f"spartron: the first to fail, as srun saw it: {first.text}", file=sys.stderr)
            if first.status:  # the root cause's status, as the local launcher exits with (not srun's 143)
                return first.status
    return status


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sbatch", help="render and submit a Slurm job running the config",
                       description="Render an sbatch script (one task per GPU, or launch.nproc per node on "
                                   "CPU) and submit it. Flags override the [launch] section.")
    add_config(p)
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
