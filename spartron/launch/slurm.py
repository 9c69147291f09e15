"""Slurm: render an sbatch script from a run config, submit it, wait for it, show its log.

The job runs one task per GPU (or `launch.nproc` tasks per node on CPU) through `srun`; each task
runs `spartron <entry> <frozen config>` and derives its rank, world size and master address from
the SLURM_* variables (spartron.parallel.env), so the script exports no rank variables, and unsets
another launcher's (torchrun's RANK, WORLD_SIZE, MASTER_*...) that sbatch's default --export=ALL would
carry over from the submitting shell: discovery prefers those, and each task would run as rank 0 of 1.

Each submission's files are immutable: the frozen config is `slurm/config-<hash>.toml` and the script
`slurm/job-<hash>.sbatch`, named by their content and never rewritten with other content, because every
rank (a requeued job's too) reads the config when it starts: a later submission into the same run
directory must not change what an earlier queued or running job trains.

Every value that reaches the script is either checked against Slurm's charset (names, times, paths
in #SBATCH directives) or shell-quoted (environment values, interpreter and image paths), and the
run name in the header comment is JSON-escaped (no newline can end the comment): a config value can
never run a command. `render_job` re-validates the [launch] section itself, so a config built
without validation (`model_construct`, attributes set on a copy) cannot slip past the rules.

Preemption: the batch shell traps SIGTERM (`launch.signal_before_s` asks Slurm for one before the
time limit; `scancel -b -s TERM` sends one) and forwards it to the ranks through srun; they save a
complete step and exit with STOPPED_STATUS (75). With `launch.requeue` the job then requeues itself
(`scontrol requeue`) and the requeued job resumes from that step. A SIGTERM sent to the ranks only
(`scancel -s TERM`, preemption) saves and stops without the shell requeueing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from spartron.launch.process import STOPPED_STATUS
from spartron.runtime.config import LaunchConfig, RunConfig, dump_config
from spartron.runtime.launch_config import LAUNCHER_ENV
from spartron.runtime.observe import launch_env
from spartron.runtime.safe_open import open_file

# Characters allowed in paths written into #SBATCH directives (sbatch parses those itself).
_DIRECTIVE_PATH = re.compile(r"/[A-Za-z0-9._/+=@:,~-]*")
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_JOB_ID = re.compile(r"\d+(_\d+)?")
_TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                    "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
ENTRIES = ("train", "smoke")
ATTEMPT_MARK = "spartron: attempt (Slurm restart count) "  # written to <jobid>.err as each attempt starts


class SlurmError(RuntimeError):
    """Slurm is missing, refused the job, or a value cannot be put into a job script."""


@dataclass(frozen=True)
class SlurmJob:
    """Where a rendered job lives: its script, its frozen config and its log files."""

    run_dir: Path
    script_path: Path
    config_path: Path
    script: str
    config_text: str

    def log_paths(self, job_id: str) -> tuple[Path, Path]:
        return (self.run_dir / "slurm" / f"{job_id}.out", self.run_dir / "slurm" / f"{job_id}.err")


def default_venv() -> str | None:
    """The virtual environment of the interpreter running this (None outside a venv)."""
    return sys.prefix if sys.prefix != sys.base_prefix else None


def _directive_path(path: Path, what: str) -> str:
    text = str(path)
    if not _DIRECTIVE_PATH.fullmatch(text):
        raise SlurmError(f"{what} {text!r} cannot go into an #SBATCH directive: use an absolute path of "
                         "letters, digits and ._/+=@:,~- only")
    return text


def _checked_launch(cfg: RunConfig) -> LaunchConfig:
    """cfg.launch validated again by the config's own rules (one rule, one place)."""
    try:
        return LaunchConfig.model_validate(cfg.launch.model_dump(warnings=False))
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(part) for part in first["loc"])
        if first["type"] == "value_error":  # our validators' messages already show the value
            raise SlurmError(f"launch.{key}: {first['ctx']['error']}") from None
        raise SlurmError(f"launch.{key}: {first['msg']} (got {first.get('input')!r})") from None


def time_limit_s(text: str) -> int | None:
    """Seconds in a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS); None: unlimited."""
    if text in ("UNLIMITED", "infinite"):
        return None
    days, rest = text.split("-", 1) if "-" in text else ("0", text)
    parts = [int(p) for p in rest.split(":")]
    if "-" in text:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:  # HH:MM:SS
        hours, minutes, seconds = parts
    else:  # MM or MM:SS
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds


def _comment(text: str) -> str:
    """`text` for a comment line: JSON-escaped, so no newline, CR or control character survives."""
    return json.dumps(text)


def tasks_per_node(cfg: RunConfig) -> int:
    """One task per GPU, or launch.nproc CPU ranks per node."""
    return cfg.launch.gpus_per_node or cfg.launch.nproc


def render_job(cfg: RunConfig, workdir: Path, entry: str = "train") -> SlurmJob:
    """The sbatch script (and the frozen config it runs) for `cfg`; writes nothing."""
    if entry not in ENTRIES:
        raise SlurmError(f"entry must be one of {', '.join(ENTRIES)}, got {entry!r}")
    launch = _checked_launch(cfg)
    if launch.requeue and not cfg.train.resume:
        raise SlurmError("launch.requeue = true needs train.resume = true: a requeued job resumes from its "
                         "newest saved step")
    limit = time_limit_s(launch.time)
    if launch.signal_before_s and limit is not None and launch.signal_before_s >= limit:
        raise SlurmError(f"launch.signal_before_s = {launch.signal_before_s} is not below launch.time = "
                         f"{launch.time} ({limit} s): the job would be told to stop as it starts")
    job_name = launch.job_name or cfg.name
    if not isinstance(job_name, str) or not _JOB_NAME.fullmatch(job_name):
        raise SlurmError(f"name {job_name!r} cannot be a Slurm job name: use letters, digits, '.', '_' "
                         "or '-' (or set launch.job_name)")
    workdir = Path(_directive_path(workdir.resolve(), "working directory"))
    run_dir = cfg.run_dir(workdir)
    slurm_dir = Path(_directive_path(run_dir / "slurm", "run directory"))
    frozen = cfg.model_copy(deep=True)
    frozen.train.run_dir = str(run_dir)  # every rank writes to the same absolute place
    config_text = dump_config(frozen)
    config_path = slurm_dir / _content_name("config", config_text, ".toml")

    sbatch = [
        f"--job-name={job_name}",
        f"--nodes={launch.nodes}",
        f"--ntasks-per-node={tasks_per_node(cfg)}",
        f"--cpus-per-task={launch.cpus_per_task}",
        f"--time={launch.time}",
        f"--output={slurm_dir}/%j.out",
        f"--error={slurm_dir}/%j.err",
        f"--chdir={workdir}",
    ]
    if launch.gpus_per_node:
        sbatch.append(f"--gpus-per-node={launch.gpus_per_node}")
    for key in ("partition", "account", "qos"):
        value = getattr(launch, key)
        if value:
            sbatch.append(f"--{key}={value}")
    if launch.requeue:  # the requeued job appends to the same %j logs instead of truncating them
        sbatch += ["--requeue", "--open-mode=append"]
    if launch.signal_before_s:
        sbatch.append(f"--signal=B:TERM@{launch.signal_before_s}")
    sbatch += launch.sbatch_args

    lines = ["#!/bin/bash", f"# spartron {entry}: {_comment(str(cfg.name))} (generated by `spartron sbatch`)"]
    lines += [f"#SBATCH {arg}" for arg in sbatch]
    lines += ["", "set -euo pipefail",
              "# the submitting shell's launcher variables (sbatch --export=ALL) would beat Slurm's in rank discovery",
              f"unset {' '.join(sorted(LAUNCHER_ENV))}",
              "export PYTHONUNBUFFERED=1",
              f"export OMP_NUM_THREADS={launch.cpus_per_task}"]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in launch.env.items()]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in launch_env(cfg.observe, run_dir).items()]
    venv = launch.venv or (None if launch.container else default_venv())
    if venv:
        lines.append(f"source {shlex.quote(str(Path(venv) / 'bin' / 'activate'))}")
    if venv:
        python = str(Path(venv) / "bin" / "python")
    else:  # inside a container its own interpreter; otherwise exactly the one running this
        python = "python" if launch.container else sys.executable
    srun = ["srun", "--kill-on-bad-exit=1"]
    if launch.container:
        srun += [f"--container-image={launch.container}", f"--container-mounts={workdir}",
                 f"--container-workdir={workdir}"]
    srun += [python, "-m", "spartron.launch.cli", entry, str(config_path)]
    lines += ['echo "spartron: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, run dir "'
              + shlex.quote(str(run_dir)),
              f'echo "{ATTEMPT_MARK}${{SLURM_RESTART_COUNT:-0}}" >&2  # first_failure reads the last attempt only']
    lines += _srun_with_sigterm_forwarding(" ".join(shlex.quote(a) for a in srun), launch.requeue)
    script = "\n".join(lines)
    return SlurmJob(run_dir=run_dir, script_path=slurm_dir / _content_name("job", script, ".sbatch"),
                    config_path=config_path, script=script, config_text=config_text)


def _content_name(stem: str, text: str, suffix: str) -> str:
    """`<stem>-<16 hex digits of the text's sha256><suffix>`: a file named by its content, so a submission
    writes a new name instead of changing what an earlier job reads."""
    return f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}{suffix}"


def _srun_with_sigterm_forwarding(srun: str, requeue: bool) -> list[str]:
    """Run srun in the background so the shell's SIGTERM trap runs at once (bash defers traps while a
    foreground command runs), forward the signal, and wait until srun has really ended.

    The signal goes to the job's steps through `scancel --signal=TERM` (which leaves the batch shell
    out), not to srun: srun takes SIGTERM as "terminate the step" and kills the ranks before they save.
    """
    lines = [
        "# SIGTERM to this shell (--signal=B:TERM before the time limit, scancel -b -s TERM): forward it",
        f"# to the ranks, which save a complete step and exit {STOPPED_STATUS}",
        "term=0",
        "srun_pid=",
        "forward_term() {",
        "  term=$((term + 1))",
        '  echo "spartron: the batch shell got SIGTERM; forwarding it to the ranks"',
        '  if [ -n "$srun_pid" ]; then scancel --signal=TERM "$SLURM_JOB_ID" || true; fi',
        "}",
        "trap forward_term TERM",
        f"{srun} &",
        "srun_pid=$!",
        "# a SIGTERM before srun started: give the step a moment to exist, then forward it",
        'if [ "$term" != 0 ]; then sleep 5; scancel --signal=TERM "$SLURM_JOB_ID" || true; fi',
        "# a trapped signal ends `wait` early (the trap runs right after): wait again until srun has ended",
        "seen=$term",
        "while :; do",
        "  status=0",
        '  wait "$srun_pid" || status=$?',
        '  if [ "$term" = "$seen" ]; then break; fi',
        "  seen=$term",
        "done",
    ]
    if requeue:
        lines += [
            f'if [ "$status" = {STOPPED_STATUS} ] && [ "$term" != 0 ]; then',
            '  echo "spartron: the ranks saved a step and stopped; requeueing job $SLURM_JOB_ID"',
            '  scontrol requeue "$SLURM_JOB_ID"',
            "fi",
        ]
    return lines + ['exit "$status"', ""]


def write_job(job: SlurmJob) -> None:
    """Write the frozen config and the script into <run dir>/slurm, each only if absent: a file already
    there with the same name holds the same content (the name is its hash) and is left as it is, so a
    file an earlier job reads is never rewritten; one whose content differs (edited by hand, or a write cut
    short) is refused, naming it. Nothing is followed through a link: a `slurm` folder or job file that is
    a link (or a FIFO...) is refused by name (UnsafeEntryError), never written through to a file elsewhere."""
    for path, text in ((job.config_path, job.config_text), (job.script_path, job.script)):
        relative = path.relative_to(job.run_dir)
        try:
            fd = open_file(job.run_dir, relative, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            with open(open_file(job.run_dir, relative, os.O_RDONLY)) as f:
                if f.read() != text:
                    raise SlurmError(f"{path} exists with other content than this submission's (it is named by "
                                     "its content, and a submitted job may read it): move it away") from None
            continue
        with open(fd, "w") as f:
            f.write(text)


def _slurm(args: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SlurmError(f"{args[0]} not found: run this where the Slurm client tools are on PATH "
                         "(a login node)") from None


def submit(job: SlurmJob) -> str:
    """Write the job files and `sbatch --parsable` the script; returns the job id."""
    write_job(job)
    proc = _slurm(["sbatch", "--parsable", str(job.script_path)])
    if proc.returncode != 0:
        raise SlurmError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}")
    job_id = proc.stdout.strip().split(";")[0]
    if not _JOB_ID.fullmatch(job_id):
        raise SlurmError(f"sbatch printed {proc.stdout.strip()!r}, not a job id")
    return job_id


def _parse_exit(state: str, exit_code: str) -> int:
    """A shell-style status from Slurm's JobState and ExitCode=code:signal."""
    code, _, signal = exit_code.partition(":")
    rc, sig = int(code or 0), int(signal or 0)
    if sig:
        return 128 + sig
    if rc == 0 and state != "COMPLETED":
        return 1  # cancelled, timed out, node failure: a failure even without an exit code
    return rc


def job_status(job_id: str) -> tuple[str, int | None]:
    """(state, exit status once terminal) from scontrol, falling back to sacct for purged jobs."""
    proc = _slurm(["scontrol", "show", "job", "-o", job_id])
    if proc.returncode == 0 and proc.stdout.strip():
        fields = dict(item.split("=", 1) for item in proc.stdout.split() if "=" in item)
        state = fields.get("JobState", "UNKNOWN")
        if state in _TERMINAL_STATES:
            return state, _parse_exit(state, fields.get("ExitCode", "0:0"))
        return state, None
    proc = _slurm(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"])
    line = proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""
    if not line:
        raise SlurmError(f"job {job_id} is unknown to scontrol and sacct")
    state, exit_code = line.split("|")
    state = state.split()[0]
    return state, (_parse_exit(state, exit_code) if state in _TERMINAL_STATES else None)


def wait(job_id: str, timeout_s: float | None = None, poll_s: float = 0.5) -> tuple[str, int]:
    """Block until the job ends; returns (final state, exit status)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        state, status = job_status(job_id)
        if status is not None:
            return state, status
        if deadline is not None and time.monotonic() > deadline:
            raise SlurmError(f"job {job_id} still {state} after {timeout_s:.0f} s")
        time.sleep(poll_s)


# srun's report of a task that ended badly, in the order srun learned of them; task k is rank k
_SRUN_TASK = re.compile(r"^srun: error: (?P<node>\S+): (?P<tasks>tasks? [\d,\-]+): (?P<what>.+)$", re.M)
_EXIT_CODE = re.compile(r"Exited with exit code (\d+)")


@dataclass(frozen=True)
class TaskFailure:
    """The first task srun saw fail in a job's last attempt, and its shell-style status."""

    text: str  # "rank 1 on n2: Exited with exit code 3"
    status: int | None  # 3; 128 + signal for "Killed" and the like; None where srun's words are not known


def _task_status(what: str) -> int | None:
    """3 for "Exited with exit code 3", 128 + signal for a signal's description ("Killed": 137)."""
    m = _EXIT_CODE.fullmatch(what)
    if m:
        return int(m[1])
    what = what.removesuffix(" (core dumped)")
    return next((128 + sig for sig in signal.valid_signals() if signal.strsignal(sig) == what), None)


def first_failure(err_log: Path) -> TaskFailure | None:
    """The first task srun saw fail, from a job's stderr log: the root cause, not its peers' knock-on
    "connection closed by peer" tracebacks that fill the log's tail, nor the ranks srun's
    --kill-on-bad-exit then stopped. Only the last attempt counts (a requeued job appends to the same log;
    the script marks each attempt's start with ATTEMPT_MARK). None when srun reported none."""
    text = err_log.read_text(errors="replace") if err_log.is_file() else ""
    text = text[text.rfind(ATTEMPT_MARK) + 1:] if ATTEMPT_MARK in text else text
    m = _SRUN_TASK.search(text)
    if m is None:
        return None
    ranks = m["tasks"].replace("tasks", "ranks").replace("task", "rank")
    return TaskFailure(f"{ranks} on {m['node']}: {m['what']}", _task_status(m["what"]))


def first_failed_task(err_log: Path) -> str | None:
    """first_failure's line, or None."""
    failure = first_failure(err_log)
    return None if failure is None else failure.text


def log_tail(path: Path, lines: int = 40) -> str:
    if not path.is_file():
        return f"(no log at {path})"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])
