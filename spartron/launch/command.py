"""What every `spartron` command shares: its parser, the config argument, and how a mistake becomes one line.

A command module (cmd_*.py) adds its parser with `register(sub)`; the config it names is loaded with
`load` so `--set` overrides pass the same validation as the file. User mistakes (bad key, missing file,
impossible layout, value Slurm would misread) are one line on stderr and exit status 2; failures of the
run itself keep their traceback. SIGTERM unwinds the commands that write files (data, convert) like
Ctrl-C, so their partial output is removed.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from spartron.launch.process import ERROR_PREFIX, USAGE_STATUS
from spartron.optional import MissingDependencyError
from spartron.parallel.dims import ParallelDimsError
from spartron.runtime.config import ConfigError, RunConfig, load_config

USAGE_ERROR = USAGE_STATUS
DEFAULT_CONFIG = "configs/tiny.toml"


class UsageError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + error
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def add_config(p: argparse.ArgumentParser, default: str | None = None) -> None:
    """The run config argument (optional when `default` is given) and its repeatable --set overrides."""
    if default is None:
        p.add_argument("config", help="run config TOML")
    else:
        p.add_argument("config", nargs="?", default=default, help=f"run config TOML (default {default})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set parallel.ep=2 (repeatable; TOML literals)")


def load(args: argparse.Namespace) -> RunConfig:
    return load_config(args.config, args.set)


def error_line(err: Exception) -> str:
    """The one line a refusal prints: a line break inside the message (a file name holding one, a library's
    multi-line text) is written as \\n, so the line stays one line."""
    return ERROR_PREFIX + str(err).replace("\r", "\\r").replace("\n", "\\n")


def is_user_error(err: Exception) -> bool:
    """Mistakes in the config, the flags, the data, the disk or the launch environment (not bugs in a run),
    also when the trainer wrapped one in its "rank r failed at step s" TrainingError (a data sample found
    bad mid-run, a save refused for a full disk), and a loss guard's intended stop: their messages already
    name the key, path or step and value. A missing optional package (spartron.optional) is one too: its message
    names the package and the command that installs it."""
    kinds: tuple[type, ...] = (UsageError, ConfigError, ParallelDimsError, MissingDependencyError)
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


class Terminated(BaseException):
    """SIGTERM during `spartron data` or `convert`: unwinds like Ctrl-C, so the partial output is removed."""


def raise_terminated(signum, frame) -> NoReturn:  # noqa: ANN001
    raise Terminated
