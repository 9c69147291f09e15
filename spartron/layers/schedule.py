"""Intra-layer micro-batch interleaving: one region call runs N micro-batches' phases interleaved.

A layer describes its forward once, as a generator of phases (`DecoderLayer.forward_phases`, which
delegates its FFN to `MoELayer.forward_phases`): it yields a `Phase` before each step that can
overlap with other micro-batches' work and returns its output at the end. `drive` runs one such
generator straight through (the ordinary forward); `interleave` steps N of them round-robin (a comm
step and the compute step after it form one turn), so the host issues one MoE layer as

    attention + routing + prepare mb0, mb1 -> dispatch + experts mb0 -> dispatch + experts mb1
    -> combine + finalize + shared experts mb0 -> combine + finalize + shared experts mb1

and the decoder stack loop is unchanged: a region simply receives lists (a PyTree) of micro-batches.

On CUDA, communication steps (the code after a `Phase(comm=True)` yield) run on a side stream of
their micro-batch, and the streams are ordered by events, never by waiting for a whole stream:
- a micro-batch's comm step waits for the event recorded after ITS previous compute step, so the
  combine of mb0 starts as soon as mb0's experts are done, while mb1's experts (queued later on the
  same compute stream) still run;
- a compute step waits for the event recorded after its micro-batch's previous comm step;
- each micro-batch has its own comm stream, so a blocking step inside one (the split-size copy to
  the host in the all-to-all dispatch) waits only for that micro-batch: the CPU blocks while the
  compute stream still runs queued work (mb1's attention under dispatch mb0, mb0's experts under
  dispatch mb1), instead of draining it;
- tensors a step reads that another stream allocated (`Phase.reads`) are recorded on the stream
  that reads them, so the caching allocator does not hand their memory out while it is still read.
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

from collections.abc import Generator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor


class Phase(NamedTuple):
    """A point where a layer's forward may yield to another micro-batch."""

    name: str
    comm: bool = False  # the step after this yield is communication (side stream on CUDA)
    # tensors the step after this yield reads that another stream allocated or will read: recorded
    # on the stream the step runs on (extra entries cost nothing but a delayed memory reuse)
    reads: tuple[Tensor | None, ...] = ()


PhaseGen = Generator[Phase, None, Any]


def drive(phases: PhaseGen) -> Any:
    """Run one phase generator to the end and return its result (the non-interleaved forward)."""
    while True:
        try:
            next(phases)
        except StopIteration as done:
            return done.value


class _Streams:
    """Per-micro-batch comm streams and the events ordering them against the compute stream (CUDA)."""

    def __init__(self, device: torch.device, n: int) -> None:
        self.compute = torch.cuda.current_stream(device)
        self.comm = [torch.cuda.Stream(device) for _ in range(n)]
        self.computed: list[Any] = [None] * n  # event after micro-batch i's last compute step
        self.communicated: list[Any] = [None] * n  # event after its last comm step (not yet waited for)

    def comm_step(self, i: int, gen: PhaseGen, phase: Phase) -> Any:
        stream = self.comm[i]
        stream.wait_event(self.computed[i])  # its own compute so far, not the other micro-batches'
        _record(phase.reads, stream)
        with torch.cuda.stream(stream):
            out = _step(gen)
        self.communicated[i] = torch.cuda.Event()
        self.communicated[i].record(stream)
        return out

    def compute_step(self, i: int, gen: PhaseGen, phase: Phase | None) -> Any:
        self.join(i)
        if phase is not None:
            _record(phase.reads, self.compute)
        out = _step(gen)
        self.computed[i] = torch.cuda.Event()
        self.computed[i].record(self.compute)
        return out

    def join(self, i: int) -> None:
        """The compute stream waits for micro-batch i's last comm step (if it has not yet)."""
        if self.communicated[i] is not None:
            self.compute.wait_event(self.communicated[i])
            self.communicated[i] = None


def _record(tensors: Sequence[Tensor | None], stream: Any) -> None:
    for t in tensors:
        if t is not None and t.device.type == "cuda":
            t.record_stream(stream)


_FINISHED = object()


def _step(gen: PhaseGen) -> Any:
    """Advance to the next yield; returns the Phase yielded, or (_FINISHED, value) at the end."""
    try:
        return next(gen)
    except StopIteration as done:
        return (_FINISHED, done.value)


def interleave(gens: Sequence[PhaseGen], device: torch.device | None = None) -> list[Any]:
    """Step the generators round-robin; returns their results in order.

    A turn runs one step of a micro-batch, and after a comm step also the compute step that follows
    it. The order on the compute stream is the same either way; what changes is when the host
    blocks: a comm step may wait on the host for its own micro-batch (the split sizes of the
    all-to-all dispatch), and by then its predecessor's compute step is already queued. In lock-step
    (dispatch mb0, dispatch mb1, experts mb0, ...) the host blocked in dispatch mb1 until mb1's
    routing was done with nothing queued behind it, and the compute stream idled until the host
    came back and issued mb0's experts.
    """
    streams = _Streams(device, len(gens)) if device is not None and device.type == "cuda" else None
    pending: list[Phase | None] = [None] * len(gens)  # the phase each generator yielded last
    results: list[Any] = [None] * len(gens)

    def advance(i: int) -> bool:
        """Run micro-batch i's pending step; True when its generator finished."""
        phase = pending[i]
        if streams is None:
            out = _step(gens[i])
        elif phase is not None and phase.comm:
            out = streams.comm_step(i, gens[i], phase)
        else:
            out = streams.compute_step(i, gens[i], phase)
        if isinstance(out, tuple) and len(out) == 2 and out[0] is _FINISHED:
            results[i] = out[1]
            if streams is not None:  # finished inside a comm step: join before the caller uses it
                streams.join(i)
            return True
        pending[i] = out
        return False

    active = list(range(len(gens)))
    while active:
        for i in list(active):
            was_comm = pending[i] is not None and pending[i].comm
            done = advance(i)
            if not done and was_comm and not pending[i].comm:
                done = advance(i)
            if done:
                active.remove(i)
    return results


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
