"""The small model configs the Megatron adapter tests build GPTModels / blocks from (one definition for all).

Three layers by default (a dense first layer, then MoE), a vocabulary of 64: big enough that routing, DSA top-k
and the source / consumer split of DSA layers are exercised, small enough for a CPU test.
"""

from __future__ import annotations

from spartron.layers.config import ModelConfig

MLA_SMALL = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
MOE_SMALL = dict(n_routed_experts=4, n_shared_experts=1, top_k=2, moe_inter_dim=16, score_func="sigmoid",
                 dispatcher="all_to_all")
DSA_SMALL = dict(n_index_heads=2, index_head_dim=8, index_topk=4, topk_freq=2, layers="all")


def small_cfg(**kw) -> ModelConfig:
    """The small model, with `kw` replacing top-level fields (pass whole sub-configs: `moe={**MOE_SMALL, ...}`)."""
    base = dict(dim=32, n_layers=3, n_heads=2, first_k_dense=1, dense_inter_dim=48, mla=MLA_SMALL,
                moe=MOE_SMALL, vocab_size=64)
    return ModelConfig(**{**base, **kw})
