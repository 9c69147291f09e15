"""The run directory, without torch: which steps it holds, their JSON files, and what a new run may do there.

`plan_run` is THE rule for starting a run in a run directory (refusals, the step to resume); the CLI calls
it through `check_run_start` before spawning ranks, and every rank calls it again
(spartron.runtime.state.start_run), whose rank 0 then takes the directory's lock (`RunDirLock`), which the
trainer holds until every rank has finished. Nothing inside the directory is followed through a link
(spartron.runtime.safe_open). Everything here reads only JSON, checked field by field: nothing read from a
run directory can run code. What a saved step holds is described in spartron.runtime.state.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import stat
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spartron.runtime.safe_open import UnsafeEntryError, check_entry, describe, open_file
from spartron.runtime.saved_config import (  # noqa: F401  (the run directory's public names, kept importable here)
    DATA_TRAIN_KEYS,
    STATE_TRAIN_KEYS,
    TRAINING_TRAIN_KEYS,
    config_changes,
    refused_change,
    resume_notes,
    state_config,
    training_notes,
)

COMPLETE = "COMPLETE"
META = "meta.json"
METRICS = "metrics.jsonl"
VAL_FRACTION = "train.data.val_fraction"  # which samples are held out: fixed for a run once it has trained
LOCK = ".lock"  # held (flock) by rank 0 of the run training in the directory
# 2: COMPLETE holds the file manifest; meta.json the run id and state config. 3: expert parameters under
# global names (layout-free: loads under another EP / CP / FSDP size or world size). A format-2 state (keyed
# per EP rank) still loads under its own layout.
FORMAT_VERSION = 3
LEGACY_FORMAT = 2
READABLE_FORMATS = (LEGACY_FORMAT, FORMAT_VERSION)
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP_DIR = re.compile(r"^\.tmp-step-(\d{8,})$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]{0,254}$")  # a step holds flat file names only


class StateLoadError(RuntimeError):
    """A saved state or run directory this run cannot start from (mismatch, damaged or unsafe file)."""


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"step-{step:08d}"


def marker_kind(path: Path) -> str:
    """What a step folder's COMPLETE is, by lstat (a link is never followed): "complete" (a regular file,
    as every save writes), "absent", or "unsafe" (a symbolic link, FIFO, folder...: someone changed the
    directory, so the step is not a complete saved step)."""
    try:
        mode = os.lstat(path / COMPLETE).st_mode
    except FileNotFoundError:
        return "absent"
    except OSError:  # the step itself is not a folder (ENOTDIR), or a looping link
        return "absent"
    return "complete" if stat.S_ISREG(mode) else "unsafe"


def _step_names(run_dir: Path) -> list[str]:
    return sorted(c.name for c in run_dir.iterdir() if _STEP_DIR.match(c.name)) if run_dir.is_dir() else []


def complete_steps(run_dir: str | Path) -> list[int]:
    """Steps with a complete saved state, ascending (folders without a regular-file marker are ignored)."""
    run_dir = Path(run_dir)
    return sorted(int(n[5:]) for n in _step_names(run_dir) if marker_kind(run_dir / n) == "complete")


def unsafe_steps(run_dir: str | Path) -> list[str]:
    """Names of step folders whose COMPLETE is there but not a regular file (`marker_kind` "unsafe")."""
    run_dir = Path(run_dir)
    return [n for n in _step_names(run_dir) if marker_kind(run_dir / n) == "unsafe"]


def incomplete_steps(run_dir: str | Path) -> list[str]:
    """Names of step directories a resume ignores: ``.tmp-step-*`` and ``step-*`` without a regular COMPLETE."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    tmp = [c.name for c in run_dir.iterdir() if _TMP_DIR.match(c.name)]
    return sorted(tmp + [n for n in _step_names(run_dir) if marker_kind(run_dir / n) != "complete"])


def check_newest_marker(run_dir: Path) -> None:
    """StateLoadError when the newest step folder has an unsafe COMPLETE: silently taking an older step
    would go back behind a step someone tampered with (a resume, an eval or an export of the run dir)."""
    unsafe = unsafe_steps(run_dir)
    steps = complete_steps(run_dir)
    if unsafe and (not steps or int(unsafe[-1][5:]) > steps[-1]):
        path = Path(run_dir) / unsafe[-1]
        older = f"to use {step_dir(run_dir, steps[-1]).name}" if steps else "to start anew"
        raise StateLoadError(f"{path / COMPLETE} {describe(path / COMPLETE)}: a save writes a regular file there, "
                             f"so {path.name} (the newest step) is not a complete saved step; restore the marker, "
                             f"or remove {path.name} {older}")


def latest_complete_step(run_dir: str | Path) -> int | None:
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _reject_constant(value: str) -> Any:
    raise ValueError(f"non-finite number {value}")


def read_json(path: Path) -> Any:
    try:
        return parse_json(path, path.read_bytes())
    except FileNotFoundError:
        raise StateLoadError(f"{path}: missing") from None
    except OSError as err:
        raise StateLoadError(f"{path}: not valid JSON ({_first_line(err)})") from None


def parse_json(path: Path, raw: bytes) -> Any:
    """The JSON in `raw` (read from `path`, which a StateLoadError names); non-finite numbers refused."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:
        raise StateLoadError(f"{path}: not valid JSON ({_first_line(err)})") from None


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


# ---- verifying a saved step ------------------------------------------------------------------------------
def _refuse_link(path: Path) -> None:
    """A step directory must be a real directory of the run directory: a symbolic link could make a resume
    read another run's state, and a save's replace or keep_last's removal act on what it points to."""
    if path.is_symlink():
        raise StateLoadError(f"{path} is a symbolic link (to {os.readlink(path)}): a saved step must be a "
                             "directory inside the run directory; copy it there instead")


def read_manifest(path: Path) -> list[dict]:
    """The file list of a step's COMPLETE marker, checked field by field (StateLoadError names the marker)."""
    marker = path / COMPLETE
    _refuse_link(path)
    kind = marker_kind(path)
    if kind == "absent":
        raise StateLoadError(f"{path} is not a complete saved state (no {COMPLETE} marker)")
    try:  # never through a link, never a FIFO (it could change between marker_kind and here)
        with os.fdopen(open_file(path, COMPLETE, os.O_RDONLY), "rb") as f:
            raw = f.read()
    except OSError:
        kind = "unsafe" if kind == "complete" and marker_kind(path) != "complete" else kind
        if kind != "unsafe":
            raise StateLoadError(f"{marker}: unreadable") from None
    if kind == "unsafe":
        raise StateLoadError(f"{marker} {describe(marker)}: a save writes a regular file there, so {path.name} is "
                             "not a complete saved step (the run directory was changed)")
    data = parse_json(marker, raw)
    if not isinstance(data, dict) or data.get("format_version") not in READABLE_FORMATS:
        version = data.get("format_version", 1) if isinstance(data, dict) else 1
        raise StateLoadError(f"{marker}: saved-state format {version!r}, this Spartron reads formats "
                             f"{LEGACY_FORMAT} and {FORMAT_VERSION} (a manifest of every file with its size and "
                             "checksum)")
    files = data.get("files")
    if not isinstance(files, list) or not all(
            isinstance(f, dict) and set(f) == {"path", "size", "crc32"} and isinstance(f["path"], str)
            and _FILE_NAME.match(f["path"]) and f["path"] != COMPLETE and _is_int(f["size"])
            and _is_int(f["crc32"]) for f in files):
        raise StateLoadError(f"{marker}: 'files' must list {{path, size, crc32}} entries with plain file names")
    if len({f["path"] for f in files}) != len(files) or META not in {f["path"] for f in files}:
        raise StateLoadError(f"{marker}: 'files' must name each file once, {META} included")
    return files


def read_meta(path: Path) -> dict:
    """meta.json of a verified step, checked field by field."""
    file = path / META
    meta = read_json(file)
    expected = {"format_version": lambda v: v in READABLE_FORMATS, "step": _is_int,
                "world_size": lambda v: _is_int(v, 1),
                "counters": lambda v: isinstance(v, dict) and _is_int(v.get("tokens", 0))
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v.values()),
                "layout": lambda v: v is None or isinstance(v, str),
                "run_id": lambda v: v is None or isinstance(v, str),
                "config": lambda v: v is None or isinstance(v, dict)}
    if not isinstance(meta, dict):
        raise StateLoadError(f"{file}: must hold a JSON object")
    for key, ok in expected.items():
        if key not in meta or not ok(meta[key]):
            raise StateLoadError(f"{file}: field {key!r} is missing or invalid (got {meta.get(key)!r:.80})")
    if _STEP_DIR.match(path.name) and int(path.name[5:]) != meta["step"]:
        raise StateLoadError(f"{file}: records step {meta['step']}, but the directory is {path.name}")
    return meta


def check_meta(path: Path, meta: dict, world: int, layout: str | None, config: dict | None) -> None:
    """The mismatches that need no model: optimizer settings, and the layout of a format-2 state (its
    experts are keyed per EP rank: it loads only under the layout that wrote it)."""
    if meta["format_version"] == LEGACY_FORMAT and (
            meta["world_size"] != world or (layout is not None and meta.get("layout") not in (None, layout))):
        saved = f"world size {meta['world_size']}" + (f", parallel layout [{meta['layout']}]" if meta.get("layout")
                                                      else "")
        now = f"world size {world}" + (f", parallel layout [{layout}]" if layout else "")
        raise StateLoadError(f"{path} is a saved-state format {LEGACY_FORMAT} state (experts keyed per EP rank), "
                             f"which resumes only on the layout that saved it ({saved}); this run has {now}")
    if config is not None and meta.get("config") is not None:
        changed = [c for c in config_changes(meta["config"], config, "train.") if refused_change(c)]
        if changed:
            raise StateLoadError(f"{path} holds optimizer state for other settings: {', '.join(changed)}; "
                                 "resume with the saved values, or start a new run")
        split, saved_split = config.get(VAL_FRACTION), meta["config"].get(VAL_FRACTION)
        if config.get("train.data.kind") != "synthetic" and None not in (split, saved_split) and split != saved_split:
            raise StateLoadError(f"{path} was trained with {VAL_FRACTION} = {saved_split:g}, this run has {split:g}: "
                                 "that moves the boundary between training and held-out samples (the run would train "
                                 "on samples it evaluated as held out, or evaluate samples it trained on); resume with "
                                 f"{saved_split:g}, or start a new run")


# ---- starting a run in a run directory ------------------------------------------------------------------
@dataclass(frozen=True)
class RunStart:
    """What a run does with its run directory (`plan_run`): resume a step, or start fresh."""

    run_dir: Path
    resume_step: int | None  # the complete step to load; None: a new run
    skipped: tuple[str, ...] = ()  # incomplete step directories a resume ignores
    replace: tuple[str, ...] = ()  # a new run's train.overwrite: what it removes first
    rotate_metrics: bool = False  # a new run with resume = true: an earlier run's metrics.jsonl is moved aside
    lock: RunDirLock | None = field(default=None, compare=False)  # rank 0's; the trainer holds it for the run

    def message(self) -> str:
        """The line rank 0 prints on stderr when the run starts."""
        if self.resume_step is None:
            if self.replace:
                return f"spartron: train.overwrite: removed {', '.join(self.replace)} from {self.run_dir}"
            if self.rotate_metrics:
                return (f"spartron: {self.run_dir} holds no complete saved step: starting a new run; the "
                        f"earlier run's {METRICS} was moved to {_rotated_name(self.run_dir)}")
            return ""
        names = [f"{n} ({COMPLETE} is not a regular file)" if marker_kind(self.run_dir / n) == "unsafe" else n
                 for n in self.skipped]
        skipped = f"; skipped incomplete step directories: {', '.join(names)}" if names else ""
        return f"spartron: resumed from step {self.resume_step} ({step_dir(self.run_dir, self.resume_step)}){skipped}"


class RunDirLock:
    """A flock on ``<run_dir>/.lock``: exclusive for the run training there, held by its rank 0 from before
    anything in the directory is written or removed until every rank has finished (the trainer releases it
    after the last barrier), so a second run, a train.overwrite or an eval cannot act on a live run. Shared
    for a reader (`spartron eval`): a run cannot start (and prune or replace steps) while one reads. The
    kernel drops it when the process ends, kill -9 included. The file is opened without following links
    (spartron.runtime.safe_open): a linked or non-regular `.lock` is refused, never written through."""

    def __init__(self, run_dir: Path, shared: bool = False) -> None:
        self.path = Path(run_dir) / LOCK
        self.shared = shared
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; StateLoadError if another run holds it (or, shared, trains there) or the `.lock`
        entry is unsafe; a warning line if the file system cannot lock (nothing then stops a second run)."""
        try:  # a reader never creates a file: no `.lock` there means no run to wait for
            fd = (open_file(self.path.parent, LOCK, os.O_RDONLY) if self.shared
                  else open_file(self.path.parent, LOCK, os.O_RDWR | os.O_CREAT, 0o644))
        except UnsafeEntryError as err:
            raise StateLoadError(str(err)) from None
        except OSError:
            if not self.shared:
                raise
            return None
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            if self.shared:
                who = holder or "holder unknown"
                raise StateLoadError(f"{self.path.parent} is being trained by another run ({who}, lock {self.path}): "
                                     "reading its steps now could race a save or train.keep_last; wait for the "
                                     "run to end, or copy the step elsewhere and evaluate the copy") from None
            raise StateLoadError(_in_use(self.path, holder)) from None
        except OSError as err:
            os.close(fd)
            return f"spartron: warning: cannot lock {self.path} ({err}): nothing stops a second run from using it"
        if not self.shared:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return None

    def release(self) -> None:
        """Unlock (a run also clears its holder line, so a later refusal never names a finished run)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                if not self.shared:
                    os.ftruncate(fd, 0)
            except OSError:
                pass
            os.close(fd)

    def __del__(self) -> None:
        self.release()


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _in_use(path: Path, holder: str) -> str:
    return (f"{path.parent} is in use by another run ({holder or 'holder unknown: a spartron eval reading it?'}, "
            f"lock {path}): wait for it to end or stop it, or give this run another directory")


def check_not_in_use(run_dir: Path) -> None:
    """StateLoadError if a run holds the directory's lock (a shared, non-blocking probe: probes of several
    ranks never conflict with each other) or `.lock` is not a regular file of the directory."""
    path = Path(run_dir) / LOCK
    try:
        fd = open_file(path.parent, LOCK, os.O_RDONLY)
    except UnsafeEntryError as err:
        raise StateLoadError(str(err)) from None
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise StateLoadError(_in_use(path, _holder(fd))) from None
    except OSError:
        return
    finally:
        os.close(fd)


def lock_for_reading(path: Path) -> RunDirLock:
    """`spartron eval` of `path` (a saved step, or a run directory): a shared lock on its run directory,
    held while the returned object lives; StateLoadError when a run is training there, or when `path` is a
    saved step reached through a symbolic link (refused before anything in it is opened). Nothing is created:
    a directory without a `.lock` has no run to wait for."""
    path = Path(path)
    if path.is_symlink() and (_STEP_DIR.match(path.name) or marker_kind(path) != "absent"):
        _refuse_link(path)
    lock = RunDirLock(path.parent if _STEP_DIR.match(path.name) else path, shared=True)
    if lock.path.parent.is_dir():
        warning = lock.acquire()
        if warning:
            print(warning, file=sys.stderr, flush=True)
    return lock


def check_entries(run_dir: Path) -> None:
    """StateLoadError naming the first entry the run would write through that is a link or of the wrong
    kind: metrics.jsonl, the logs / tensorboard / memory / nccl_trace / wandb folders, the rank logs, and
    ``.tmp-step-*`` folders (checked before anything is written, on every rank)."""
    run_dir = Path(run_dir)
    try:
        check_entry(run_dir / METRICS, "file")
        for name in ("logs", "tensorboard", "memory", "nccl_trace", "wandb"):
            check_entry(run_dir / name, "dir")
        logs = run_dir / "logs"
        if logs.is_dir():
            for child in logs.iterdir():
                if re.match(r"^rank\d+\.log$", child.name):
                    check_entry(child, "file")
        if run_dir.is_dir():
            for child in run_dir.iterdir():
                if _TMP_DIR.match(child.name):
                    check_entry(child, "dir")
    except UnsafeEntryError as err:
        raise StateLoadError(str(err)) from None


def _rotated_name(run_dir: Path) -> str:
    k = 1
    while os.path.lexists(run_dir / f"metrics.{k}.jsonl"):
        k += 1
    return f"metrics.{k}.jsonl"


def plan_run(run_dir: str | Path, *, resume: bool, overwrite: bool, steps: int, world_size: int,
             layout: str | None = None, config: dict[str, Any] | None = None) -> RunStart:
    """Local checks of the run directory against this run (no collectives: `spartron train` calls it
    before spawning ranks, and every rank again). StateLoadError when the run cannot start:
    - a new run (resume = false) into a directory holding saved steps or metrics, without train.overwrite;
    - a resume whose newest complete step is at or past train.steps (nothing would be trained);
    - a resume under other optimizer settings, or a format-2 state under another layout (meta.json);
    - a directory another run is training in (its lock is held);
    - a resume whose saved step belongs to another run than the directory's metrics.jsonl;
    - a metrics.jsonl that is a symbolic link, or an entry the run writes through (`.lock`, logs,
      tensorboard, ``.tmp-step-*``, ...) that is a link or not a regular file / folder (`check_entries`).
    File damage is left to load_state, which verifies every file collectively.
    """
    run_dir = Path(run_dir)
    check_not_in_use(run_dir)
    steps_saved, incomplete = complete_steps(run_dir), incomplete_steps(run_dir)
    if (run_dir / METRICS).is_symlink():  # appending through it would write outside the run directory
        raise StateLoadError(f"{run_dir / METRICS} is a symbolic link (to {os.readlink(run_dir / METRICS)}): "
                             "a run's metrics must be a file inside its run directory; remove the link")
    check_entries(run_dir)
    has_metrics = (run_dir / METRICS).is_file()
    if not resume:
        held = [step_dir(run_dir, s).name for s in steps_saved] + incomplete + ([METRICS] if has_metrics else [])
        if held and not overwrite:
            what = f"saved steps {steps_saved}" if steps_saved else "files of an earlier run"
            raise StateLoadError(
                f"{run_dir} already holds {what} ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}); "
                "train.resume = false will not mix a new run into it: give this run another directory "
                "(name or train.run_dir), delete that one, or set train.overwrite = true to replace its "
                "saved steps and metrics")
        return RunStart(run_dir, None, replace=tuple(held))
    check_newest_marker(run_dir)
    if not steps_saved:
        return RunStart(run_dir, None, rotate_metrics=has_metrics)
    last = steps_saved[-1]
    if last >= steps:
        raise StateLoadError(f"{step_dir(run_dir, last)}: this run already reached step {last} and "
                             f"train.steps = {steps}, so nothing is left to train: raise train.steps to "
                             "continue it, or start a new run (another run directory)")
    path = step_dir(run_dir, last)
    _refuse_link(path)
    try:
        files = {f["path"]: f for f in read_manifest(path)}
        entry, meta_file = files[META], path / META
        intact = (meta_file.is_file() and meta_file.stat().st_size == entry["size"]
                  and zlib.crc32(meta_file.read_bytes()) == entry["crc32"])
    except (StateLoadError, OSError):
        intact = False
    if intact:  # else load_state reports the damage, naming the file and the newest intact step
        meta = read_meta(path)
        check_meta(path, meta, world_size, layout, config)
        logged = _metrics_run_id(run_dir / METRICS) if has_metrics else None
        if meta["run_id"] and logged and logged != meta["run_id"]:
            raise StateLoadError(f"{run_dir / METRICS} belongs to run {logged}, but {path / META} records run_id "
                                 f"{meta['run_id']}: resuming would mix two runs in one directory; move "
                                 f"{METRICS} away, or resume in a directory holding only that step")
    return RunStart(run_dir, last, skipped=tuple(incomplete))


def _metrics_run_id(path: Path) -> str | None:
    """The run id in the first line (the first header) of a metrics.jsonl, if it has one."""
    try:
        with path.open("rb") as f:
            first = json.loads(f.readline(1 << 20).decode("utf-8"))
    except (OSError, ValueError):
        return None
    run_id = first.get("run_id") if isinstance(first, dict) else None
    return run_id if isinstance(run_id, str) else None


def check_run_start(cfg: Any, world_size: int) -> RunStart:
    """plan_run for a RunConfig on `world_size` ranks (the pre-spawn check of `spartron train`)."""
    dims = cfg.parallel.dims(world_size)
    t = cfg.train
    return plan_run(cfg.run_dir(), resume=t.resume, overwrite=t.overwrite, steps=t.steps, world_size=world_size,
                    layout=dims.describe(), config=state_config(cfg))
