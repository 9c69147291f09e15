"""The SideChannel: per-forward outputs of Spartron's Megatron adapters that Megatron has no slot for.

DSA source layers store their top-k ids here and consumer layers read them (the hand-over
`run_decoder_stack` does); attention layers store their AttentionOutput and MoE layers their
MoEOutput (aux loss, tokens per expert, routing). Call `side.reset()` before every forward
(micro-batch) and add `side.loss()` to the LM loss before backward. A layer that writes twice
without a reset raises: that catches a missing reset and any recompute the channel would
otherwise see twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from spartron.layers.outputs import AttentionOutput, MoEOutput


@dataclass
class SideChannel:
    """Per-forward outputs of the adapters, keyed by Spartron layer index (Megatron layer_number - 1)."""

    attention: dict[int, AttentionOutput] = field(default_factory=dict)
    moe: dict[int, MoEOutput] = field(default_factory=dict)
    dsa_topk_ids: Tensor | None = None  # ids of the latest DSA source layer [B, S_local, K]

    def reset(self) -> None:
        self.attention.clear()
        self.moe.clear()
        self.dsa_topk_ids = None

    def record_attention(self, layer_idx: int, out: AttentionOutput) -> None:
        _check_fresh(self.attention, layer_idx)
        self.attention[layer_idx] = out
        if out["dsa_topk_ids"] is not None:
            self.dsa_topk_ids = out["dsa_topk_ids"]

    def record_moe(self, layer_idx: int, out: MoEOutput) -> None:
        _check_fresh(self.moe, layer_idx)
        self.moe[layer_idx] = out

    def aux_loss(self) -> Tensor | None:
        losses = [o["aux_loss"].float() for _, o in sorted(self.moe.items()) if o["aux_loss"] is not None]
        return torch.stack(losses).sum() if losses else None

    def indexer_loss(self) -> Tensor | None:
        losses = [o["indexer_loss"].float() for _, o in sorted(self.attention.items())
                  if o["indexer_loss"] is not None]
        return torch.stack(losses).sum() if losses else None

    def loss(self) -> Tensor | float:
        """Aux + indexer losses of this forward: add it to the LM loss (0.0 when there are none)."""
        terms = [t for t in (self.aux_loss(), self.indexer_loss()) if t is not None]
        return torch.stack(terms).sum() if terms else 0.0

    def tokens_per_expert(self) -> Tensor | None:
        """[n_moe_layers, n_routed_experts] counts of this forward, in layer order."""
        counts = [o["tokens_per_expert"] for _, o in sorted(self.moe.items())]
        return torch.stack(counts) if counts else None


def _check_fresh(store: dict, layer_idx: int) -> None:
    if layer_idx in store:
        raise RuntimeError(f"SideChannel already holds layer {layer_idx}'s output: call side.reset() before "
                           "each forward (Megatron recompute is not supported; use spartron.checkpointing)")
