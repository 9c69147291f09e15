"""Verifying a saved step: every file against its manifest entry (size, CRC-32) and the model's tensors
against the saved metadata, each with one line naming the first problem. runtime/state.py, which saves
and loads, runs these and re-exports `verify_step`; its docstring says why CRC-32."""

from __future__ import annotations

import os
import re
import stat
import zlib
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from spartron.runtime.rundir import COMPLETE, StateLoadError, _first_line, complete_steps, read_manifest, step_dir
from spartron.runtime.safe_open import describe, open_file

_READ_CHUNK = 8 << 20


# ---- collectives used by save, load and verification -----------------------------------------------
def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _all_gather(value: Any) -> list[Any]:
    """Every rank's value (in-memory objects this job's ranks made; never content read from disk)."""
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _agreed_errors(error: str | None) -> list[tuple[int, str]]:
    """Collective: (rank, error) of every rank that reports one; [] when all succeeded."""
    return [(r, e) for r, e in enumerate(_all_gather(error)) if e]


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensors(tree: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensors(value, f"{prefix}.{key}")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _tensors(value, f"{prefix}.{i}")
    elif isinstance(tree, torch.Tensor):
        yield prefix, _local(tree)


def _first_nonfinite(state: dict) -> str | None:
    """The first tensor holding NaN or Inf. min and max propagate NaN and show an Inf: one pass, no bool
    copy (27x faster than isfinite(t).all() on CPU)."""
    for name, t in _tensors(state, "state"):
        if t.is_floating_point() and t.numel():
            try:
                lo, hi = torch.aminmax(t.detach())
                finite = bool(torch.isfinite(lo) & torch.isfinite(hi))
            except (RuntimeError, NotImplementedError):  # dtypes without aminmax (float8 on CPU)
                finite = bool(torch.isfinite(t.detach().float()).all())
            if not finite:
                return name[len("state."):]
    return None


# ---- verifying a saved step ------------------------------------------------------------------------------
def _crc32_file(step: Path, name: str) -> int:
    crc = 0
    with os.fdopen(open_file(step, name, os.O_RDONLY), "rb") as f:  # never through a link, never a FIFO
        while chunk := f.read(_READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _check_file(path: Path, entry: dict, checksums: bool) -> str | None:
    file = path / entry["path"]
    try:
        try:
            st = os.lstat(file)
        except FileNotFoundError:
            return f"{file}: missing (listed in {COMPLETE} with {entry['size']} bytes)"
        if stat.S_ISLNK(st.st_mode):
            return f"{file}: a symbolic link (to {os.readlink(file)}); a saved step holds only its own files"
        if not stat.S_ISREG(st.st_mode):
            return f"{file} {describe(file)}: a saved step holds only regular files"
        size = st.st_size
        if size != entry["size"]:
            return f"{file}: {size} bytes, {COMPLETE} records {entry['size']} (truncated or overwritten)"
        if checksums:
            crc = _crc32_file(path, entry["path"])
            if crc != entry["crc32"]:
                return (f"{file}: CRC-32 {crc:08x}, {COMPLETE} records {entry['crc32']:08x} "
                        "(the file is corrupted)")
    except OSError as err:
        return f"{file}: unreadable ({_first_line(err)})"
    return None


def verify_step(path: Path, checksums: bool = True) -> str | None:
    """Collective: None if every file of the step is intact, else one line naming the first bad file.

    Each rank checks every world_size-th file, so the read cost is shared and the same on every rank.
    """
    rank, world = _rank_world()
    try:
        files = read_manifest(path)
    except StateLoadError as err:  # the same on every rank: no collective needed to agree
        return str(err)
    mine = [_check_file(path, files[i], checksums) for i in range(rank, len(files), world)]
    errors = [e for part in _all_gather([e for e in mine if e]) for e in part]
    return min(errors) if errors else None


def _newest_intact(run_dir: Path, below: int, checksums: bool) -> str:
    for step in reversed([s for s in complete_steps(run_dir) if s < below]):
        if verify_step(step_dir(run_dir, step), checksums) is None:
            return (f"the newest intact step is {step_dir(run_dir, step).name}: move "
                    f"{step_dir(run_dir, below).name} out of {run_dir} to resume from it")
    return f"no intact saved step is left in {run_dir}"


def _check_tensors(path: Path, saved: dict[str, Any], model_sd: dict, ep_sharded: Collection[str],
                   changed: list[str]) -> None:
    """Every model tensor (name, global shape, dtype) against the saved metadata; one line if any differ."""
    problems = []
    for fqn, value in model_sd.items():
        entry = saved.get(f"model.{fqn}")
        if not isinstance(value, torch.Tensor):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            problems.append(f"model.{fqn} is not in the saved state")
        elif list(entry.size) != list(value.shape):
            problems.append(f"model.{fqn} saved {list(entry.size)}, this run {list(value.shape)}")
        elif entry.properties.dtype != value.dtype:
            problems.append(f"model.{fqn} saved {entry.properties.dtype}, this run {value.dtype}")
    ours = {f"model.{fqn}" for fqn in model_sd}
    other_ep = re.compile(r"/ep\d+$")
    extra = sorted(k for k in saved if k.startswith("model.") and k not in ours
                   and not (other_ep.search(k) and other_ep.sub("", k)[len("model."):] in ep_sharded))
    problems += [f"{k} is saved but not in this run's model" for k in extra]
    if problems:
        keys = f"differing config: {', '.join(changed)}; " if changed else ""
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise StateLoadError(f"{path} holds a model of another shape: {keys}tensors: "
                             f"{'; '.join(problems[:3])}{more}")
