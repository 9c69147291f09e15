"""Intra-layer micro-batch interleaving: one region call runs N micro-batches' phases interleaved.

A layer describes its forward once, as a list of `Step`s (`DecoderLayer.phases`, which splices in
`MoELayer.phases`): each step reads and writes entries of one carry dict, and every step but the
first names the `Phase` before it, a point where other micro-batches' work may overlap. `drive`
runs one list straight through (the ordinary forward); `interleave` steps N of them round-robin (a
comm step and the compute step after it form one turn), so the host issues one MoE layer as

    attention + routing + prepare mb0, mb1 -> dispatch + experts mb0 -> dispatch + experts mb1
    -> combine + finalize + shared experts mb0 -> combine + finalize + shared experts mb1

and the decoder stack loop is unchanged: a region simply receives lists (a PyTree) of micro-batches.

On CUDA, communication steps (a step whose phase has `comm=True`) run on a side stream of
their micro-batch, and the streams are ordered by events, never by waiting for a whole stream:
- a micro-batch's comm step waits for the event recorded after ITS previous compute step, so the
  combine of mb0 starts as soon as mb0's experts are done, while mb1's experts (queued later on the
  same compute stream) still run;
- a compute step waits for the event recorded after its micro-batch's previous comm step;
- each micro-batch has its own comm stream, so a blocking step inside one (the split-size copy to
  the host in the all-to-all dispatch) waits only for that micro-batch: the CPU blocks while the
  compute stream still runs queued work (mb1's attention under dispatch mb0, mb0's experts under
  dispatch mb1), instead of draining it;
- tensors a step reads that another stream allocated (`Phase.reads`, carry keys) are recorded on
  the stream that reads them, so the caching allocator does not hand their memory out while it is
  still read.
Steps are plain functions, not generators, so torch.compile traces a block's forward (one step
after another) in one graph. Inside a compiled graph the steps of N micro-batches are issued in the
same interleaved order on one stream (no side streams: the compiled graph orders its own work).
With two micro-batches one MoE layer then overlaps dispatch(mb0) with attention(mb1),
dispatch(mb1) with experts(mb0), combine(mb0) with experts(mb1) and combine(mb1) with the
finalize + shared experts of mb0. Backward needs no schedule of its own: autograd runs each
backward op on the stream its forward ran on and follows the interleaved creation order in
reverse. The operations and their order per micro-batch are those of the plain path, so numerics
are identical; on CPU the steps simply run in order.

Micro-batches split the batch dimension into equal parts, so per-micro-batch token or sequence
means average to the whole-batch mean (aux losses, indexer losses) and expert counts add up.

Scope (`train.intra_layer_micro_batch_scope`): the above is scope "layer". Scope "experts" keeps
whole tensors between layers and splits only inside each MoE layer (`MoELayer._chunked`): routing
and the shared experts run once over all tokens, and the routed path (dispatch, experts, combine,
finalize) runs per chunk of tokens through `interleave`. Attention is not split (no doubled small
kernels), the routing and its balance loss are those of the whole batch, the chunks exchange their
counts in one collective (one host sync per layer), and the shared experts run under the first
dispatch. What it gives up: nothing overlaps the exchange with attention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

Carry = dict[str, Any]
"""What the steps of one micro-batch hand each other: named intermediate values."""


class Phase(NamedTuple):
    """A point where a layer's forward may yield to another micro-batch."""

    name: str
    comm: bool = False  # the step after this point is communication (side stream on CUDA)
    # carry keys of tensors the step after this point reads that another stream allocated or will
    # read: recorded on the stream the step runs on (extra entries cost nothing but a delayed reuse)
    reads: tuple[str, ...] = ()


class Step(NamedTuple):
    """One piece of a forward: `run(carry)` reads and writes carry entries; `phase` is the point
    before it (None for a first step)."""

    run: Callable[[Carry], None]
    phase: Phase | None = None


def then(*runs: Callable[[Carry], None]) -> Callable[[Carry], None]:
    """One step function running `runs` in order (splicing one layer's steps into another's)."""
    def run(carry: Carry) -> None:
        for r in runs:
            r(carry)
    return run


def drive(steps: Sequence[Step], carry: Carry) -> Carry:
    """Run the steps of one micro-batch in order (the non-interleaved forward); returns the carry."""
    for step in steps:
        step.run(carry)
    return carry


class _Streams:
    """Per-micro-batch comm streams and the events ordering them against the compute stream (CUDA)."""

    def __init__(self, device: torch.device, n: int) -> None:
        self.compute = torch.cuda.current_stream(device)
        self.comm = [torch.cuda.Stream(device) for _ in range(n)]
        self.computed: list[Any] = [None] * n  # event after micro-batch i's last compute step
        self.communicated: list[Any] = [None] * n  # event after its last comm step (not yet waited for)

    def comm_step(self, i: int, step: Step, carry: Carry) -> None:
        stream = self.comm[i]
        stream.wait_event(self.computed[i])  # its own compute so far, not the other micro-batches'
        _record(carry, step.phase.reads, stream)
        with torch.cuda.stream(stream):
            step.run(carry)
        self.communicated[i] = torch.cuda.Event()
        self.communicated[i].record(stream)

    def compute_step(self, i: int, step: Step, carry: Carry) -> None:
        self.join(i)
        if step.phase is not None:
            _record(carry, step.phase.reads, self.compute)
        step.run(carry)
        self.computed[i] = torch.cuda.Event()
        self.computed[i].record(self.compute)

    def join(self, i: int) -> None:
        """The compute stream waits for micro-batch i's last comm step (if it has not yet)."""
        if self.communicated[i] is not None:
            self.compute.wait_event(self.communicated[i])
            self.communicated[i] = None


def _record(carry: Carry, keys: Sequence[str], stream: Any) -> None:
    for key in keys:
        t = carry.get(key)
        if isinstance(t, Tensor) and t.device.type == "cuda":
            t.record_stream(stream)


def _is_comm(steps: Sequence[Step], index: int) -> bool:
    return index < len(steps) and steps[index].phase is not None and steps[index].phase.comm


def interleave(plans: Sequence[tuple[Sequence[Step], Carry]], device: torch.device | None = None) -> list[Carry]:
    """Run N micro-batches' (steps, carry) round-robin; returns their carries in order.

    A turn runs one step of a micro-batch, and after a comm step also the compute step that follows
    it. The order on the compute stream is the same either way; what changes is when the host
    blocks: a comm step may wait on the host for its own micro-batch (the split sizes of the
    all-to-all dispatch), and by then its predecessor's compute step is already queued. In lock-step
    (dispatch mb0, dispatch mb1, experts mb0, ...) the host blocked in dispatch mb1 until mb1's
    routing was done with nothing queued behind it, and the compute stream idled until the host
    came back and issued mb0's experts.
    """
    on_cuda = device is not None and device.type == "cuda" and not torch.compiler.is_compiling()
    streams = _Streams(device, len(plans)) if on_cuda else None
    cursor = [0] * len(plans)  # the index of each micro-batch's next step

    def advance(i: int) -> bool:
        """Run micro-batch i's next step; True when it was its last."""
        steps, carry = plans[i]
        step = steps[cursor[i]]
        if streams is None:
            step.run(carry)
        elif step.phase is not None and step.phase.comm:
            streams.comm_step(i, step, carry)
        else:
            streams.compute_step(i, step, carry)
        cursor[i] += 1
        done = cursor[i] == len(steps)
        if done and streams is not None:  # finished inside a comm step: join before the caller uses it
            streams.join(i)
        return done

    active = [i for i, (steps, _) in enumerate(plans) if steps]
    while active:
        for i in list(active):
            steps = plans[i][0]
            was_comm = _is_comm(steps, cursor[i])
            done = advance(i)
            if not done and was_comm and not _is_comm(steps, cursor[i]):
                done = advance(i)
            if done:
                active.remove(i)
    return [carry for _, carry in plans]


def split_micro_batches(x: Tensor, n: int) -> list[Tensor]:
    """Split the batch dimension into n equal micro-batches (an error if it does not divide)."""
    if x.shape[0] % n:
        raise ValueError(f"train.intra_layer_micro_batches = {n} must divide the per-forward batch "
                         f"(train.micro_batch_size), got a batch of {x.shape[0]}")
    return list(x.chunk(n, dim=0))


def merge_micro_batches(x: Tensor | list[Tensor] | None) -> Tensor | None:
    """Inverse of split_micro_batches; a tensor or None passes through."""
    if x is None or isinstance(x, Tensor):
        return x
    return torch.cat(list(x), dim=0)


def mean_or_none(values: Sequence[Tensor | None]) -> Tensor | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    if len(present) != len(values):
        raise ValueError("micro-batches disagree on whether a loss is produced")
    return torch.stack(present).mean()


def sum_or_none(values: Sequence[Tensor | None]) -> Tensor | None:
    present = [v for v in values if v is not None]
    return torch.stack(present).sum(dim=0) if present else None
