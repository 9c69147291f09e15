"""The `spartron` command: train, eval, smoke, sbatch, regress, plan, convert.

One config, one code path: `spartron train run.toml` runs `launch.nproc` ranks here, and the job that
`spartron sbatch run.toml --nodes 16` submits runs the same `spartron train` once per Slurm task.
User mistakes (bad key, missing file, impossible layout, value Slurm would misread) are one line on
stderr and exit status 2; failures of the run itself keep their traceback.
Heavy modules (torch, the trainer) are imported inside the command that needs them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from spartron import __version__
from spartron.launch.process import ERROR_PREFIX, STOPPED_STATUS, USAGE_STATUS, exit_process
from spartron.parallel.dims import ParallelDimsError
from spartron.runtime.config import ConfigError, RunConfig, load_config
from spartron.runtime.debug import check_fault

USAGE_ERROR = USAGE_STATUS
MAX_PLAN_WORLD = 1 << 18  # rank groups of 2^18 ranks take seconds to list; 2^20 half a minute
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


# ---- train / smoke ---------------------------------------------------------------------------
def _check_before_launch(cfg: RunConfig, environ: dict[str, str], is_rank: bool, entry: str) -> None:
    """Data file, batch division, device options, offload window, run dir: one line, exit 2, before any
    rank starts (a rank of srun/torchrun checks against the launcher's world size). `smoke` only brings
    distributed up: of these only the device options matter to it."""
    from spartron.parallel.env import discover
    from spartron.runtime.preflight import check_before_launch, check_device_options
    from spartron.runtime.rundir import check_run_start

    if entry in ("smoke", "eval"):  # eval reads a saved step: the run directory's start rules do not apply
        check_device_options(cfg)
        if entry == "smoke":  # it writes smoke.json (and rank logs) there: never into a live run's directory
            from spartron.runtime.rundir import check_not_in_use

            check_not_in_use(cfg.run_dir(Path.cwd()))
        return
    world_size = discover(environ).world_size if is_rank else cfg.launch.nproc
    check_before_launch(cfg, world_size, local_ranks=None if is_rank else cfg.launch.nproc)
    check_run_start(cfg, world_size)  # the run directory: new run into old steps, finished run, mismatches
    if cfg.train.init_from is not None:
        from spartron.runtime.init_from import check_init_from
        from spartron.runtime.state import latest_complete_step

        if latest_complete_step(cfg.run_dir(Path.cwd())) is None:  # a new run: it reads the checkpoint
            check_init_from(cfg)


def _run_ranks(args: argparse.Namespace, entry: str) -> int:
    """Run `entry` in this process when already a rank (or nproc = 1), else spawn launch.nproc ranks."""
    from spartron.launch.local import existing_launcher, launch_local, launch_with_temporary_logs
    from spartron.parallel.env import process_environ
    from spartron.runtime.observe import launch_env

    cfg = _load(args)
    run_dir = cfg.run_dir(Path.cwd())
    os.environ.update(launch_env(cfg.observe, run_dir))  # read by torch when the process group starts
    environ = process_environ()
    _check_before_launch(cfg, environ, existing_launcher(environ) is not None, entry)
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

        return _as_rank(smoke)
    if entry == "eval":
        return _as_rank(lambda: _eval_rank(cfg, args.step, environ, args.set))
    from spartron.runtime.trainer import train

    return _as_rank(lambda: STOPPED_STATUS if train(cfg).stopped_at is not None else 0)


def _as_rank(body: Callable[[], int]) -> int:
    """Run one rank's work, returning its exit status; on failure report it and end the process at once.

    A failed rank must not run interpreter teardown: destroying a process group can block on peers
    still waiting in a collective, and the launcher (local or srun) stops the others.
    """
    try:
        return body()
    except BaseException as err:  # noqa: BLE001 - every failure must surface and end this rank
        if isinstance(err, Exception) and _is_user_error(err):
            print(error_line(err), file=sys.stderr)
            code = USAGE_ERROR
        elif isinstance(err, KeyboardInterrupt):  # the user's Ctrl-C: a stop, not a failure to trace
            print("spartron: stopped by SIGINT; complete saved steps are kept", file=sys.stderr)
            code = 130
        else:
            code = traceback.print_exc() or 1
        exit_process(code)


def cmd_train(args: argparse.Namespace) -> int:
    return _run_ranks(args, "train")


def cmd_smoke(args: argparse.Namespace) -> int:
    return _run_ranks(args, "smoke")


def cmd_eval(args: argparse.Namespace) -> int:
    return _run_ranks(args, "eval")


def _eval_rank(cfg: RunConfig, step: str, environ: dict[str, str], overrides: list[str]) -> int:
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
    if args.wait_timeout is not None:  # checked before anything is submitted
        if not args.wait:
            raise UsageError("--wait-timeout applies to --wait; add --wait or drop it")
        if not math.isfinite(args.wait_timeout) or args.wait_timeout <= 0:
            raise UsageError(f"--wait-timeout must be a positive number of seconds, got {args.wait_timeout}")
    cfg = load_config(args.config, args.set + _sbatch_overrides(args))
    cfg.parallel.dims(cfg.launch.nodes * slurm.tasks_per_node(cfg))
    if args.entry == "train":
        from spartron.runtime.preflight import check_before_submit

        check_before_submit(cfg, cfg.launch.nodes * slurm.tasks_per_node(cfg))  # batch, offload, devices
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
    if status == STOPPED_STATUS:
        print(f"spartron: the ranks got SIGTERM, saved a complete step and stopped (status {STOPPED_STATUS}); "
              "submit again to resume from it")
    elif status != 0:
        for path in (out, err):
            print(f"---- last lines of {path} ----\n{slurm.log_tail(path)}", file=sys.stderr)
        first = slurm.first_failed_task(err)
        if first:
            print(f"spartron: the first to fail, as srun saw it: {first}", file=sys.stderr)
    return status


# ---- regress ---------------------------------------------------------------------------------
def _add_tolerances(p: argparse.ArgumentParser) -> None:
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


def _tolerances(args: argparse.Namespace):
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


def _metrics_file(path: str | Path, what: str) -> Path:
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


def _compare(run: str | Path, baseline: str | Path, args: argparse.Namespace) -> bool:
    from spartron.launch import regression

    tolerances = _tolerances(args)  # flags first: a bad flag is reported whatever the files hold
    run_file, base_file = _metrics_file(run, "run"), _metrics_file(baseline, "baseline")
    noise = [_metrics_file(p, "noise-floor run") for p in args.noise_floor_from]
    report = regression.compare_runs(run_file, base_file, tolerances, noise_floor_from=noise)
    print(report.text())
    if args.plot:
        print(f"spartron: wrote {regression.plot_runs(run_file, base_file, args.plot, tolerances, report)}")
    return report.passed


def cmd_regress_compare(args: argparse.Namespace) -> int:
    return 0 if _compare(args.run, args.baseline, args) else 1


def cmd_regress_run(args: argparse.Namespace) -> int:
    """Train the config `repeats` times (run dirs <run dir>-r<i>) and compare each with the baseline."""

    cfg = _load(args)
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.baseline is None and args.repeats < 2:
        raise UsageError("give --baseline, or --repeats >= 2 to compare repeats with each other")
    if args.baseline is not None:
        _metrics_file(args.baseline, "baseline")
    base_dir = cfg.run_dir(Path.cwd())
    run_dirs = [base_dir.with_name(f"{base_dir.name}-r{i}") for i in range(args.repeats)]
    for run_dir in run_dirs:  # a regression run never appends to, or overwrites, an earlier one
        if run_dir.exists():
            raise UsageError(f"run directory {run_dir} exists (an earlier regression run?): remove it or "
                             "give this run another name (--set name=...)")
    runs = []
    for i, run_dir in enumerate(run_dirs):
        overrides = [f"train.run_dir={json.dumps(str(run_dir))}", "train.resume=false"]
        status = _run_ranks(argparse.Namespace(config=args.config, set=args.set + overrides), "train")
        if status:
            print(f"spartron: repeat {i} failed with exit status {status}", file=sys.stderr)
            return status
        runs.append(run_dir)
    baseline = args.baseline or runs[0]
    compared = runs if args.baseline else runs[1:]
    return 0 if all([_compare(run, baseline, args) for run in compared]) else 1


# ---- plan ------------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    from spartron.launch.plan import render_plan

    if args.world_size is not None and args.world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {args.world_size}")
    if args.max_groups < 1:
        raise UsageError(f"--max-groups must be >= 1, got {args.max_groups}")
    if args.world_size is not None and args.world_size > MAX_PLAN_WORLD:
        raise UsageError(f"--world-size {args.world_size} is above {MAX_PLAN_WORLD}, the most ranks `spartron plan` "
                         "lays out (every rank group is listed in memory)")
    cfg = _load(args)
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


# ---- convert ---------------------------------------------------------------------------------
class _Terminated(BaseException):
    """SIGTERM during `spartron data` or `convert`: unwinds like Ctrl-C, so the partial output is removed."""


def _raise_terminated(signum, frame) -> NoReturn:  # noqa: ANN001
    raise _Terminated


def cmd_convert(args: argparse.Namespace) -> int:
    """Hugging Face checkpoint -> a step-0 saved state `spartron train` resumes (train.resume = true), or a
    saved state (step or run directory) -> a Hugging Face checkpoint (spartron/interop/hf)."""
    if (args.from_hf is None) == (args.from_state is None) or (args.to is None) == (args.to_hf is None):
        raise UsageError("give one of --from-hf DIR / --from STATE and one of --to RUN_DIR / --to-hf DIR")
    if (args.from_hf is None) != (args.to is None):
        raise UsageError("--from-hf goes with --to RUN_DIR (a saved state), --from with --to-hf DIR")
    if args.to_hf is None and args.max_shard_bytes is not None:
        raise UsageError("--max-shard-bytes goes with --to-hf DIR (an import writes a saved state, not shards)")
    if args.to_hf is not None and (args.config is not None or args.set):
        raise UsageError(f"{'--config' if args.config is not None else '--set'} goes with --from-hf (an export "
                         "writes the saved step's own [model]; it reads no run config)")
    if args.max_shard_bytes is not None and args.max_shard_bytes < 1:
        raise UsageError(f"--max-shard-bytes must be >= 1, got {args.max_shard_bytes}")
    if args.with_mtp and args.to_hf is None:
        raise UsageError("--with-mtp goes with --to-hf DIR (an import keeps the MTP layers the checkpoint holds)")
    from spartron.interop.hf import HFCheckpointError, HFConfigError, export_hf
    from spartron.interop.hf.convert import DEFAULT_SHARD_BYTES
    from spartron.runtime import hf_state
    from spartron.runtime.hf_state import SavedStateSource, import_hf_run_dir, run_tokenizer

    previous = signal.signal(signal.SIGTERM, _raise_terminated)  # as Ctrl-C: the partial import/export is removed
    try:
        if args.from_hf is not None:
            keys = tuple(item.split("=", 1)[0].strip() for item in args.set if item.strip().startswith("model."))
            step, cfg, toml = import_hf_run_dir(args.from_hf, args.to, given := load_config(args.config, args.set),
                                                keys)
            for line in hf_state.replaced_model_notes(given.model, cfg.model, args.config, args.from_hf):
                print(line, file=sys.stderr)
            print(f"spartron: wrote {step} from {args.from_hf}; its [model] section is {toml}: train from it with "
                  f"that section, train.run_dir = {json.dumps(str(args.to))} and train.resume = true")
        else:
            from spartron.runtime.rundir import lock_for_reading

            reading = lock_for_reading(Path(args.from_state))  # as eval's: no run saves or prunes steps meanwhile
            try:
                source = SavedStateSource(Path(args.from_state))
                source.check_target(args.to_hf)
                tokenizer, note = run_tokenizer(source)
                out = export_hf(source, args.to_hf, max_shard_bytes=args.max_shard_bytes or DEFAULT_SHARD_BYTES,
                                with_mtp=args.with_mtp, extra_files=tokenizer)
            finally:
                reading.release()
            if note:
                print(f"spartron: note: {note}", file=sys.stderr)
            print(f"spartron: wrote a Hugging Face checkpoint of {args.from_state} to {out}"
                  + (" with its tokenizer" if tokenizer else ""))
    except (KeyboardInterrupt, _Terminated) as err:
        what, out = ("import", args.to) if args.from_hf is not None else ("export", args.to_hf)
        print(f"spartron: convert: stopped by {'SIGTERM' if isinstance(err, _Terminated) else 'SIGINT'}; removed "
              f"the partial {what} ({out} is as it was: run the same command again)", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(err, _Terminated) else signal.SIGINT)
    except (HFConfigError, HFCheckpointError) as err:
        raise UsageError(str(err)) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


# ---- data ------------------------------------------------------------------------------------
def cmd_data(args: argparse.Namespace) -> int:
    """Tokenize a corpus (jsonl / parquet / text file or folder) into a token folder (spartron.data)."""
    import time

    from spartron.data import prepare_corpus

    last = [time.monotonic()]

    def progress(documents: int, tokens: int) -> None:  # a line every 10 s on a long corpus
        if time.monotonic() - last[0] >= 10:
            last[0] = time.monotonic()
            print(f"spartron data: {documents} documents, {tokens} tokens", file=sys.stderr, flush=True)

    if args.text_key in ("", "messages"):
        raise UsageError(f"--text-key {args.text_key!r}: name the text field of pretraining records ('messages' "
                         "holds chats)")
    previous = signal.signal(signal.SIGTERM, _raise_terminated)  # as Ctrl-C: the partial output is removed
    try:
        meta = prepare_corpus(args.corpus, args.tokenizer, args.out, eos_token=args.eos, text_key=args.text_key,
                              bos_token=args.bos, progress=progress, chat_format=args.chat_format)
    except (KeyboardInterrupt, _Terminated) as err:
        name = "SIGTERM" if isinstance(err, _Terminated) else "SIGINT"
        print(f"spartron: data: stopped by {name}; removed the partial output ({args.out} is as it was: run the "
              "same command again)", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(err, _Terminated) else signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"spartron: wrote {meta['n_tokens']} tokens ({meta['dtype']}) of {meta['n_documents']} documents to "
          f"{args.out}; train on it with train.data.kind = \"packed\" and train.data.path = {json.dumps(args.out)} "
          f"(model.vocab_size >= {meta['vocab_size']})")
    return 0


# ---- parser ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="spartron", description="Distributed training of sparse MoE models with MLA+DSA.")
    parser.add_argument("--version", action="version", version=f"spartron {__version__}")
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

    p = sub.add_parser("eval", help="validation loss of a saved step on the held-out split",
                       description="Load a saved step (or a run directory's newest complete step) on "
                                   "launch.nproc ranks and print its validation loss and perplexity over "
                                   "train.eval_steps batches of held-out sequences, as one JSON line. The data "
                                   "(train.data.*, seed, seq_len, global_batch_size, eval_steps) is the one the "
                                   "step records; a config naming other data is reported, --set overrides it.")
    _add_config(p)
    p.add_argument("--step", required=True, metavar="DIR", help="a saved step, or a run directory (newest step)")
    p.set_defaults(func=cmd_eval)

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
                                    "each with --baseline; without a baseline, compare repeats 1.. with "
                                    "repeat 0 (a determinism check). Exit 1 if any comparison fails.")
    _add_config(r)
    r.add_argument("--baseline", help="baseline run directory or metrics.jsonl")
    r.add_argument("--repeats", type=int, default=1,
                   help="how many runs (default 1; at least 2 without --baseline)")
    _add_tolerances(r)
    r.set_defaults(func=cmd_regress_run)

    p = sub.add_parser("plan", help="print the resolved config, rank groups and memory per rank",
                       description="Print the resolved config as TOML, which ranks form each parallel group, "
                                   "and an estimate of parameter/gradient/optimizer memory per rank.")
    _add_config(p, DEFAULT_CONFIG)
    p.add_argument("--world-size", type=int, help="number of ranks (default launch.nproc)")
    p.add_argument("--max-groups", type=int, default=16, help="groups listed per dimension (default 16)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("convert", help="Hugging Face DeepSeek-V3/V3.2 checkpoints to a saved state and back",
                       description="--from-hf DIR --to RUN_DIR: a step-0 saved state (one rank) and RUN_DIR/"
                                   "model.toml; --from STATE --to-hf DIR: config.json, safetensors shards and "
                                   "model.safetensors.index.json, one shard at a time.")
    p.add_argument("--from-hf", metavar="DIR", help="a Hugging Face checkpoint directory (config.json, safetensors)")
    p.add_argument("--from", dest="from_state", metavar="STATE", help="a saved step, or a run directory (newest step)")
    p.add_argument("--to", metavar="RUN_DIR", help="new run directory for the imported state")
    p.add_argument("--to-hf", metavar="DIR", help="new Hugging Face checkpoint directory")
    p.add_argument("--config", help="run config TOML whose train/parallel settings the imported state gets")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--max-shard-bytes", type=int, default=None, help="export shard size (default 5 GiB)")
    p.add_argument("--with-mtp", action="store_true", help="export the MTP layers too (transformers' "
                   "DeepseekV3ForCausalLM has no MTP module and would report them as unexpected keys)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("data", help="tokenize a text corpus into a token folder for train.data.kind = 'packed'",
                       description="Tokenize CORPUS (a .jsonl / .jsonl.gz / .parquet / .txt file or a folder of "
                                   "them: records "
                                   "with 'text', or chat 'messages') with a local tokenizer into DIR: tokens.bin, "
                                   "loss_mask.bin (chats) and tokens.json (dtype, vocabulary, tokenizer hash, "
                                   "document offsets).")
    p.add_argument("corpus", help="a corpus file or folder")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json, or a folder saved by transformers")
    p.add_argument("--out", required=True, metavar="DIR", help="new (or empty) output folder")
    p.add_argument("--eos", help="the end-of-document token (default: eos_token of tokenizer_config.json)")
    p.add_argument("--bos", help="a token starting every document (default: bos_token of tokenizer_config.json "
                                 "when it sets add_bos_token; else none)")
    p.add_argument("--text-key", default="text", help="the text field of pretraining records (default text)")
    p.add_argument("--chat-format", default="spartron",
                   help="how chats are rendered: spartron (default), chatml or deepseek (spartron/data/tokenizer.py)")
    p.set_defaults(func=cmd_data)
    return parser


def error_line(err: Exception) -> str:
    """The one line a refusal prints: a line break inside the message (a file name holding one, a library's
    multi-line text) is written as \\n, so the line stays one line."""
    return ERROR_PREFIX + str(err).replace("\r", "\\r").replace("\n", "\\n")


def _is_user_error(err: Exception) -> bool:
    """Mistakes in the config, the flags, the data, the disk or the launch environment (not bugs in a run),
    also when the trainer wrapped one in its "rank r failed at step s" TrainingError (a data sample found
    bad mid-run, a save refused for a full disk), and a loss guard's intended stop: their messages already
    name the key, path or step and value."""
    kinds: tuple[type, ...] = (UsageError, ConfigError, ParallelDimsError)
    for module, name in (("spartron.launch.slurm", "SlurmError"), ("spartron.parallel.env", "DistEnvError"),
                         ("spartron.runtime.rundir", "StateLoadError"),
                         ("spartron.runtime.safe_open", "UnsafeEntryError"),
                         ("spartron.runtime.state", "StateSaveError"),
                         ("spartron.runtime.metrics", "MetricsFileError"),
                         ("spartron.runtime.metrics", "MetricsWriteError")):
        if module in sys.modules:  # not imported means it cannot have raised; keeps --help free of torch
            kinds += (getattr(sys.modules[module], name),)
    trainer = sys.modules.get("spartron.runtime.trainer")
    if trainer is not None:
        if isinstance(err, trainer.LossGuardStop):  # train.max_loss, loss_spike_factor, a non-finite loss
            return True
        if type(err) is trainer.TrainingError and err.__cause__ is not None:
            return isinstance(err.__cause__, kinds)
    return isinstance(err, kinds)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except Exception as err:
        if not _is_user_error(err):
            raise
        print(error_line(err), file=sys.stderr)
        return USAGE_ERROR


def run() -> NoReturn:
    """The `spartron` console script and ``python -m spartron.launch.cli``: `main`, then `exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    run()
