"""Multi-head latent attention (DeepSeek-V3), with DeepSeek sparse attention on DSA layers.

q = wq_b(q_norm(wq_a(x))) (or wq(x) when q_lora_rank = 0), split per head into a no-RoPE part and
a RoPE part; wkv_a(x) gives the compressed KV: a latent (kv_lora_rank, RMS-normed) and ONE rope key
shared by all heads. RoPE pairs are interleaved (DeepSeek reference), optional YaRN scales the
frequencies and the softmax scale (mscale^2). Under context parallelism the compressed KV
(latent ++ rope key, kv_lora_rank + rope dims per token) is what is all-gathered.

Dense layers expand the gathered latent with wkv_b and run causal SDPA. DSA layers stay in the
latent ("absorbed") form: W_uk is folded into the query, so each query attends over the 576-wide
(V3 shapes) latent rows selected by the indexer through `spartron::sparse_mla`, and W_uv maps the
attended latent back to per-head values. The two forms are the same function of the weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spartron.checkpointing.replay import reuse_during_recompute
from spartron.layers.attention.absorb import absorb_output, absorb_query
from spartron.layers.attention.context_parallel import (
    check_local_positions,
    cp_positions,
    cp_size_of,
    gather_sequence,
)
from spartron.layers.attention.doc_mask import check_document_positions, document_attention
from spartron.layers.attention.dsa import (
    LightningIndexer,
    causal_visible,
    dsa_schedule,
    trained_indexer_ids_and_loss,
)
from spartron.layers.attention.indexer_topk import visible_keys
from spartron.layers.attention.rope import apply_rope, mla_softmax_scale, rope_cos_sin
from spartron.layers.attention.sparse_mla import sparse_mla
from spartron.layers.attention.sparse_mla_absorbed import AbsorbedQuery, sparse_mla_absorbed
from spartron.layers.config import ModelConfig
from spartron.layers.norms import RMSNorm
from spartron.layers.outputs import AttentionOutput

INDEXER_MODES = ("frozen", "kl_dense", "kl_sparse", "dense_warmup")


def set_indexer_mode(model: nn.Module, mode: str) -> int:
    """Run every DSA layer of `model` in `mode` from its next forward (a training stage's switch,
    spartron.runtime.stages); returns how many layers changed. "dense_warmup": full causal attention, the
    indexer trained by KL towards its head-summed distribution over all visible keys (DeepSeek-V3.2's
    warm-up); the others as model.dsa.indexer_mode."""
    if mode not in INDEXER_MODES:
        raise ValueError(f"indexer mode must be one of {', '.join(INDEXER_MODES)}, got {mode!r}")
    changed = 0
    for module in model.modules():
        if isinstance(module, MLA) and module.dsa_role is not None and module.indexer_mode != mode:
            module.indexer_mode = mode
            changed += 1
    return changed


class MLA(nn.Module):
    """MLA attention of decoder layer `layer_idx` (n_layers + d for MTP depth d).

    forward(x [B,S_local,D], positions [S_local] int64 global positions, dsa_topk_ids) -> AttentionOutput.
    `dsa_topk_ids` goes to consumer layers only (see `spartron.layers.attention.dsa.ids_for_layer`); an MTP
    source layer also accepts them, which is how one weight-shared MTP block computes ids at depth 0
    and reuses them at later depths.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, cp_group=None) -> None:
        super().__init__()
        mla = cfg.mla
        roles = dsa_schedule(cfg)
        if not 0 <= layer_idx < len(roles):
            raise ValueError(f"MLA layer_idx {layer_idx} outside 0..{len(roles) - 1} "
                             "(model.n_layers decoder layers, then model.mtp.depth MTP depths)")
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.dsa_role = roles[layer_idx]
        self.is_mtp = layer_idx >= cfg.n_layers
        self.cp_group = cp_group
        self.n_heads = cfg.n_heads
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        self.softmax_scale = mla_softmax_scale(mla)
        self.q_lora = mla.q_lora_rank > 0  # compressed query (wq_a, q_norm, wq_b) or one wq
        if self.q_lora:
            self.wq_a = nn.Linear(cfg.dim, mla.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(mla.q_lora_rank, eps=cfg.norm_eps)
            self.wq_b = nn.Linear(mla.q_lora_rank, self.n_heads * self.qk_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, self.n_heads * self.qk_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, eps=cfg.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, self.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_dim, cfg.dim, bias=False)
        self.indexer = LightningIndexer(cfg, cp_group) if self.dsa_role == "source" else None
        # How a DSA layer attends and trains its indexer: model.dsa.indexer_mode, or a training stage's
        # "dense_warmup" (full causal attention, the indexer trained by KL to it): set_indexer_mode.
        self.indexer_mode = cfg.dsa.indexer_mode if self.dsa_role is not None else None

    def _query(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Per-head queries [B,S,H,qk_dim] and the indexer's query input (q latent, or x)."""
        if self.q_lora:
            q_latent = self.q_norm(self.wq_a(x))
            return self.wq_b(q_latent).unflatten(-1, (self.n_heads, self.qk_dim)), q_latent
        return self.wq(x).unflatten(-1, (self.n_heads, self.qk_dim)), x

    def forward(self, x: Tensor, positions: Tensor, dsa_topk_ids: Tensor | None = None) -> AttentionOutput:
        self._check_inputs(x, positions, dsa_topk_ids)
        cos, sin, q_nope, q_pe, q_in, kv, k_positions = self._project(x, positions)
        if self.dsa_role is None or self.indexer_mode == "dense_warmup":
            out = self._dense(q_nope, q_pe, kv, positions, k_positions)
            if self.dsa_role != "source":  # a consumer in the dense warm-up passes its source's ids on unused
                return AttentionOutput(hidden_states=out, dsa_topk_ids=None, indexer_loss=None)
            ids, loss = self._indexer_kl(x, q_in, q_nope, q_pe, kv, cos, sin, positions, k_positions, sparse=False)
            return AttentionOutput(hidden_states=out, dsa_topk_ids=ids, indexer_loss=loss)
        return self._sparse(x, q_in, q_nope, q_pe, kv, cos, sin, positions, k_positions, dsa_topk_ids)

    def _project(self, x: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        """RoPE tables, per-head query parts, the indexer's query input, the gathered compressed KV rows and
        the key positions: what every attention form starts from."""
        cos, sin = rope_cos_sin(positions, self.cfg.mla)
        q, q_in = self._query(x)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin, interleaved=True)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        compressed = torch.cat((self.kv_norm(latent), apply_rope(k_pe, cos, sin, interleaved=True)), dim=-1)
        kv = gather_sequence(compressed, self.cp_group, dim=1)  # [B, S_kv, kv_lora + rope], global order
        return cos, sin, q_nope, q_pe, q_in, kv, self._key_positions(positions)

    def indexer_probe(self, x: Tensor, positions: Tensor, rows: Tensor) -> dict[str, Tensor]:
        """What the indexer-quality metric (spartron.layers.attention.indexer_recall) reads, no gradient: at
        local query `rows` only, the absorbed queries, the indexer's queries and head weights, the visibility
        and the query positions; all keys (latent rows, index keys) and their positions. A DSA source only."""
        if self.indexer is None:
            raise ValueError(f"layer {self.layer_idx} has no indexer (it is not a DSA source)")
        with torch.no_grad():
            cos, sin = rope_cos_sin(positions, self.cfg.mla)
            latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
            compressed = torch.cat((self.kv_norm(latent), apply_rope(k_pe, cos, sin, interleaved=True)), dim=-1)
            kv = gather_sequence(compressed, self.cp_group, dim=1)
            k_positions = self._key_positions(positions)
            q_pos, q_starts = self._query_positions(positions, k_positions)
            # the indexer over all rows (its keys need them); the main queries at the sampled rows only
            q_idx, weights, k_idx = self.indexer(x, self.q_norm(self.wq_a(x)) if self.q_lora else x, cos, sin)
            q, _ = self._query(x[:, rows])
            cos_r, sin_r = rope_cos_sin(positions[..., rows], self.cfg.mla)
            q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
            q_abs = absorb_query(q_nope, apply_rope(q_pe, cos_r, sin_r, interleaved=True), self._absorbed_weights()[0])
            starts = None if q_starts is None else q_starts[:, rows]
            return {"q_abs": q_abs, "kv": kv, "q_index": q_idx[:, rows], "weights": weights[:, rows], "k_index": k_idx,
                    "q_positions": q_pos[rows], "k_positions": k_positions, "q_starts": starts,
                    "visible": visible_keys(q_pos[rows], k_positions, starts)}

    def _check_inputs(self, x: Tensor, positions: Tensor, ids: Tensor | None) -> None:
        if x.dim() != 3 or x.shape[-1] != self.cfg.dim:
            raise ValueError(f"MLA expects x [B, S_local, {self.cfg.dim}], got {tuple(x.shape)}")
        if positions.dim() == 2:  # packed documents (attention.doc_mask): per-document positions of these tokens
            check_document_positions(positions, x.shape[0], x.shape[1])
        else:
            if positions.dtype != torch.int64 or positions.shape != (x.shape[1],):
                raise ValueError(f"MLA expects positions int64 [{x.shape[1]}], got {positions.dtype} "
                                 f"{tuple(positions.shape)}")
            if not torch.compiler.is_compiling():  # its torch.equal is data-dependent: a compiled region (fed
                check_local_positions(positions, self.cp_group)  # by the model's own cp_positions) skips it
        if ids is None:
            if self.dsa_role == "consumer":
                raise ValueError(f"layer {self.layer_idx} is a DSA consumer: pass the source layer's "
                                 "dsa_topk_ids")
            return
        if self.dsa_role is None or (self.dsa_role == "source" and not self.is_mtp):
            kind = "a dense-attention" if self.dsa_role is None else "a DSA source"
            raise ValueError(f"layer {self.layer_idx} is {kind} layer and takes no dsa_topk_ids "
                             "(pass them only to consumers: spartron.layers.attention.dsa.ids_for_layer)")
        if ids.dtype != torch.int32 or ids.dim() != 3 or ids.shape[:2] != x.shape[:2]:
            raise ValueError(f"dsa_topk_ids must be int32 [B, S_local, K] matching x {tuple(x.shape[:2])}, "
                             f"got {ids.dtype} {tuple(ids.shape)}")

    def _key_positions(self, positions: Tensor) -> Tensor:
        cp = cp_size_of(self.cp_group)
        if cp == 1 and positions.dim() == 1:
            return positions
        return torch.arange(positions.shape[-1] * cp, device=positions.device)

    def _query_index(self, positions: Tensor) -> Tensor | None:
        """Packed documents under CP: the global indices of this rank's queries (None without CP)."""
        cp = cp_size_of(self.cp_group)
        return None if cp == 1 else cp_positions(positions.shape[-1] * cp, self.cp_group, positions.device)

    def _dense(self, q_nope: Tensor, q_pe: Tensor, kv: Tensor, positions: Tensor,
               k_positions: Tensor) -> Tensor:
        b, s, h, _ = q_nope.shape
        latent, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_nope, v = self.wkv_b(latent).unflatten(-1, (h, self.nope_dim + self.v_dim)).split(
            [self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, :, None, :].expand(-1, -1, h, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        if positions.dim() == 2:  # packed documents: block-causal (spartron.layers.attention.doc_mask)
            out = document_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions,
                                     self.softmax_scale, self._query_index(positions))
            return self.wo(out.transpose(1, 2).reshape(b, s, h * self.v_dim))
        if cp_size_of(self.cp_group) == 1:  # keys are the local tokens in order: plain causal (a 1-rank
            mask, causal = None, True      # CP group too: an explicit mask runs cuDNN's 3-4x slower kernel)
        else:
            mask, causal = causal_visible(positions, k_positions), False
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=causal, scale=self.softmax_scale)
        return self.wo(out.transpose(1, 2).reshape(b, s, h * self.v_dim))

    def _absorbed_weights(self) -> tuple[Tensor, Tensor]:
        """W_uk [H, nope, kv_lora] and W_uv [H, v, kv_lora] views of wkv_b."""
        w = self.wkv_b.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _query_positions(self, positions: Tensor, k_positions: Tensor) -> tuple[Tensor, Tensor | None]:
        """The queries' key-axis positions and, with packed documents, their documents' starts."""
        if positions.dim() != 2:
            return positions, None
        q_index = self._query_index(positions)  # packed documents: the queries' global indices
        q_pos = k_positions[:positions.shape[-1]] if q_index is None else q_index
        return q_pos, q_pos[None] - positions

    def _indexer_kl(self, x, q_in, q_nope, q_pe, kv, cos, sin, positions, k_positions, sparse: bool):
        """The KL-trained indexer's ids and loss (dsa.trained_indexer_ids_and_loss): sparse over its top-k, or
        dense over all visible keys, towards the main attention, which the absorbed queries compute."""
        q_pos, q_starts = self._query_positions(positions, k_positions)
        w_uk, chunk = self._absorbed_weights()[0], self.cfg.dsa.attention_chunk
        with torch.no_grad():  # the target is detached: no graph through the absorbed queries
            q_abs = AbsorbedQuery(q_nope, q_pe, w_uk, chunk) if chunk else absorb_query(q_nope, q_pe, w_uk)
        return trained_indexer_ids_and_loss(self.indexer, x, q_in, cos, sin, q_pos, k_positions, q_starts, q_abs,
                                            kv, self.softmax_scale, sparse=sparse,
                                            coeff=self.cfg.dsa.indexer_loss_coeff)

    def _sparse(self, x, q_in, q_nope, q_pe, kv, cos, sin, positions, k_positions, ids) -> AttentionOutput:
        """Top-k sparse attention in the absorbed form; model.dsa.attention_chunk > 0: in query chunks
        (sparse_mla_absorbed), the absorbed query never whole (the KL target reads it chunk by chunk)."""
        w_uk, w_uv = self._absorbed_weights()
        chunk = self.cfg.dsa.attention_chunk
        q_abs = AbsorbedQuery(q_nope, q_pe, w_uk, chunk) if chunk else absorb_query(q_nope, q_pe, w_uk)
        loss = None
        if ids is None:  # a source computing its ids
            q_pos, q_starts = self._query_positions(positions, k_positions)
            if self.indexer_mode == "frozen":
                ids = reuse_during_recompute(self.indexer.select_frozen, x, q_in, cos, sin, q_pos, k_positions,
                                             q_starts)
            else:
                ids, loss = trained_indexer_ids_and_loss(
                    self.indexer, x, q_in, cos, sin, q_pos, k_positions, q_starts, q_abs, kv,
                    self.softmax_scale, sparse=self.indexer_mode == "kl_sparse",
                    coeff=self.cfg.dsa.indexer_loss_coeff)
        deterministic = self.cfg.dsa.deterministic_dkv
        if chunk:
            heads = sparse_mla_absorbed(q_nope, q_pe, kv, ids, w_uk, w_uv, self.softmax_scale, chunk, deterministic)
        else:
            out_latent, _ = sparse_mla(q_abs, kv, ids, self.softmax_scale, self.kv_lora_rank,
                                       deterministic=deterministic)
            heads = absorb_output(out_latent, w_uv)
        return AttentionOutput(hidden_states=self.wo(heads), dsa_topk_ids=ids, indexer_loss=loss)
