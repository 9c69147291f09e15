"""DeepSeek sparse attention (DSA): the lightning indexer, its top-k, its KL loss, and the
source/consumer schedule that decides which layers compute ids and which reuse them.

Conventions (DeepSeek-V3.2 reference):
- index queries come from the compressed query latent (q_lora); with q_lora_rank = 0 there is no
  latent and they come from the layer input x (as Megatron-core does);
- ONE key head shared by all index heads, LayerNorm'ed; RoPE (half-split pairs) on the FIRST
  qk_rope_head_dim dims of index queries and keys;
- head weights w = weights_proj(x) * H^-1/2 * d^-1/2; I[t,s] = sum_h w[t,h] * ReLU(q[t,h] . k[s]);
- top-k of min(index_topk, S_kv) over causally visible keys, as a set in ascending key order
  (`indexer_topk.topk_ids`); slots beyond a query's visible keys are -1, last. Ids index the key
  axis, which is the global position when positions start at 0.
Training (`model.dsa.indexer_mode`): `frozen` computes ids under no_grad through
`reuse_during_recompute` (a checkpoint replay never reruns it); `kl_dense` / `kl_sparse` train the
indexer with KL(main-attention distribution || softmax(I)) over all visible keys (in query chunks, nothing
[S, S] kept: indexer_kl_dense) /
the top-k only (ids from `indexer_topk`, the loss in O(S x K): indexer_kl).
The indexer input is detached in both KL modes (like Megatron-core: the KL loss trains the indexer
only) and the main attention target is detached. Attention is top-k sparse, except in a training stage's
`dense_warmup` (mla.set_indexer_mode): dense attention, the indexer trained by kl_dense's loss towards it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from spartron.checkpointing.replay import reuse_during_recompute
from spartron.layers.attention.context_parallel import gather_sequence
from spartron.layers.attention.indexer_kl import sparse_indexer_kl
from spartron.layers.attention.indexer_kl_dense import dense_indexer_kl
from spartron.layers.attention.indexer_topk import causal_visible, index_scores, indexer_topk, topk_ids
from spartron.layers.attention.rope import apply_rope
from spartron.layers.attention.sparse_mla_absorbed import AbsorbedQuery
from spartron.layers.config import ModelConfig, check_dsa, dsa_layers

DSARole = str | None  # None (dense attention), "source" (computes ids), "consumer" (reuses ids)

__all__ = ["DSARole", "LightningIndexer", "causal_visible", "dsa_schedule", "ids_for_layer", "index_scores",
           "topk_ids", "trained_indexer_ids_and_loss", "validate_dsa"]


def validate_dsa(cfg: ModelConfig) -> None:
    """Reject DSA settings that cannot work (the rule lives with the config: `check_dsa`); a
    ModelConfig changed field by field after validation is checked again here."""
    check_dsa(cfg)


def dsa_schedule(cfg: ModelConfig) -> list[DSARole]:
    """Role of every attention layer: entries 0..n_layers-1 are the decoder layers, entry
    n_layers + d is MTP depth d.

    DSA layers are grouped in order by `topk_freq`: the first of each group is a source, the rest
    consume the nearest preceding source's ids. MTP depths are DSA layers when `dsa.layers` is "moe"
    or "all" (MTP blocks are MoE blocks); depth 0 is a source and, with `share_indexer_across_mtp`,
    the later depths consume its ids (one indexer for all depths), otherwise each depth is a source.
    """
    roles: list[DSARole] = [None] * (cfg.n_layers + cfg.mtp.depth)
    if cfg.dsa is None:
        return roles
    validate_dsa(cfg)
    for j, layer in enumerate(dsa_layers(cfg)):
        roles[layer] = "source" if j % cfg.dsa.topk_freq == 0 else "consumer"
    if cfg.dsa.layers in ("moe", "all"):
        for d in range(cfg.mtp.depth):
            share = d > 0 and cfg.dsa.share_indexer_across_mtp
            roles[cfg.n_layers + d] = "consumer" if share else "source"
    return roles


def ids_for_layer(role: DSARole, latest_ids: Tensor | None) -> Tensor | None:
    """What a stack loop passes as `dsa_topk_ids`: the latest source's ids to consumers, else None."""
    if role != "consumer":
        return None
    if latest_ids is None:
        raise ValueError("a DSA consumer layer runs before any source produced ids (check model.dsa.layers)")
    return latest_ids


class LightningIndexer(nn.Module):
    """Projections of the lightning indexer; returns index queries, head weights and gathered keys."""

    def __init__(self, cfg: ModelConfig, cp_group=None) -> None:
        super().__init__()
        validate_dsa(cfg)
        dsa = cfg.dsa
        self.n_heads = dsa.n_index_heads
        self.head_dim = dsa.index_head_dim
        self.rope_dim = cfg.mla.qk_rope_head_dim
        self.topk = dsa.index_topk
        self.fp8 = dsa.indexer_fp8  # the frozen selection's dot in float8 e4m3 (model.dsa.indexer_fp8)
        self.deterministic = dsa.deterministic_dkv  # kl_sparse's key gradient in fixed point too (indexer_kl)
        self.kl_dense_chunk = dsa.kl_dense_chunk or None  # query rows per kl_dense chunk; None: derived
        self.cp_group = cp_group
        q_in = cfg.mla.q_lora_rank or cfg.dim
        self.wq_b = nn.Linear(q_in, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim)
        self.weights_proj = nn.Linear(cfg.dim, self.n_heads, bias=False)
        self.weight_scale = self.n_heads**-0.5 * self.head_dim**-0.5

    def _rope_front(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        pe, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rope(pe, cos, sin, interleaved=False), rest), dim=-1)

    def forward(self, x: Tensor, q_in: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B,S,D], q_in [B,S,q_lora or D] -> q [B,S,H,d], weights [B,S,H], keys [B,S_kv,d] (global)."""
        b, s, _ = x.shape
        q = self._rope_front(self.wq_b(q_in).view(b, s, self.n_heads, self.head_dim), cos, sin)
        k = self._rope_front(self.k_norm(self.wk(x)), cos, sin)
        weights = self.weights_proj(x) * self.weight_scale
        return q, weights, gather_sequence(k, self.cp_group, dim=1)

    def select_frozen(self, x: Tensor, q_in: Tensor, cos: Tensor, sin: Tensor, q_positions: Tensor,
                      k_positions: Tensor, q_starts: Tensor | None = None) -> Tensor:
        """Top-k ids under no_grad through `spartron::indexer_topk` (the Triton kernel on CUDA); `q_starts`:
        each query's document start, packed documents (attention.doc_mask)."""
        with torch.no_grad():
            q, weights, k = self(x, q_in, cos, sin)
            return indexer_topk(q, weights, k, q_positions, k_positions, self.topk, self.fp8, q_starts)


def trained_indexer_ids_and_loss(indexer: LightningIndexer, x: Tensor, q_in: Tensor, cos: Tensor, sin: Tensor,
                                 q_positions: Tensor, k_positions: Tensor, q_starts: Tensor | None,
                                 q_abs: Tensor | AbsorbedQuery,
                                 kv: Tensor, scale: float, sparse: bool, coeff: float) -> tuple[Tensor, Tensor]:
    """KL-trained indexer: ids (the selection reused on replay) and coeff * KL loss.

    Inputs are detached so the loss trains only the indexer; positions and `q_starts` (packed documents) as
    for `indexer_topk`. kl_sparse (V3.2's sparse stage): ids from `spartron::indexer_topk` (the Triton kernel
    on CUDA), then the loss over those ids in O(S x K) memory (indexer_kl). kl_dense (the dense warm-up) is
    a distribution over ALL visible keys: `spartron::kl_dense` walks it in query chunks (model.dsa.kl_dense_chunk)
    and picks the ids from the same scores, nothing [S, S_kv] kept (indexer_kl_dense). `q_abs`: the absorbed
    queries, or an AbsorbedQuery when the attention runs in query chunks (model.dsa.attention_chunk): both KL forms
    then absorb one chunk of rows at a time, nothing [S, H, c + r] made.
    """
    q, weights, k = indexer(x.detach(), q_in.detach(), cos, sin)
    if sparse:
        ids = reuse_during_recompute(indexer_topk, q.detach(), weights.detach(), k.detach(), q_positions,
                                     k_positions, indexer.topk, indexer.fp8, q_starts)
        return ids, coeff * sparse_indexer_kl(q, weights, k, ids, q_abs, kv, scale,
                                              deterministic=indexer.deterministic)
    ids, loss = dense_indexer_kl(q, weights, k, q_abs, kv, scale, q_positions, k_positions, q_starts, indexer.topk,
                                 indexer.kl_dense_chunk)
    return ids, coeff * loss
