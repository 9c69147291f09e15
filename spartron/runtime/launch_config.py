"""The run config's [launch] section: what `spartron sbatch` and the local launcher may write into a job
(Slurm words, times, sbatch arguments, environment names), checked before anything is rendered."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from spartron.configbase import ConfigSection
from spartron.runtime.observe import FLIGHT_RECORDER_ENV

_SLURM_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SLURM_TIME = re.compile(r"\d+(:\d{2}){0,2}|\d+-\d+(:\d{2}){0,2}|UNLIMITED|infinite")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Set per rank by torchrun / the local launcher (read before SLURM_* by discovery); the same value for every rank
# breaks discovery, so launch.env may not set them and the Slurm job script unsets what the submitting shell has.
LAUNCHER_ENV = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                          "MASTER_PORT"})
_SBATCH_ARG = re.compile(r"--[a-z][a-z0-9-]*(=[A-Za-z0-9._,:/@+=-]+)?")


class LaunchConfig(ConfigSection):
    """How ranks start: `nproc` local ranks for `spartron train`, and the Slurm job for `spartron sbatch`.

    Slurm values end up in a shell script, so they are checked against Slurm's own charsets here
    (one error naming the key) instead of being escaped into something Slurm would misread.
    Under Slurm each node runs `gpus_per_node` tasks (one per GPU), or `nproc` tasks on CPU.
    """

    nproc: int = Field(1, ge=1)  # ranks spawned on this machine by `spartron train`
    bind_cores: bool = False  # pin each spawned local rank to its own slice of cores (as srun does)
    nodes: int = Field(1, ge=1)  # default of `spartron sbatch --nodes`
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_task: int = Field(1, ge=1)
    partition: str | None = None  # one partition or a comma-separated list
    account: str | None = None
    qos: str | None = None
    job_name: str | None = None  # default: the run name
    time: str = "01:00:00"
    env: dict[str, str] = Field(default_factory=dict)  # exported in the job script, values shell-quoted
    venv: str | None = None  # default: the venv of the interpreter running `spartron sbatch`
    container: str | None = None  # pyxis/enroot image for `srun --container-image`
    sbatch_args: list[str] = Field(default_factory=list)  # extra `--flag=value` directives
    # Preemption: ranks save a complete step on SIGTERM and exit 75 (spartron.runtime.preemption).
    requeue: bool = False  # `#SBATCH --requeue`; a SIGTERM to the batch shell then requeues the job
    signal_before_s: int = Field(0, ge=0, le=65535)  # `--signal=B:TERM@<s>` before the time limit; 0: no
    terminate_grace_s: float = Field(120.0, gt=0)  # local launcher: time to save after a forwarded SIGTERM

    @field_validator("partition")
    @classmethod
    def _partition(cls, v: str | None) -> str | None:
        if v is not None and not all(_SLURM_WORD.fullmatch(p) for p in v.split(",")):
            raise ValueError(f"must be Slurm partition names ([A-Za-z0-9._-], comma-separated), got {v!r}")
        return v

    @field_validator("account", "qos", "job_name")
    @classmethod
    def _slurm_word(cls, v: str | None) -> str | None:
        if v is not None and not _SLURM_WORD.fullmatch(v):
            raise ValueError(f"must be letters, digits, '.', '_' or '-' (at most 128), got {v!r}")
        return v

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        if not _SLURM_TIME.fullmatch(v):
            raise ValueError(f"must be a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
                             f"D-HH:MM:SS or UNLIMITED), got {v!r}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not _ENV_NAME.fullmatch(key):
                raise ValueError(f"environment variable name {key!r} must match [A-Za-z_][A-Za-z0-9_]*")
            if key in LAUNCHER_ENV or key.startswith("SLURM_"):
                raise ValueError(f"{key} is set by the launcher (srun / the local launcher) for each rank; "
                                 "setting it here would give every rank the same value")
            if key in FLIGHT_RECORDER_ENV:
                raise ValueError(f"{key} is set by the launchers from observe.nccl_flight_recorder (with the dump "
                                 "folder in the run directory): set that instead")
            if "\0" in value:
                raise ValueError(f"value of {key} contains a NUL byte")
        return v

    @field_validator("venv", "container")
    @classmethod
    def _no_nul(cls, v: str | None) -> str | None:
        if v is not None and ("\0" in v or "\n" in v or not v.strip()):
            raise ValueError(f"must be a non-empty single-line path or image name, got {v!r}")
        return v

    @field_validator("sbatch_args")
    @classmethod
    def _sbatch_args(cls, v: list[str]) -> list[str]:
        for arg in v:
            if not _SBATCH_ARG.fullmatch(arg):
                raise ValueError(f"each entry must look like --flag or --flag=value with value in "
                                 f"[A-Za-z0-9._,:/@+=-], got {arg!r}")
            refusal = _refused_sbatch_arg(arg)
            if refusal:
                raise ValueError(refusal)
        return v


def _refused_sbatch_arg(arg: str) -> str | None:
    """Why `arg` may not be an extra sbatch directive, or None. sbatch (getopt_long) takes any unambiguous
    prefix of a long option, so `--sig=...` is `--signal`: the option's name is compared as a prefix.

    --signal: the ranks save only on SIGTERM, and the job script's trap is for SIGTERM alone; another signal
    (USR1 is a common template's choice) would kill the job early without a save, and a second --signal
    would replace launch.signal_before_s's. --array: every task of an array shares this one run directory
    (one would be refused as "in use", or train another's steps) and `spartron sbatch --wait` follows one job.
    """
    name = arg[2:].split("=", 1)[0]
    if "signal".startswith(name):
        return (f"{arg!r} sets the signal Slurm sends before the time limit: set launch.signal_before_s "
                "instead (it renders --signal=B:TERM@<seconds>; the ranks save a complete step on SIGTERM)")
    if "array".startswith(name):
        return (f"{arg!r} makes an array job, whose tasks would all share one run directory: submit one "
                "`spartron sbatch` per run, each with its own name or train.run_dir")
    return None
