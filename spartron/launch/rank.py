"""One training rank as a process: `python -m spartron.launch.rank CONFIG [--set key=value ...]`.

What torchrun, srun or the local launcher start on each rank when a script brings its own model
(`main(argv, model_factory)`); `spartron train` runs the same `train()` in its own rank processes.
Every failure prints the traceback and ends the rank at once with status 1 (never a hang in
process-group teardown); a run stopped by SIGTERM after saving ends with STOPPED_STATUS. SIGTERM is held
from `main`'s first line until the trainer's handler is in place (spartron.launch.process.hold_sigterm); this
module imports torch only inside `main`, so `python -m spartron.launch.rank` holds it before torch loads.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import TYPE_CHECKING

from spartron.launch.process import STOPPED_STATUS, exit_process, hold_sigterm

if TYPE_CHECKING:
    from spartron.runtime.trainer import ModelFactory


def main(argv: list[str] | None = None, model_factory: ModelFactory | None = None) -> int:
    """Process entry: train, print the traceback and exit non-zero on any failure (never hang in teardown)."""
    hold_sigterm()
    import torch.distributed as dist

    from spartron.runtime.config import load_config
    from spartron.runtime.trainer import train

    parser = argparse.ArgumentParser(prog="python -m spartron.launch.rank", description=__doc__)
    parser.add_argument("config", nargs="?", default=None, help="run config TOML (default: defaults)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        result = train(cfg, model_factory)
    except BaseException:  # noqa: BLE001 - every failure must surface and end this rank
        rank = dist.get_rank() if dist.is_initialized() else "?"
        sys.stderr.write(f"[spartron rank {rank}] training failed:\n{traceback.format_exc()}")
        exit_process(1)  # skip process-group teardown, which can block on peers that are still waiting
    return 0 if result.stopped_at is None else STOPPED_STATUS


if __name__ == "__main__":
    exit_process(main())
