"""The TypedDicts every layer returns.

Data that crosses layers (DSA top-k ids from a source layer to its consumers, router statistics, aux
losses) is a field here, never hidden mutable state on a module.
"""

from __future__ import annotations

from typing import TypedDict

from torch import Tensor


class AttentionOutput(TypedDict):
    hidden_states: Tensor  # [batch, seq_local, dim]
    dsa_topk_ids: Tensor | None  # [batch, seq_local, index_topk] int32 global key positions, -1 = none
    indexer_loss: Tensor | None  # scalar, None when the indexer is frozen or absent


class MoEOutput(TypedDict):
    hidden_states: Tensor  # [batch, seq, dim]
    router_scores: Tensor  # [tokens, n_routed_experts] scores after the score function
    topk_ids: Tensor  # [tokens, top_k] int64 global expert ids
    topk_weights: Tensor  # [tokens, top_k] gate weights (after normalisation and route_scale)
    tokens_per_expert: Tensor  # [n_routed_experts] int64 counts of this forward (local tokens)
    aux_loss: Tensor | None  # scalar load-balancing loss, None when disabled


class DecoderLayerOutput(TypedDict):
    hidden_states: Tensor
    dsa_topk_ids: Tensor | None
    indexer_loss: Tensor | None
    aux_loss: Tensor | None
    tokens_per_expert: Tensor | None  # None for dense-FFN layers


class MTPOutput(TypedDict):
    hidden_states: list[Tensor]  # one per depth
    losses: list[Tensor]  # one scaled loss per depth
    dsa_topk_ids: Tensor | None


class ModelOutput(TypedDict):
    loss: Tensor  # what backward is called on: lm + mtp + aux + indexer
    lm_loss: Tensor
    mtp_losses: list[Tensor]
    aux_loss: Tensor | None
    indexer_loss: Tensor | None
    tokens_per_expert: Tensor | None  # [n_moe_layers, n_routed_experts] counts of this forward
