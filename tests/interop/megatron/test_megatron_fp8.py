"""Megatron's blockwise FP8 (`fp8 = "e4m3"`, `fp8_recipe = "blockwise"`, DeepSeek-V3's recipe as Megatron runs it
through Transformer Engine) is model.fp8 in the adapters: the config maps both ways, every other FP8 recipe or TE
FP8 feature is refused by name, and the adapters' layers run the same FP8 numerics as Spartron's own layers."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core==0.16.1)")

from megatron.core.transformer.transformer_block import TransformerBlock  # noqa: E402
from megatron_configs import MOE_SMALL, small_cfg  # noqa: E402 - next to this file

from spartron.configbase import ConfigError  # noqa: E402
from spartron.interop.megatron import (  # noqa: E402
    MegatronConfigError,
    SideChannel,
    megatron_config_from_spartron,
    spartron_block_spec,
    spartron_config_from_megatron,
    spartron_layer_key,
)
from spartron.interop.megatron.groups import to_process_group_collection  # noqa: E402
from spartron.layers.config import FP8Config  # noqa: E402
from spartron.layers.decoder import DecoderLayer, run_decoder_stack  # noqa: E402
from spartron.layers.fp8 import apply_fp8  # noqa: E402
from spartron.layers.fp8.modules import FP8FeedForward, FP8GroupedExperts, FP8Linear  # noqa: E402
from spartron.layers.init import init_parameters_  # noqa: E402
from spartron.parallel.dims import ParallelDims  # noqa: E402
from spartron.parallel.groups import ParallelGroups  # noqa: E402
from spartron.testing import run_distributed  # noqa: E402

# dims that are multiples of 128 where FP8 applies: wq_a, wkv_b, wo, the FFNs and experts; wq_b (2 x 96 = 192) and
# wkv_a (128 + 32) stay in bfloat16, as in Spartron's own model
MLA_128 = dict(q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)


def fp8_cfg(**fp8):
    return small_cfg(dtype="bfloat16", dim=128, dense_inter_dim=256, mla=MLA_128,
                     moe={**MOE_SMALL, "moe_inter_dim": 128}, fp8={"backend": "reference", **fp8})


def test_model_fp8_is_megatrons_blockwise_e4m3_both_ways():
    cfg = fp8_cfg(modules=["experts"], power_of_two_scales=False)
    tcfg = megatron_config_from_spartron(cfg)
    assert (tcfg.fp8, tcfg.fp8_recipe, tcfg.fp8_wgrad, tcfg.fp8_param) == ("e4m3", "blockwise", True, False)
    assert spartron_config_from_megatron(tcfg, base=cfg) == cfg
    # without a base, the Spartron-only FP8 fields are FP8Config's defaults
    assert spartron_config_from_megatron(tcfg).fp8 == FP8Config()
    assert megatron_config_from_spartron(fp8_cfg().model_copy(update={"fp8": None})).fp8 is None
    # fp8_wgrad=False (the weight gradients in bf16) is model.fp8.wgrad = "model_dtype", both ways
    hp = fp8_cfg(wgrad="model_dtype")
    tcfg = megatron_config_from_spartron(hp)
    assert tcfg.fp8_wgrad is False and spartron_config_from_megatron(tcfg, base=hp) == hp
    bf16_wgrad = _with(megatron_config_from_spartron(cfg), fp8_wgrad=False)
    assert spartron_config_from_megatron(bf16_wgrad).fp8.wgrad == "model_dtype"
    with pytest.raises(MegatronConfigError) as info:  # a base that says otherwise is a disagreement, not a choice
        spartron_config_from_megatron(bf16_wgrad, base=cfg)
    assert info.value.problems == ["model.fp8.wgrad: Spartron 'fp8' vs Megatron 'model_dtype'"]


def test_the_layers_kept_in_bf16_are_megatrons_first_last_layers_bf16_both_ways():
    kept = fp8_cfg(layers_at_start_in_bf16=1, layers_at_end_in_bf16=1)
    tcfg = megatron_config_from_spartron(kept)
    assert (tcfg.first_last_layers_bf16, tcfg.num_layers_at_start_in_bf16, tcfg.num_layers_at_end_in_bf16) == \
        (True, 1, 1)
    assert spartron_config_from_megatron(tcfg, base=kept) == kept
    assert spartron_config_from_megatron(tcfg).fp8.layers_at_end_in_bf16 == 1
    cfg = fp8_cfg()
    plain = megatron_config_from_spartron(cfg)
    assert plain.first_last_layers_bf16 is False
    # Megatron reads the counts only with first_last_layers_bf16 (its defaults are 1): no bf16 layers
    assert spartron_config_from_megatron(_with(plain, num_layers_at_start_in_bf16=2), base=cfg) == cfg
    with pytest.raises(MegatronConfigError) as info:
        spartron_config_from_megatron(tcfg, base=cfg)
    assert info.value.problems == ["model.fp8.layers_at_start_in_bf16: Spartron 0 vs Megatron 1",
                                   "model.fp8.layers_at_end_in_bf16: Spartron 0 vs Megatron 1"]


def _with(tcfg, **fields):
    """tcfg with fields set after construction (megatron-core 0.16 cannot construct an MoE config with fp8 set
    when Transformer Engine is absent: its __post_init__ compares TE's missing version)."""
    out = copy.copy(tcfg)
    for key, value in fields.items():
        setattr(out, key, value)
    return out


@pytest.mark.parametrize("fields, problem", [
    (dict(fp8="hybrid"), "fp8='hybrid': Spartron's blockwise recipe is E4M3 for activations, weights and gradients"),
    (dict(fp8_recipe="delayed"), "fp8_recipe='delayed': Spartron runs DeepSeek-V3's recipe, 'blockwise'"),
    (dict(fp8_recipe="mxfp8"), "fp8_recipe='mxfp8': Spartron runs DeepSeek-V3's recipe, 'blockwise'"),
    (dict(fp8_param=True), "fp8_param=True: must be one of [False] (Spartron keeps the weights in model.dtype"),
    (dict(fp8_margin=1), "fp8_margin=1: must be one of [0] (delayed scaling's"),
    (dict(fp8_amax_history_len=16), "fp8_amax_history_len=16: must be one of [1] (delayed scaling's"),
    (dict(fp8_dot_product_attention=True), "fp8_dot_product_attention=True: must be one of [False] (attention's "
                                           "core stays in model.dtype"),
    (dict(fp8_multi_head_attention=True), "fp8_multi_head_attention=True: must be one of [False]"),
    (dict(activation_func_fp8_input_store=True), "activation_func_fp8_input_store=True: must be one of [False] "
                                                 "(the FP8 experts keep the SwiGLU input in model.dtype"),
    (dict(moe_router_padding_for_fp8=True), "moe_router_padding_for_fp8=True: must be one of [False] (Spartron's "
                                            "FP8 experts take any row count"),
])
def test_every_other_fp8_recipe_or_feature_is_refused_by_name(fields, problem):
    cfg = fp8_cfg()
    with pytest.raises(MegatronConfigError) as info:
        spartron_config_from_megatron(_with(megatron_config_from_spartron(cfg), **fields), base=cfg)
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(problem), info.value.problems


def test_fp8_without_bf16_is_one_megatron_problem_not_a_validation_error():
    tcfg = _with(megatron_config_from_spartron(fp8_cfg()), bf16=False, params_dtype=torch.float32)
    with pytest.raises(MegatronConfigError) as info:
        spartron_config_from_megatron(tcfg)
    assert info.value.problems == ["fp8='e4m3' with bf16=False: Spartron's FP8 layers run in bfloat16 outside the "
                                   "FP8 GEMMs (set bf16=True)"]


def test_fp8_in_megatron_or_in_the_base_alone_is_a_disagreement():
    cfg = fp8_cfg()
    bf16 = cfg.model_copy(update={"fp8": None})
    with pytest.raises(MegatronConfigError) as info:
        spartron_config_from_megatron(megatron_config_from_spartron(cfg), base=bf16)
    assert info.value.problems == ["model.fp8: Spartron None vs Megatron {'recipe': 'blockwise', 'wgrad': 'fp8', "
                                   "'layers_at_start_in_bf16': 0, 'layers_at_end_in_bf16': 0}"]
    with pytest.raises(MegatronConfigError) as info:
        spartron_config_from_megatron(megatron_config_from_spartron(bf16), base=cfg)
    assert info.value.problems == [f"model.fp8: Spartron {cfg.fp8.model_dump()!r} vs Megatron None"]
    # fp8_recipe without fp8 is Megatron's default and has no effect: no problem
    assert spartron_config_from_megatron(_with(megatron_config_from_spartron(bf16), fp8_recipe="delayed"),
                                         base=bf16) == bf16


def _bf16_params(module):
    """Parameters in bfloat16, buffers as built (the router's fp32 expert bias), as build_model stores them."""
    for p in module.parameters():
        p.data = p.data.to(torch.bfloat16)
    return module


def _fp8_block(rank, world, fp8):
    torch.manual_seed(0)
    cfg = fp8_cfg(**fp8)
    pgc = to_process_group_collection(ParallelGroups.build(ParallelDims(world_size=1, fsdp=1), "cpu"))
    tcfg = megatron_config_from_spartron(cfg)
    side = SideChannel()
    try:
        block = TransformerBlock(tcfg, spartron_block_spec(tcfg, side, base_config=cfg, pg_collection=pgc,
                                                           init_seed=4), pg_collection=pgc)
    except ConfigError as err:
        return {"error": str(err)}
    _bf16_params(block)
    # a module's name: the key of its parameters' prefix ("layers.0.mlp.ffn" -> "0.ffn")
    converted = sorted(f"{name.split('.')[1]}.{spartron_layer_key(name.split('.', 2)[2] + '.')[:-1]}"
                       for name, m in block.named_modules()
                       if isinstance(m, (FP8Linear, FP8GroupedExperts, FP8FeedForward)))
    layers = _bf16_params(torch.nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers)))
    init_parameters_(layers, 4, cfg.init_std, prefix="layers.")
    plain = copy.deepcopy(layers)  # the same weights in bfloat16 without FP8
    apply_fp8([layer for i, layer in enumerate(layers) if cfg.fp8.runs_fp8(i, cfg.n_layers)], cfg.fp8)
    spartron_converted = sorted(f"{i}.{name}" for i, layer in enumerate(layers) for name, m in layer.named_modules()
                                if isinstance(m, (FP8Linear, FP8GroupedExperts, FP8FeedForward)))
    s, b = 12, 2
    x = torch.randn(s, b, cfg.dim, dtype=torch.bfloat16)
    x_m, x_s = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
    side.reset()
    y_m = block(x_m, attention_mask=None)
    final = block.final_layernorm
    y_s = final(run_decoder_stack(layers, x_s, torch.arange(s)).hidden_states).transpose(0, 1)
    y_plain = final(run_decoder_stack(plain, x.transpose(0, 1), torch.arange(s)).hidden_states).transpose(0, 1)
    grad = torch.randn_like(y_m)
    (y_m * grad).float().sum().backward()
    (y_s * grad).float().sum().backward()
    params_s = dict(layers.named_parameters())
    unequal, norm_diff = [], 0.0
    for k, p in block.named_parameters():
        if not k.startswith("layers.") or p.grad is None:  # the final norm is Megatron's own, used on both sides
            continue
        theirs = params_s[f"{k.split('.')[1]}.{spartron_layer_key(k.split('.', 2)[2])}"].grad
        if "layernorm" in k:  # Megatron's norm sums its weight gradient over [s, b], Spartron's over [b, s]
            norm_diff = max(norm_diff, ((p.grad.float() - theirs.float()).abs().max() / theirs.abs().max()).item())
        elif not torch.equal(p.grad, theirs):
            unequal.append(k)
    return dict(converted=converted, spartron_converted=spartron_converted, out_equal=torch.equal(y_m, y_s),
                x_grad_equal=torch.equal(x_m.grad, x_s.grad.transpose(0, 1)), unequal=unequal, norm_diff=norm_diff,
                fp8_effect=(y_m.float() - y_plain.float()).abs().max().item(),
                experts=type(block.layers[1].mlp.moe.experts).__name__)


@pytest.mark.parametrize("modules", [["experts", "dense"], ["experts"], ["dense"]])
def test_the_adapters_run_spartrons_fp8_layers_bitwise(modules):
    """The same modules switch to FP8 as in Spartron's own layers, from the same seed, and the block's output, its
    input's gradient and every weight's gradient equal Spartron's bitwise (the norms' weights up to bfloat16's
    summation order); FP8 changes the output (it is not a bfloat16 run)."""
    (r,) = run_distributed(_fp8_block, 1, {"modules": modules})
    assert r["converted"] == r["spartron_converted"] and r["converted"], r
    expected = {"0.ffn"} if "dense" in modules else set()  # the dense FFN: one FP8FeedForward
    for layer in range(3):
        if "dense" in modules:
            expected |= {f"{layer}.attn.wq_a", f"{layer}.attn.wkv_b", f"{layer}.attn.wo"}
    for layer in (1, 2):
        if "experts" in modules:
            expected.add(f"{layer}.ffn.experts")
        if "dense" in modules:
            expected.add(f"{layer}.ffn.shared_experts")
    assert set(r["converted"]) == expected
    assert r["experts"] == ("FP8GroupedExperts" if "experts" in modules else "GroupedExperts")
    assert r["out_equal"] and r["x_grad_equal"] and r["unequal"] == [], r
    assert r["norm_diff"] < 1e-2, r
    assert r["fp8_effect"] > 1e-3, r


def test_the_experts_weight_cache_on_is_refused_in_the_adapters():
    """Megatron's optimizer step never invalidates the cache: 'on' would keep the FP8 copy of old weights."""
    (r,) = run_distributed(_fp8_block, 1, {"weight_cache": "on"})
    assert r["error"].startswith("model.fp8.weight_cache = 'on' in the Megatron adapters: Megatron's optimizer "
                                 "step does not invalidate it"), r


def _fp8_gpt_grads(rank, world, ac):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    from spartron.interop.megatron.checkpointing import apply_spartron_checkpointing

    cfg = fp8_cfg()
    pgc = to_process_group_collection(ParallelGroups.build(ParallelDims(world_size=1, fsdp=1), "cpu"))
    parallel_state.initialize_model_parallel()
    tcfg = megatron_config_from_spartron(cfg, use_cpu_initialization=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    grads, first = {}, None
    for name in ("none", ac["mode"]):
        side = SideChannel()
        model = _bf16_params(GPTModel(tcfg, spartron_block_spec(tcfg, side, base_config=cfg, pg_collection=pgc,
                                                                 init_seed=3),
                                      vocab_size=cfg.vocab_size, max_sequence_length=32,
                                      position_embedding_type="none", pg_collection=pgc))
        if first is None:
            first = model.state_dict()
        model.load_state_dict(first)  # Megatron's own embedding and head: drawn from the global generator
        ckpt = apply_spartron_checkpointing(model, ac if name != "none" else {"mode": "none"})
        with ckpt.session() if name != "none" else contextlib.nullcontext():
            side.reset()
            model(tokens[:, :-1], None, None, labels=tokens[:, 1:]).float().mean().backward()
        grads[name] = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    ref, got = grads["none"], grads[ac["mode"]]
    return dict(same_keys=sorted(ref) == sorted(got), n=len(ref), regions=list(ckpt.layers),
                fp8_modules=sum(isinstance(m, (FP8Linear, FP8GroupedExperts, FP8FeedForward)) for m in model.modules()),
                unequal=sorted(k for k in ref if not torch.equal(ref[k], got[k])))


@pytest.mark.parametrize("ac", [{"mode": "full"}, {"mode": "selective"}], ids=["full", "selective"])
def test_spartron_checkpointing_of_the_fp8_adapters_gives_the_no_ac_gradients_bitwise(ac):
    """apply_spartron_checkpointing over a GPTModel of FP8 adapters: the replay re-quantises the same inputs, so
    every gradient equals the run without AC bitwise (the FP8 GEMMs are the policy's GEMM targets)."""
    (r,) = run_distributed(_fp8_gpt_grads, 1, ac, timeout=300)
    assert r["same_keys"] and r["n"] > 30 and r["unequal"] == [], r
    # 3 layers x 3 MLA linears, the dense FFN, 2 x (experts, shared-expert FFN)
    assert r["regions"] == [f"decoder.layers.{i}" for i in range(3)] and r["fp8_modules"] == 14, r


def test_the_adapters_keep_megatrons_first_and_last_layers_in_bf16():
    """first_last_layers_bf16 (model.fp8.layers_at_start/end_in_bf16 = 1 of 3 layers): only the middle layer's
    modules turn FP8, in the adapters as in Spartron's layers, with the same numerics bitwise."""
    (r,) = run_distributed(_fp8_block, 1, {"layers_at_start_in_bf16": 1, "layers_at_end_in_bf16": 1})
    assert r["converted"] == r["spartron_converted"], r
    assert {name.split(".")[0] for name in r["converted"]} == {"1"} and "1.ffn.experts" in r["converted"], r
    assert r["out_equal"] and r["x_grad_equal"] and r["unequal"] == [], r
    assert r["fp8_effect"] > 1e-3, r


def test_an_mlp_slot_turns_fp8_when_numbered_and_refuses_to_run_before():
    """The MLP slots learn their layer in set_layer_number (Megatron's TransformerLayer calls it): that is where they
    initialise and, unless the layer is kept in bf16, turn FP8; a slot run before it is one error, not a bf16 run."""
    from spartron.interop.megatron.spec import SpartronDenseMLP
    from spartron.layers.ffn import FeedForward

    cfg = fp8_cfg(layers_at_start_in_bf16=1)
    tcfg = megatron_config_from_spartron(cfg)
    slots = [SpartronDenseMLP(tcfg, SideChannel(), base_config=cfg) for _ in range(2)]
    x = torch.randn(4, 2, cfg.dim, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="set_layer_number was not called: build SpartronDenseMLP in a "
                                           "TransformerLayer"):
        slots[0](x)
    for slot, number in zip(slots, (1, 2), strict=True):
        slot.set_layer_number(number)
        _bf16_params(slot)
    assert type(slots[0].ffn) is FeedForward and type(slots[1].ffn) is FP8FeedForward  # layer 0 is kept in bf16
    assert slots[1](x)[0].shape == x.shape
