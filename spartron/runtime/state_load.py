"""Loading a saved step (`load_state`): verified before DCP's collectives, resharded onto this run's layout,
the RNG and rank state restored under the saved layout. What is verified, and why loading runs no code
from a file: spartron.runtime.state."""

from __future__ import annotations

import random
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh

from spartron.runtime.rundir import (
    _STEP_DIR,
    COMPLETE,
    LEGACY_FORMAT,
    StateLoadError,
    _first_line,
    check_meta,
    config_changes,
    marker_kind,
    read_json,
    read_manifest,
    read_meta,
)
from spartron.runtime.state_files import SafeFileSystemReader, SafeLoadPlanner, _torch_load
from spartron.runtime.state_layout import globalize, restore
from spartron.runtime.state_verify import (
    _agreed_errors,
    _check_tensors,
    _first_nonfinite,
    _newest_intact,
    _rank_world,
    verify_step,
)


def _set_rng_state(plain: dict, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["torch_cuda"], device)



def _rename_ep_entries(model_sd: dict, optim_sd: dict, ep_sharded: Collection[str], ep_rank: int,
                       to_saved: bool) -> None:
    """In place: EP-sharded parameters' model and optimizer entries <fqn> <-> <fqn>/ep<rank>."""
    for fqn in ep_sharded:
        saved = f"{fqn}/ep{ep_rank}"
        old, new = (fqn, saved) if to_saved else (saved, fqn)
        if old not in model_sd:
            raise StateLoadError(f"EP-sharded parameter {old!r} is not in the model's state dict")
        model_sd[new] = model_sd.pop(old)
        if old in optim_sd["state"]:
            optim_sd["state"][new] = optim_sd["state"].pop(old)


def _states_in_checkpoint(states: dict[str, dict], saved_keys: set[str]) -> dict[str, dict]:
    """The per-parameter optimizer states that the checkpoint holds (DCP key optim.state.<fqn>.<name>).

    get_state_dict initialises a fresh optimizer with a state for EVERY parameter; the saved optimizer
    only had states for parameters that had received a gradient.
    """
    return {fqn: st for fqn, st in states.items() if any(f"optim.state.{fqn}.{k}" in saved_keys for k in st)}


# ---- load --------------------------------------------------------------------------------------------
def load_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
               device: torch.device, ep_sharded: Collection[str] = (), ep_rank: int = 0,
               layout: str | None = None, config: dict[str, Any] | None = None,
               verify_checksums: bool = True, ep_mesh: DeviceMesh | None = None) -> tuple[dict, dict]:
    """Collective: load a complete saved state into model and optimizer, on this run's layout.

    Returns (meta, rank_state) where meta has "step", "counters", "run_id" and "config"; ep_sharded,
    ep_rank, ep_mesh, layout and config as in save_state. Everything is verified (module docstring) before
    DCP's collectives; any problem is a StateLoadError naming the file, the same on every rank. DCP reshards
    the tensors onto this layout. Under the saved layout (world size and `layout` equal) each rank restores
    its own RNG and gets its own rank state; under another one no RNG is restored and every rank gets
    rank 0's rank state (the data position, which the trainer re-splits: state_layout.resplit_data_position).
    """
    path = Path(path)
    rank, world = _rank_world()
    problem = verify_step(path, verify_checksums)
    if problem is not None:
        newest = _newest_intact(path.parent, int(path.name[5:]), verify_checksums) \
            if _STEP_DIR.match(path.name) and marker_kind(path) == "complete" else ""
        raise StateLoadError(problem + (f"; {newest}" if newest else ""))
    meta = read_meta(path)
    check_meta(path, meta, world, layout, config)
    allowed = {f["path"] for f in read_manifest(path)}
    reader = SafeFileSystemReader(path)
    metadata = reader.read_metadata()
    unlisted = sorted({i.relative_path for i in metadata.storage_data.values()} - allowed)
    if unlisted:
        raise StateLoadError(f"{path / '.metadata'}: refers to {unlisted[0]}, which {COMPLETE} does not list")
    saved = metadata.state_dict_metadata
    model_sd, optim_sd = get_state_dict(model, optimizer)
    per_ep_rank = meta["format_version"] == LEGACY_FORMAT  # checked by check_meta to be the saved layout
    originals = {}
    if per_ep_rank:
        _rename_ep_entries(model_sd, optim_sd, ep_sharded, ep_rank, to_saved=True)
    else:
        originals = globalize(model_sd, optim_sd, ep_sharded, ep_mesh)
    changed = config_changes(meta["config"] or {}, config or {}, "model.") if config is not None else []
    _check_tensors(path, saved, model_sd, ep_sharded if per_ep_rank else (), changed)
    optim_sd["state"] = _states_in_checkpoint(optim_sd["state"], set(saved))
    state = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointException as err:  # the same failures on every rank
        exc = err.failures[min(err.failures)][0]
        raise StateLoadError(str(exc) if isinstance(exc, StateLoadError) else
                             f"{path}: {_first_line(exc)}") from None
    if per_ep_rank:
        _rename_ep_entries(state["model"], state["optim"], ep_sharded, ep_rank, to_saved=False)
    else:
        restore(state["model"], state["optim"], originals)
    set_model_state_dict(model, state["model"])
    # Not strict: parameters that never had a gradient (e.g. the DSA indexers with
    # model.dsa.indexer_mode = 'frozen') have no optimizer state in the checkpoint, and must have none after
    # loading either, as in the uninterrupted run (a state created here would change AdamW's bias
    # correction if such a parameter got a gradient later).
    set_optimizer_state_dict(model, optimizer, state["optim"], options=StateDictOptions(strict=False))
    error, rank_state = None, None
    try:  # this rank's own files: agreed below, so a bad file of one rank stops every rank at once
        bad = _first_nonfinite(state)
        if bad is not None:
            raise StateLoadError(f"{path}: {bad} holds non-finite values (no save writes them: the files were "
                                 "altered)")
        same_layout = meta["world_size"] == world and (layout is None or meta["layout"] in (None, layout))
        rank_state = _restore_rank_files(path, rank, device) if same_layout else _rank_state(path, 0)
    except StateLoadError as err:
        error = str(err)
    failed = _agreed_errors(error)
    if failed:
        more = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        raise StateLoadError(failed[0][1] + more)
    return meta, rank_state


def _restore_rank_files(path: Path, rank: int, device: torch.device) -> Any:
    """Restore this rank's RNG from rank-<r>.pt / .json; returns its saved rank state (data position)."""
    pt, js = path / f"rank-{rank:05d}.pt", path / f"rank-{rank:05d}.json"
    tensors = _torch_load(pt, pt)
    plain = read_json(js)
    try:
        if not (isinstance(tensors, dict) and isinstance(tensors.get("torch_cpu"), torch.Tensor)):
            raise TypeError(f"{pt.name} must map 'torch_cpu' to a tensor")
        _set_rng_state(plain["rng"], tensors, device)
        return plain["rank"]
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, RuntimeError) as err:
        raise StateLoadError(f"{js}: RNG state does not fit this run ({_first_line(err)})") from None


def _rank_state(path: Path, rank: int) -> Any:
    """The saved rank state (data position) of `rank`, without its RNG."""
    js = path / f"rank-{rank:05d}.json"
    plain = read_json(js)
    if not isinstance(plain, dict) or "rank" not in plain:
        raise StateLoadError(f"{js}: must hold a JSON object with a 'rank' field")
    return plain["rank"]
