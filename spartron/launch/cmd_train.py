"""`spartron train`, `smoke` and `eval`: the commands that run ranks of a config.

One config, one code path: `spartron train run.toml` runs `launch.nproc` ranks here (each one this
command again, as `python -m spartron.launch.cli`), and under torchrun or srun the process is the rank
the launcher made. Torch and the trainer are imported inside the command that needs them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from spartron.launch.command import DEFAULT_CONFIG, USAGE_ERROR, add_config, error_line, is_user_error, load
from spartron.launch.process import STOPPED_STATUS, exit_process
from spartron.runtime.config import ConfigError, RunConfig
from spartron.runtime.debug import check_fault


def finished_before_the_requeue(cfg: RunConfig, environ: dict[str, str]) -> str | None:
    """The note of a requeued Slurm job (SLURM_RESTART_COUNT > 0) whose run already saved step train.steps,
    else None. A requeue (`scontrol requeue`, preemption, the time-limit signal) can land after the final step
    was saved, while the job finishes: that job has nothing left to train and must end with 0, since a
    failure would reach Slurm's accounting, mail and `afterok` dependencies for a finished run. Outside a
    requeue, resuming a finished run stays plan_run's error (the user asked for training that cannot happen)."""
    from spartron.parallel.env import slurm_restart_count
    from spartron.runtime.rundir import latest_complete_step, step_dir

    restarts = slurm_restart_count(environ)
    run_dir = cfg.run_dir(Path.cwd())
    last = latest_complete_step(run_dir) if restarts and cfg.train.resume else None
    if last is None or last < cfg.train.steps:
        return None
    return (f"spartron: note: this Slurm job was requeued (restart {restarts}) after its run had saved step {last} "
            f"of train.steps = {cfg.train.steps} ({step_dir(run_dir, last)}): nothing is left to train; ending "
            "with status 0")


def check_before_launch(cfg: RunConfig, environ: dict[str, str], is_rank: bool, entry: str) -> bool:
    """Data file, batch division, device options, offload window, run dir: one line, exit 2, before any
    rank starts (a rank of srun/torchrun checks against the launcher's world size). `smoke` only brings
    distributed up: of these only the device options matter to it. True when there is nothing to run: a
    requeued Slurm job whose run had already finished (finished_before_the_requeue; rank 0 prints the note)."""
    from spartron.parallel.env import discover
    from spartron.runtime.preflight import check_before_launch, check_device_options
    from spartron.runtime.rundir import check_run_start

    if entry in ("smoke", "eval"):  # eval reads a saved step: the run directory's start rules do not apply
        check_device_options(cfg)
        if entry == "smoke":  # it writes smoke.json (and rank logs) there: never into a live run's directory
            from spartron.runtime.rundir import check_not_in_use

            check_not_in_use(cfg.run_dir(Path.cwd()))
        return False
    note = finished_before_the_requeue(cfg, environ)  # also a one-task step, which is no multi-rank launch
    if note:
        if not is_rank or discover(environ).rank == 0:
            print(note, file=sys.stderr, flush=True)
        return True
    world_size = discover(environ).world_size if is_rank else cfg.launch.nproc
    check_before_launch(cfg, world_size, local_ranks=None if is_rank else cfg.launch.nproc)
    check_run_start(cfg, world_size)  # the run directory: new run into old steps, finished run, mismatches
    if cfg.train.init_from is not None:
        from spartron.runtime.init_from import check_init_from
        from spartron.runtime.state import latest_complete_step

        if latest_complete_step(cfg.run_dir(Path.cwd())) is None:  # a new run: it reads the checkpoint
            check_init_from(cfg)
    return False


def run_ranks(args: argparse.Namespace, entry: str, on_failure: Callable[[int], int] | None = None) -> int:
    """Run `entry` in this process when already a rank (or nproc = 1), else spawn launch.nproc ranks.
    `on_failure`: as_rank's, for the rank run in this process (spawned ranks' statuses are returned)."""
    from spartron.launch.local import launch_local, launch_with_temporary_logs
    from spartron.launch.rank_env import existing_launcher
    from spartron.parallel.env import process_environ
    from spartron.runtime.observe import launch_env

    cfg = load(args)
    run_dir = cfg.run_dir(Path.cwd())
    os.environ.update(launch_env(cfg.observe, run_dir))  # read by torch when the process group starts
    os.environ.update(cfg.launch.env)  # the ranks' environment, as the Slurm job script exports it
    environ = process_environ()
    if check_before_launch(cfg, environ, existing_launcher(environ) is not None, entry):
        return 0
    if existing_launcher(environ) is None and cfg.launch.nproc > 1:
        cfg.parallel.dims(cfg.launch.nproc)  # ParallelDimsError before any launch
        step = ["--step", args.step] if entry == "eval" else []
        command = [sys.executable, "-m", "spartron.launch.cli", entry, args.config, *step,
                   *(x for item in args.set for x in ("--set", item))]
        fault = check_fault(cfg.debug, cfg.launch.nproc, cfg.train.steps)
        if fault:
            raise ConfigError(fault)
        options = dict(bind_cores=cfg.launch.bind_cores, stopped_limit_s=cfg.parallel.timeout_s,
                       terminate_grace_s=cfg.launch.terminate_grace_s)
        if entry == "eval":  # it reads a run directory it does not own (maybe a live one): never writes there
            return launch_with_temporary_logs(command, cfg.launch.nproc, environ, "spartron-eval-logs-", **options)
        print(f"spartron: launching {cfg.launch.nproc} local ranks; logs of ranks 1.. in {run_dir / 'logs'}",
              file=sys.stderr)
        return launch_local(command, cfg.launch.nproc, environ, run_dir / "logs", root=run_dir, **options)
    if entry == "smoke":
        from spartron.launch.smoke import run_smoke

        def smoke() -> int:
            run_smoke(cfg, environ, run_dir)
            return 0

        return as_rank(smoke, on_failure=on_failure)
    if entry == "eval":
        return as_rank(lambda: eval_rank(cfg, args.step, environ, args.set), on_failure=on_failure)
    from spartron.runtime.trainer import train

    return as_rank(lambda: STOPPED_STATUS if train(cfg).stopped_at is not None else 0, on_failure=on_failure)


# A rank whose collective failed because a peer's connection went away waits this long before it exits, so the
# launcher sees the peer (the root cause) end first: srun reports task exits in the order its slurmds tell it, and
# under load a knock-on exit milliseconds after the peer's can reach it first. The launcher kills the waiting rank
# as soon as it has the root cause.
KNOCK_ON_DELAY_S = 5.0
_PEER_GONE = ("closed by peer", "reset by peer", "broken pipe", "remote process exited")


def is_knock_on(err: BaseException) -> bool:
    """A collective's failure because a peer's connection went away (gloo's "Connection closed by peer", NCCL's
    "remote process exited"): another rank's failure seen from here, not this rank's own."""
    return isinstance(err, Exception) and any(s in str(err).lower() for s in _PEER_GONE)


def as_rank(body: Callable[[], int], knock_on_delay_s: float = KNOCK_ON_DELAY_S,
            on_failure: Callable[[int], int] | None = None) -> int:
    """Run one rank's work, returning its exit status; on failure report it and end the process at once
    (a knock-on failure after `knock_on_delay_s`: is_knock_on). `on_failure(status)`, for a command that runs
    the rank's work as one part of its own (`regress run`'s repeats), reports which part failed and returns the
    status the process ends with: the process ends here, so the command's own report could never run.

    A failed rank must not run interpreter teardown: destroying a process group can block on peers
    still waiting in a collective, and the launcher (local or srun) stops the others.
    """
    try:
        return body()
    except BaseException as err:  # noqa: BLE001 - every failure must surface and end this rank
        if isinstance(err, Exception) and is_user_error(err):
            print(error_line(err), file=sys.stderr)
            code = USAGE_ERROR
        elif isinstance(err, KeyboardInterrupt):  # the user's Ctrl-C: a stop, not a failure to trace
            print("spartron: stopped by SIGINT; complete saved steps are kept", file=sys.stderr)
            code = 130
        else:
            code = traceback.print_exc() or 1
            if is_knock_on(err):
                sys.stderr.flush()
                time.sleep(knock_on_delay_s)
        exit_process(code if on_failure is None else on_failure(code))


def cmd_train(args: argparse.Namespace) -> int:
    return run_ranks(args, "train")


def cmd_smoke(args: argparse.Namespace) -> int:
    return run_ranks(args, "smoke")


def cmd_eval(args: argparse.Namespace) -> int:
    return run_ranks(args, "eval")


def eval_rank(cfg: RunConfig, step: str, environ: dict[str, str], overrides: list[str]) -> int:
    """One rank of `spartron eval`: the step's own data unless --set names other (evaluate_saved); rank 0
    prints a note per setting taken from the step, the result as one JSON line on stdout, and what it
    evaluated."""
    from spartron.parallel.env import discover
    from spartron.runtime.trainer import evaluate_saved

    explicit = [item.split("=", 1)[0].strip() for item in overrides]  # load_config checked their form
    result = evaluate_saved(cfg, step, explicit=explicit)
    if discover(environ).rank == 0:
        for note in result["notes"]:
            print(note, file=sys.stderr)
        print(json.dumps({k: v for k, v in result.items() if k != "notes"}), flush=True)  # notes: stderr only
        print(f"spartron: {result['path']} (step {result['step']}): validation loss {result['val_loss']:.6g} "
              f"(perplexity {result['val_ppl']:.6g}) over {result['val_tokens']} tokens of {result['data']}",
              file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a config (launch.nproc local ranks, or a rank of torchrun/srun)",
                       description="Train a run config. With launch.nproc > 1 spawns that many local ranks; "
                                   "under torchrun or srun runs as the rank the launcher made.")
    add_config(p, DEFAULT_CONFIG)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("smoke", help="bring-up check: init distributed, all_reduce, write smoke.json",
                       description="Init distributed like training does, run one all_reduce and one "
                                   "all_gather, and write <run dir>/smoke.json.")
    add_config(p, DEFAULT_CONFIG)
    p.set_defaults(func=cmd_smoke)

    p = sub.add_parser("eval", help="validation loss of a saved step on the held-out split",
                       description="Load a saved step (or a run directory's newest complete step) on "
                                   "launch.nproc ranks and print its validation loss and perplexity over "
                                   "train.eval_steps batches of held-out sequences, as one JSON line. The data "
                                   "(train.data.*, seed, seq_len, global_batch_size, eval_steps) is the one the "
                                   "step records; a config naming other data is reported, --set overrides it.")
    add_config(p)
    p.add_argument("--step", required=True, metavar="DIR", help="a saved step, or a run directory (newest step)")
    p.set_defaults(func=cmd_eval)
