"""MoELayer: literal reference, telemetry (also under full AC), bad configs, dispatcher selection."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (custom ops import it lazily: 4 s in every forked rank otherwise)
import torch.distributed as dist
import torch.nn.functional as F

from spartron.checkpointing import checkpoint
from spartron.comm.transport import EPTransport
from spartron.layers.config import ModelConfig
from spartron.layers.moe import LocalDispatcher, MoELayer
from spartron.testing import run_distributed


def model_cfg(**moe) -> ModelConfig:
    base = {"n_routed_experts": 8, "n_shared_experts": 1, "top_k": 2, "moe_inter_dim": 16,
            "score_func": "sigmoid", "n_groups": 2, "topk_groups": 1, "dispatcher": "all_to_all"}
    base.update(moe)
    return ModelConfig.model_validate({"dim": 32, "init_std": 0.3, "moe": base})


def test_layer_matches_literal_per_token_reference():
    torch.manual_seed(0)
    layer = MoELayer(model_cfg(aux_loss_coeff=0.01))
    x = torch.randn(2, 3, 32)
    out = layer(x)
    tokens = x.reshape(-1, 32)
    ex, sh = layer.experts, layer.shared_experts
    for t in range(6):
        ref = sh.w2.weight @ (F.silu(sh.w1.weight @ tokens[t]) * (sh.w3.weight @ tokens[t]))
        for e, w in zip(out["topk_ids"][t].tolist(), out["topk_weights"][t], strict=True):
            ref = ref + w * (ex.w2[e] @ (F.silu(ex.w1[e] @ tokens[t]) * (ex.w3[e] @ tokens[t])))
        torch.testing.assert_close(out["hidden_states"].reshape(-1, 32)[t], ref)
    counts = torch.bincount(out["topk_ids"].flatten(), minlength=8)
    assert out["tokens_per_expert"].tolist() == counts.tolist()
    assert out["aux_loss"] is not None and out["aux_loss"].dim() == 0
    assert isinstance(layer.dispatcher, LocalDispatcher)  # all_to_all with one EP rank moves nothing


def test_no_shared_experts():
    layer = MoELayer(model_cfg(n_shared_experts=0))
    assert layer.shared_experts is None
    assert layer(torch.randn(1, 4, 32))["hidden_states"].shape == (1, 4, 32)


def test_step_counts_accumulate_and_reset():
    torch.manual_seed(1)
    layer = MoELayer(model_cfg(bias_update_rate=0.1))
    a = layer(torch.randn(1, 4, 32))["tokens_per_expert"]
    b = layer(torch.randn(1, 4, 32))["tokens_per_expert"]
    assert layer.step_tokens_per_expert.tolist() == (a + b).tolist()
    assert "step_tokens_per_expert" not in layer.state_dict() and "router.expert_bias" in layer.state_dict()
    total = (a + b).float()
    layer.update_expert_bias()
    torch.testing.assert_close(layer.router.expert_bias, 0.1 * torch.sign(total.mean() - total))
    assert layer.step_tokens_per_expert.sum().item() == 0


def test_router_not_replayed_under_full_ac():
    torch.manual_seed(3)
    layer, plain = MoELayer(model_cfg(norm_topk_prob=False)), MoELayer(model_cfg(norm_topk_prob=False))
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 4, 32)
    out = checkpoint(layer.router, x)
    ref = plain.router(x)
    with torch.no_grad():  # would move the selection if the replay re-ran top-k
        layer.router.expert_bias.copy_(torch.linspace(1.0, -1.0, 8))
    assert not torch.equal(layer.router(x)["topk_ids"], ref["topk_ids"])
    out["topk_weights"].square().sum().backward()
    ref["topk_weights"].square().sum().backward()
    assert torch.equal(out["topk_ids"], ref["topk_ids"])
    torch.testing.assert_close(layer.router.weight.grad, plain.router.weight.grad)


def test_telemetry_counted_once_and_routing_not_replayed_under_full_ac():
    torch.manual_seed(2)
    layer = MoELayer(model_cfg())
    plain = MoELayer(model_cfg())
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 4, 32)
    xa, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = checkpoint(layer, xa)
    ref = plain(xp)
    # a different bias before backward would change the selection if the replay re-routed
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.linspace(1.0, -1.0, 8))
    out["hidden_states"].square().sum().backward()
    ref["hidden_states"].square().sum().backward()
    assert layer.step_tokens_per_expert.tolist() == plain.step_tokens_per_expert.tolist()
    assert layer.step_tokens_per_expert.sum().item() == 2 * 4 * 2
    torch.testing.assert_close(xa.grad, xp.grad)
    torch.testing.assert_close(layer.experts.w1.grad, plain.experts.w1.grad)
    torch.testing.assert_close(layer.router.weight.grad, plain.router.weight.grad)


def test_bad_configs():
    with pytest.raises(ValueError, match="model.moe.top_k 9 must be <= model.moe.n_routed_experts 8"):
        model_cfg(top_k=9)
    with pytest.raises(ValueError, match="model.moe.dispatcher = 'deepep' needs DeepEP"):
        MoELayer(model_cfg(dispatcher="deepep"))
    with pytest.raises(ValueError, match=r"MoELayer expects x \[batch, seq, dim\]"):
        MoELayer(model_cfg())(torch.zeros(4, 32))


def _bad_ep_worker(rank, world):
    errors = []
    for moe in ({"n_routed_experts": 8}, {"dispatcher": "local"}):
        try:
            MoELayer(model_cfg(**moe), EPTransport(dist.group.WORLD))
        except ValueError as err:
            errors.append(str(err))
    dist.barrier()  # no collective ran: keep every rank alive until all finished connecting
    return errors


def test_bad_ep_configs_fail_on_every_rank():
    results = run_distributed(_bad_ep_worker, 3)
    for errors in results:
        assert errors[0] == ("model.moe.n_routed_experts 8 is not divisible by the expert-parallel size 3 "
                             "(parallel.ep)")
        assert errors[1].startswith("model.moe.n_routed_experts 8 is not divisible")
    results = run_distributed(_bad_ep_worker, 2)
    for errors in results:
        assert errors == ["model.moe.dispatcher = 'local' cannot serve an EP group of 2 ranks; use "
                          "'all_to_all' or 'deepep'"]


def test_permute_rows_matches_indexing_exactly_with_a_gather_backward():
    from spartron.layers.moe.dispatch import inverse_permutation, permute_rows

    torch.manual_seed(0)
    order = torch.randperm(9)
    x = torch.randn(9, 5, requires_grad=True)
    ref = torch.randn(9, 5, requires_grad=True)
    with torch.no_grad():
        ref.copy_(x)
    g = torch.randn(9, 5)
    inverse = inverse_permutation(order)
    assert torch.equal(order[inverse], torch.arange(9)) and torch.equal(inverse[order], torch.arange(9))
    out, out_ref = permute_rows(x, order, inverse), ref[order]
    assert torch.equal(out, out_ref)
    (out * g).sum().backward()
    (out_ref * g).sum().backward()
    assert torch.equal(x.grad, ref.grad)
    assert type(out.grad_fn).__name__ == "_PermuteRowsBackward" and "Index" in type(out_ref.grad_fn).__name__
