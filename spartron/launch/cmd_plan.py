"""`spartron plan`: the resolved config, the rank groups and the memory per rank, before any run.

The plan is of the model `spartron train` would build (train.init_from is checked as train checks it);
a batch that training would refuse at this size is a note, not an error: a plan at scale is still worth
printing (spartron.launch.plan renders).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spartron.launch.command import DEFAULT_CONFIG, UsageError, add_config, load
from spartron.runtime.config import ConfigError

MAX_PLAN_WORLD = 1 << 18  # rank groups of 2^18 ranks take seconds to list; 2^20 half a minute


def cmd_plan(args: argparse.Namespace) -> int:
    from spartron.launch.plan import render_plan

    if args.world_size is not None and args.world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {args.world_size}")
    if args.max_groups < 1:
        raise UsageError(f"--max-groups must be >= 1, got {args.max_groups}")
    if args.world_size is not None and args.world_size > MAX_PLAN_WORLD:
        raise UsageError(f"--world-size {args.world_size} is above {MAX_PLAN_WORLD}, the most ranks `spartron plan` "
                         "lays out (every rank group is listed in memory)")
    cfg = load(args)
    world = cfg.launch.nproc if args.world_size is None else args.world_size
    if world > MAX_PLAN_WORLD:  # launch.nproc when --world-size is not given
        raise UsageError(f"launch.nproc {world} is above {MAX_PLAN_WORLD}, the most ranks `spartron plan` lays out")
    dims = cfg.parallel.dims(world)
    if cfg.train.init_from is not None:  # train's preflight check: the plan is of the model it would train
        from spartron.runtime.init_from import check_init_from
        from spartron.runtime.state import latest_complete_step

        if latest_complete_step(cfg.run_dir(Path.cwd())) is None:  # a new run reads the checkpoint
            check_init_from(cfg)
    sys.stdout.write(render_plan(cfg, world, max_groups=args.max_groups))
    try:  # a plan at scale is still worth printing; training at this size would refuse the batch
        cfg.train.micro_steps(dims.dp)
    except ConfigError as err:
        print(f"spartron: note: `spartron train` on {world} ranks would refuse this config: {err}",
              file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the resolved config, rank groups and memory per rank",
                       description="Print the resolved config as TOML, which ranks form each parallel group, "
                                   "and an estimate of parameter/gradient/optimizer memory per rank.")
    add_config(p, DEFAULT_CONFIG)
    p.add_argument("--world-size", type=int, help="number of ranks (default launch.nproc)")
    p.add_argument("--max-groups", type=int, default=16, help="groups listed per dimension (default 16)")
    p.set_defaults(func=cmd_plan)
