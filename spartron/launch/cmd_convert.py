"""`spartron convert`: a Hugging Face DeepSeek-V3/V3.2 checkpoint to a step-0 saved state, and back.

The conversion itself lives in spartron/interop/hf and spartron/runtime/hf_state; this module checks
which flags go together and reports. SIGTERM unwinds like Ctrl-C: the partial import or export is
removed and the target is as it was.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from spartron.launch.command import Terminated, UsageError, raise_terminated
from spartron.runtime.config import load_config


def check_flags(args: argparse.Namespace) -> None:
    """Which flags go together: one line naming the flag, before anything is read."""
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
    if args.fp8_weights and args.to_hf is None:
        raise UsageError("--fp8-weights goes with --to-hf DIR (an import reads FP8 weights dequantised as they are "
                         "stored)")


def cmd_convert(args: argparse.Namespace) -> int:
    """Hugging Face checkpoint -> a step-0 saved state `spartron train` resumes (train.resume = true), or a
    saved state (step or run directory) -> a Hugging Face checkpoint (spartron/interop/hf)."""
    check_flags(args)
    from spartron.interop.hf import HFCheckpointError, HFConfigError, export_hf
    from spartron.interop.hf.convert import DEFAULT_SHARD_BYTES
    from spartron.runtime import hf_state
    from spartron.runtime.hf_state import SavedStateSource, import_hf_run_dir, run_tokenizer

    previous = signal.signal(signal.SIGTERM, raise_terminated)  # as Ctrl-C: the partial import/export is removed
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
                tokenizer, token_ids, note = run_tokenizer(source)
                out = export_hf(source, args.to_hf, max_shard_bytes=args.max_shard_bytes or DEFAULT_SHARD_BYTES,
                                with_mtp=args.with_mtp, extra_files=tokenizer, fp8_weights=args.fp8_weights,
                                token_ids=token_ids)
            finally:
                reading.release()
            if note:
                print(f"spartron: note: {note}", file=sys.stderr)
            print(f"spartron: wrote a Hugging Face checkpoint of {args.from_state} to {out}"
                  + (" with its tokenizer" if tokenizer else ""))
    except (KeyboardInterrupt, Terminated) as err:
        what, out = ("import", args.to) if args.from_hf is not None else ("export", args.to_hf)
        print(f"spartron: convert: stopped by {'SIGTERM' if isinstance(err, Terminated) else 'SIGINT'}; removed "
              f"the partial {what} ({out} is as it was: run the same command again)", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT)
    except (HFConfigError, HFCheckpointError) as err:
        raise UsageError(str(err)) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--fp8-weights", action="store_true", help="store the decoder layers' 2-D weights as E4M3 with "
                   "a float32 weight_scale_inv per 128 x 128 block, as DeepSeek's release (for serving engines that "
                   "read that format; the import reads it back dequantised)")
    p.set_defaults(func=cmd_convert)
