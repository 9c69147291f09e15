"""Lightning indexer, top-k, KL loss, source/consumer schedule, frozen indexer under AC."""

from __future__ import annotations

import pytest
import torch
from mla_reference import per_head_scores  # tests/mla_reference.py
from torch import nn

from spartron.checkpointing import checkpoint
from spartron.layers.attention.dsa import LightningIndexer, dsa_schedule, ids_for_layer, index_scores, topk_ids
from spartron.layers.attention.mla import MLA
from spartron.layers.attention.rope import rope_cos_sin
from spartron.layers.config import ModelConfig

DSA = dict(n_index_heads=3, index_head_dim=8, index_topk=4, topk_freq=2)


def make_cfg(n_layers=5, first_k_dense=1, mtp_depth=0, share_mtp=True, **dsa):
    return ModelConfig.model_validate(dict(
        dim=16, n_heads=2, n_layers=n_layers, first_k_dense=first_k_dense, mtp=dict(depth=mtp_depth),
        mla=dict(q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
        dsa={**DSA, "share_indexer_across_mtp": share_mtp, **dsa}))


def randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3 + (1.0 if p.dim() == 1 else 0.0))


def literal_index_scores(ix: LightningIndexer, mla_cfg, x, q_in, positions):
    """I[t,s] = sum_h w[t,h] ReLU(q[t,h] . k[s]) written out with loops; -inf for s > t."""
    cos, sin = rope_cos_sin(positions, mla_cfg)
    r = ix.rope_dim

    def rope_half(v, t):  # rotate (v[i], v[i + r/2]) by angle pos*freq_i on the first r dims
        a, b = v[: r // 2], v[r // 2 : r]
        c, s = cos[t].to(v.dtype), sin[t].to(v.dtype)
        return torch.cat([a * c - b * s, a * s + b * c, v[r:]])

    b, n = x.shape[:2]
    qs = ix.wq_b(q_in).view(b, n, ix.n_heads, ix.head_dim)
    ks = ix.k_norm(ix.wk(x))
    w = ix.weights_proj(x) / (ix.n_heads**0.5 * ix.head_dim**0.5)
    out = torch.full((b, n, n), float("-inf"), dtype=x.dtype)
    for bi in range(b):
        for t in range(n):
            for s in range(t + 1):
                k = rope_half(ks[bi, s], s)
                out[bi, t, s] = sum(w[bi, t, h] * torch.relu(rope_half(qs[bi, t, h], t) @ k)
                                    for h in range(ix.n_heads))
    return out


def test_indexer_scores_and_topk_match_literal_formula():
    torch.manual_seed(0)
    cfg = make_cfg()
    ix = LightningIndexer(cfg).double()
    randomize(ix)
    x, q_in = torch.randn(2, 6, 16, dtype=torch.float64), torch.randn(2, 6, 12, dtype=torch.float64)
    positions = torch.arange(6)
    cos, sin = rope_cos_sin(positions, cfg.mla)
    q, w, k = ix(x, q_in, cos, sin)
    visible = positions[None, :] <= positions[:, None]
    scores = index_scores(q, w, k, visible)
    expected = literal_index_scores(ix, cfg.mla, x, q_in, positions)
    torch.testing.assert_close(scores.double(), expected, rtol=1e-5, atol=1e-6)
    ids = topk_ids(scores, 4)
    assert ids.shape == (2, 6, 4) and ids.dtype == torch.int32
    for t in range(6):  # min(topk, visible) real ids, then -1
        n_real = min(4, t + 1)
        assert torch.all(ids[:, t, n_real:] == -1)
        # the highest scores, equal ones (ReLU's exact zeros) to the lower key id: a stable sort on -score
        by_score = torch.sort(-expected[:, t, : t + 1], dim=-1, stable=True).indices
        want = by_score[:, :n_real].sort(-1).values
        assert torch.equal(ids[:, t, :n_real].long().sort(-1).values, want)


def test_frozen_selection_is_chunk_independent_and_matches_scores():
    cfg = make_cfg()
    ix = LightningIndexer(cfg)
    x, q_in = torch.randn(1, 9, 16), torch.randn(1, 9, 12)
    pos = torch.arange(9)
    cos, sin = rope_cos_sin(pos, cfg.mla)
    ids = ix.select_frozen(x, q_in, cos, sin, pos, pos)
    q, w, k = ix(x, q_in, cos, sin)
    assert torch.equal(ids, topk_ids(index_scores(q, w, k, pos[None] <= pos[:, None]), 4))
    assert not ids.requires_grad


def test_schedule_groups_sources_and_consumers():
    assert dsa_schedule(make_cfg()) == [None, "source", "consumer", "source", "consumer"]
    assert dsa_schedule(make_cfg(topk_freq=3)) == [None, "source", "consumer", "consumer", "source"]
    assert dsa_schedule(make_cfg(layers=[0, 2, 4])) == ["source", None, "consumer", None, "source"]
    assert dsa_schedule(make_cfg(layers="all", topk_freq=1)) == ["source"] * 5
    assert dsa_schedule(make_cfg(mtp_depth=3))[5:] == ["source", "consumer", "consumer"]
    assert dsa_schedule(make_cfg(mtp_depth=2, share_mtp=False))[5:] == ["source", "source"]
    assert dsa_schedule(make_cfg(mtp_depth=2, layers=[1, 2]))[5:] == [None, None]


def run_stack(layers, roles, x, positions):
    """A minimal stack loop: the latest ids go to consumers only."""
    latest, outputs = None, []
    for layer, role in zip(layers, roles, strict=True):
        out = layer(x, positions, ids_for_layer(role, latest))
        latest = out["dsa_topk_ids"] if out["dsa_topk_ids"] is not None else latest
        outputs.append(out)
        x = x + out["hidden_states"]
    return outputs


def test_consumers_receive_exactly_the_source_ids():
    cfg = make_cfg()
    roles = dsa_schedule(cfg)
    layers = [MLA(cfg, i) for i in range(cfg.n_layers)]
    outs = run_stack(layers, roles, torch.randn(2, 7, 16), torch.arange(7))
    assert outs[0]["dsa_topk_ids"] is None
    assert outs[2]["dsa_topk_ids"] is outs[1]["dsa_topk_ids"]  # the very tensor, not a recomputation
    assert outs[4]["dsa_topk_ids"] is outs[3]["dsa_topk_ids"]
    assert layers[2].indexer is None and layers[1].indexer is not None


def test_mtp_depths_share_one_indexer():
    cfg = make_cfg(mtp_depth=2)
    shared = MLA(cfg, cfg.n_layers)  # one weight-shared MTP block serves every depth
    calls = []
    shared.indexer.register_forward_hook(lambda *a: calls.append(1))
    roles = dsa_schedule(cfg)[cfg.n_layers:]
    x, pos, latest = torch.randn(1, 6, 16), torch.arange(6), torch.zeros(1, 6, 4, dtype=torch.int32)
    ids = []
    for role in roles:
        out = shared(x, pos, ids_for_layer(role, latest))
        latest = out["dsa_topk_ids"]
        ids.append(latest)
    assert len(calls) == 1 and ids[1] is ids[0]


class SourceThenConsumer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.source, self.consumer = MLA(cfg, 1), MLA(cfg, 2)

    def forward(self, x, positions):
        a = self.source(x, positions)
        b = self.consumer(x + a["hidden_states"], positions, a["dsa_topk_ids"])
        return {"h": b["hidden_states"], "ids": b["dsa_topk_ids"]}


def test_frozen_indexer_runs_once_per_step_under_full_ac():
    cfg = make_cfg()
    torch.manual_seed(0)
    block = SourceThenConsumer(cfg)
    calls = []
    block.source.indexer.register_forward_hook(lambda *a: calls.append(torch.is_grad_enabled()))
    x, pos = torch.randn(2, 8, 16, requires_grad=True), torch.arange(8)
    eager = block(x, pos)
    eager["h"].square().sum().backward()
    eager_grads = [p.grad.clone() for p in block.parameters() if p.grad is not None]
    eager_x = x.grad.clone()
    block.zero_grad()
    x.grad = None
    calls.clear()
    out = checkpoint(block, x, pos)  # original pass + replay during backward
    out["h"].square().sum().backward()
    assert calls == [False]  # ran once, under no_grad; the replay reused its ids
    assert torch.equal(out["ids"], eager["ids"])
    grads = [p.grad for p in block.parameters() if p.grad is not None]
    assert len(grads) == len(eager_grads)
    for a, b in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(x.grad, eager_x)
    assert all(p.grad is None for p in block.source.indexer.parameters())


def literal_kl(m: MLA, x, pos, ids, sparse):
    """KL(head-summed normalised main attention || softmax(I)), per-head non-absorbed form."""
    with torch.no_grad():
        b, n, _ = x.shape
        scores, cos, sin = per_head_scores(m, x, pos)
        allowed = torch.ones(n, n, dtype=torch.bool).tril().expand(b, n, n).clone()
        if sparse:
            allowed = torch.zeros(b, n, n + 1, dtype=torch.bool).scatter_(
                -1, torch.where(ids < 0, n, ids).long(), True)[..., :n]
        p = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), -1).sum(1)
        p = p / p.sum(-1, keepdim=True)
    qi, w, ki = m.indexer(x, m.q_norm(m.wq_a(x)), cos, sin)
    index = index_scores(qi, w, ki, pos[None] <= pos[:, None]).masked_fill(~allowed, float("-inf"))
    logq = torch.log_softmax(index, -1)
    kl = torch.where(p > 0, p * (p.clamp_min(1e-300).log() - torch.where(p > 0, logq, 0)), 0)
    return kl.sum(-1).mean()


@pytest.mark.parametrize("mode", ["kl_dense", "kl_sparse"])
def test_trained_indexer_kl_loss_matches_literal_and_trains_only_the_indexer(mode):
    cfg = make_cfg(indexer_mode=mode, indexer_loss_coeff=0.5)
    m = MLA(cfg, 1).double()
    randomize(m, seed=3)
    x, pos = torch.randn(2, 7, 16, dtype=torch.float64), torch.arange(7)
    out = m(x, pos)
    expected = literal_kl(m, x, pos, out["dsa_topk_ids"], sparse=mode == "kl_sparse")
    torch.testing.assert_close(out["indexer_loss"].double(), 0.5 * expected, rtol=1e-5, atol=1e-7)
    assert out["indexer_loss"] > 0
    m.zero_grad()
    out["indexer_loss"].backward()
    for name, p in m.named_parameters():
        has_grad = p.grad is not None and bool(p.grad.abs().sum() > 0)
        assert has_grad == name.startswith("indexer."), name


@pytest.mark.parametrize("dsa, message", [
    (dict(index_head_dim=2), "model.dsa.index_head_dim 2 must be >= model.mla.qk_rope_head_dim 4"),
    (dict(layers=[1, 1]), "model.dsa.layers has duplicate indices"),
    (dict(indexer_mode="kl_dense"), "set model.dsa.indexer_loss_coeff > 0"),
    (dict(indexer_loss_coeff=1.0), "needs indexer_mode kl_dense or kl_sparse"),
])
def test_bad_dsa_settings_are_rejected(dsa, message):
    with pytest.raises(ValueError, match=message):
        MLA(make_cfg(**dsa), 1)


def test_dsa_without_any_layer_is_rejected():
    with pytest.raises(ValueError, match="model.dsa.layers = 'moe' selects no layer"):
        dsa_schedule(make_cfg(first_k_dense=5))


def test_consumer_before_any_source_is_an_error():
    with pytest.raises(ValueError, match="consumer layer runs before any source"):
        ids_for_layer("consumer", None)
