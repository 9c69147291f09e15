"""Intra-layer micro-batch interleaving: one region call runs N micro-batches' phases interleaved.

A layer describes its forward once, as a generator of phases (`DecoderLayer.forward_phases`, which
delegates its FFN to `MoELayer.forward_phases`): it yields a `Phase` before each step that can
overlap with other micro-batches' work and returns its output at the end. `drive` runs one such
generator straight through (the ordinary forward); `interleave` steps N of them round-robin, so the
schedule of one MoE layer is

    attention + routing + prepare (mb0, mb1, ...) -> dispatch mb0, dispatch mb1 -> experts mb0,
    experts mb1 -> combine mb0, combine mb1 -> finalize + shared experts mb0, mb1

and the decoder stack loop is unchanged: a region simply receives lists (a PyTree) of micro-batches.

On CUDA, communication phases (`Phase.comm`) run on a side stream: that stream first waits for the
compute stream, the tensors the phase reads are recorded on it (so the allocator does not hand
their memory to compute work while the collective still reads them), and an event recorded at the
end is what that micro-batch's next phase waits for. Experts of mb0 therefore run while the dispatch
of mb1 is in flight. The operations and their order per micro-batch are the same as in the plain
path, so numerics are identical; on CPU phases simply run in order.

Micro-batches split the batch dimension into equal parts, so per-micro-batch token or sequence
means average to the whole-batch mean (aux losses, indexer losses) and expert counts add up.
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
    reads: tuple[Tensor | None, ...] = ()  # tensors that step reads (recorded on the side stream)


PhaseGen = Generator[Phase, None, Any]


def drive(phases: PhaseGen) -> Any:
    """Run one phase generator to the end and return its result (the non-interleaved forward)."""
    while True:
        try:
            next(phases)
        except StopIteration as done:
            return done.value


class _CommStream:
    """The side stream and per-micro-batch events of one interleaved call (CUDA only)."""

    def __init__(self, device: torch.device) -> None:
        self.compute = torch.cuda.current_stream(device)
        self.stream = torch.cuda.Stream(device)

    def run(self, gen: PhaseGen, phase: Phase) -> tuple[Any, torch.cuda.Event]:
        self.stream.wait_stream(self.compute)
        for t in phase.reads:
            if t is not None:
                t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            result = _step(gen)
            done = torch.cuda.Event()
            done.record(self.stream)
        return result, done


_FINISHED = object()


def _step(gen: PhaseGen) -> Any:
    """Advance to the next yield; returns the Phase yielded, or (_FINISHED, value) at the end."""
    try:
        return next(gen)
    except StopIteration as done:
        return (_FINISHED, done.value)


def interleave(gens: Sequence[PhaseGen], device: torch.device | None = None) -> list[Any]:
    """Step the generators round-robin, one phase each per round; returns their results in order."""
    comm = _CommStream(device) if device is not None and device.type == "cuda" else None
    pending: list[Phase | None] = [None] * len(gens)  # the phase each generator yielded last
    waits: list[Any] = [None] * len(gens)
    results: list[Any] = [None] * len(gens)
    active = list(range(len(gens)))
    while active:
        for i in list(active):
            phase = pending[i]
            if comm is not None and phase is not None and phase.comm:
                out, waits[i] = comm.run(gens[i], phase)
            else:
                if waits[i] is not None:
                    torch.cuda.current_stream(device).wait_event(waits[i])
                    waits[i] = None
                out = _step(gens[i])
            if isinstance(out, tuple) and len(out) == 2 and out[0] is _FINISHED:
                results[i] = out[1]
                active.remove(i)
                if waits[i] is not None:  # finished inside a comm step: join before the caller uses it
                    torch.cuda.current_stream(device).wait_event(waits[i])
            else:
                pending[i] = out
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


def set_intra_layer_micro_batches(model: torch.nn.Module, cfg: Any) -> None:
    """Wire `train.intra_layer_micro_batches` (RunConfig `cfg`) into the model; errors name the keys."""
    n = cfg.train.intra_layer_micro_batches
    if n == 1:
        return
    if not hasattr(model, "intra_layer_micro_batches"):
        raise ValueError(f"train.intra_layer_micro_batches = {n}: {type(model).__name__} does not run "
                         "intra-layer micro-batches (the reference SparseMoEModel does)")
    if cfg.train.micro_batch_size % n:
        raise ValueError(f"train.intra_layer_micro_batches = {n} must divide train.micro_batch_size "
                         f"= {cfg.train.micro_batch_size} (micro-batches split the batch dimension)")
    moe = cfg.model.moe
    if moe.aux_loss_coeff > 0 and moe.aux_loss_type == "batch":
        raise ValueError("train.intra_layer_micro_batches > 1 needs model.moe.aux_loss_type = 'seq': a "
                         "batch-level balance loss is not the mean of its micro-batches' losses")
    model.intra_layer_micro_batches = n
