"""The `spartron` command: parse the arguments, run the chosen command, turn a user mistake into one line.

Each command (or group) is a module `cmd_<name>.py` with `register(sub)`, which adds its parser and sets
`func`; `build_parser` lists them in `spartron --help` order. A new command is one module and one entry
there. User mistakes (bad key, missing file, impossible layout, value Slurm would misread) are one line on
stderr and exit status 2; failures of the run itself keep their traceback (spartron.launch.command).

This module imports no torch at its top (only the standard library and spartron.launch.process): `run`
holds SIGTERM before torch loads (spartron.launch.process.hold_sigterm), so a rank signalled while it starts
still saves and stops. The commands are imported on first use, in `build_parser`.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from spartron import __version__
from spartron.launch.process import exit_process, hold_sigterm, release_sigterm

# A rank of `spartron train` keeps SIGTERM held until its handler is in place (the trainer's
# StopOnSigterm, the local launcher's forwarding); every other command gets the default at once.
HOLDS_SIGTERM = ("train",)


def build_parser() -> argparse.ArgumentParser:
    from spartron.launch import cmd_convert, cmd_data, cmd_plan, cmd_regress, cmd_rehearse, cmd_sbatch, cmd_train
    from spartron.launch.command import Parser

    # train, smoke, eval | sbatch | regress compare, regress run | plan | rehearse | convert | data
    commands = (cmd_train, cmd_sbatch, cmd_regress, cmd_plan, cmd_rehearse, cmd_convert, cmd_data)
    parser = Parser(prog="spartron", description="Distributed training of sparse MoE models with MLA+DSA.")
    parser.add_argument("--version", action="version", version=f"spartron {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser, required=True)
    for command in commands:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from spartron.launch.command import USAGE_ERROR, error_line, is_user_error

    try:
        args = build_parser().parse_args(argv)
        if args.command not in HOLDS_SIGTERM:
            release_sigterm()
        return args.func(args)
    except Exception as err:
        if not is_user_error(err):
            raise
        print(error_line(err), file=sys.stderr)
        return USAGE_ERROR


def run() -> NoReturn:
    """The `spartron` console script and ``python -m spartron.launch.cli``: `main`, then `exit_process`."""
    hold_sigterm()
    exit_process(main())


if __name__ == "__main__":
    run()
