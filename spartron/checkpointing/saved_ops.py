"""The one mechanism behind the operator policy: a dispatch mode that saves op outputs and replays them.

During a region's original pass, every dispatched operator the policy keeps has its outputs cached
in call order. During the replay the same mode hands those outputs back instead of running the op
again, and lets every other op recompute. It sits below autograd, so the replay still builds the
backward graph of saved ops (their backward formulas receive the cached outputs). It does not care
how the region replays (reentrant autograd.Function or torch's non-reentrant hooks), so both modes
share it; torch's own selective-checkpoint contexts are non-reentrant only.

The replay also checks that it dispatches the same op sequence as the original pass, saved ops
and recomputed ones alike: the original pass records each op's identity (the OpOverload object, one
list append, no allocation), the replay compares it op by op and raises at the first op added,
missing or changed, naming it with its position and input shapes. Saved ops are also checked for the
same input shapes. Replay-only markers (profiler ranges, FSDP hooks) and the ops inside
``reuse_during_recompute`` (which run in the original pass only) are left out of both sequences.
The check runs below autograd, so in non-reentrant mode it fires before torch's own "trying to save
more tensors" check of the same op.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from spartron.checkpointing.policy import REPLAY_ONLY_MARKERS, SAVE_WITH_BACKWARD_OUTPUTS, OpPolicy, op_packet_name
from spartron.checkpointing.replay import ReplayFrame, current_frame

log = logging.getLogger("spartron.checkpointing")


class CheckpointReplayError(RuntimeError):
    """The replay diverged from the original pass (different saved ops, structure or mutated saves)."""


@dataclass
class RegionStats:
    """What one region call did: ops saved vs recomputed, bytes kept, how often it replayed."""

    name: str
    ops_original: int = 0
    ops_saved: int = 0
    ops_recomputed: int = 0
    bytes_saved: int = 0
    bytes_inputs: int = 0
    replay_count: int = 0
    results_reused: int = 0
    saved_by_op: collections.Counter = field(default_factory=collections.Counter)
    recomputed_by_op: collections.Counter = field(default_factory=collections.Counter)

    def summary(self) -> str:
        def top(counter: collections.Counter) -> str:
            return ", ".join(f"{k} x{v}" for k, v in counter.most_common(8)) or "-"

        return (f"checkpoint region {self.name!r}: {self.ops_original} ops in forward, "
                f"{self.ops_saved} saved ({self.bytes_saved / 2**20:.2f} MiB) [{top(self.saved_by_op)}], "
                f"{self.ops_recomputed} recomputed [{top(self.recomputed_by_op)}], inputs kept "
                f"{self.bytes_inputs / 2**20:.2f} MiB, replays {self.replay_count}, "
                f"reused results {self.results_reused}")


@dataclass
class _ArgAlias:
    """Marks an op output that is (an alias of) argument ``index``: returned as the replay's argument."""

    index: int


@dataclass
class _SavedOp:
    name: str
    reason: str
    outputs: Any
    versions: list[tuple[torch.Tensor, int]]
    mutated: list[tuple[int, StorageWeakRef, torch.Tensor]]
    shapes: list[torch.Size]


def _input_shapes(args: tuple, kwargs: dict) -> list[torch.Size]:
    shapes = [a.shape for a in args if isinstance(a, torch.Tensor)]
    if kwargs:
        shapes += [a.shape for a in kwargs.values() if isinstance(a, torch.Tensor)]
    return shapes


def _shapes_text(shapes: list[torch.Size]) -> str:
    return ", ".join(str(list(s)) for s in shapes) or "no tensors"


def _arg(func: torch._ops.OpOverload, args: tuple, kwargs: dict, index: int) -> Any:
    if index < len(args):
        return args[index]
    schema_arg = func._schema.arguments[index]
    return kwargs.get(schema_arg.name, schema_arg.default_value)


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


class SavedOps:
    """The saved outputs of one region call, in dispatch order, plus the replay cursor."""

    def __init__(self, policy: OpPolicy, stats: RegionStats) -> None:
        self.policy = policy
        self.stats = stats
        self._entries: list[_SavedOp] = []
        self._cursor = 0
        # every op of the original pass in dispatch order, and the replay's position in it
        self.trace: list[torch._ops.OpOverload] = []
        self.trace_pos = 0
        self._schema_infos: dict[torch._ops.OpOverload, tuple[list[int | None], list[int]]] = {}

    def _schema_info(self, func: torch._ops.OpOverload) -> tuple[list[int | None], list[int]]:
        """(per return: index of the argument it aliases or None, indices of written arguments)."""
        info = self._schema_infos.get(func)
        if info is None:
            schema = func._schema
            alias_sets = {frozenset(a.alias_info.before_set): i for i, a in enumerate(schema.arguments)
                          if a.alias_info is not None}
            alias_returns = [alias_sets.get(frozenset(r.alias_info.before_set)) if r.alias_info else None
                             for r in schema.returns]
            written = [i for i, a in enumerate(schema.arguments)
                       if a.alias_info is not None and a.alias_info.is_write]
            info = self._schema_infos[func] = (alias_returns, written)
        return info

    def record(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any, reason: str) -> None:
        alias_returns, written = self._schema_info(func)
        # Detach with ADInplaceOrView re-enabled so the cached alias shares the output's version
        # counter: an in-place update of the output in the original pass is then detectable.
        with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
            if not alias_returns:  # an op returning () (e.g. spartron::record_routing_stats)
                stored = None
            elif len(alias_returns) == 1:
                stored = _ArgAlias(alias_returns[0]) if alias_returns[0] is not None else \
                    out.detach() if isinstance(out, torch.Tensor) else tree_map(_detach, out)
            else:
                stored = tuple(_ArgAlias(a) if a is not None else tree_map(_detach, o)
                               for a, o in zip(alias_returns, out, strict=True))
        mutated = []
        for i in written:
            value = _arg(func, args, kwargs, i)
            if isinstance(value, torch.Tensor):
                mutated.append((i, StorageWeakRef(value.untyped_storage()), value.detach().clone()))
        leaves = [stored] if isinstance(stored, torch.Tensor) else tree_leaves(stored)
        versions = [(t, t._version) for t in leaves if isinstance(t, torch.Tensor)]
        name = op_packet_name(func)
        self._entries.append(_SavedOp(name, reason, stored, versions, mutated, _input_shapes(args, kwargs)))
        self.stats.ops_saved += 1
        self.stats.saved_by_op[name] += 1
        self.stats.bytes_saved += sum(t.numel() * t.element_size() for t, _ in versions) \
            + sum(_nbytes(c) for _, _, c in mutated)

    def replay(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        name = op_packet_name(func)
        if self._cursor >= len(self._entries):
            raise CheckpointReplayError(
                f"region {self.stats.name!r}: the replay dispatched saved op {name} (#{self._cursor}) "
                f"but the original pass saved only {len(self._entries)} ops")
        entry = self._entries[self._cursor]
        if entry.name != name:
            raise CheckpointReplayError(
                f"region {self.stats.name!r}: saved op #{self._cursor} differs between passes: the original "
                f"pass saved {entry.name}, the replay dispatched {name}")
        shapes = _input_shapes(args, kwargs)
        if shapes != entry.shapes:
            raise CheckpointReplayError(
                f"region {self.stats.name!r}: saved op {name} (#{self._cursor}) has other input shapes in the "
                f"replay: original [{_shapes_text(entry.shapes)}], replay [{_shapes_text(shapes)}]")
        for tensor, version in entry.versions:
            if tensor._version != version:
                raise CheckpointReplayError(
                    f"region {self.stats.name!r}: the saved output of {name} (#{self._cursor}) was modified "
                    "in place after it was saved; clone it before mutating, or do not target this op")
        for index, storage, value in entry.mutated:
            target = _arg(func, args, kwargs, index)
            same = not storage.expired() and StorageWeakRef(target.untyped_storage()) == storage
            if not same:  # a buffer re-created by the replay receives the saved result; one that
                target.copy_(value)  # outlives the pass was already updated by the original op
        self._cursor += 1
        if isinstance(entry.outputs, torch.Tensor):  # the common case: one tensor, no alias
            return entry.outputs.detach()

        def restore(x: Any) -> Any:
            return _arg(func, args, kwargs, x.index) if isinstance(x, _ArgAlias) else _detach(x)

        return tree_map(restore, entry.outputs, is_leaf=lambda x: isinstance(x, _ArgAlias))

    def diverged(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> CheckpointReplayError:
        """The error for a replay op that is not the original pass's op at the same position."""
        pos, count = self.trace_pos, len(self.trace)
        got = f"{op_packet_name(func)} (inputs {_shapes_text(_input_shapes(args, kwargs))})"
        if pos >= count:
            return CheckpointReplayError(
                f"region {self.stats.name!r}: the replay dispatched op #{pos} {got} after the original "
                f"pass's last op (it ran {count} ops): the replay added an op")
        return CheckpointReplayError(
            f"region {self.stats.name!r}: the replay diverged from the original pass at op #{pos}: the "
            f"original pass ran {op_packet_name(self.trace[pos])}, the replay dispatched {got}")

    def finish_replay(self) -> None:
        """Check the replay ran the whole op sequence and met every saved op, then free the cache."""
        if self.trace_pos != len(self.trace):
            pos, count, missing = self.trace_pos, len(self.trace), op_packet_name(self.trace[self.trace_pos])
            self.release()
            raise CheckpointReplayError(
                f"region {self.stats.name!r}: the replay ended after {pos} of the original pass's {count} ops; "
                f"the first op it did not dispatch is {missing} (#{pos})")
        if self._cursor != len(self._entries):
            replayed, count = self._cursor, len(self._entries)  # read before release() resets them
            missing = self._entries[replayed].name
            self.release()
            raise CheckpointReplayError(
                f"region {self.stats.name!r}: the replay ended after {replayed} of {count} saved ops; "
                f"the first op it did not dispatch is {missing}")
        self.release()

    def release(self) -> None:
        self._entries = []
        self._cursor = 0
        self.trace = []
        self.trace_pos = 0


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


_UNDECIDED = object()
_MARKER = "replay-only marker"  # a decision: profiler / FSDP ops, outside both op sequences
_PASS = "not the region's computation"  # a decision: views and autograd's detach, outside both sequences
# Dispatched by autograd itself depending on grad mode (a reentrant original pass runs without grad,
# its replay with it), not by the region's code: outside both op sequences too, never saved.
_GRAD_MODE_ARTIFACTS = frozenset({torch.ops.aten.detach.default})
_RANGE_ENTER = torch.ops.profiler._record_function_enter_new.default
_RANGE_EXITS = frozenset(getattr(torch.ops.profiler._record_function_exit, name)
                         for name in torch.ops.profiler._record_function_exit.overloads())


def with_backward_outputs(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Force the SAVE_WITH_BACKWARD_OUTPUTS flags of a saved op to True (see policy.py)."""
    flags = SAVE_WITH_BACKWARD_OUTPUTS.get(op_packet_name(func))
    if not flags:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for i, arg in enumerate(func._schema.arguments):
        if arg.name in flags:
            if i < len(args) and not arg.kwarg_only:
                args[i] = True
            else:
                kwargs[arg.name] = True
    return tuple(args), kwargs


class PolicyMode(TorchDispatchMode):
    """Applies the policy to every op of one pass ("original" saves, "replay" reuses or recomputes).

    Every op of the region passes through here, so the common case (an op already decided, nothing
    to save) is one dict lookup; per-op counts are kept by OpOverload and folded into the region's
    stats when the pass ends.
    """

    def __init__(self, saved: SavedOps, phase: str, frame: ReplayFrame | None = None) -> None:
        super().__init__()
        self.saved = saved
        self.phase = phase
        # the region call's replay frame (its `reusing` count is read per op); default: the current one
        self._frame = frame if frame is not None else current_frame()
        self._original = phase == "original"
        self._decisions: dict[torch._ops.OpOverload, str | None] = {}
        self._ops_original = 0
        self._recomputed: dict[torch._ops.OpOverload, int] = {}
        self._ranges: list[bool] = []  # profiler ranges opened in this pass: is each an FSDP one
        self._fsdp_depth = 0

    def _decide(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
        if func.namespace in REPLAY_ONLY_MARKERS:
            self._decisions[func] = _MARKER
            return _MARKER
        if func in _GRAD_MODE_ARTIFACTS:
            self._decisions[func] = _PASS
            return _PASS
        reason = self.saved.policy.decide(func, args, kwargs)
        if reason is None and getattr(func, "is_view", False):  # computes nothing; outer tools' hooks issue views
            reason = _PASS
        if op_packet_name(func) not in self.saved.policy.device_to_host:  # arg-dependent: not cached
            self._decisions[func] = reason
        return reason

    def _marker(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        """Run a marker op; an FSDP profiler range (FSDP2's hooks: all-gather copies, pre-backward)
        opened inside a pass makes the ops until it closes FSDP's, not the region's."""
        if not self._original:
            self._recomputed[func] = self._recomputed.get(func, 0) + 1
        out = func(*args, **kwargs)
        if func is _RANGE_ENTER:  # ranges nest (LIFO); one opened before this pass closes unseen
            fsdp = isinstance(args[0], str) and args[0].startswith("FSDP::")
            self._ranges.append(fsdp)
            self._fsdp_depth += fsdp
        elif func in _RANGE_EXITS and self._ranges:
            self._fsdp_depth -= self._ranges.pop()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = self._decisions.get(func, _UNDECIDED)
        if reason is _UNDECIDED:
            reason = self._decide(func, args, kwargs)
        if reason is _PASS:  # a view or autograd's detach: in neither sequence, never saved
            if not self._original:
                self._recomputed[func] = self._recomputed.get(func, 0) + 1
            return func(*args, **kwargs)
        if reason is _MARKER:  # in neither sequence, never saved
            return self._marker(func, args, kwargs)
        if self._fsdp_depth:  # FSDP's own work inside one of its ranges
            return func(*args, **kwargs)
        saved = self.saved
        if self._original:
            frame = self._frame
            if frame is not None and frame.reusing:  # inside reuse_during_recompute: runs once, never replays
                return func(*args, **kwargs)
            saved.trace.append(func)
            if reason is not None:
                args, kwargs = with_backward_outputs(func, args, kwargs)
            out = func(*args, **kwargs)
            self._ops_original += 1
            if reason is not None:
                saved.record(func, args, kwargs, out, reason)
            return out
        pos = saved.trace_pos
        if pos >= len(saved.trace) or saved.trace[pos] is not func:
            raise saved.diverged(func, args, kwargs)
        saved.trace_pos = pos + 1
        if reason is None:
            self._recomputed[func] = self._recomputed.get(func, 0) + 1
            return func(*args, **kwargs)
        return saved.replay(func, args, kwargs)

    def __exit__(self, exc_type, exc_value, traceback):
        stats = self.saved.stats
        stats.ops_original += self._ops_original
        for func, count in self._recomputed.items():
            stats.ops_recomputed += count
            stats.recomputed_by_op[op_packet_name(func)] += count
        self._ops_original, self._recomputed = 0, {}
        return super().__exit__(exc_type, exc_value, traceback)
