"""Hugging Face checkpoints <-> Spartron's saved state (spartron.runtime.state), through its public API.

The runtime half of spartron.interop.hf (which stays below the runtime floor and knows no saved state):

- `import_hf_to_state(hf_dir, run_dir, run_cfg)`: a step-0 saved state (`run_dir/step-00000000`)
  holding the HF weights, a fresh optimizer (no moments: AdamW starts from zero moments anyway),
  a fresh data position and the run config's settings, written by `save_state` as one rank.
  `spartron train` with `train.run_dir = run_dir`, `train.resume = true` and the same config then
  trains steps 1.. from the imported weights. One rank because a saved state records its world
  size (per-rank data positions and RNG); other layouts start from the HF directory itself
  (`load_hf_weights` after building the model: any layout).
- `SavedStateSource(path)`: the tensors of a saved step (or a run directory's newest complete
  step) for `export_hf`, verified first (`verify_step`), its ModelConfig from meta.json, read with
  DCP through state.py's safe reader only as the output shard being written needs them. EP-sharded
  entries (`<fqn>/ep<r>`) are joined in EP-rank order, which is global expert order.
- `hf_initialised(factory, hf_dir)`: a trainer model factory that builds the model on the run's
  layout and fills it from the HF directory (each rank reads its own shards): how a run starts from
  HF weights on any layout (what a `train.init_from` option would call for a new run).
- `model_toml(cfg)`: the `[model]` section of a run config TOML for a ModelConfig (runtime's writer).
- `import_hf_run_dir(hf_dir, run_dir, run_cfg, keys)`: what `spartron convert --from-hf` writes (the step-0
  state and `model.toml`), atomically: an interrupt or an error leaves run_dir as it was.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException

from spartron.interop.hf.config_map import SPARTRON_ONLY_KEYS, HFConfigError
from spartron.interop.hf.convert import HFCheckpointError, TensorSource, hf_model_config, import_hf, load_hf_weights
from spartron.layers.config import ModelConfig
from spartron.layers.costs import PARAM_BYTES, count_parameters
from spartron.runtime.config import RunConfig, config_from_dict, dump_config
from spartron.runtime.rundir import StateLoadError, _first_line, check_newest_marker, marker_kind
from spartron.runtime.safe_open import open_file
from spartron.runtime.state import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    latest_complete_step,
    read_meta,
    read_metadata_file,
    save_state,
    state_config,
    step_dir,
    verify_step,
)
from spartron.temporaries import make_sibling, remove_stale

_EP_KEY = re.compile(r"^model\.(.+)/ep(\d+)$")


def _nest(flat: dict[str, Any], prefix: str) -> dict:
    """{'model.mla.yarn.factor': 4.0, ...} -> {'mla': {'yarn': {'factor': 4.0}}, ...} for keys under prefix."""
    out: dict = {}
    for key, value in flat.items():
        if not key.startswith(prefix + "."):
            continue
        parts = key[len(prefix) + 1:].split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


class SavedStateSource(TensorSource):
    """A verified saved step read tensor by tensor (module docstring)."""

    def __init__(self, path: Path) -> None:
        if dist.is_initialized():
            raise HFCheckpointError("exporting a saved state runs in one process (outside torch.distributed)")
        if marker_kind(path) == "absent":  # a run directory: its newest complete step
            try:
                check_newest_marker(path)
            except StateLoadError as err:
                raise HFCheckpointError(str(err)) from None
            step = latest_complete_step(path)
            if step is None:
                raise HFCheckpointError(f"{path}: neither a complete saved step nor a run directory holding one")
            path = step_dir(path, step)
        problem = verify_step(path)
        if problem is not None:
            raise HFCheckpointError(problem)
        self.path = path
        meta = read_meta(path)
        if not meta.get("config"):
            raise HFCheckpointError(f"{path / 'meta.json'}: records no model config to export")
        self.cfg = ModelConfig.model_validate(_nest(meta["config"], "model"))
        self.entries = read_metadata_file(path / ".metadata").state_dict_metadata
        self.ep_ranks: dict[str, list[int]] = {}
        for key in self.entries:
            found = _EP_KEY.match(key)
            if found:
                self.ep_ranks.setdefault(found.group(1), []).append(int(found.group(2)))

    def check_target(self, out_dir: str | Path) -> None:
        """HFCheckpointError when `out_dir` (links resolved) lies inside the run directory of this step: an
        export never writes into a run's directory (its steps are verified against what they list)."""
        run = Path(os.path.realpath(self.path.parent))
        if Path(os.path.realpath(out_dir)).is_relative_to(run):
            raise HFCheckpointError(f"{out_dir}: inside the run directory {self.path.parent} the step is read from "
                                    "(an export writes a folder outside any run directory)")

    def _keys(self, name: str) -> list[str]:
        if name in self.ep_ranks:
            return [f"model.{name}/ep{r}" for r in sorted(self.ep_ranks[name])]
        if f"model.{name}" not in self.entries:
            raise HFCheckpointError(f"{self.path}: holds no tensor model.{name}")
        return [f"model.{name}"]

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[self._keys(name)[0]].properties.dtype

    def fetch(self, names: list[str]) -> dict[str, Tensor]:
        wanted = {}
        for name in names:
            for key in self._keys(name):
                entry = self.entries[key]
                wanted[key[len("model."):]] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        with warnings.catch_warnings():  # one process on purpose: not worth torch's warning on every shard
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            try:
                dcp.load({"model": wanted}, storage_reader=SafeFileSystemReader(self.path),
                         planner=SafeLoadPlanner(), no_dist=True)
            except CheckpointException as err:  # a tensor file the safe reader refuses (garbage, a pickle)
                exc = err.failures[min(err.failures)][0]
                if not isinstance(exc, Exception):  # Ctrl-C, SIGTERM unwinding: torch wrapped it, not an error
                    raise exc from None
                raise HFCheckpointError(f"{exc}: nothing was exported" if isinstance(exc, StateLoadError) else
                                        f"{self.path}: {_first_line(exc)}: nothing was exported") from None
        out = {}
        for name in names:
            parts = [wanted[key[len("model."):]] for key in self._keys(name)]
            out[name] = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out


def available_memory() -> int | None:
    """Bytes this machine can still allocate (Linux MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_memory(cfg: ModelConfig, what: str, available: int | None = None) -> None:
    """HFCheckpointError when a one-process AdamW state of `cfg` (parameters, gradients and two moments at
    the parameters' dtype, the planner's parameter count) exceeds the memory this machine has available."""
    needed = 4 * count_parameters(cfg).total * PARAM_BYTES[cfg.stored_dtype]
    available = available_memory() if available is None else available
    if available is not None and needed > available:
        raise HFCheckpointError(f"{what}: the model's {count_parameters(cfg).total:,} parameters with AdamW need "
                                f"{needed / 2**30:.1f} GiB, this machine has {available / 2**30:.1f} GiB available")


def run_tokenizer(source: SavedStateSource) -> tuple[dict[str, bytes], dict[str, int | None], str | None]:
    """(file name -> bytes, token ids, note) of the tokenizer the saved step was trained with, for `export_hf`'s
    extra_files and token_ids: the copy `spartron data` kept in the token folder (train.data.path, kind
    'packed'), else the original tokenizer file if it still has the recorded SHA-256; the folder's EOS / BOS ids
    (config.json's eos_token_id / bos_token_id: generate() stops at the EOS the model was trained with). The note
    says why no tokenizer is included."""
    from spartron.data.tokenfile import open_token_folder

    config = read_meta(source.path).get("config") or {}
    if config.get("train.data.kind") != "packed":
        return {}, {}, None
    if not config.get("train.data.path"):
        return {}, {}, "the run trained on a blend of token folders: no tokenizer is included"
    folder = Path(config["train.data.path"])
    try:
        meta = open_token_folder(folder).meta
    except Exception as err:  # noqa: BLE001 - any problem with the folder: the export goes on without it
        return {}, {}, f"no tokenizer included: {err}"
    files, note = _tokenizer_files(folder, meta)
    return files, {"eos_token_id": meta["eos_id"], "bos_token_id": meta.get("bos_id")}, note


def _tokenizer_files(folder: Path, meta: dict) -> tuple[dict[str, bytes], str | None]:
    """The token folder's tokenizer files (its kept copy, or the original if unchanged), or a note why none."""
    import hashlib

    from spartron.data.tokenfile import META

    sha = meta["tokenizer"]["sha256"]
    kept = meta.get("tokenizer_copy")
    if isinstance(kept, list) and all(isinstance(n, str) and "/" not in n and n not in ("", ".", "..") for n in kept):
        files = {}
        for name in kept:
            path = folder / name
            if not path.is_file() or path.is_symlink():
                return {}, f"no tokenizer included: {path} is missing (listed in {folder / META})"
            files[name] = path.read_bytes()
        if hashlib.sha256(files.get("tokenizer.json", b"")).hexdigest() != sha:
            return {}, (f"no tokenizer included: {folder / 'tokenizer.json'} is not the tokenizer "
                        f"{folder / META} records")
        return files, None
    original = Path(str(meta["tokenizer"].get("file", "")))
    if original.is_file() and hashlib.sha256(original.read_bytes()).hexdigest() == sha:
        files = {"tokenizer.json": original.read_bytes()}
        if (original.parent / "tokenizer_config.json").is_file():
            files["tokenizer_config.json"] = (original.parent / "tokenizer_config.json").read_bytes()
        return files, None
    return {}, (f"no tokenizer included: {folder / META} keeps no copy and {original} is gone or changed "
                "(re-run `spartron data` to keep one)")


def _check_new_run_dir(run_dir: Path) -> None:
    """An imported state starts a new run directory (or fills an empty one). As for `spartron train`, the run
    directory itself may be a link to an empty folder (another disk, a scratch space): it then fills that
    folder; a link to nothing is refused (making its target would create a folder wherever it points)."""
    try:
        if run_dir.is_symlink() and not run_dir.exists():
            raise HFCheckpointError(f"{run_dir}: is a symbolic link to nothing (to {os.readlink(run_dir)!r}); an "
                                    "imported state starts a new run directory or fills an empty one")
        if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
            raise HFCheckpointError(f"{run_dir}: exists and is not an empty directory; an imported state starts "
                                    "a new run directory")
    except OSError as err:
        raise HFCheckpointError(f"{str(run_dir)[:200]}: cannot be used as a run directory "
                                f"({err.strerror or err})") from None


def _check_model_overrides(run: ModelConfig, checkpoint: ModelConfig, keys: tuple[str, ...]) -> None:
    """A `--set model.KEY=...` the checkpoint contradicts is refused: the import takes the checkpoint's
    [model] (a run config's own [model] is replaced, as the README says), so the value would be dropped."""
    ours, theirs = run.model_dump(mode="json"), checkpoint.model_dump(mode="json")
    for key in keys:
        if key[len("model."):] in SPARTRON_ONLY_KEYS:  # the run's own (_keep_spartron_only)
            continue
        a, b = ours, theirs
        for part in key.split(".")[1:]:
            a = a.get(part) if isinstance(a, dict) else None
            b = b.get(part) if isinstance(b, dict) else None
        if a != b:
            raise HFCheckpointError(f"--set {key}: {a!r}, the Hugging Face checkpoint has {b!r} (an import takes "
                                    "the checkpoint's [model])")


def _keep_spartron_only(run: ModelConfig, model: dict) -> None:
    """Put the run config's explicit settings of SPARTRON_ONLY_KEYS (how Spartron runs the same function: the
    dispatcher, the dtypes; a checkpoint does not decide them) into `model`, the checkpoint's [model] dump."""
    for key in SPARTRON_ONLY_KEYS:
        *parents, name = key.split(".")
        section, target = run, model
        for part in parents:
            section = getattr(section, part, None)
            target = target.get(part) if isinstance(target, dict) else None
        if section is not None and isinstance(target, dict) and name in section.model_fields_set:
            target[name] = section.model_dump(mode="json")[name]


def import_hf_to_state(hf_dir: str | Path, run_dir: str | Path, run_cfg=None,
                       model_overrides: tuple[str, ...] = ()) -> tuple[Path, Any]:
    """Write `run_dir/step-00000000` from a Hugging Face checkpoint (module docstring).

    `run_cfg`: the RunConfig the run will train with (its `model` section is replaced by the checkpoint's,
    but for the SPARTRON_ONLY_KEYS it sets; default: RunConfig()). `model_overrides`: the `model.*` keys the
    user set on the command line: each must equal the checkpoint's (HFCheckpointError naming it), but for the
    SPARTRON_ONLY_KEYS. Returns (the step directory, the RunConfig).
    """
    from spartron.layers.model import build_model
    from spartron.parallel.dims import ParallelDims
    from spartron.runtime.data import build_loader
    from spartron.runtime.optim import build_optimizer

    if dist.is_initialized():
        raise HFCheckpointError("import_hf_to_state writes a one-rank saved state: call it outside "
                                "torch.distributed (other layouts load the HF directory with load_hf_weights)")
    run_dir = Path(run_dir)
    _check_new_run_dir(run_dir)
    check_memory(hf_model_config(hf_dir), f"converting {hf_dir}")  # config.json alone, before any tensor
    model_cfg, load = import_hf(hf_dir)
    if run_cfg is not None:
        _check_model_overrides(run_cfg.model, model_cfg, model_overrides)
    data = (run_cfg or RunConfig()).model_dump(mode="json")
    data["model"] = model_cfg.model_dump(mode="json")
    if run_cfg is not None:
        _keep_spartron_only(run_cfg.model, data["model"])
    run_cfg = config_from_dict(data)
    p, t = run_cfg.parallel, run_cfg.train
    dims = ParallelDims(1, fsdp=p.resolve_fsdp(1), cp=p.cp, ep=p.ep, dp_replicate=p.dp_replicate, order=p.order)
    model = build_model(run_cfg.model, seed=t.seed)
    load(model)
    # the CPU model takes torch's AdamW: the state (same keys) resumes under either adamw_kernel
    optimizer = build_optimizer(model, t.model_copy(update={"adamw_kernel": "torch"}))
    loader = build_loader(t.data, run_cfg.model.vocab_size, t.seq_len, t.seed, 0, 1)
    path = save_state(run_dir, 0, model, optimizer, {"tokens": 0}, {"data": loader.state_dict()},
                      torch.device("cpu"), layout=dims.describe(), config=state_config(run_cfg))
    return path, run_cfg


def import_hf_run_dir(hf_dir: str | Path, run_dir: str | Path, run_cfg=None,
                      model_overrides: tuple[str, ...] = ()) -> tuple[Path, Any, Path]:
    """`import_hf_to_state` plus `run_dir/model.toml`, built in a temporary sibling `.<run_dir>.tmp-<host>-<pid>-
    <hex>` (spartron.temporaries) and moved into place at the end, so a SIGTERM, Ctrl-C or error removes it and
    leaves run_dir as it was (a SIGKILL's leftover is removed by the retry, with a note). A new run_dir is the
    renamed temporary; an existing empty folder, or a link to one, receives its entries (the folder, its owner
    and mode stay; the temporary lies beside the link's target, on its file system). model.toml is created
    without following links. Returns (the step directory, the RunConfig, the model.toml path)."""
    run_dir = Path(run_dir)
    _check_new_run_dir(run_dir)
    target = run_dir.resolve() if run_dir.exists() else run_dir
    for note in remove_stale(target, "tmp"):
        print(note, file=sys.stderr, flush=True)
    try:
        os.makedirs(target.parent, exist_ok=True)  # missing parents are made, as save_state and mkdir -p do
        tmp = make_sibling(target, "tmp")
    except OSError as err:
        raise HFCheckpointError(f"{run_dir}: cannot make a temporary folder beside it "
                                f"({err.strerror or err}); nothing was imported") from None
    try:
        path, cfg = import_hf_to_state(hf_dir, tmp, run_cfg, model_overrides)
        fd = open_file(tmp, "model.toml", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with open(fd, "w", encoding="utf-8") as f:
            f.write(model_toml(cfg.model))
        _check_new_run_dir(run_dir)  # nothing appeared meanwhile
        try:
            if target.exists():
                for name in sorted(os.listdir(tmp)):
                    os.rename(tmp / name, target / name)
                os.rmdir(tmp)
            else:
                os.rename(tmp, target)
        except OSError as err:
            raise HFCheckpointError(f"{run_dir}: moving the import into it failed ({err.strerror or err})") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return run_dir / path.relative_to(tmp), cfg, run_dir / "model.toml"


def replaced_model_notes(given: ModelConfig, taken: ModelConfig, config: str | None, hf_dir: str) -> list[str]:
    """One `spartron: note:` line per key the run config `config` sets explicitly in [model] (not a default)
    that the import replaced with the checkpoint's value: a user's setting never changes silently (none
    without a config file)."""
    if config is None:
        return []
    return [f"spartron: note: {key} = {mine} in {config} is replaced by the checkpoint's {theirs} ({hf_dir}/"
            "config.json decides the model)" for key, mine, theirs in _replaced(given, taken, "model")]


def _replaced(given, taken, prefix: str) -> list[tuple[str, str, str]]:  # noqa: ANN001 - config sections
    out = []
    for name in sorted(given.model_fields_set):
        mine, theirs = getattr(given, name), getattr(taken, name)
        if hasattr(mine, "model_fields_set") and hasattr(theirs, "model_fields_set"):
            out += _replaced(mine, theirs, f"{prefix}.{name}")
        elif mine != theirs:
            show = [json.dumps(v.model_dump(mode="json") if hasattr(v, "model_dump") else v) for v in (mine, theirs)]
            out.append((f"{prefix}.{name}", *show))
    return out


def model_toml(cfg: ModelConfig) -> str:
    """The `[model]` section (and its sub-tables) of a run config TOML for `cfg`."""
    lines, keep = [], False
    for line in dump_config(RunConfig(model=cfg)).splitlines():
        if line.startswith("["):
            keep = line == "[model]" or line.startswith("[model.")
        if keep:
            lines.append(line)
    return "\n".join(lines).strip() + "\n"


def hf_initialised(factory, hf_dir: str | Path):
    """The trainer model factory `factory(cfg, groups)` followed by `load_hf_weights(model, hf_dir)`
    (the run's [model] must compute the checkpoint's function: `check_config_matches`). Each rank reads only
    its own boxes, so a NaN one rank finds is agreed: every rank raises the same HFCheckpointError."""

    def build(cfg, groups):
        model = factory(cfg, groups)
        error = None
        try:
            load_hf_weights(model, hf_dir)
        except (HFCheckpointError, HFConfigError) as err:
            error = str(err)
        if dist.is_initialized():
            errors: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise HFCheckpointError(error)
        return model

    return build
