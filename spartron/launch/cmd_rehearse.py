"""`spartron rehearse`: one rank of an N-rank run on the local device (spartron.launch.rehearse)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from spartron.launch.command import UsageError, add_config, load
from spartron.runtime.metrics import git_commit

MAX_REHEARSE_WORLD = 1 << 16
MAX_GPU_MEMORY_GIB = 1 << 20
MAX_REHEARSE_STEPS = 100  # a rehearsal measures a step; more steps only repeat it
DEFAULT_PEAK_TFLOPS = 750.0  # the bf16 matmul ceiling measured on one H200 (issue 37), when train.peak_tflops is unset


def cmd_suggest(args: argparse.Namespace) -> int:
    """--suggest: the planner's layouts for --world-size GPUs of --gpu-memory-gib each (spartron.launch.suggest)."""
    from spartron.launch.suggest import candidate_layouts, refused_layouts, render_suggestions, suggest

    memory = args.gpu_memory_gib
    if memory is None or not math.isfinite(memory) or not 0 < memory <= MAX_GPU_MEMORY_GIB:
        raise UsageError(f"--suggest needs --gpu-memory-gib in (0, {MAX_GPU_MEMORY_GIB}] (the memory of one GPU), "
                         f"got {memory}")
    if not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu must be in (0, 1], got {args.mfu}")
    if args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    cfg = load(args)
    peak = cfg.train.peak_tflops or DEFAULT_PEAK_TFLOPS
    device_bytes = int(args.gpu_memory_gib * 2**30)
    candidates = list(candidate_layouts(cfg, args.world_size))  # each layout validated once, for both lists
    rows = suggest(cfg, args.world_size, device_bytes, cfg.cluster, args.mfu, peak, candidates)
    refused = refused_layouts(cfg, args.world_size, candidates)
    if not rows:
        first = f"; the first refusal: {next(iter(refused))}" if refused else ""
        raise UsageError(f"no layout of {cfg.name} on {args.world_size} GPUs: EP must divide "
                         f"model.moe.n_routed_experts and the world, and train.global_batch_size the data ranks{first}")
    sys.stdout.write(render_suggestions(rows, args.world_size, device_bytes, args.mfu, peak, args.limit, refused))
    return 0


def cmd_rehearse(args: argparse.Namespace) -> int:
    from spartron.launch.rehearse import run_rehearsal
    from spartron.launch.rehearse_report import build_report, render, write_report

    if not 1 <= args.world_size <= MAX_REHEARSE_WORLD:
        raise UsageError(f"--world-size must be in [1, {MAX_REHEARSE_WORLD}], got {args.world_size}")
    if args.suggest:
        if args.profile:
            raise UsageError("--profile profiles a rehearsed step; --suggest rehearses nothing")
        return cmd_suggest(args)
    if not 0 <= args.rank < args.world_size:
        raise UsageError(f"--rank must be in [0, {args.world_size}), got {args.rank}")
    if not 1 <= args.steps <= MAX_REHEARSE_STEPS:
        raise UsageError(f"--steps must be in [1, {MAX_REHEARSE_STEPS}], got {args.steps}")
    if args.out is not None:  # refused before the rehearsal, not after it
        out = Path(args.out)
        if not out.parent.is_dir():
            raise UsageError(f"--out {args.out!r}: its folder does not exist")
        if out.is_symlink() or (out.exists() and not out.is_file()):
            raise UsageError(f"--out {args.out!r} exists and is not a regular file (the JSON report replaces a file)")
    started = time.monotonic()
    cfg = load(args)
    cfg.parallel.dims(args.world_size)  # an impossible layout is one line before anything is built
    cfg.train.micro_steps(cfg.parallel.dims(args.world_size).dp)
    # the rank's environment, as `spartron train` and the Slurm job script give it (an allocator setting such as
    # PYTORCH_CUDA_ALLOC_CONF is read at the process's first CUDA use, which comes after this)
    os.environ.update(cfg.launch.env)
    measured = run_rehearsal(cfg, args.world_size, args.rank, args.steps, args.routing == "balanced", args.profile)
    # what reproduces the report: the code's commit and the command's config file and overrides (a suggested
    # layout is the preset plus --set values); wall_s is the command's time up to the report
    report = {"commit": git_commit(), "config_path": str(args.config), "overrides": list(args.set),
              **build_report(measured, cfg.cluster), "wall_s": time.monotonic() - started}
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
    p.add_argument("--routing", choices=("balanced", "model"), default="balanced",
                   help="balanced (default): every expert slot receives the mean of what this rank sends; model: the "
                        "model's own router, whose all-gathered weight rows are copies of this rank's shard (the "
                        "mirror has no other), so experts tie and the first ones take the tokens: a worst case")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--profile", action="store_true",
                   help="after the reported steps, one more under torch.profiler: its kernels by time (where the "
                        "rank's compute goes) in the table and the JSON")
    p.add_argument("--suggest", action="store_true",
                   help="rehearse nothing: list the layouts (EP, CP, FSDP, AC) the planner fits in --gpu-memory-gib "
                        "on --world-size GPUs, with predicted peak and modelled tokens/s")
    p.add_argument("--gpu-memory-gib", type=float, help="with --suggest: memory of one GPU (GiB)")
    p.add_argument("--mfu", type=float, default=0.4, help="with --suggest: compute modelled at this MFU (default 0.4)")
    p.add_argument("--limit", type=int, default=10, help="with --suggest: layouts listed (default 10)")
    p.set_defaults(func=cmd_rehearse)
