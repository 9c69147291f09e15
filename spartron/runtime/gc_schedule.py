"""Python's garbage collection on the step schedule (train.gc_every): the automatic collector off while a
Trainer runs, one full collection every `gc_every` steps, on every rank at the same step.

Why: a large model's training process holds many Python objects (modules, hooks, DTensor specs, autograd
state), so an automatic generation-2 collection can pause a rank for tens to hundreds of milliseconds at a
moment chosen by allocation counts, differently on each rank; every collective then waits for the paused rank.
Collected at the same step everywhere, the pause is paid once per `gc_every` steps and in step (torchtitan's
training.gc_freq, Megatron-LM's --manual-gc). A full collection, not only the young generations: with the
automatic collector off nothing else would ever free reference cycles that reached the oldest generation.
"""

from __future__ import annotations

import gc


class ScheduledGC:
    """Owns the collector's on/off state for one Trainer: `start` turns automatic collection off (and collects
    once), `step` collects when the step number is a multiple of `every`, `stop` restores what it found.
    `every` 0: Python's automatic collection, untouched."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.restore: bool | None = None  # the collector's state before start(); None: not started

    def start(self) -> None:
        if self.every and self.restore is None:
            self.restore = gc.isenabled()
            gc.disable()
            gc.collect()

    def step(self, step: int) -> None:
        if self.restore is not None and step % self.every == 0:
            gc.collect()

    def stop(self) -> None:
        if self.restore is not None:
            if self.restore:
                gc.enable()
            self.restore = None
