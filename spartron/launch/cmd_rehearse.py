"""`spartron rehearse`: one rank of an N-rank run on the local device (spartron.launch.rehearse)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spartron.launch.command import UsageError, add_config, load

MAX_REHEARSE_WORLD = 1 << 16


def cmd_rehearse(args: argparse.Namespace) -> int:
    from spartron.launch.rehearse import run_rehearsal
    from spartron.launch.rehearse_report import build_report, render, write_report

    if not 1 <= args.world_size <= MAX_REHEARSE_WORLD:
        raise UsageError(f"--world-size must be in [1, {MAX_REHEARSE_WORLD}], got {args.world_size}")
    if not 0 <= args.rank < args.world_size:
        raise UsageError(f"--rank must be in [0, {args.world_size}), got {args.rank}")
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if args.out is not None and not Path(args.out).parent.is_dir():
        raise UsageError(f"--out {args.out!r}: its folder does not exist")
    cfg = load(args)
    cfg.parallel.dims(args.world_size)  # an impossible layout is one line before anything is built
    cfg.train.micro_steps(cfg.parallel.dims(args.world_size).dp)
    measured = run_rehearsal(cfg, args.world_size, args.rank, args.steps, args.balanced_routing)
    report = build_report(measured, cfg.cluster)
    sys.stdout.write(render(report))
    if args.out is not None:
        write_report(report, Path(args.out))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rehearse", help="run one rank of an N-rank layout on this device; model its communication",
                       description="Build and step rank R of an N-rank run of CONFIG on the local device, at its true "
                                   "shapes, with mirrored collectives: measured compute and peak memory, modelled "
                                   "communication (the [cluster] link table), predicted step time, tokens/s per GPU, "
                                   "MFU, and the planner's predicted peak beside the measured one.")
    add_config(p)
    p.add_argument("--world-size", type=int, required=True, help="ranks of the run rehearsed")
    p.add_argument("--rank", type=int, default=0, help="the rank rehearsed (default 0)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps rehearsed (default 3; the last is reported)")
    p.add_argument("--balanced-routing", action="store_true",
                   help="every expert slot receives the mean of what this rank sends (default: the model's routing)")
    p.add_argument("--out", help="write the JSON report here")
    p.set_defaults(func=cmd_rehearse)
