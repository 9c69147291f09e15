"""A step's loss as the exact token mean of all its micro-batches (the trainer's and the evaluator's rule), and
the step's loss statistics (StepStats).

A micro-batch's token-mean loss weighted 1/n in its step is the step's token mean only when every micro-batch
holds as many targets; with a loss mask (chat data: a window that is all prompt holds none) or packed
documents (MTP targets stop at document ends) it is not, and the step's value and gradient would depend on
how the step is split into micro-batches and ranks. A model with `target_counts` is handed the step's counts
instead (`LossNorm`), once per step.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from spartron.comm import labelled
from spartron.layers.loss import LossNorm
from spartron.layers.outputs import ModelOutput
from spartron.runtime.data import Batch


@runtime_checkable
class TokenNormModel(Protocol):
    def target_counts(self, labels: Tensor, positions: Tensor | None = None) -> Tensor:
        """This rank's label counts of one micro-batch (the LM loss, then each MTP depth). The trainer sums
        them over the step's micro-batches, all-reduces them over dp x cp once, and passes the model
        ``loss_norm=LossNorm(counts, micro_batches)``: each micro-batch's ``loss`` is then its share of the
        step's objective (backward runs on it as it is), so the step is the exact token mean however its
        targets fall into micro-batches and ranks. Without this protocol every micro-batch weighs 1/n."""


def step_loss_norm(model: nn.Module, batches: list[Batch], group: dist.ProcessGroup, device: torch.device
                   ) -> LossNorm | None:
    """The LossNorm of a step's (or an evaluation's) micro-batches on this rank: their label counts, taken on
    the host and summed, then all-reduced over `group` on `device` (one collective); None for a model without
    `target_counts`."""
    if not isinstance(model, TokenNormModel):
        return None
    counts = sum(model.target_counts(b.labels, **b.model_kwargs(b.labels.device)) for b in batches).to(device)
    with labelled("loss_norm", group):
        dist.all_reduce(counts, group=group)
    return LossNorm(counts, len(batches))


class StepStats:
    """Detached per-step sums over micro-batches, all-reduced to global means at the end (with a LossNorm,
    the loss, LM and MTP values are already the micro-batches' shares: summed, not averaged)."""

    def __init__(self) -> None:
        self.values: list[Tensor] | None = None
        self.counts: Tensor | None = None
        self.n_mtp = 0

    def add(self, out: ModelOutput) -> None:
        zero = torch.zeros((), device=out["loss"].device)
        row = [out["loss"], out["lm_loss"], out["aux_loss"] if out["aux_loss"] is not None else zero,
               out["indexer_loss"] if out["indexer_loss"] is not None else zero, *out["mtp_losses"]]
        row = [t.detach().float() for t in row]
        self.n_mtp = len(out["mtp_losses"])
        self.values = row if self.values is None else [a + b for a, b in zip(self.values, row, strict=True)]
        tpe = out["tokens_per_expert"]
        if tpe is not None:
            self.counts = tpe.detach().clone() if self.counts is None else self.counts + tpe.detach()

    def reduce(self, n_micro: int, group: dist.ProcessGroup, shares: bool) -> tuple[list[float], Tensor | None]:
        divisors = [1, 1, n_micro, n_micro, *[1] * self.n_mtp] if shares else [n_micro] * len(self.values)
        stacked = torch.stack(self.values) / torch.tensor(divisors, dtype=torch.float32, device=self.values[0].device)
        with labelled("step_stats", group):
            dist.all_reduce(stacked, group=group)  # gloo has no AVG: sum, then divide
        means = (stacked / dist.get_world_size(group)).tolist()
        counts = None
        if self.counts is not None:
            counts = self.counts.to(torch.int64)
            with labelled("step_stats", group):
                dist.all_reduce(counts, group=group)
        return means, counts
