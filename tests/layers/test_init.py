"""The init rule (spartron.layers.init): values from (seed, global name, global expert) only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spartron.layers.init import identity_seed, init_parameters_, init_tensor_
from spartron.layers.model import build_model
from spartron.layers.moe import MoELayer
from spartron.layers.moe.experts import GroupedExperts
from spartron.runtime.config import load_config


def tiny_model_cfg():
    return load_config("configs/tiny.toml", []).model


def test_identity_seed_is_a_stable_hash_not_pythons_salted_hash():
    # SHA-256 of "0\x1fembed.weight": the same in every process (Python's str hash is salted per process)
    assert identity_seed(0, "embed.weight") == 2990671959978863173
    assert identity_seed(0, "layers.1.ffn.experts.w1", 5) == 1633834384715218073
    assert len({identity_seed(0, "w"), identity_seed(1, "w"), identity_seed(0, "w", 0), identity_seed(0, "v")}) == 4


def test_a_shard_of_experts_generates_exactly_its_slice_of_the_whole():
    whole = init_tensor_(torch.empty(8, 3, 5), "experts.w1", 7, 0.5, first_expert=0)
    low = init_tensor_(torch.empty(4, 3, 5), "experts.w1", 7, 0.5, first_expert=0)
    high = init_tensor_(torch.empty(4, 3, 5), "experts.w1", 7, 0.5, first_expert=4)
    assert torch.equal(torch.cat([low, high]), whole)
    assert not any(torch.equal(whole[e], whole[e + 4]) for e in range(4))  # the EP defect: these were equal
    experts = GroupedExperts(2, 5, 3, mode="loop", init_std=0.5, first_expert=6)
    experts.reset_parameters(seed=7, prefix="experts.")
    assert torch.equal(experts.w1.detach(), whole[6:])


def test_values_ignore_the_global_rng_and_follow_the_seed():
    cfg = tiny_model_cfg()
    torch.manual_seed(1)
    a = build_model(cfg, seed=5).state_dict()
    torch.manual_seed(2)
    b = build_model(cfg, seed=5).state_dict()
    c = build_model(cfg, seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed.weight"], c["embed.weight"])
    expected = init_tensor_(torch.empty(cfg.vocab_size, cfg.dim), "embed.weight", 5, cfg.init_std)
    assert torch.equal(a["embed.weight"], expected)
    assert a["embed.weight"].std().item() == pytest.approx(cfg.init_std, rel=0.05)


def test_norms_start_at_ones_and_layer_norm_biases_at_zeros():
    model = build_model(tiny_model_cfg())
    k_norm = model.layers["1"].attn.indexer.k_norm
    assert isinstance(k_norm, nn.LayerNorm)
    assert torch.equal(k_norm.weight.detach(), torch.ones(k_norm.normalized_shape))
    assert torch.equal(k_norm.bias.detach(), torch.zeros(k_norm.normalized_shape))  # were ones before
    assert torch.equal(model.norm.weight.detach(), torch.ones(model.cfg.dim))


def test_bfloat16_parameters_are_the_float32_values_cast():
    fp32 = init_tensor_(torch.empty(4, 6), "w", 0, 0.02)
    bf16 = init_tensor_(torch.empty(4, 6, dtype=torch.bfloat16), "w", 0, 0.02)
    assert torch.equal(bf16, fp32.to(torch.bfloat16))


def test_build_model_keeps_its_config_and_stores_the_float32_values_cast():
    """The model is built with the config it is given (no swap afterwards); every parameter is in the
    stored dtype and holds the float32 model's value cast, the MoE layers' ones included."""
    fp32 = tiny_model_cfg()
    ref = build_model(fp32, seed=3).state_dict()
    for update, dtype in (({"dtype": "bfloat16"}, torch.bfloat16),
                          ({"dtype": "bfloat16", "master_dtype": "float32"}, torch.float32)):
        cfg = fp32.model_copy(update=update)
        model = build_model(cfg, seed=3)
        assert model.cfg is cfg and model.layers["1"].ffn.router.weight.dtype == dtype
        assert {p.dtype for p in model.parameters()} == {dtype}
        assert model.layers["1"].ffn.router.expert_bias.dtype == torch.float32
        assert {p.dtype for p in MoELayer(cfg).parameters()} == {dtype}  # built in the stored dtype
        for name, value in model.state_dict().items():
            assert torch.equal(value, ref[name].to(value.dtype)), name


def test_parameters_without_a_rule_and_meta_tensors_are_errors():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.empty(4))

    with pytest.raises(ValueError) as err:
        init_parameters_(nn.ModuleDict({"block": Scaled()}), 0, 0.02, prefix="model.")
    assert str(err.value) == ("no initialisation rule for parameter 'model.block.scale' (1-d, in Scaled): "
                              "add it to spartron.layers.init.rule_of")
    with pytest.raises(ValueError, match=r"^cannot initialise 'w' on the meta device: materialise it first"):
        init_tensor_(torch.empty(2, 2, device="meta"), "w", 0, 0.02)
    with pytest.raises(ValueError, match=r"^unknown init rule 'uniform' for 'w': normal, ones or zeros$"):
        init_tensor_(torch.empty(2, 2), "w", 0, 0.02, rule="uniform")
