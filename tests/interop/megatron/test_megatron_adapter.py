"""Spartron layers inside megatron-core: config mapping, ModuleSpec adapters, groups, parity, GPTModel."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core==0.16.1)")

import torch.distributed as dist  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlock  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig  # noqa: E402
from megatron_configs import DSA_SMALL, MLA_SMALL, MOE_SMALL, small_cfg  # noqa: E402 - next to this file

from spartron.comm.transport import EPTransport  # noqa: E402
from spartron.interop.megatron import (  # noqa: E402
    MAPPED,
    MEGATRON_OWNED,
    REQUIRED,
    MegatronConfigError,
    SideChannel,
    SpartronMLAAttention,
    SpartronMoEMLP,
    megatron_config_from_spartron,
    spartron_block_spec,
    spartron_config_from_megatron,
    spartron_layer_key,
    spartron_layer_spec,
)
from spartron.interop.megatron.groups import to_process_group_collection  # noqa: E402
from spartron.layers.attention.context_parallel import local_positions, shard_sequence  # noqa: E402
from spartron.layers.decoder import DecoderLayer, run_decoder_stack  # noqa: E402
from spartron.layers.init import init_parameters_, init_tensor_  # noqa: E402
from spartron.layers.norms import RMSNorm  # noqa: E402
from spartron.parallel.dims import ParallelDims  # noqa: E402
from spartron.parallel.groups import ParallelGroups  # noqa: E402
from spartron.testing import run_distributed  # noqa: E402

# ---------------------------------------------------------------- config mapping

def test_every_megatron_field_is_in_exactly_one_table():
    names = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    tables = [MAPPED, set(REQUIRED), MEGATRON_OWNED]
    assert set().union(*tables) == names
    assert sum(len(t) for t in tables) == len(names)


@pytest.mark.parametrize("cfg", [
    small_cfg(),
    small_cfg(first_k_dense=3),
    small_cfg(dtype="bfloat16", mla={**MLA_SMALL, "q_lora_rank": 0, "yarn": {"factor": 4.0, "mscale": 0.7}}),
    small_cfg(moe={**MOE_SMALL, "score_func": "softmax", "norm_topk_prob": False, "n_groups": 2,
                   "topk_groups": 2, "bias_update_rate": 0.0, "aux_loss_coeff": 0.01,
                   "aux_loss_type": "batch",
                   "router_fp32": False, "grouped_mm": "loop", "route_scale": 2.5}),
    small_cfg(moe={**MOE_SMALL, "n_routed_experts": 8, "n_groups": 2, "topk_groups": 1,
                   "dispatcher": "deepep",
                   "deepep_num_sms": 8, "aux_loss_coeff": 0.001, "aux_loss_type": "seq"}),
    small_cfg(dsa={**DSA_SMALL, "layers": "moe", "indexer_mode": "kl_sparse", "indexer_loss_coeff": 0.5}),
    small_cfg(dsa={**DSA_SMALL, "indexer_fp8": True, "deterministic_dkv": True}),
    small_cfg(dsa={**DSA_SMALL, "indexer_mode": "kl_dense", "indexer_loss_coeff": 0.5, "kl_dense_chunk": 7}),
], ids=["moe", "dense", "yarn-bf16-noqlora", "softmax-groups-aux", "sigmoid-groups-deepep", "dsa", "dsa-fp8-det",
        "dsa-kl-dense-chunk"])
def test_round_trip_spartron_megatron_spartron(cfg):
    tcfg = megatron_config_from_spartron(cfg)
    assert spartron_config_from_megatron(tcfg, base=cfg) == cfg


def test_handwritten_megatron_config_maps_to_spartron():
    tcfg = MLATransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, layernorm_epsilon=1e-6,
        attention_dropout=0.0, add_bias_linear=False, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, qk_layernorm=True, q_lora_rank=None, kv_lora_rank=32,
        qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="rope", rotary_base=50000,
        num_moe_experts=8, moe_layer_freq=[0, 0, 1, 1], moe_ffn_hidden_size=24, moe_router_topk=4,
        moe_shared_expert_intermediate_size=48, moe_router_score_function="sigmoid",
        moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2, moe_router_dtype="fp32",
        moe_aux_loss_coeff=1e-4, moe_router_load_balancing_type="seq_aux_loss",
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, experimental_attention_variant="dsa",
        dsa_indexer_n_heads=4, dsa_indexer_head_dim=16, dsa_indexer_topk=8, dsa_indexer_loss_coeff=0.0)
    cfg = spartron_config_from_megatron(tcfg)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.first_k_dense, cfg.dense_inter_dim) == (64, 4, 4, 2, 96)
    assert cfg.mla.model_dump() == dict(q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=16, rope_theta=50000.0, yarn=None)
    assert cfg.moe.model_dump() == dict(
        n_routed_experts=8, n_shared_experts=2, top_k=4, moe_inter_dim=24, score_func="sigmoid", n_groups=4,
        topk_groups=2, route_scale=2.5, norm_topk_prob=True, router_fp32=True, bias_update_rate=1e-2,
        aux_loss_coeff=1e-4, aux_loss_type="seq", dispatcher="all_to_all",
        all_to_all_transport="nccl", copy_engine_sync="barrier", deepep_num_sms=24, grouped_mm="auto")
    assert cfg.dsa.model_dump() == dict(n_index_heads=4, index_head_dim=16, index_topk=8, topk_freq=1,
                                        layers="all", indexer_mode="frozen", indexer_loss_coeff=0.0,
                                        share_indexer_across_mtp=True, indexer_fp8=False, deterministic_dkv=False,
                                        kl_dense_chunk=0, attention_chunk=0)
    assert cfg.norm_eps == 1e-6 and cfg.dtype == "float32"


def _problem_names(err: MegatronConfigError) -> list[str]:
    return [p.split("=")[0].split(":")[0].strip() for p in err.problems]


def test_error_lists_every_setting_the_adapter_cannot_honour():
    tcfg = megatron_config_from_spartron(small_cfg())
    bad = dataclasses.replace(
        tcfg, tensor_model_parallel_size=2, sequence_parallel=True, add_bias_linear=True,
        gated_linear_unit=False, attention_dropout=0.1, recompute_granularity="full",
        recompute_method="uniform", recompute_num_layers=1,
        moe_token_dispatcher_type="allgather", moe_router_dtype="fp64", moe_layer_freq=[1, 0, 1],
        moe_router_load_balancing_type="sinkhorn", moe_shared_expert_intermediate_size=20,
        moe_router_num_groups=2, moe_router_group_topk=2, rope_type="mrope", mtp_num_layers=1)
    with pytest.raises(MegatronConfigError) as info:
        spartron_config_from_megatron(bad)
    assert sorted(_problem_names(info.value)) == sorted([
        "tensor_model_parallel_size", "sequence_parallel", "add_bias_linear", "gated_linear_unit",
        "attention_dropout", "recompute_granularity", "moe_token_dispatcher_type", "moe_router_dtype",
        "moe_layer_freq", "moe_router_load_balancing_type", "moe_shared_expert_intermediate_size",
        "moe_router_topk // moe_router_group_topk", "rope_type", "mtp_num_layers"])
    assert "must be one of [1] (Spartron layers are not tensor-parallel)" in str(info.value)


def test_reverse_mapping_checks_overrides_and_spartron_only_settings():
    with pytest.raises(MegatronConfigError, match=r"fp16=True: must be one of \[False\]"):
        megatron_config_from_spartron(small_cfg(), fp16=True, params_dtype=torch.float16)
    with pytest.raises(MegatronConfigError, match=r"model.mtp.depth: Spartron 1 vs Megatron 0"):
        megatron_config_from_spartron(small_cfg(mtp={"depth": 1}))  # MTP blocks are not adapted
    with pytest.raises(MegatronConfigError, match=r"bias_update_rate > 0 with score_func 'softmax'"):
        megatron_config_from_spartron(small_cfg(moe={**MOE_SMALL, "score_func": "softmax"}))


def test_base_config_must_agree_with_megatron():
    tcfg = megatron_config_from_spartron(small_cfg())
    with pytest.raises(MegatronConfigError) as info:
        spartron_config_from_megatron(tcfg, base=small_cfg(norm_eps=1e-5, moe={**MOE_SMALL, "top_k": 1}))
    assert info.value.problems == ["model.norm_eps: Spartron 1e-05 vs Megatron 1e-06",
                                   "model.moe.top_k: Spartron 1 vs Megatron 2"]


def test_unknown_non_default_field_of_a_newer_megatron_is_a_problem():
    newer = dataclasses.make_dataclass("Newer", [("shiny_new_knob", int, 0)], bases=(MLATransformerConfig,))
    kw = {f.name: getattr(megatron_config_from_spartron(small_cfg()), f.name)
          for f in dataclasses.fields(MLATransformerConfig) if f.init}
    assert spartron_config_from_megatron(newer(**kw)).dim == 32  # default value: fine
    with pytest.raises(MegatronConfigError, match="shiny_new_knob=3: unknown to this adapter"):
        spartron_config_from_megatron(newer(**kw, shiny_new_knob=3))


# ---------------------------------------------------------------- layers on real gloo ranks

def _differing_from_decoder_layer(mlayer, dlayer: DecoderLayer) -> list[str]:
    """Keys of a Megatron layer whose value differs bitwise from the Spartron layer's (none may be missing)."""
    theirs = dlayer.state_dict()
    ours = {spartron_layer_key(k): v for k, v in mlayer.state_dict().items()}
    assert sorted(ours) == sorted(theirs)
    return [k for k, v in ours.items() if not torch.equal(v, theirs[k])]


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def _block_parity(rank, world, cfg_kwargs):
    torch.manual_seed(0)
    cfg = small_cfg(**cfg_kwargs)
    groups = ParallelGroups.build(ParallelDims(world_size=1, fsdp=1), "cpu")
    pgc = to_process_group_collection(groups)
    tcfg = megatron_config_from_spartron(cfg)
    side = SideChannel()
    block = TransformerBlock(tcfg, spartron_block_spec(tcfg, side, base_config=cfg, pg_collection=pgc, init_seed=4),
                             pg_collection=pgc)
    # No weights copied: the adapters initialise by the model's rule under SparseMoEModel's names.
    layers = torch.nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
    init_parameters_(layers, 4, cfg.init_std, prefix="layers.")
    init_differs = [k for mlayer, dlayer in zip(block.layers, layers, strict=True)
                    for k in _differing_from_decoder_layer(mlayer, dlayer)]
    norm = RMSNorm(cfg.dim, cfg.norm_eps)
    norm.load_state_dict(block.final_layernorm.state_dict())
    s, b = 12, 2
    x = torch.randn(s, b, cfg.dim)
    x_m, x_s = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
    side.reset()
    y_m = block(x_m, attention_mask=None)
    stack = run_decoder_stack(layers, x_s, torch.arange(s))
    y_s = norm(stack.hidden_states).transpose(0, 1)
    grad = torch.randn_like(y_m)
    aux_s = sum(stack.aux_losses) if stack.aux_losses else None
    # The adapters' balance loss rides on the MoE output (MoEAuxLossAutoScaler) and is logged in
    # Megatron's tracker as aux / coeff per layer; the SideChannel no longer carries it.
    tracked = get_moe_layer_wise_logging_tracker().get("seq_load_balancing_loss")  # aux_loss_type "seq"
    aux_m = None if tracked is None else tracked["values"].sum() * cfg.moe.aux_loss_coeff
    side_aux = side.aux_loss()
    (y_m * grad).sum().backward()
    ((y_s * grad).sum() + (aux_s if aux_s is not None else 0)).backward()
    params_s = dict(layers.named_parameters())
    def spartron_name(k: str) -> str:  # "layers.{i}.<megatron layer key>" -> "{i}.<spartron layer key>"
        _, i, key = k.split(".", 2)
        return f"{i}.{spartron_layer_key(key)}"

    grad_diffs = {k: _max_diff(p.grad, params_s[spartron_name(k)].grad)
                  for k, p in block.named_parameters() if k.startswith("layers.") and p.grad is not None}
    no_grad = sorted(k for k, p in block.named_parameters() if p.grad is None)
    return dict(init_differs=init_differs, out=_max_diff(y_m, y_s),
                x_grad=_max_diff(x_m.grad, x_s.grad.transpose(0, 1)),
                grads=max(grad_diffs.values()), n_grads=len(grad_diffs), no_grad=no_grad,
                aux=None if aux_m is None else _max_diff(aux_m, aux_s), side_aux=side_aux,
                ids_equal=(side.dsa_topk_ids is None and stack.dsa_topk_ids is None)
                or torch.equal(side.dsa_topk_ids, stack.dsa_topk_ids),
                tpe=side.tokens_per_expert().sum(dim=1).tolist(),
                tpe_equal=torch.equal(side.tokens_per_expert(), torch.stack(stack.tokens_per_expert)))


@pytest.mark.parametrize("cfg_kwargs", [
    {"moe": {**MOE_SMALL, "aux_loss_coeff": 0.01}},
    {"dsa": DSA_SMALL},
], ids=["mla-moe-aux", "dsa-source-consumer"])
def test_megatron_block_matches_spartron_decoder_layers(cfg_kwargs):
    (r,) = run_distributed(_block_parity, 1, cfg_kwargs)
    assert r["init_differs"] == [], r["init_differs"]
    assert r["out"] < 2e-6 and r["x_grad"] < 2e-6 and r["grads"] < 2e-6, r
    assert r["no_grad"] == ([] if "dsa" not in cfg_kwargs else  # frozen indexers get no gradient
                            [f"layers.{i}.self_attention.mla.indexer.{n}" for i in (0, 2)
                             for n in ("k_norm.bias", "k_norm.weight", "weights_proj.weight", "wk.weight",
                                       "wq_b.weight")])
    assert r["ids_equal"] and r["tpe_equal"] and r["tpe"] == [2 * 12 * 2] * 2  # tokens x top_k per MoE layer
    assert r["side_aux"] is None  # the aux loss reaches backward once, through Megatron's scaler
    if "dsa" not in cfg_kwargs:
        assert r["aux"] < 1e-6


def _side_channel_rules(rank, world):
    cfg = small_cfg(dsa=DSA_SMALL)
    pgc = to_process_group_collection(ParallelGroups.build(ParallelDims(world_size=1, fsdp=1), "cpu"))
    tcfg = megatron_config_from_spartron(cfg)
    side = SideChannel()
    block = TransformerBlock(tcfg, spartron_block_spec(tcfg, side, base_config=cfg, pg_collection=pgc),
                             pg_collection=pgc)
    x = torch.randn(8, 1, cfg.dim)
    errors = {}
    block(x, attention_mask=None)
    for name, call in {
        "no_reset": lambda: block(x, attention_mask=None),
        "consumer_first": lambda: (side.reset(), block.layers[1](x, attention_mask=None)),
        "mask": lambda: (side.reset(), block(x, attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))),
        "padding": lambda: block.layers[1].mlp(x, padding_mask=torch.zeros(1, 8, dtype=torch.bool)),
    }.items():
        try:
            call()
        except (RuntimeError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    return errors


def test_block_spec_gives_every_moe_slot_one_transport():
    cfg = small_cfg(moe=MOE_SMALL)
    tcfg = megatron_config_from_spartron(cfg)
    spec = spartron_block_spec(tcfg, SideChannel(), base_config=cfg)
    moe_slots = [s.submodules.mlp for s in spec.layer_specs if s.submodules.mlp.module is SpartronMoEMLP]
    transports = {id(slot.params["transport"]) for slot in moe_slots}
    assert len(moe_slots) == cfg.n_layers - cfg.first_k_dense > 1 and len(transports) == 1
    assert isinstance(moe_slots[0].params["transport"], EPTransport)


def test_side_channel_and_unsupported_inputs_fail_clearly():
    (errors,) = run_distributed(_side_channel_rules, 1)
    assert errors["no_reset"].startswith("RuntimeError: SideChannel already holds layer 0's output")
    assert errors["consumer_first"].startswith("RuntimeError: layer 1 is a DSA consumer but the SideChannel")
    assert "do not support ['attention_mask']" in errors["mask"]
    assert "do not support ['padding_mask']" in errors["padding"]


def _groups_and_cp_parity(rank, world):
    torch.manual_seed(0)
    cfg = small_cfg(moe={**MOE_SMALL, "n_routed_experts": 4})
    groups = ParallelGroups.build(ParallelDims(world_size=world, fsdp=2, cp=2, ep=2), "cpu")
    pgc = to_process_group_collection(groups)
    other_dims = ParallelDims(world_size=world, fsdp=1, cp=4, ep=4)
    other = to_process_group_collection(ParallelGroups.build(other_dims, "cpu"))
    tcfg = megatron_config_from_spartron(cfg, context_parallel_size=2, expert_model_parallel_size=2)
    side = SideChannel()
    ranks = {}
    for how, params in {"pgc": dict(pg_collection=pgc), "groups": dict(groups=groups),
                        "both": dict(groups=groups, pg_collection=pgc)}.items():
        attn = SpartronMLAAttention(tcfg, layer_number=2, side_channel=side, base_config=cfg, **params)
        mlp = SpartronMoEMLP(tcfg, side, cfg, **params)
        ranks[how] = (dist.get_process_group_ranks(attn.cp_group), dist.get_process_group_ranks(mlp.ep_group))
    layer = build_module(spartron_layer_spec(side, "moe", cfg, groups=groups), config=tcfg, layer_number=2,
                         pg_collection=pgc)  # through TransformerLayer: attention gets pgc AND groups
    ranks["layer"] = (dist.get_process_group_ranks(layer.self_attention.cp_group),
                      dist.get_process_group_ranks(layer.mlp.ep_group))
    # EP: this rank's experts are its slice of the 1-rank model's (global expert index, model names)
    experts = layer.mlp.moe.experts
    whole = init_tensor_(torch.empty(4, *experts.w1.shape[1:]), "layers.1.ffn.experts.w1", 0, cfg.init_std,
                         first_expert=0)
    n_local = experts.n_local_experts
    own_experts = torch.equal(experts.w1.detach(), whole[experts.first_expert:experts.first_expert + n_local])
    mismatch = None
    try:
        build_module(spartron_layer_spec(side, "moe", cfg, groups=groups), config=tcfg, layer_number=2,
                     pg_collection=other)
    except ValueError as e:
        mismatch = str(e)
    # CP: the Megatron layer on this rank's Megatron-layout shard equals the full-sequence run's shard.
    cp_rank = dist.get_rank(groups.cp)
    layer = build_module(spartron_layer_spec(side, "dense", cfg), config=tcfg, layer_number=1,
                         pg_collection=pgc)
    full = build_module(spartron_layer_spec(side, "dense", cfg), config=megatron_config_from_spartron(cfg),
                        layer_number=1,
                        pg_collection=to_process_group_collection(
                            ParallelGroups.build(ParallelDims(world_size=world, fsdp=world), "cpu")))
    full.load_state_dict(layer.state_dict())
    x = torch.randn(16, 2, cfg.dim)
    side.reset()
    y_local, _ = layer(shard_sequence(x, 2, cp_rank, dim=0), attention_mask=None)
    side.reset()
    y_full, _ = full(x, attention_mask=None)
    positions = layer.self_attention.positions(8, torch.device("cpu"))
    y_full_shard = shard_sequence(y_full, 2, cp_rank, dim=0)
    return dict(ranks=ranks, mismatch=mismatch, cp_diff=_max_diff(y_local, y_full_shard), own_experts=own_experts,
                first_expert=experts.first_expert,
                positions_ok=torch.equal(positions, local_positions(16, 2, cp_rank)))


def test_groups_from_pg_collection_or_parallel_groups_are_the_same_ranks():
    results = run_distributed(_groups_and_cp_parity, 4)
    for rank, r in enumerate(results):
        assert r["ranks"]["pgc"] == r["ranks"]["groups"] == r["ranks"]["both"] == r["ranks"]["layer"], r
        cp_ranks, ep_ranks = r["ranks"]["pgc"]
        assert rank in cp_ranks and rank in ep_ranks and len(cp_ranks) == len(ep_ranks) == 2
        assert r["mismatch"] is not None and "the cp group of pg_collection has ranks" in r["mismatch"]
        assert r["positions_ok"] and r["cp_diff"] < 2e-6, r
        assert r["own_experts"] and r["first_expert"] == 2 * sorted(ep_ranks).index(rank), r


def _gpt_model_train_step(rank, world):
    from megatron.core import parallel_state

    torch.manual_seed(0)
    cfg = small_cfg(dsa=DSA_SMALL)
    pgc = to_process_group_collection(ParallelGroups.build(ParallelDims(world_size=1, fsdp=1), "cpu"))
    parallel_state.initialize_model_parallel()  # GPTModel's vocab-parallel loss reads Megatron's tp group
    tcfg = megatron_config_from_spartron(cfg, use_cpu_initialization=True)
    side = SideChannel()
    model = GPTModel(tcfg, spartron_block_spec(tcfg, side, base_config=cfg, pg_collection=pgc), vocab_size=64,
                     max_sequence_length=32, position_embedding_type="none", pg_collection=pgc)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 17))
    losses = []
    for _ in range(3):
        side.reset()
        loss = model(tokens[:, :-1], None, None, labels=tokens[:, 1:]).mean() + side.loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_gpt_model_with_spartron_spec_trains_on_cpu():
    (losses,) = run_distributed(_gpt_model_train_step, 1)
    assert losses[2] < losses[0], losses
