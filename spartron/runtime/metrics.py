"""Training metrics: measured peak FLOP/s (MFU's denominator; the FLOP model is spartron.layers.costs),
memory and expert-load statistics, and the JSONL log.

`metrics.jsonl` (rank 0 writes it) holds one ``{"type": "header", ...}`` record per (re)start with the
config, versions, git commit and hardware, then one ``{"type": "step", ...}`` record per optimizer
step. After a resume, steps re-run past the last save appear again; readers keep the last record of
each step (`read_metrics`).

Memory: on CUDA the peak allocated / reserved bytes of the step (allocator stats, reset each
step). On CPU there is no allocator statistic for torch tensors, so both fields report the process's
peak resident set size (``ru_maxrss``) since start: an upper bound, monotone over the run.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from spartron.runtime.safe_open import UnsafeEntryError, open_file


# ---- peak FLOP/s (the FLOP model itself is spartron.layers.costs) --------------------------------
def measure_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a square matmul loop on `device`: the 'measured peak' MFU uses when none is configured."""
    n = 8192 if device.type == "cuda" else 512
    # Constant operands: the global RNG stream is left untouched (resume must replay it exactly).
    a = torch.full((n, n), 0.5, device=device, dtype=dtype)
    b = torch.full((n, n), 0.25, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    reps = 10 if device.type == "cuda" else 5
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


# ---- memory and expert load ----------------------------------------------------------------------
def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[int, int]:
    """(peak allocated, peak reserved) bytes; on CPU both are the process's peak RSS (see module doc)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss *= 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
    return rss, rss


def alloc_retries(device: torch.device) -> int | None:
    """CUDA: how often the caching allocator has freed its cache and retried an allocation since the process
    started (fragmentation close to the limit; each retry is a synchronising cudaFree); None on CPU."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if device.type == "cuda" else None


def expert_load_max_violation(tokens_per_expert: Tensor | None) -> float | None:
    """max over MoE layers of (busiest expert's tokens / mean tokens per expert - 1); 0 = balanced."""
    per_layer = expert_load_per_layer(tokens_per_expert)
    return None if per_layer is None else max(per_layer)


def expert_load_per_layer(tokens_per_expert: Tensor | None) -> list[float] | None:
    """Per MoE layer (model order, MTP last): busiest expert's tokens / mean tokens per expert - 1."""
    if tokens_per_expert is None or tokens_per_expert.numel() == 0:
        return None
    counts = tokens_per_expert.double().reshape(-1, tokens_per_expert.shape[-1])
    return (counts.max(dim=-1).values / counts.mean(dim=-1).clamp_min(1e-12) - 1).tolist()


# ---- run header --------------------------------------------------------------------------------
def git_commit(root: Path | None = None) -> str | None:
    """The commit this code is: the BUILD_COMMIT file in the checkout root when there is one (a snapshot
    copied to a lent GPU machine, which may sit inside an unrelated, older git checkout; its writer says what
    it holds), else HEAD, as "<sha>-dirty" when tracked files differ from it: a report of modified code must
    not name the commit as if it had run that commit's code (untracked files are not counted)."""
    root = Path(__file__).resolve().parents[2] if root is None else root
    marker = root / "BUILD_COMMIT"
    built = marker.read_text().strip() if marker.is_file() else ""
    if built:
        return built
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5)
        if out.returncode == 0 and out.stdout.strip():
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=5)
            dirty = status.returncode == 0 and status.stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return None


def hardware(device: torch.device, world_size: int) -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpu_count": __import__("os").cpu_count(),
                            "device_type": device.type, "world_size": world_size}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["devices_per_node"] = torch.cuda.device_count()
    return info


def versions() -> dict[str, str]:
    import numpy

    import spartron

    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "spartron": getattr(spartron, "__version__", "unknown")}


# ---- the log -------------------------------------------------------------------------------------
def _seconds(s: float) -> str:
    """A duration for a person: ms below a second, s below ten minutes, else h:mm:ss."""
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 600:
        return f"{s:.2f} s"
    return f"{int(s // 3600)}:{int(s // 60 % 60):02d}:{int(s % 60):02d} h"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# The summary's rows: the record key, its label, how a value reads (human units: GiB, %, ms / s).
SUMMARY_ROWS: tuple[tuple[str, str, Any], ...] = (
    ("loss", "loss", lambda v: f"{v:.4f}"),
    ("val_loss", "validation loss", lambda v: f"{v:.4f}"),
    ("grad_norm", "grad norm", lambda v: f"{v:.4g}"),
    ("lr", "learning rate", lambda v: f"{v:.3g}"),
    ("step_time_s", "step time", _seconds),
    ("tokens_per_s", "tokens/s", lambda v: f"{v:,.0f}"),
    ("tokens_per_s_per_gpu", "tokens/s per GPU", lambda v: f"{v:,.0f}"),
    ("mfu", "MFU", lambda v: f"{v:.2%}"),
    ("peak_memory_allocated_bytes", "peak memory allocated", _gib),
    ("expert_load_max_violation", "expert load violation", lambda v: f"{v:.3f}"),
)


def step_info(record: dict) -> str:
    """The progress line's text for one step record: loss, grad norm, lr, step time, tokens/s, peak memory
    (and the validation loss when the step evaluated); a field the record lacks is left out."""
    parts = [f"loss {record['loss']:.4f}", f"gnorm {record['grad_norm']:.3f}"]
    if record.get("lr") is not None:
        parts.append(f"lr {record['lr']:.3g}")
    if record.get("step_time_s") is not None:
        parts.append(f"time {_seconds(record['step_time_s'])}")
    parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    if record.get("peak_memory_allocated_bytes") is not None:
        parts.append(f"mem {_gib(record['peak_memory_allocated_bytes'])}")
    if record.get("val_loss") is not None:
        parts.append(f"val {record['val_loss']:.4f} (ppl {record['val_ppl']:.4g})")
    return " ".join(parts)


class MetricsLog:
    """Appends JSONL records and drives the progress display; a no-op on ranks other than the writer."""

    def __init__(self, path: Path, total_steps: int, enabled: bool, progress: bool = True) -> None:
        self.path, self.total_steps, self.enabled = path, total_steps, enabled
        self.records: list[dict] = []
        self._progress = None
        self._task = None
        if not enabled:
            return
        try:  # never through a link or into a FIFO (spartron.runtime.safe_open): nothing outside the run is written
            fd = open_file(path.parent, path.name, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        except UnsafeEntryError as err:
            raise MetricsFileError(str(err)) from None
        except OSError as err:
            raise MetricsFileError(f"{path} cannot be opened for appending: {err.strerror or err}") from None
        _drop_partial_last_line(fd)
        self._fd: int | None = fd  # unbuffered: a failed write leaves nothing queued for a later flush to retry
        if progress:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            console = Console(stderr=True)
            if console.is_terminal:
                self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                          TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                          console=console)
                self._task = self._progress.add_task("train", total=total_steps, info="")
                self._progress.start()
        self._plain = progress and self._progress is None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        data = (json.dumps(record) + "\n").encode()
        try:
            while data:  # O_APPEND: a partial line a full disk leaves is cut when the run resumes
                data = data[os.write(self._fd, data):]
        except OSError as err:  # a full disk or a file-size limit: name the file (write() alone does not)
            raise MetricsWriteError(f"{self.path}: cannot write a metrics record ({err.strerror or err}): free space "
                                    "on its disk, then resume the run") from None
        if record.get("type") != "step":
            return
        self.records.append(record)
        info = step_info(record)
        if self._progress is not None:
            self._progress.update(self._task, completed=record["step"], info=info)
        elif self._plain:
            print(f"step {record['step']}/{self.total_steps} {info}", file=sys.stderr, flush=True)

    def close(self, summary: bool = True, first_loss: float | None = None, total_s: float | None = None,
              saved: str | None = None) -> None:
        """`first_loss`: the run's first-step loss (kept across resumes), for the summary's divergence line;
        `total_s` and `saved`: the run's wall time and its last saved step, for the summary's last lines."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if summary and self.records:
            print_summary(self.records, first_loss, total_s, saved)


def _drop_partial_last_line(fd: int) -> None:
    """A process killed mid-write leaves a line without its newline; cut it so appends stay valid JSONL."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    end = size
    while end > 0:  # back to the last newline, 1 MiB at a time
        start = max(0, end - (1 << 20))
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            os.ftruncate(fd, start + cut + 1)
            return
        end = start
    os.ftruncate(fd, 0)


# The summary says so when the last loss is above this many times the first: a run that learns ends below its
# first loss; one that ends at twice it (train.loss_spike_factor, 10x by default, did not stop it) diverged.
LOSS_ENDED_HIGH = 2.0


def loss_ended_high(records: list[dict], first_loss: float | None) -> str | None:
    """The summary's line for a run whose last loss is far above its first (None when it is not)."""
    first = first_loss if first_loss is not None else records[0]["loss"] if records else None
    if not records or first is None or not first > 0:
        return None
    last = records[-1]
    if not last["loss"] > LOSS_ENDED_HIGH * first:
        return None
    return (f"spartron: warning: the loss ended at {last['loss']:.6g} (step {last['step']}), "
            f"{last['loss'] / first:.3g}x the first step's {first:.6g}: the run diverged (a lower train.lr may "
            "train; a lower train.loss_spike_factor stops such a run earlier)")


def print_summary(records: list[dict], first_loss: float | None = None, total_s: float | None = None,
                  saved: str | None = None) -> None:
    """The end-of-run table (first, last and median of each metric, in human units), then the run's total
    time, its last saved step (`saved`, None: none) and, when the loss ended far above its start, a warning."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"spartron: {len(records)} steps (steps {records[0]['step']}-{records[-1]['step']})")
    table.add_column("metric")
    for col in ("first", "last", "median"):
        table.add_column(col, justify="right")
    for key, label, show in SUMMARY_ROWS:
        values = [r[key] for r in records if r.get(key) is not None]
        if not values:
            continue
        median = statistics.median(values)  # the mean of the middle two for an even count
        table.add_row(label, *(show(v) for v in (values[0], values[-1], median)))
    Console(stderr=True).print(table)
    if total_s is not None:
        print(f"spartron: total time {_seconds(total_s)}; last saved step: {saved or 'none'}", file=sys.stderr,
              flush=True)
    diverged = loss_ended_high(records, first_loss)
    if diverged:
        print(diverged, file=sys.stderr, flush=True)


class MetricsFileError(ValueError):
    """A metrics.jsonl that cannot be read as ONE run (unreadable, or several runs in one file)."""


class MetricsWriteError(OSError):
    """A record that could not be appended to metrics.jsonl (a full disk, a file-size limit): names the file."""


def read_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(headers, steps) of a metrics.jsonl; steps sorted, the last record of each step kept, and none past a
    resume's step from before that resume (an attempt that went on after its last save, then stopped).

    A file holds one run: its first header and the headers of resumes (`resumed_from_step` set, the same
    `run_id`). The trainer never appends a new run to an earlier run's file (spartron.runtime.state
    plan_run), so a file with a second fresh header or two run ids is refused, not silently merged.
    """
    headers, by_step = [], {}
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as err:
        raise MetricsFileError(f"{path}: not UTF-8 text (byte {err.start}): not a metrics JSONL") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise MetricsFileError(f"{path}:{number}: not a JSON record ({err})") from None
        if not isinstance(record, dict):
            raise MetricsFileError(f"{path}:{number}: not a JSON object")
        if record.get("type") == "header":
            headers.append(record)
            resumed = record.get("resumed_from_step")
            if isinstance(resumed, int) and not isinstance(resumed, bool):  # steps past it were never committed:
                by_step = {s: r for s, r in by_step.items() if s <= resumed}  # an abandoned attempt's, not this run's
        elif record.get("type") == "step":
            if not isinstance(record.get("step"), int) or isinstance(record["step"], bool):
                raise MetricsFileError(f"{path}:{number}: a step record needs an integer 'step'")
            by_step[record["step"]] = record
    ids = {h["run_id"] for h in headers if h.get("run_id")}
    fresh = [i for i, h in enumerate(headers) if i and "resumed_from_step" in h and h["resumed_from_step"] is None]
    if len(ids) > 1 or fresh:
        raise MetricsFileError(f"{path} holds {max(len(ids), len(fresh) + 1)} runs (run ids "
                               f"{sorted(ids) or 'unrecorded'}): it cannot be compared as one run; "
                               "split it, or rerun into an empty run directory")
    return headers, [by_step[s] for s in sorted(by_step)]
