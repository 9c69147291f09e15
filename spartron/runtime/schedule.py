"""The learning-rate schedule a run records with each saved step, and the note a resume that changes it
prints (the first step whose lr changes, was and is)."""

from __future__ import annotations

import math
from typing import Any

from spartron.runtime.config import RunConfig
from spartron.runtime.optim import lr_at
from spartron.runtime.sections import TrainConfig

# Recorded with every saved step besides state_config: the learning-rate schedule (a resume that changes it
# says so: schedule_note) and train.eval_steps (`spartron eval` of a step evaluates what the run evaluated).
SCHEDULE_KEYS = ("train.lr", "train.warmup_steps", "train.min_lr_ratio", "train.steps")


def recorded_run_settings(cfg: RunConfig) -> dict[str, Any]:
    return {key: getattr(cfg.train, key.split(".", 1)[1]) for key in (*SCHEDULE_KEYS, "train.eval_steps")}


def schedule_note(saved: dict[str, Any], t: TrainConfig, step: int) -> str | None:
    """One line when resuming after `step` under a learning-rate schedule other than the saved step's: the first
    step whose lr changes, what it would have been and is now, and the keys that changed. A resume that raises
    train.steps to extend a run re-plans the cosine decay; this is the line that says so (None: no change, or a
    step saved before the schedule was recorded)."""
    if not all(key in saved for key in SCHEDULE_KEYS):
        return None
    changed = [key for key in SCHEDULE_KEYS if saved[key] != getattr(t, key.split(".", 1)[1])]
    if not changed:
        return None
    before = t.model_copy(update={key.split(".", 1)[1]: saved[key] for key in SCHEDULE_KEYS})
    for s in range(step + 1, t.steps + 1):
        was, now = lr_at(s, before), lr_at(s, t)
        if not math.isclose(was, now, rel_tol=1e-9, abs_tol=0.0):
            break
    else:
        return None
    keys = ", ".join(f"{key} {saved[key]!r} -> {getattr(t, key.split('.', 1)[1])!r}" for key in changed)
    return (f"spartron: note: the learning-rate schedule changed on resume: lr at step {s} was to be {was:.4g}, "
            f"is now {now:.4g} ({keys})")
