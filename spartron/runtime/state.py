"""Distributed save / resume of the training state (model, optimizer, counters, data position, RNG).

Layout: ``<run_dir>/step-00000004/`` holds a torch.distributed.checkpoint (DCP) of the FSDP2-aware model
and optimizer state dicts, ``meta.json`` (step, world size, counters), and per rank
``rank-00000.json`` (data position, Python / NumPy RNG) and ``rank-00000.pt`` (torch RNG tensors).

Atomicity: everything is written to ``.tmp-step-00000004``; after every rank finished writing, rank 0
writes the ``COMPLETE`` marker LAST and renames the directory. A crash at any point leaves either
no ``step-*`` directory or one without ``COMPLETE``: neither is ever picked for resume. (The run
directory must be on a filesystem every rank sees, as with DCP in general.)

Expert-parallel parameters: each EP rank holds DIFFERENT experts under the same name, and their FSDP2
DTensors only describe the expert-FSDP split, so DCP would see one tensor and keep one EP rank's
copy. Their entries (model and optimizer) are therefore saved under per-EP-rank keys
``<fqn>/ep<rank>``; a resume must use the same EP layout.

Loading never unpickles arbitrary objects: DCP's ``.metadata`` (a pickle) is read with an unpickler
that only accepts DCP's metadata classes and a few plain types, DCP's byte items and the per-rank
tensors use ``torch.load(weights_only=True)``, everything else is JSON.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

COMPLETE = "COMPLETE"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class StateLoadError(RuntimeError):
    """A saved state that cannot be loaded into this run (mismatch or an unsafe file)."""


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"step-{step:08d}"


def complete_steps(run_dir: str | Path) -> list[int]:
    """Steps with a complete saved state, ascending (directories without the marker are ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    steps = []
    for child in run_dir.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / COMPLETE).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_complete_step(run_dir: str | Path) -> int | None:
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


# ---- per-rank RNG ----------------------------------------------------------------------------------
def _rng_state(device: torch.device) -> tuple[dict, dict[str, torch.Tensor]]:
    py = random.getstate()
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    plain = {"python": [py[0], list(py[1]), py[2]],
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}
    tensors = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["torch_cuda"] = torch.cuda.get_rng_state(device)
    return plain, tensors


def _set_rng_state(plain: dict, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["torch_cuda"], device)


# ---- safe DCP reading -----------------------------------------------------------------------------
_ALLOWED_GLOBALS = {("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"),
                    ("builtins", "frozenset"), ("torch.serialization", "_get_layout"),
                    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise StateLoadError(f"saved-state metadata references {module}.{name}, which is not a DCP metadata "
                             "type; refusing to unpickle it")


class SafeFileSystemReader(FileSystemReader):
    """DCP's filesystem reader with the metadata pickle restricted to DCP's own types."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
        if not isinstance(metadata, Metadata):
            raise StateLoadError(f"{path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor items read through torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:  # noqa: ANN001 - DCP signature
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ---- save / load ----------------------------------------------------------------------------------
def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _write_durable(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_state(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
               counters: dict[str, int], rank_state: dict, device: torch.device,
               before_commit: Callable[[Path], None] | None = None,
               ep_sharded: Collection[str] = (), ep_rank: int = 0, layout: str | None = None) -> Path:
    """Collective: save everything needed to continue after optimizer step `step`; returns the directory.

    counters: small global integers (same on every rank), rank_state: this rank's JSON-able state
    (data position). before_commit(tmp_dir) runs on every rank after all data is written and before
    the COMPLETE marker (a hook for tests and for copying elsewhere); if it raises, nothing is committed.
    ep_sharded: names of parameters holding only this EP rank's experts (ep_rank), saved per EP rank.
    layout: the parallel layout (ParallelDims.describe()); a load under another layout is refused.
    """
    rank, world = _rank_world()
    run_dir = Path(run_dir)
    final = step_dir(run_dir, step)
    tmp = run_dir / f".tmp-{final.name}"
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier crashed save of this step
        tmp.mkdir()
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    _rename_ep_entries(model_sd, optim_sd, ep_sharded, ep_rank, to_saved=True)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(tmp))
    plain, tensors = _rng_state(device)
    buffer = io.BytesIO()
    torch.save({k: v.cpu() for k, v in tensors.items()}, buffer)
    _write_durable(tmp / f"rank-{rank:05d}.pt", buffer.getvalue())
    _write_durable(tmp / f"rank-{rank:05d}.json", json.dumps({"rng": plain, "rank": rank_state}).encode())
    if rank == 0:
        meta = {"format_version": FORMAT_VERSION, "step": step, "world_size": world, "counters": counters,
                "layout": layout}
        _write_durable(tmp / "meta.json", json.dumps(meta).encode())
    _barrier()
    if before_commit is not None:
        before_commit(tmp)
    if rank == 0:
        _write_durable(tmp / COMPLETE, b"")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    _barrier()
    return final


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


def load_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
               device: torch.device, ep_sharded: Collection[str] = (), ep_rank: int = 0,
               layout: str | None = None) -> tuple[dict, dict]:
    """Collective: load a complete saved state into model and optimizer, restore this rank's RNG.

    Returns (meta, rank_state) where meta has "step" and "counters"; ep_sharded / ep_rank as in save_state.
    """
    path = Path(path)
    rank, world = _rank_world()
    if not (path / COMPLETE).is_file():
        raise StateLoadError(f"{path} is not a complete saved state (no {COMPLETE} marker)")
    meta = json.loads((path / "meta.json").read_text())
    if meta["world_size"] != world:
        raise StateLoadError(f"{path} was saved by {meta['world_size']} ranks; this run has {world} "
                             "(per-rank data positions and RNG cannot be remapped)")
    if layout is not None and meta.get("layout") not in (None, layout):
        raise StateLoadError(f"{path} was saved with parallel layout [{meta['layout']}]; this run has "
                             f"[{layout}] (expert and context shards cannot be remapped)")
    reader = SafeFileSystemReader(path)
    # On every rank, before DCP's collectives: an unsafe file fails clearly here.
    saved_keys = set(reader.read_metadata().state_dict_metadata)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    _rename_ep_entries(model_sd, optim_sd, ep_sharded, ep_rank, to_saved=True)
    optim_sd["state"] = _states_in_checkpoint(optim_sd["state"], saved_keys)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    _rename_ep_entries(state["model"], state["optim"], ep_sharded, ep_rank, to_saved=False)
    set_model_state_dict(model, state["model"])
    # Not strict: parameters that never had a gradient (e.g. the DSA indexers with
    # model.dsa.indexer_mode = 'frozen') have no optimizer state in the checkpoint, and must have none after
    # loading either, as in the uninterrupted run (a state created here would change AdamW's bias
    # correction if such a parameter got a gradient later).
    set_optimizer_state_dict(model, optimizer, state["optim"], options=StateDictOptions(strict=False))
    tensors = torch.load(path / f"rank-{rank:05d}.pt", weights_only=True)
    plain = json.loads((path / f"rank-{rank:05d}.json").read_text())
    _set_rng_state(plain["rng"], tensors, device)
    return meta, plain["rank"]
