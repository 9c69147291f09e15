"""Metric sinks besides metrics.jsonl: TensorBoard event files and Weights & Biases (rank 0 only).

One table (`SCALARS`) says which record field becomes which tag, so both sinks show the same names:
train/* (losses, grad norm, lr), perf/* (tokens/s, MFU, step and data-loading time), memory/* (GB, the
allocator's retries), moe/* (expert load: the worst layer, and each MoE layer's busiest-expert excess
`moe/layer_<i>/load_violation`), val/* (evaluation). The x axis is the optimizer step. A resumed run appends
to the same folder; TensorBoard shows the re-run steps past the last save over the first run's values.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from spartron.runtime.metrics import MetricsWriteError
from spartron.runtime.safe_open import UnsafeEntryError, open_file

GB = 1e9
SCALARS: tuple[tuple[str, str, float], ...] = (
    ("loss", "train/loss", 1.0), ("lm_loss", "train/lm_loss", 1.0), ("aux_loss", "train/aux_loss", 1.0),
    ("indexer_loss", "train/indexer_loss", 1.0), ("grad_norm", "train/grad_norm", 1.0), ("lr", "train/lr", 1.0),
    ("tokens", "train/tokens", 1.0), ("tokens_per_s", "perf/tokens_per_s", 1.0),
    ("tokens_per_s_per_gpu", "perf/tokens_per_s_per_gpu", 1.0), ("mfu", "perf/mfu", 1.0),
    ("step_time_s", "perf/step_time_s", 1.0), ("data_time_s", "perf/data_time_s", 1.0),
    ("peak_memory_allocated_bytes", "memory/peak_allocated_gb", 1 / GB),
    ("peak_memory_reserved_bytes", "memory/peak_reserved_gb", 1 / GB), ("alloc_retries", "memory/alloc_retries", 1.0),
    ("expert_load_max_violation", "moe/load_max_violation", 1.0), ("val_loss", "val/loss", 1.0),
    ("val_ppl", "val/perplexity", 1.0),
)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """Tag -> value of one step record (fields that are None or absent are left out)."""
    out = {tag: float(record[key]) * scale for key, tag, scale in SCALARS if record.get(key) is not None}
    for depth, value in enumerate(record.get("mtp_losses") or []):
        out[f"train/mtp_loss_{depth + 1}"] = float(value)
    for layer, value in enumerate(record.get("expert_load_per_layer") or []):
        out[f"moe/layer_{layer}/load_violation"] = float(value)
    for name in ("recall", "kl"):  # the indexer-quality metric (spartron.runtime.indexer_metrics)
        if record.get(f"indexer_{name}") is not None:
            out[f"dsa/indexer_{name}"] = float(record[f"indexer_{name}"])
        values = record.get(f"indexer_{name}_per_layer") or []
        for layer, value in zip(record.get("indexer_metric_layers") or [], values, strict=True):
            out[f"dsa/layer_{layer}/indexer_{name}"] = float(value)
    return out


class EventFile:
    """One TensorBoard event file written on the caller's thread (SummaryWriter writes from a thread of its
    own, whose failure -- a full disk -- printed that thread's traceback before our one-line error)."""

    def __init__(self, folder: Path, name: str) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event = Event
        # opened without following links below folder's run directory; O_EXCL: never an existing file
        fd = open_file(folder.parent, Path(folder.name) / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        self.path = folder / name
        self._records = RecordWriter(os.fdopen(fd, "wb"))
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def _write(self, event) -> None:  # noqa: ANN001 - an event_pb2.Event
        self._records.write(event.SerializeToString())

    def add(self, summary, step: int) -> None:  # noqa: ANN001 - a summary_pb2.Summary
        self._write(self._event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        self._records.close()


class MetricSinks:
    """The configured sinks of `[observe]`; `write(record)` logs one step record to each."""

    def __init__(self, cfg, run_dir: Path, config: dict) -> None:  # noqa: ANN001 - an ObserveConfig
        self.tb = self.wandb_run = None
        self.tb_dir = run_dir / "tensorboard"
        if cfg.tensorboard:
            # a real folder of the run directory (a link there is refused); each start writes a new event file
            # named by time, host and pid, so an existing event file (a link too) is never opened
            name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}"
            try:
                self.tb = EventFile(self.tb_dir, name)
            except UnsafeEntryError:
                raise
            except OSError as err:
                raise self._error(err) from None
        if cfg.wandb_project is not None:
            import wandb

            self.wandb_run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity, mode=cfg.wandb_mode,
                                        dir=str(run_dir), name=run_dir.name, config=config, resume="allow")

    def write(self, record: dict[str, Any]) -> None:
        if record.get("type") != "step":
            return
        values, step = scalars(record), record["step"]
        if self.tb is not None:
            try:
                self._write_tb(values, step, record.get("expert_load_per_layer"))
            except OSError as err:  # a full disk
                raise self._error(err) from None
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)

    def _error(self, err: OSError) -> MetricsWriteError:
        return MetricsWriteError(f"{self.tb_dir}: cannot write TensorBoard events ({err.strerror or err}): "
                                 "free space on its disk, then resume the run")

    def _write_tb(self, values: dict[str, float], step: int, layers: list[float] | None) -> None:
        from torch.utils.tensorboard.summary import histogram, scalar

        for tag, value in values.items():
            self.tb.add(scalar(tag, value), step)
        if layers:
            import numpy as np

            self.tb.add(histogram("moe/load_violation_over_layers", np.asarray(layers, dtype=np.float64),
                                  "auto"), step)
        self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            try:
                self.tb.close()
            except OSError as err:
                raise self._error(err) from None
        if self.wandb_run is not None:
            self.wandb_run.finish()
