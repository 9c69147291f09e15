"""Router math against a literal per-token reference; the moe_topk op; expert-bias updates."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo  # noqa: F401  (custom ops import it lazily: 4 s in every forked rank otherwise)
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from spartron.layers.config import MoEConfig
from spartron.layers.moe.router import Router, load_balancing_loss
from spartron.layers.moe.topk import moe_topk
from spartron.testing import run_distributed


def _cfg(**kw) -> MoEConfig:
    base = {"n_routed_experts": 8, "top_k": 2, "n_shared_experts": 0, "moe_inter_dim": 16}
    base.update(kw)
    return MoEConfig.model_validate(base)


def _literal_route(logits: list[float], cfg: MoEConfig, bias: list[float]):
    """One token, written out: scores, groups, biased selection, unbiased weights."""
    n = len(logits)
    if cfg.score_func == "sigmoid":
        scores = [1.0 / (1.0 + math.exp(-v)) for v in logits]
    else:
        z = sum(math.exp(v) for v in logits)
        scores = [math.exp(v) / z for v in logits]
    choice = [s + b for s, b in zip(scores, bias, strict=True)]
    allowed = list(range(n))
    if cfg.n_groups > 1:
        size = n // cfg.n_groups
        group_scores = []
        for g in range(cfg.n_groups):
            members = sorted(choice[g * size:(g + 1) * size], reverse=True)
            group_scores.append(members[0] + members[1] if cfg.score_func == "sigmoid" else members[0])
        best = sorted(range(cfg.n_groups), key=lambda g: -group_scores[g])[:cfg.topk_groups]
        allowed = [e for e in range(n) if e // size in best]
    ids = sorted(allowed, key=lambda e: -choice[e])[:cfg.top_k]
    weights = [scores[e] for e in ids]
    if cfg.norm_topk_prob:
        total = sum(weights)
        weights = [w / total for w in weights]
    return scores, ids, [w * cfg.route_scale for w in weights]


@pytest.mark.parametrize("cfg_kw", [
    {"score_func": "sigmoid"},
    {"score_func": "softmax"},
    {"score_func": "softmax", "norm_topk_prob": False, "route_scale": 2.5},
    {"score_func": "sigmoid", "n_groups": 4, "topk_groups": 2, "top_k": 3, "route_scale": 1.5},
    {"score_func": "softmax", "n_groups": 4, "topk_groups": 1},
])
def test_router_matches_literal_reference(cfg_kw):
    torch.manual_seed(0)
    cfg = _cfg(**cfg_kw)
    router = Router(cfg, dim=16, dtype=torch.float64, init_std=0.5)
    with torch.no_grad():
        router.expert_bias.copy_(torch.randn(8) * 0.1)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    out = router(x)
    logits = x.reshape(-1, 16).float() @ router.weight.float().T
    for t in range(10):
        scores, ids, weights = _literal_route(logits[t].tolist(), cfg, router.expert_bias.tolist())
        torch.testing.assert_close(out["scores"][t], torch.tensor(scores, dtype=torch.float32))
        assert out["topk_ids"][t].tolist() == ids
        torch.testing.assert_close(out["topk_weights"][t], torch.tensor(weights, dtype=torch.float32))
    assert out["scores"].dtype == torch.float32 and out["topk_ids"].dtype == torch.int64
    assert out["aux_loss"] is None


def test_bias_changes_selection_not_weights():
    torch.manual_seed(1)
    cfg = _cfg(score_func="sigmoid", norm_topk_prob=False)
    router = Router(cfg, dim=16, init_std=0.5)
    x = torch.randn(1, 6, 16)
    plain = router(x)
    with torch.no_grad():
        router.expert_bias[3] = 10.0  # expert 3 now always chosen
    biased = router(x)
    assert (biased["topk_ids"][:, 0] == 3).all()
    assert not (plain["topk_ids"] == 3).any(dim=1).all()
    torch.testing.assert_close(biased["scores"], plain["scores"])
    # the weight of expert 3 is its unbiased score, not score + 10
    torch.testing.assert_close(biased["topk_weights"][:, 0], plain["scores"][:, 3])
    # gradients of the gate weights flow through the unbiased scores only
    biased["topk_weights"].sum().backward()
    assert router.weight.grad is not None and router.expert_bias.grad is None


def test_router_fp32_computes_logits_in_fp32():
    torch.manual_seed(2)
    router = Router(_cfg(router_fp32=True), dim=16, dtype=torch.bfloat16, init_std=0.5)
    x = torch.randn(1, 4, 16, dtype=torch.bfloat16)
    out = router(x)
    ref = torch.softmax(x.reshape(-1, 16).float() @ router.weight.float().T, dim=-1)
    assert out["scores"].dtype == torch.float32
    torch.testing.assert_close(out["scores"], ref)


def _literal_balance_loss(scores, ids, n_seq, score_func, top_k):
    tokens, n = scores.shape
    per_seq = tokens // n_seq
    total = 0.0
    for s in range(n_seq):
        rows = range(s * per_seq, (s + 1) * per_seq)
        loss = 0.0
        for i in range(n):
            f = n / (top_k * per_seq) * sum(1 for t in rows if i in ids[t].tolist())
            p = 0.0
            for t in rows:
                denom = scores[t].sum().item() if score_func == "sigmoid" else 1.0
                p += scores[t, i].item() / denom
            loss += f * p / per_seq
        total += loss
    return total / n_seq


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("kind", ["seq", "batch"])
def test_aux_loss_matches_literal_reference(score_func, kind):
    torch.manual_seed(3)
    cfg = _cfg(score_func=score_func, aux_loss_coeff=0.01, aux_loss_type=kind)
    router = Router(cfg, dim=16, dtype=torch.float64, init_std=0.5)
    x = torch.randn(3, 4, 16, dtype=torch.float64)
    out = router(x)
    n_seq = 3 if kind == "seq" else 1
    ref = 0.01 * _literal_balance_loss(out["scores"].detach(), out["topk_ids"], n_seq, score_func, 2)
    assert out["aux_loss"].item() == pytest.approx(ref, rel=1e-5)
    out["aux_loss"].backward()
    assert router.weight.grad.abs().sum() > 0


def test_seq_and_batch_aux_loss_differ():
    # two sequences, each balanced against itself differently than the whole batch
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.1, 0.9]])
    ids = torch.tensor([[0], [0], [1], [1]])
    seq = load_balancing_loss(scores, ids, 2, "softmax", 1)
    batch = load_balancing_loss(scores, ids, 1, "softmax", 1)
    # seq: each sequence routes both tokens to one expert: f = (2, 0) or (0, 2)
    assert seq.item() == pytest.approx((2 * 0.85 + 2 * 0.8) / 2)
    # batch: f = (1, 1), P = (0.525, 0.475)
    assert batch.item() == pytest.approx(1.0)


def test_moe_topk_is_a_registered_op_with_fake_impl():
    assert torch.ops.spartron.moe_topk.default is not None
    with FakeTensorMode():
        ids = moe_topk(torch.empty(5, 8), 3, 2, 1, "top2_sum")
    assert ids.shape == (5, 3) and ids.dtype == torch.int64


def test_moe_topk_group_limited_literal():
    # group 0 = experts 0..3, group 1 = 4..7. Best single score sits in group 1, best top-2 sum in group 0.
    scores = torch.tensor([[0.5, 0.48, 0.1, 0.0, 0.9, 0.02, 0.05, 0.01]])
    assert moe_topk(scores, 2, 2, 1, "max").tolist() == [[4, 6]]
    assert moe_topk(scores, 2, 2, 1, "top2_sum").tolist() == [[0, 1]]
    assert moe_topk(scores, 2, 1, 1).tolist() == [[4, 0]]
    assert moe_topk(scores, 3, 2, 2, "max").tolist() == [[4, 0, 1]]


def test_moe_topk_errors():
    with pytest.raises(ValueError, match="top_k 9 must be in"):
        moe_topk(torch.rand(2, 8), 9)
    with pytest.raises(ValueError, match="n_groups 3 must divide"):
        moe_topk(torch.rand(2, 8), 2, 3, 1)
    with pytest.raises(ValueError, match="group_score 'mean'"):
        moe_topk(torch.rand(2, 8), 2, 2, 1, "mean")


def test_config_rejects_top_k_above_experts():
    with pytest.raises(ValueError, match="model.moe.top_k 9 must be <= model.moe.n_routed_experts 8"):
        _cfg(top_k=9)


def test_update_expert_bias_single_rank():
    router = Router(_cfg(bias_update_rate=0.1), dim=4)
    counts = torch.tensor([4, 0, 2, 2, 2, 2, 3, 1])  # mean 2
    router.update_expert_bias(counts)
    expected = torch.tensor([-0.1, 0.1, 0.0, 0.0, 0.0, 0.0, -0.1, 0.1])
    torch.testing.assert_close(router.expert_bias, expected)
    assert router.expert_bias.dtype == torch.float32
    assert counts.tolist() == [4, 0, 2, 2, 2, 2, 3, 1]  # the caller's tensor is not modified
    with pytest.raises(ValueError, match=r"counts must be an integer tensor of shape \(8,\)"):
        router.update_expert_bias(torch.zeros(7, dtype=torch.int64))


def test_bias_stays_fp32_error_on_cast():
    router = Router(_cfg(), dim=4).to(torch.bfloat16)
    with pytest.raises(ValueError, match="expert_bias must stay float32"):
        router(torch.randn(1, 2, 4, dtype=torch.bfloat16))


def _bias_update_worker(rank, world):
    torch.manual_seed(0)
    router = Router(_cfg(bias_update_rate=0.01), dim=4)
    # each rank saw different tokens: counts differ per rank, the sum decides the update
    counts = torch.zeros(8, dtype=torch.int64)
    counts[rank] = 10
    counts[7] = rank
    router.update_expert_bias(counts, dist.group.WORLD)
    return router.expert_bias.tolist()


def test_update_expert_bias_identical_on_all_ranks():
    results = run_distributed(_bias_update_worker, 4)
    # totals: experts 0..3 -> 10, 4..6 -> 0, 7 -> 0+1+2+3 = 6; mean = 46 / 8 = 5.75
    expected = [-0.01] * 4 + [0.01] * 3 + [-0.01]
    for r in results:
        assert r == results[0]
        torch.testing.assert_close(torch.tensor(r), torch.tensor(expected))
