"""The indexer-quality metric against a brute-force reference (every query, non-absorbed attention, a sort for the
top-k), and the dense warm-up mode: attention exactly the dense model's, the loss kl_dense's."""

from __future__ import annotations

import pytest
import torch
from mla_reference import per_head_scores  # tests/mla_reference.py

from spartron.layers.attention.dsa import index_scores
from spartron.layers.attention.indexer_recall import dense_distribution, indexer_quality, sampled_rows
from spartron.layers.attention.mla import MLA, set_indexer_mode
from spartron.layers.config import ModelConfig


def make_cfg(dsa=True, **kw):
    return ModelConfig.model_validate(dict(
        dim=16, n_heads=3, n_layers=2, first_k_dense=1,
        mla=dict(q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
        dsa=dict(n_index_heads=3, index_head_dim=8, index_topk=4, indexer_mode="kl_sparse",
                 indexer_loss_coeff=0.5, **kw) if dsa else None))


def randomized(cfg, seed=0):
    m = MLA(cfg, 1).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.4 + (1.0 if p.dim() == 1 else 0.0))
    return m


def brute_force(m: MLA, x, pos):
    """Per query: head-summed, normalised dense attention (the non-absorbed per-head form, all S x S), the
    indexer's scores over all keys, its top-k by a full sort; -> recall [B,S], KL [B,S]."""
    b, n, _ = x.shape
    scores, cos, sin = per_head_scores(m, x, pos)
    causal = pos[None] <= pos[:, None]
    p = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1).sum(1)
    p = p / p.sum(-1, keepdim=True)
    qi, w, ki = m.indexer(x, m.q_norm(m.wq_a(x)), cos, sin)
    index = index_scores(qi, w, ki, causal)
    recall = torch.zeros(b, n, dtype=torch.float64)
    kl = torch.zeros(b, n, dtype=torch.float64)
    for bi in range(b):
        for t in range(n):
            visible = int(causal[t].sum())
            order = sorted(range(visible), key=lambda s: -float(index[bi, t, s]))[:m.cfg.dsa.index_topk]
            recall[bi, t] = sum(float(p[bi, t, s]) for s in order)
            logq = torch.log_softmax(index[bi, t, :visible], -1)
            kl[bi, t] = sum(float(p[bi, t, s] * (p[bi, t, s].log() - logq[s])) for s in range(visible))
    return recall, kl


def test_sampled_rows_spread_evenly_with_the_last_included():
    assert sampled_rows(9, 4, "cpu").tolist() == [0, 3, 5, 8]
    assert sampled_rows(3, 32, "cpu").tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="at least one sampled query, got 0"):
        sampled_rows(9, 0, "cpu")


@pytest.mark.parametrize("rows", [[0, 3, 5, 8], [8]])
def test_recall_and_kl_match_a_brute_force_reference(rows):
    m = randomized(make_cfg(), seed=3)
    x, pos = torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), torch.arange(9)
    with torch.no_grad():
        recall, kl = brute_force(m, x, pos)
        probe = m.indexer_probe(x, pos, torch.tensor(rows))
        got_recall, got_kl = indexer_quality(probe, m.softmax_scale, m.cfg.dsa.index_topk)
    want_recall, want_kl = recall[:, rows].mean(), kl[:, rows].mean()
    assert abs(float(got_recall) - float(want_recall)) < 1e-6 and abs(float(got_kl) - float(want_kl)) < 1e-6
    assert 0.3 < float(got_recall) < 1.0 and float(got_kl) > 1e-3  # a random indexer: neither perfect nor empty
    if rows == [0, 3, 5, 8]:  # query 0 sees one key, query 3 four = top-k: all its mass is captured
        assert abs(float(recall[:, [0, 3]].mean()) - 1.0) < 1e-12


def test_dense_distribution_is_the_same_for_any_head_chunk():
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, 3, 5, 7, generator=g, dtype=torch.float64), torch.randn(2, 6, 7, generator=g,
                                                                                  dtype=torch.float64)
    visible = torch.arange(6)[None] <= torch.tensor([1, 3, 5])[:, None]
    one, all_ = dense_distribution(q, kv, 0.3, visible, head_chunk=1), dense_distribution(q, kv, 0.3, visible)
    torch.testing.assert_close(one, all_, rtol=0, atol=1e-15)
    assert torch.equal(one[:, 0, 2:], torch.zeros(2, 4, dtype=torch.float64))  # invisible keys carry nothing


def test_dense_warmup_attends_as_the_dense_model_and_trains_only_the_indexer():
    m = randomized(make_cfg(), seed=5)
    dense = MLA(make_cfg(dsa=False), 1).double()
    dense.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("indexer.")})
    x, pos = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2)), torch.arange(7)
    assert set_indexer_mode(m, "dense_warmup") == 1 and set_indexer_mode(m, "dense_warmup") == 0
    out = m(x, pos)
    assert torch.equal(out["hidden_states"], dense(x, pos)["hidden_states"])  # the same dense path, bitwise
    m.indexer_mode = "kl_dense"  # the same KL loss: over all visible keys towards the dense attention
    torch.testing.assert_close(out["indexer_loss"], m(x, pos)["indexer_loss"], rtol=0, atol=1e-12)
    out["indexer_loss"].backward()
    assert sorted(n for n, p in m.named_parameters() if p.grad is not None) == sorted(
        "indexer." + n for n, _ in m.indexer.named_parameters())
    with pytest.raises(ValueError, match="indexer mode must be one of frozen, kl_dense, kl_sparse, dense_warmup"):
        set_indexer_mode(m, "dense")
