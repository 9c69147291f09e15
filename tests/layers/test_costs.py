"""The one cost model: parameters against the built model, FLOPs by hand and against FlopCounterMode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from spartron.layers.attention.dsa import dsa_schedule
from spartron.layers.config import ModelConfig
from spartron.layers.costs import (
    count_parameters,
    indexer_matmul_params,
    mean_visible_keys,
    state_bytes_per_rank,
    training_flop_parts,
    training_flops_per_token,
)
from spartron.layers.model import build_model
from spartron.parallel.dims import ParallelDims
from spartron.runtime.config import load_config

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")
TINY_DENSE = {"vocab_size": 10, "dim": 4, "n_layers": 1, "n_heads": 1, "first_k_dense": 1,
              "dense_inter_dim": 8,
              "mla": {"q_lora_rank": 0, "kv_lora_rank": 2, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2,
                      "v_head_dim": 2}}


# ---- parameters ----------------------------------------------------------------------------------
def test_parameter_count_matches_hand_count():
    m = ModelConfig(vocab_size=10, dim=4, n_layers=2, n_heads=2, first_k_dense=1, dense_inter_dim=6,
                    mla={"q_lora_rank": 0, "kv_lora_rank": 3, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2,
                         "v_head_dim": 2},
                    moe={"n_routed_experts": 4, "n_shared_experts": 1, "top_k": 2, "moe_inter_dim": 5})
    mla = 4 * 2 * 4 + 4 * (3 + 2) + 3 + 3 * 2 * (2 + 2) + 2 * 2 * 4  # wq, wkv_a, kv_norm, wkv_b, wo
    embed_head_norm = 10 * 4 * 2 + 4
    dense_layer = 2 * 4 + mla + 3 * 4 * 6
    moe_layer_dense = 2 * 4 + mla + 3 * 4 * 5 * 1 + 4 * 4  # norms, attn, shared expert, router
    count = count_parameters(m)
    assert count.experts == 4 * 3 * 4 * 5
    assert count.dense == embed_head_norm + dense_layer + moe_layer_dense


@pytest.mark.parametrize("overrides", [
    [], ["model.mtp.share_weights=false"], ["model.mla.q_lora_rank=0", "model.tie_embeddings=true"],
    ['model.dsa.layers="all"', "model.mtp.depth=0"],
    ["model.dsa.share_indexer_across_mtp=false", "model.mtp.share_weights=false"],
])
def test_parameter_count_equals_the_reference_model(overrides):
    cfg = load_config(TINY, overrides)
    model = build_model(cfg.model)
    count = count_parameters(cfg.model)
    assert count.total == sum(p.numel() for p in model.parameters())
    assert count.experts == sum(p.numel() for n, p in model.named_parameters()
                                if ".experts." in n and "shared" not in n)


def test_state_bytes_shard_over_fsdp_cp_and_count_optimizer_state():
    cfg = load_config(TINY)
    one = state_bytes_per_rank(cfg.model, ParallelDims(1, fsdp=1), "adamw")
    dims = ParallelDims(4, fsdp=2, cp=2, ep=2)
    four = [state_bytes_per_rank(cfg.model, dims, "adamw", rank) for rank in range(4)]
    n = count_parameters(cfg.model).total
    model = build_model(cfg.model)
    frozen = sum(p.numel() for name, p in model.named_parameters() if ".indexer." in name)  # no grad, no state
    assert cfg.model.dsa.indexer_mode == "frozen" and frozen == 6624
    t = n - frozen
    assert one == {"parameters": 4 * n, "gradients": 4 * t, "optimizer_state": 8 * t, "total": 4 * n + 12 * t}
    assert sum(f["parameters"] for f in four) == one["parameters"]  # shards, uneven (2-row weights over 4)
    assert four[0]["parameters"] == max(f["parameters"] for f in four) > one["parameters"] // 4
    bf16 = state_bytes_per_rank(load_config(TINY, ['model.dtype="bfloat16"']).model, ParallelDims(1, fsdp=1),
                                "muon")
    muon = sum(p.numel() for name, p in model.named_parameters() if p.ndim in (2, 3) and ".indexer." not in name
               and cfg.model.vocab_size not in p.shape)  # one momentum (experts too); the rest AdamW's two
    assert bf16["parameters"] == 2 * n and bf16["optimizer_state"] == 2 * (muon + 2 * (t - muon))


def test_frozen_indexer_has_no_gradient_or_optimizer_state_in_the_plan():
    """model.dsa.indexer_mode = "frozen" selects under no_grad: a built tiny rank (world 1) holds 6,624 fewer
    gradient elements at the optimizer step and no moments for them (audit F9: the planner counted both).
    A trained (kl_dense) indexer has both."""
    cfg = load_config(TINY)
    plan = state_bytes_per_rank(cfg.model, ParallelDims(1, fsdp=1), "adamw")
    trained = load_config(TINY, ['model.dsa.indexer_mode="kl_dense"', "model.dsa.indexer_loss_coeff=0.1"])
    kl = state_bytes_per_rank(trained.model, ParallelDims(1, fsdp=1), "adamw")
    assert kl["gradients"] - plan["gradients"] == 4 * 6624
    assert kl["optimizer_state"] - plan["optimizer_state"] == 8 * 6624
    assert kl["parameters"] == plan["parameters"]
    model = build_model(cfg.model)  # what exists: after a backward the frozen indexer's grads are still None
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens)["loss"].backward()
    assert sum(p.numel() for p in model.parameters() if p.grad is None) == 6624


# ---- FLOPs by hand -------------------------------------------------------------------------------
def test_flops_of_a_dense_layer_by_hand():
    # attention matmul params: q 4*4 + kv_a 4*(2+2) + kv_b 2*(2+2) + o 2*4 = 48; ffn 3*4*8 = 96
    # 6 * (48 + 96) = 864; causal attention 3 * 2*(2+2+2) * (4+1)/2 = 90; head 6*4*10 = 240
    assert training_flops_per_token(ModelConfig(**TINY_DENSE), seq_len=4) == 864 + 90 + 240


def test_flops_of_moe_mtp_and_frozen_dsa_by_hand():
    cfg = ModelConfig(**{**TINY_DENSE, "first_k_dense": 0,
                         "moe": {"n_routed_experts": 4, "n_shared_experts": 1, "top_k": 2,
                                 "moe_inter_dim": 3},
                         "dsa": {"n_index_heads": 2, "index_head_dim": 2, "index_topk": 2},
                         "mtp": {"depth": 1}})
    moe = 3 * 3 * 4 * 3 + 4 * 4  # (top_k + shared) experts of 3*dim*inter, router dim x experts
    attn_params = 48
    indexer_params = 4 * 2 * 2 + 4 * 2 + 4 * 2  # q (q_lora 0: from x), k, head weights
    sparse_per_key = 2 * 1 * (2 + 2 + 2)  # absorbed: scores over kv_lora + rope, values over kv_lora
    # top-2 of 1, 2, 2, 2 visible keys: 1.75 keys; the indexer scores all 2.5 visible keys (2 heads x (2 + 1))
    layer = 6 * (attn_params + moe) + 3 * sparse_per_key * 1.75 + 2 * indexer_params + 2 * 2 * 3 * 2.5
    head = 6 * 4 * 10
    expected = layer + head + (layer + 6 * 2 * 4 * 4 + head)  # MTP depth 0 is a source too
    assert training_flops_per_token(cfg, seq_len=4) == pytest.approx(expected)


def test_only_dsa_source_layers_are_charged_an_indexer():
    cfg = load_config(TINY, ["model.mtp.depth=0"]).model  # DSA on layers 1, 2, 3; topk_freq 2: 1 and 3 source
    parts = training_flop_parts(cfg, 64)
    assert [r for r in dsa_schedule(cfg)] == [None, "source", "consumer", "source"]
    assert parts.indexer_projections == 2 * 2 * indexer_matmul_params(cfg)
    assert parts.indexer_scores == 2 * (2 * 2 * (16 + 1) * 32.5)
    every = training_flop_parts(load_config(TINY, ["model.mtp.depth=0", "model.dsa.topk_freq=1"]).model, 64)
    assert every.indexer_projections == 3 * 2 * indexer_matmul_params(cfg)


def test_mean_visible_keys_matches_brute_force():
    for seq, cap in [(4, 2), (7, 3), (5, None), (5, 9)]:
        brute = sum(min(cap or 10**9, t + 1) for t in range(seq)) / seq
        assert mean_visible_keys(seq, cap) == pytest.approx(brute)


# ---- FLOPs against torch's FlopCounterMode ------------------------------------------------------
@pytest.mark.parametrize("indexer", ["frozen", "kl_dense", "kl_sparse"])
def test_flops_equal_flop_counter_mode_on_the_tiny_preset(indexer):
    """Forward + backward of the tiny preset (no AC, local dispatcher) under FlopCounterMode.

    FlopCounterMode counts aten matmuls (mm, bmm; einsum and SDPA's CPU math decompose to them), so it
    and the model agree exactly on every projection and indexer projection. The remaining differences,
    each computed here from the shapes:
    - SDPA (dense layer 0): counted over the whole S x S square; the model counts causal pairs only.
    - `spartron::sparse_mla` (DSA layers) and the frozen indexer's `spartron::indexer_topk` (scores and
      top-k in one op): custom ops with no flop formula, so not counted at all.
    - index scores: the indexer computes all S x S pairs and masks; the model counts visible pairs.
      kl_sparse's slot scores and their backward (`spartron::kl_selected_scores[_backward]`) and its KL
      target (`spartron::kl_sparse_target`) are custom ops too, so not counted; its selection is inside
      indexer_topk.
    - kl_dense's scores, KL target and their backward: inside the custom ops spartron::kl_dense[_backward]
      (query chunks, attention.indexer_kl_dense), not counted.
    - the MoE combine's gate-weighted sum of the top-k expert rows (and, in backward, the weights' gradient) is
      the custom op spartron::moe_combine: not counted, and the model, like MFU conventions, does not count it.
    The attention cores the counter skips are checked against a brute-force count over the causal mask.
    """
    extra = [] if indexer == "frozen" else [f'model.dsa.indexer_mode="{indexer}"', "model.dsa.indexer_loss_coeff=0.1"]
    cfg = load_config(TINY, ['model.moe.dispatcher="local"', *extra]).model
    batch, seq = 2, 64
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        model(tokens, tokens.roll(-1, dims=1))["loss"].backward()

    parts, roles, a, d = training_flop_parts(cfg, seq), dsa_schedule(cfg), cfg.mla, cfg.dsa
    n_tok = batch * seq
    n_dense, n_sources = roles.count(None), roles.count("source")
    dense_per_key = 2 * cfg.n_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)
    score_factor = {"frozen": 1, "kl_dense": 3, "kl_sparse": 1}[indexer]  # over the visible keys
    # every mode's index scores and KL target run inside custom ops (spartron::indexer_topk, kl_dense, kl_sparse's),
    # unseen by the counter
    expected = (n_tok * (parts.projections + parts.indexer_projections)
                + n_dense * n_tok * seq * 3 * dense_per_key)
    assert counter.get_total_flops() == expected

    causal = sum(t + 1 for t in range(seq))
    picked = sum(min(d.index_topk, t + 1) for t in range(seq))
    sparse_per_key = 2 * cfg.n_heads * (2 * a.kv_lora_rank + a.qk_rope_head_dim)
    assert parts.attention * seq == pytest.approx(3 * (n_dense * dense_per_key * causal
                                                       + (len(roles) - n_dense) * sparse_per_key * picked))
    target = {"frozen": 0, "kl_dense": causal, "kl_sparse": picked}[indexer]
    trained_slots = picked if indexer == "kl_sparse" else 0
    assert parts.indexer_scores * seq == pytest.approx(n_sources * (
        score_factor * 2 * d.n_index_heads * (d.index_head_dim + 1) * causal
        + 3 * 2 * d.n_index_heads * (d.index_head_dim + 1) * trained_slots
        + 2 * cfg.n_heads * (a.kv_lora_rank + a.qk_rope_head_dim) * target))
