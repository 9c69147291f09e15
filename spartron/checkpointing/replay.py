"""Replay frames: results computed once in the original pass and handed back during the replay.

A checkpoint region replays its forward during backward. Some work inside it (the DSA source
indexer: frozen, no-grad, expensive) must not run twice. ``reuse_during_recompute(fn, ...)`` stores
the result of ``fn`` in a FIFO frame that belongs to ONE call of ONE region; the replay of that call
pops it. The current frame is held in a ContextVar that the region sets around its original pass
and its replay, and the frame carries an explicit phase, because a non-reentrant replay runs during
backward with grad enabled just like an ordinary forward would.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch
from torch.utils._pytree import tree_leaves, tree_map

from spartron.scoped import ScopedValue

T = TypeVar("T")
Phase = Literal["original", "replay"]


class ReplayFrameError(RuntimeError):
    """A reuse frame was used wrongly: a miss on replay, leftovers, or a stored result needing grad."""


def _callable_key(fn: Callable[..., Any]) -> Any:
    """Identify a callable across the original pass and the replay.

    A bound method is re-created on every attribute access and a lambda or closure defined inside a
    forward is a new object on each run, so identity would not match between the two passes: key
    bound methods by (owner id, function) and plain functions by their code object.
    """
    if isinstance(fn, functools.partial):
        return ("partial", _callable_key(fn.func))
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", None)
    if owner is not None and func is not None:
        return ("method", id(owner), func)
    code = getattr(fn, "__code__", None)
    if code is not None:
        return ("code", code)
    return ("object", id(fn))


def _describe(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class ReplayFrame:
    """FIFO queues of stored results for one region call, keyed by callable."""

    def __init__(self, region_name: str) -> None:
        self.region_name = region_name
        self.phase: Phase = "original"
        self._queues: dict[Any, collections.deque] = {}
        self._names: dict[Any, str] = {}
        self.stored = 0
        self.reused = 0
        # > 0 while the original pass runs a reused callable: its ops never replay, so the operator
        # policy must neither save them nor expect them in the replay's op sequence.
        self.reusing = 0

    def store(self, fn: Callable[..., Any], result: Any) -> None:
        for leaf in tree_leaves(result):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                raise ReplayFrameError(
                    f"reuse_during_recompute({_describe(fn)}) in region {self.region_name!r} returned a "
                    "tensor that requires grad; reused results get no gradient on replay. Only reuse "
                    "no-grad work (frozen modules, integer ids), or detach the inputs explicitly.")
        key = _callable_key(fn)
        self._queues.setdefault(key, collections.deque()).append(result)
        self._names[key] = _describe(fn)
        self.stored += 1

    def pop(self, fn: Callable[..., Any]) -> Any:
        queue = self._queues.get(_callable_key(fn))
        if not queue:
            raise ReplayFrameError(
                f"reuse_during_recompute({_describe(fn)}) found no stored result while replaying region "
                f"{self.region_name!r}: the replay called it more often than the original pass did")
        self.reused += 1
        return queue.popleft()

    def check_consumed(self) -> None:
        """Raise if the replay left stored results behind (the two passes diverged)."""
        left = {self._names[k]: len(q) for k, q in self._queues.items() if q}
        self._queues.clear()
        if left:
            raise ReplayFrameError(
                f"region {self.region_name!r} finished its replay with unconsumed "
                f"reuse_during_recompute results {left}: the replay called these fewer times than the "
                "original pass")

    def clear(self) -> None:
        self._queues.clear()


_CURRENT_FRAME: ScopedValue[ReplayFrame] = ScopedValue("spartron_replay_frame")


@torch.library.custom_op("spartron_ac::reused", mutates_args=())
def _reused(x: torch.Tensor) -> torch.Tensor:
    """A reused result inside a compiled region: a copy the policy table marks mandatory (saved), so
    the compiled backward reads it instead of recomputing the work that made it."""
    return x.clone()


@_reused.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def active_frame(frame: ReplayFrame, phase: Phase) -> contextlib.AbstractContextManager[ReplayFrame]:
    """Make ``frame`` current for one pass (``phase``) of its region."""
    frame.phase = phase
    return _CURRENT_FRAME.scope(frame)


def current_frame() -> ReplayFrame | None:
    return _CURRENT_FRAME.get()


def reuse_during_recompute(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call ``fn`` once per region call; its replay gets the stored result back (FIFO per callable).

    The original pass runs ``fn`` with grad enabled so that a result which would need a gradient is
    caught (it raises instead of silently dropping the gradient). Outside a region, just ``fn(...)``.
    """
    if torch.compiler.is_compiling():  # a compiled region (CheckpointRegion.compile): no frames
        return tree_map(lambda x: _reused(x) if isinstance(x, torch.Tensor) else x, fn(*args, **kwargs))
    frame = _CURRENT_FRAME.get()
    if frame is None:
        return fn(*args, **kwargs)
    if frame.phase == "replay":
        return frame.pop(fn)
    frame.reusing += 1
    try:
        with torch.enable_grad():
            result = fn(*args, **kwargs)
    finally:
        frame.reusing -= 1
    frame.store(fn, result)
    return result
