"""Intra-layer micro-batch overlap: one region call runs N micro-batches' phases interleaved.

A layer's `forward` is plain code. A layer that can overlap micro-batches also declares the same
computation cut into phases (`Phased.phases()`: its methods, in order, each `state -> next state`),
cut where it communicates: a MoE block is

    attention + routing | dispatch (comm) | experts | combine (comm) | finalize + shared experts

`interleave` steps N micro-batches' phases round-robin (a comm phase and the compute phase after it
form one turn), so the host issues one MoE layer as

    attention + routing mb0, mb1 -> dispatch + experts mb0 -> dispatch + experts mb1
    -> combine + finalize mb0 -> combine + finalize mb1

and the decoder stack loop is unchanged: a region simply receives lists (a PyTree) of micro-batches.
This module imports no layer: it knows them only through `Phased` and `InFlight`.

On CUDA, comm phases run on a side stream of their micro-batch, and the streams are ordered by
events, never by waiting for a whole stream:
- a micro-batch's comm phase waits for the event recorded after ITS previous compute phase (or, as
  its first phase, for the compute stream as it was when `interleave` began), so the combine of mb0
  starts as soon as mb0's experts are done, while mb1's experts (queued later) still run;
- a compute phase waits for the event recorded after its micro-batch's previous comm phase;
- each micro-batch has its own comm stream, so a blocking call inside one (the split-size copy to
  the host in the all-to-all dispatch) waits only for that micro-batch: the CPU blocks while the
  compute stream still runs queued work (mb1's attention under dispatch mb0, mb0's experts under
  dispatch mb1), instead of draining it;
- the tensors a state hands across streams (`InFlight.in_flight()`) are recorded on the stream of
  the phase that reads them, so the caching allocator does not hand their memory out while it is
  still read.
Phases are plain functions, not generators, so torch.compile traces a block's forward in one graph.
Inside a compiled graph the phases of N micro-batches are issued in the same interleaved order on
one stream (the compiled graph orders its own work). Backward needs no plan of its own: autograd
runs each backward op on the stream its forward ran on and follows the interleaved creation order in
reverse. The operations and their order per micro-batch are those of the plain forward, so numerics
are identical; on CPU the phases simply run in order.

Micro-batches split the batch dimension into equal parts, so per-micro-batch token or sequence
means average to the whole-batch mean (aux losses, indexer losses) and expert counts add up.

Scope (`train.intra_layer_micro_batch_scope`): the above is scope "layer". Scope "experts" keeps
whole tensors between layers and the MoE layer interleaves chunks of its routed path (dispatch,
experts, combine, finalize) with `interleave`, after routing all tokens once (see MoELayer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor


class Phase(NamedTuple):
    """One piece of a layer's forward between two points where another micro-batch may run."""

    run: Callable[[Any], Any]  # state -> next state (the first phase takes the input, the last returns the output)
    comm: bool = False  # it only communicates: on CUDA it runs on its micro-batch's side stream


class Phased(Protocol):
    """A layer whose forward can be interleaved with other micro-batches' at its phase boundaries."""

    def phases(self) -> Sequence[Phase]:
        """The layer's forward as phases; run in order they compute what `forward` computes."""


class InFlight(Protocol):
    """A state between phases that holds tensors the next phase reads though another stream allocated them."""

    def in_flight(self) -> Sequence[Tensor]:
        """Those tensors (extra entries cost nothing but a delayed reuse of their memory)."""


class _Streams:
    """Per-micro-batch comm streams and the events ordering them against the compute stream (CUDA)."""

    def __init__(self, device: torch.device, n: int) -> None:
        self.compute = torch.cuda.current_stream(device)
        self.comm = [torch.cuda.Stream(device) for _ in range(n)]
        self.computed: list[Any] = [None] * n  # event after micro-batch i's last compute phase
        self.communicated: list[Any] = [None] * n  # event after its last comm phase (not yet waited for)

    def start(self, i: int) -> None:
        """Micro-batch i begins with a comm phase: it waits for the compute stream as it is now."""
        self.computed[i] = torch.cuda.Event()
        self.computed[i].record(self.compute)

    def comm_phase(self, i: int, phase: Phase, state: Any) -> Any:
        stream = self.comm[i]
        stream.wait_event(self.computed[i])  # its own compute so far, not the other micro-batches'
        _record(state, stream)
        with torch.cuda.stream(stream):
            state = phase.run(state)
        self.communicated[i] = torch.cuda.Event()
        self.communicated[i].record(stream)
        return state

    def compute_phase(self, i: int, phase: Phase, state: Any) -> Any:
        self.join(i)
        _record(state, self.compute)
        state = phase.run(state)
        self.computed[i] = torch.cuda.Event()
        self.computed[i].record(self.compute)
        return state

    def join(self, i: int) -> None:
        """The compute stream waits for micro-batch i's last comm phase (if it has not yet)."""
        if self.communicated[i] is not None:
            self.compute.wait_event(self.communicated[i])
            self.communicated[i] = None


def _record(state: Any, stream: Any) -> None:
    in_flight = getattr(state, "in_flight", None)  # InFlight (an attribute look-up: cheaper than isinstance)
    if in_flight is not None:
        for t in in_flight():
            if t.device.type == "cuda":
                t.record_stream(stream)


def _is_comm(phases: Sequence[Phase], index: int) -> bool:
    return index < len(phases) and phases[index].comm


def interleave(plans: Sequence[tuple[Sequence[Phase], Any]], device: torch.device | None = None) -> list[Any]:
    """Run N micro-batches' (phases, input) round-robin; returns what their last phases returned, in order.

    A turn runs one phase of a micro-batch, and after a comm phase also the compute phase that
    follows it. The order on the compute stream is the same either way; what changes is when the
    host blocks: a comm phase may wait on the host for its own micro-batch (the split sizes of the
    all-to-all dispatch), and by then its predecessor's compute phase is already queued. In
    lock-step (dispatch mb0, dispatch mb1, experts mb0, ...) the host blocked in dispatch mb1 until
    mb1's routing was done with nothing queued behind it, and the compute stream idled until the
    host came back and issued mb0's experts.
    """
    on_cuda = device is not None and device.type == "cuda" and not torch.compiler.is_compiling()
    streams = _Streams(device, len(plans)) if on_cuda else None
    states = [state for _, state in plans]
    cursor = [0] * len(plans)  # the index of each micro-batch's next phase
    if streams is not None:
        for i, (phases, _) in enumerate(plans):
            if _is_comm(phases, 0):
                streams.start(i)

    def advance(i: int) -> bool:
        """Run micro-batch i's next phase; True when it was its last."""
        phases = plans[i][0]
        phase = phases[cursor[i]]
        if streams is None:
            states[i] = phase.run(states[i])
        elif phase.comm:
            states[i] = streams.comm_phase(i, phase, states[i])
        else:
            states[i] = streams.compute_phase(i, phase, states[i])
        cursor[i] += 1
        done = cursor[i] == len(phases)
        if done and streams is not None:  # finished inside a comm phase: join before the caller uses it
            streams.join(i)
        return done

    active = [i for i, (phases, _) in enumerate(plans) if phases]
    while active:
        for i in list(active):
            phases = plans[i][0]
            was_comm = _is_comm(phases, cursor[i])
            done = advance(i)
            if not done and was_comm and not _is_comm(phases, cursor[i]):
                done = advance(i)
            if done:
                active.remove(i)
    return states


def run_interleaved(layer: Phased, inputs: Sequence[Any], device: torch.device | None = None) -> list[Any]:
    """`layer` over each of `inputs` (one per micro-batch), its phases interleaved; the outputs in order."""
    return interleave([(layer.phases(), x) for x in inputs], device)


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
    """The mean of per-micro-batch losses (None when no micro-batch produced one)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if len(present) != len(values):
        raise ValueError("micro-batches disagree on whether a loss is produced")
    return torch.stack(present).mean()


def sum_or_none(values: Sequence[Tensor | None]) -> Tensor | None:
    """The sum of per-micro-batch counts (None when no micro-batch produced any)."""
    present = [v for v in values if v is not None]
    return torch.stack(present).sum(dim=0) if present else None
