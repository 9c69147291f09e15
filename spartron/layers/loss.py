"""Language-model loss without materialising full logits.

The fp32 logits / log-softmax are the largest activation surviving to backward in an MoE model
(vocab x tokens). `linear_cross_entropy` computes them chunk by chunk and, because the loss is a
scalar, the gradients of each chunk right away: only grad(hidden) [N, D] and grad(weight) [V, D]
are kept for backward, never [N, V]. Exact: the same sums as the plain path, in the same dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


class LossNorm(NamedTuple):
    """How one micro-batch's losses count in its optimizer step (or evaluation), which the trainer knows and
    the micro-batch does not: `targets` [1 + MTP depth] float32, the step's label counts of the LM loss and
    of each MTP depth over all its micro-batches and the loss group's ranks (the model's `target_counts`,
    summed and all-reduced once); `micro_batches`, the step's per rank. A token-mean loss then becomes the
    micro-batch's share of the step's token mean (the shares sum to it, however the step's targets fall into
    micro-batches: an all-prompt chat window counts nothing, not a zero averaged in), the aux and indexer
    losses their 1/micro_batches share."""

    targets: Tensor
    micro_batches: int


def plain_cross_entropy_sum(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    """Sum of token losses with full logits (reference and short-sequence path)."""
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int) -> Tensor:
        needs_h, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if needs_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start:start + chunk_size]
            y = labels[start:start + chunk_size]
            logits = (h @ weight.t()).float()
            total += F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")
            if needs_h or needs_w:
                # d(sum CE)/d logits = softmax - onehot, zero on ignored rows (no host sync: no nonzero()).
                grad_logits = torch.softmax(logits, dim=-1)
                del logits  # one [chunk, V] fp32 buffer less while the gradient is cast (0.8 GB of peak at dsv3-12l)
                valid = (y != IGNORE_INDEX).unsqueeze(1)
                grad_logits.scatter_add_(1, torch.where(valid, y.unsqueeze(1), 0), -valid.to(grad_logits.dtype))
                grad_logits = grad_logits.to(hidden.dtype)
                # Ignored rows are zeroed on the narrow side of each product ([chunk, D]), not on the
                # [chunk, V] fp32 logits: the same values, without a broadcast pass over the logits
                # (~2 ms a chunk at dsv3-12l's 4096 x 102400 on the H200).
                keep = valid.to(hidden.dtype)
                if needs_h:
                    grad_hidden[start:start + chunk_size] = (grad_logits @ weight) * keep
                if needs_w:  # fp32 += bf16 promotes in the add: no fp32 copy of the [V, D] product
                    grad_weight += grad_logits.t() @ (h * keep)
        ctx.save_for_backward(grad_hidden if needs_h else None,
                              grad_weight if needs_w else None)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_out.to(grad_hidden.dtype) if grad_hidden is not None else None
        gw = (grad_weight * grad_out).to(ctx.weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None


def linear_cross_entropy_sum(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int = 0) -> Tensor:
    """Sum over tokens of CE(hidden @ weight.T, labels); labels == -100 are ignored.

    hidden [N, D], weight [V, D], labels [N]. chunk_size 0 uses full logits.
    """
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, D] and labels [N]; got {tuple(hidden.shape)} and "
                         f"{tuple(labels.shape)}")
    if chunk_size <= 0 or chunk_size >= hidden.shape[0]:
        return plain_cross_entropy_sum(hidden, weight, labels)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_size)
