"""THE cost model of the reference model (spartron.layers.model): parameters, training FLOPs, state memory.

One place, read from the ModelConfig shapes the layers build, so `spartron plan` (parameters and
memory), the trainer's MFU and the benchmarks agree. Tested against the built model's numel and
against torch's FlopCounterMode over a forward + backward (tests/layers/test_costs.py).

FLOPs count what the layers compute, per trained token, forward + backward = 3 x forward:
- every projection (attention, FFN, the `top_k` routed and the shared experts, router, MTP
  projection, head): 6 x its parameters; embedding lookups, norms and elementwise work are not
  counted;
- dense attention: 2 x heads x (qk + v dims) per causally visible key (SDPA's QK^T and PV);
- DSA layers attend in the absorbed latent form (spartron.layers.attention.mla): 2 x heads x
  (kv_lora + rope + kv_lora) per selected key (at most `index_topk` visible keys);
- the lightning indexer runs only in DSA SOURCE layers (`dsa_schedule`; consumers reuse the ids):
  projections, and 2 x index heads x (index dim + 1) per visible key for the weighted scores. A
  frozen indexer runs forward only (no grad); a KL-trained one has detached inputs (its
  projections get weight gradients only: 2 x forward), trains its scores (3 x) and computes the
  main-attention target without grad over the visible keys (kl_dense) or the top-k (kl_sparse).
"""

from __future__ import annotations

from dataclasses import dataclass

from spartron.layers.attention.dsa import dsa_schedule
from spartron.layers.config import ModelConfig
from spartron.parallel.dims import ParallelDims

PARAM_BYTES = {"float32": 4, "bfloat16": 2}
OPTIMIZER_STATE_BYTES = {"adamw": 8, "muon": 4}  # fp32 exp_avg + exp_avg_sq / fp32 momentum


# ---- parameters ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamCount:
    """Parameters split the way they are sharded: dense (over fsdp x cp) and routed experts (over ep)."""

    dense: int
    experts: int

    @property
    def total(self) -> int:
        return self.dense + self.experts


def mla_matmul_params(m: ModelConfig) -> int:
    """wq (or wq_a + wq_b), wkv_a, wkv_b, wo."""
    a, h = m.mla, m.n_heads
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    q = m.dim * a.q_lora_rank + a.q_lora_rank * h * qk if a.q_lora_rank else m.dim * h * qk
    kv = m.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim)
    return q + kv + h * a.v_head_dim * m.dim


def indexer_matmul_params(m: ModelConfig) -> int:
    """The lightning indexer's wq_b (from the q latent, or x when q_lora_rank = 0), wk, weights_proj."""
    d = m.dsa
    q_in = m.mla.q_lora_rank or m.dim
    return q_in * d.n_index_heads * d.index_head_dim + m.dim * d.index_head_dim + m.dim * d.n_index_heads


def _moe_params(m: ModelConfig) -> ParamCount:
    e = m.moe
    shared = 3 * m.dim * e.moe_inter_dim * e.n_shared_experts
    router = m.dim * e.n_routed_experts  # the expert bias is a buffer, not a parameter
    return ParamCount(dense=shared + router, experts=3 * m.dim * e.moe_inter_dim * e.n_routed_experts)


def count_parameters(m: ModelConfig) -> ParamCount:
    """Parameter count of the reference model, norms included.

    Only DSA source layers own an indexer; consumers reuse the source's top-k ids.
    """
    roles = dsa_schedule(m)
    mla = mla_matmul_params(m) + m.mla.q_lora_rank + m.mla.kv_lora_rank  # + q_norm, kv_norm
    indexer = indexer_matmul_params(m) + 2 * m.dsa.index_head_dim if m.dsa is not None else 0  # + k_norm
    dense, experts = m.vocab_size * m.dim * (1 if m.tie_embeddings else 2) + m.dim, 0
    for layer in range(m.n_layers):
        dense += 2 * m.dim + mla + (indexer if roles[layer] == "source" else 0)
        if layer < m.first_k_dense:
            dense += 3 * m.dim * m.dense_inter_dim
        else:
            moe = _moe_params(m)
            dense, experts = dense + moe.dense, experts + moe.experts
    mtp_blocks = (1 if m.mtp.share_weights else m.mtp.depth) if m.mtp.depth else 0
    for depth in range(mtp_blocks):
        moe = _moe_params(m)
        dense += 2 * m.dim * m.dim + 5 * m.dim + mla + (indexer if roles[m.n_layers + depth] == "source" else 0)
        dense, experts = dense + moe.dense, experts + moe.experts
    return ParamCount(dense=dense, experts=experts)


# ---- FLOPs -------------------------------------------------------------------------------------
def mean_visible_keys(seq_len: int, cap: int | None) -> float:
    """Average number of keys a causal query attends to over positions 0..seq_len-1 (capped at top-k)."""
    if cap is None or cap >= seq_len:
        return (seq_len + 1) / 2
    return (cap * (cap + 1) / 2 + cap * (seq_len - cap)) / seq_len


@dataclass(frozen=True)
class FlopParts:
    """Training FLOPs per token by kind (see the module docstring); `total` is what MFU divides by."""

    projections: float  # 6 x active matmul parameters, head and MTP projections included
    attention: float  # dense SDPA and sparse (absorbed) attention cores, forward + backward
    indexer_projections: float
    indexer_scores: float  # the weighted index scores, and the KL target of a trained indexer

    @property
    def total(self) -> float:
        return self.projections + self.attention + self.indexer_projections + self.indexer_scores


def _ffn_active_params(m: ModelConfig, moe: bool) -> int:
    if not moe:
        return 3 * m.dim * m.dense_inter_dim
    e = m.moe
    return (e.top_k + e.n_shared_experts) * 3 * m.dim * e.moe_inter_dim + m.dim * e.n_routed_experts


def training_flop_parts(m: ModelConfig, seq_len: int) -> FlopParts:
    """FLOPs of one trained token of a `seq_len` sequence, decoder layers and MTP depths included."""
    a, h = m.mla, m.n_heads
    dense_per_key = 2 * h * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)
    sparse_per_key = 2 * h * (2 * a.kv_lora_rank + a.qk_rope_head_dim)
    all_keys = mean_visible_keys(seq_len, None)
    roles = dsa_schedule(m)
    proj = attn = idx_proj = idx_scores = 0.0
    for layer, role in enumerate(roles):
        moe = layer >= m.first_k_dense  # MTP depths (layer >= n_layers) are MoE blocks
        proj += 6 * (mla_matmul_params(m) + _ffn_active_params(m, moe))
        if role is None:
            attn += 3 * dense_per_key * all_keys
            continue
        d = m.dsa
        topk_keys = mean_visible_keys(seq_len, d.index_topk)
        attn += 3 * sparse_per_key * topk_keys
        if role != "source":
            continue
        scores = 2 * d.n_index_heads * (d.index_head_dim + 1) * all_keys
        if d.indexer_mode == "frozen":
            idx_proj += 2 * indexer_matmul_params(m)
            idx_scores += scores
        else:
            target_keys = all_keys if d.indexer_mode == "kl_dense" else topk_keys
            idx_proj += 4 * indexer_matmul_params(m)
            idx_scores += 3 * scores + 2 * h * (a.kv_lora_rank + a.qk_rope_head_dim) * target_keys
    head = 6 * m.dim * m.vocab_size
    proj += head + m.mtp.depth * (6 * 2 * m.dim * m.dim + head)
    return FlopParts(projections=proj, attention=attn, indexer_projections=idx_proj, indexer_scores=idx_scores)


def training_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one trained token (the MFU numerator over tokens/s): `training_flop_parts(...).total`."""
    return training_flop_parts(m, seq_len).total


# ---- memory --------------------------------------------------------------------------------------
def state_bytes_per_rank(m: ModelConfig, dims: ParallelDims, optimizer: str) -> dict[str, int]:
    """Bytes per rank of parameters, gradients and optimizer state (+ fp32 master copy for bf16), after
    dense parameters are sharded over fsdp x cp and routed experts over ep x expert_fsdp."""
    params = count_parameters(m)
    local = params.dense / (dims.fsdp * dims.cp) + params.experts / (dims.ep * dims.expert_fsdp)
    width = PARAM_BYTES[m.dtype]
    out = {
        "parameters": int(local * width),
        "gradients": int(local * width),
        "optimizer_state": int(local * OPTIMIZER_STATE_BYTES[optimizer]),
        "master_weights": int(local * 4) if width < 4 else 0,
    }
    out["total"] = sum(out.values())
    return out
