"""Spartron's adapters as Megatron's machinery sees them: expert attributes, groups, aux losses, the router
under finalize_model_grads / Float16Module, and dist_checkpointing across EP sizes (real gloo ranks)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core==0.16.1)")

import torch.distributed as dist  # noqa: E402
from cpu_shim import cpu_megatron  # noqa: E402 - next to this file
from megatron_configs import MOE_SMALL, small_cfg  # noqa: E402 - next to this file

from spartron.interop.megatron import (  # noqa: E402
    SideChannel,
    megatron_config_from_spartron,
    spartron_block_spec,
    spartron_layer_spec,  # noqa: E402
)
from spartron.interop.megatron.groups import to_process_group_collection  # noqa: E402
from spartron.interop.megatron.router_hooks import MegatronRouter, update_expert_bias  # noqa: E402
from spartron.layers.config import ModelConfig  # noqa: E402
from spartron.layers.moe.router import Router  # noqa: E402
from spartron.parallel.dims import ParallelDims  # noqa: E402
from spartron.parallel.groups import ParallelGroups  # noqa: E402
from spartron.testing import run_distributed  # noqa: E402


def _attrs(param) -> tuple[str, ...]:
    return tuple(sorted(k for k in vars(param) if not k.startswith("_")))


def _role(name: str) -> str:
    for role in ("experts", "shared_experts", "router"):
        if f"mlp.{role}." in name or f"mlp.moe.{role}." in name:
            return role
    return "other"


def _roles(layer) -> dict[str, set]:
    """role -> the set of (attribute names, allreduce value) its parameters carry."""
    out: dict[str, set] = {}
    for name, p in layer.named_parameters():
        if name.startswith("mlp."):
            out.setdefault(_role(name), set()).add((_attrs(p), getattr(p, "allreduce", None)))
    return out


# ---------------------------------------------------------------- 2 ranks, parallel_state EP 2

def _two_rank_checks(rank, world):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    out = {}
    # (a) Megatron's own MoE layer (local spec: builds on CPU) on the same MoE shape, and ours.
    theirs_cfg = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
        moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16, use_cpu_initialization=True,
        expert_model_parallel_size=2, add_bias_linear=False, gated_linear_unit=True,
        moe_token_dispatcher_type="allgather", moe_router_score_function="sigmoid")
    theirs = build_module(get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False), config=theirs_cfg,
                          layer_number=1)
    cfg = small_cfg(first_k_dense=0, n_layers=1)
    tcfg = megatron_config_from_spartron(cfg, expert_model_parallel_size=2)
    side = SideChannel()
    # (d) no pg_collection / groups in the spec: parallel_state's groups
    ours = build_module(spartron_layer_spec(side, "moe", cfg), config=tcfg, layer_number=1)
    out["roles"] = (_roles(theirs), _roles(ours))
    out["attention_attrs"] = {(_attrs(p), p.allreduce) for n, p in ours.named_parameters()
                              if n.startswith("self_attention.")}
    out["ep_ranks"] = (dist.get_process_group_ranks(ours.mlp.ep_group),
                       dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group()))
    out["first_expert"] = ours.mlp.moe.experts.first_expert
    try:
        build_module(spartron_layer_spec(side, "moe", cfg), config=megatron_config_from_spartron(cfg), layer_number=1)
    except ValueError as e:
        out["mismatch"] = str(e)
    # (a) what decides it: Megatron's DDP puts exactly the local experts into its expert-parallel buffers
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    with cpu_megatron():
        ddp = DistributedDataParallel(tcfg, DistributedDataParallelConfig(), ours, pg_collection=pgc)
    expert_ids = {id(p) for n, p in ours.named_parameters() if ".experts." in n}
    out["ddp_expert_params"] = {id(p) for b in ddp.expert_parallel_buffers for p in b.params} == expert_ids
    out["ddp_dense_params"] = ({id(p) for b in ddp.buffers for p in b.params}
                               == {id(p) for p in ours.parameters()} - expert_ids)
    out["n_experts"] = len(expert_ids)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_two_rank_checks, 2, timeout=180)


def test_expert_parameters_carry_megatron_attributes(two_ranks):
    for r in two_ranks:
        theirs, ours = r["roles"]
        assert sorted(theirs) == sorted(ours) == ["experts", "router", "shared_experts"]
        for role in theirs:
            assert ours[role] == theirs[role], role
        assert theirs["experts"] == {(("allreduce", "partition_dim", "partition_stride", "tensor_model_parallel"),
                                      False)}
        assert theirs["router"] == {(("sequence_parallel",), None)}
        assert r["attention_attrs"] == {(("allreduce", "partition_dim", "partition_stride",
                                          "tensor_model_parallel"), True)}
        assert r["ddp_expert_params"] and r["ddp_dense_params"] and r["n_experts"] == 3


def test_groups_default_to_parallel_state(two_ranks):
    for rank, r in enumerate(two_ranks):
        ours, megatron = r["ep_ranks"]
        assert ours == megatron == [0, 1]
        assert r["first_expert"] == 2 * rank
        assert r["mismatch"].startswith("Megatron config expert_model_parallel_size=1 but the ep group has 2 "
                                        "rank(s): set expert_model_parallel_size=2 in the Megatron config")


def test_ep_without_any_groups_is_an_error():
    cfg = small_cfg(n_layers=2)
    tcfg = megatron_config_from_spartron(cfg, expert_model_parallel_size=2)
    with pytest.raises(ValueError) as info:
        spartron_block_spec(tcfg, SideChannel(), base_config=cfg)
    assert str(info.value) == (
        "Megatron config expert_model_parallel_size=2 but the spec has no pg_collection / groups and "
        "megatron.core.parallel_state is not initialised: pass pg_collection= (or groups=) to "
        "spartron_block_spec, or initialise parallel_state")


def test_router_refuses_a_bias_rounded_by_float16module_and_moe_layer_bias_path():
    router = MegatronRouter(small_cfg().moe, 32)
    router(torch.randn(1, 3, 32))
    assert router.local_tokens_per_expert.sum().item() == 6  # 3 tokens x top-2, training mode
    router.eval()
    router(torch.randn(1, 3, 32))
    assert router.local_tokens_per_expert.sum().item() == 6  # eval forwards do not steer the bias
    router.bfloat16()  # what Float16Module does; a zero bias survives the round trip
    router(torch.randn(1, 3, 32))
    assert router.expert_bias.dtype == torch.float32 and router.local_tokens_per_expert.dtype == torch.int64
    router.expert_bias.add_(0.1234567)
    router.bfloat16()
    with pytest.raises(RuntimeError, match="expert_bias was cast to torch.bfloat16 while non-zero"):
        router(torch.randn(1, 3, 32))
    with pytest.raises(RuntimeError, match="call megatron's finalize_model_grads"):
        router.update_expert_bias(torch.zeros(4, dtype=torch.int64))


# ---------------------------------------------------------------- dist_checkpointing across EP sizes

def _gpt(cfg: ModelConfig, world: int, ep: int, seed: int):
    from megatron.core.models.gpt.gpt_model import GPTModel

    pgc = to_process_group_collection(ParallelGroups.build(ParallelDims(world_size=world, fsdp=world, ep=ep), "cpu"))
    tcfg = megatron_config_from_spartron(cfg, use_cpu_initialization=True, expert_model_parallel_size=ep)
    torch.manual_seed(seed)  # Megatron's own embedding init draws from torch's generator: the same on every rank
    model = GPTModel(tcfg, spartron_block_spec(tcfg, SideChannel(), base_config=cfg, pg_collection=pgc, init_seed=seed),
                     vocab_size=cfg.vocab_size, max_sequence_length=32, position_embedding_type="none",
                     pg_collection=pgc)
    experts = {f"{name}.{p}": (m.first_expert, m.n_local_experts) for name, m in model.named_modules()
               if getattr(m, "is_expert_module", False) for p, _ in m.named_parameters()}
    return model, pgc, experts


def _dist_checkpoint_round_trip(rank, world, ckpt_dir, load_eps):
    import multiprocessing

    from megatron.core import dist_checkpointing, parallel_state

    # torch_dist's writer starts a multiprocessing Manager, which a daemonic process may not do; the
    # ranks of run_distributed are daemonic only so that they die with the test (it kills them anyway).
    multiprocessing.current_process().daemon = False
    parallel_state.initialize_model_parallel()  # GPTModel's tp/pp bookkeeping; EP comes from each pg_collection
    cfg = small_cfg(n_layers=3)
    saved, pgc, experts = _gpt(cfg, world, 2, seed=1)
    with torch.no_grad():
        for i, router in enumerate(m for m in saved.modules() if isinstance(m, MegatronRouter)):
            router.expert_bias.copy_(torch.arange(4.0) * 0.01 + i)  # persistent non-parameter state too
    local = {k: v.detach().clone() for k, v in saved.state_dict().items() if isinstance(v, torch.Tensor)}
    full = dict(local)  # the saved model's global state: every rank's experts gathered over its EP group
    for key in experts:
        parts = [torch.empty_like(local[key]) for _ in range(dist.get_world_size(pgc.ep))]
        dist.all_gather(parts, local[key], group=pgc.ep)
        full[key] = torch.cat(parts)
    with cpu_megatron():
        dist_checkpointing.save(saved.sharded_state_dict(metadata={"dp_cp_group": pgc.dp_cp}), ckpt_dir)
    out = {"experts_differ_across_ep": not torch.equal(full[next(iter(experts))][:2], full[next(iter(experts))][2:])}
    for ep in load_eps:
        model, pgc, experts = _gpt(cfg, world, ep, seed=2)
        def wrong(m, experts=experts):
            return sorted(k for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)
                          and not torch.equal(v, full[k][experts[k][0]:sum(experts[k])] if k in experts else full[k]))
        before = wrong(model)
        with cpu_megatron():
            state = dist_checkpointing.load(model.sharded_state_dict(metadata={"dp_cp_group": pgc.dp_cp}), ckpt_dir)
        model.load_state_dict(state)
        out[ep] = {"n_keys": len(full), "wrong_before": len(before), "wrong_after": wrong(model)}
    return out


@pytest.mark.parametrize("world,load_eps", [(2, (1, 2)), (4, (1, 2, 4))], ids=["2ranks", "4ranks"])
def test_dist_checkpointing_saved_under_ep2_loads_under_other_ep_sizes(tmp_path, world, load_eps):
    (tmp_path / "ckpt").mkdir()
    results = run_distributed(_dist_checkpoint_round_trip, world, str(tmp_path / "ckpt"), load_eps, timeout=300)
    for r in results:
        assert r["experts_differ_across_ep"]
        for ep in load_eps:
            assert r[ep]["wrong_after"] == [], (ep, r[ep])
            assert r[ep]["wrong_before"] > r[ep]["n_keys"] // 2, (ep, r[ep])  # another seed: the load did it


# ---------------------------------------------------------------- the router under Megatron's machinery

def _bf16_step_and_finalize(rank, world):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    cfg = small_cfg(n_layers=3, dtype="bfloat16", moe={**MOE_SMALL, "bias_update_rate": 0.01})
    tcfg = megatron_config_from_spartron(cfg, use_cpu_initialization=True, expert_model_parallel_size=2)
    side = SideChannel()
    torch.manual_seed(0)
    gpt = GPTModel(tcfg, spartron_block_spec(tcfg, side, base_config=cfg), vocab_size=64, max_sequence_length=32,
                   position_embedding_type="none", pg_collection=pgc)  # the spec's groups: parallel_state's
    with cpu_megatron():
        model = DistributedDataParallel(tcfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                        Float16Module(tcfg, gpt), pg_collection=pgc)
    routers = [m for m in gpt.modules() if isinstance(m, MegatronRouter)]
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    side.reset()
    model(tokens[:, :-1], None, None, labels=tokens[:, 1:]).float().mean().backward()
    out = {"bias_dtypes": {str(r.expert_bias.dtype) for r in routers},
           "param_dtypes": {str(p.dtype) for n, p in gpt.named_parameters() if "experts" in n},
           "no_grad": sorted(n for n, p in gpt.named_parameters() if p.main_grad.abs().sum() == 0)}
    before, expected = [], []
    for r in routers:  # Spartron's trainer rule on the same counts, summed over dp x cp
        ref = Router(cfg.moe, cfg.dim)
        ref.expert_bias.copy_(r.expert_bias)
        before.append(r.expert_bias.clone())
        ref.update_expert_bias(r.local_tokens_per_expert.clone(), group=pgc.dp_cp)
        expected.append(ref.expert_bias)
    with cpu_megatron():
        finalize_model_grads([model], pg_collection=pgc)
    after = [r.expert_bias.clone() for r in routers]
    out["moved"] = all(not torch.equal(b, e) for b, e in zip(before, expected, strict=True))
    out["equal_rule"] = all(torch.equal(a, e) for a, e in zip(after, expected, strict=True))
    out["counts_zeroed"] = all(r.local_tokens_per_expert.sum().item() == 0 for r in routers)
    update_expert_bias(gpt, pgc.dp_cp)  # the hand-written-loop path in the same step: no second move
    out["no_double_update"] = all(torch.equal(r.expert_bias, a) for r, a in zip(routers, after, strict=True))
    try:
        routers[0].update_expert_bias(torch.zeros(4, dtype=torch.int64))
    except RuntimeError as e:
        out["moe_layer_path"] = str(e)
    return out


def test_float16module_forward_backward_and_finalize_model_grads_update_the_bias_by_spartrons_rule():
    for r in run_distributed(_bf16_step_and_finalize, 2, timeout=180):
        assert r["bias_dtypes"] == {"torch.float32"} and r["param_dtypes"] == {"torch.bfloat16"}
        assert r["no_grad"] == []
        assert r["moved"] and r["equal_rule"] and r["counts_zeroed"] and r["no_double_update"], r
        assert r["moe_layer_path"].startswith("the expert bias of a router under Megatron moves from its "
                                              "local_tokens_per_expert")


# ---------------------------------------------------------------- aux losses

def _aux_definitions(rank, world):
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        compute_routing_scores_for_aux_loss,
        get_moe_layer_wise_logging_tracker,
        switch_load_balancing_loss_func,
    )
    from megatron.core.transformer.spec_utils import build_module

    cfg = small_cfg(first_k_dense=0, n_layers=1, moe={**MOE_SMALL, "n_groups": 2, "topk_groups": 1,
                                                      "aux_loss_coeff": 0.01, "aux_loss_type": "batch"})
    pgc = to_process_group_collection(ParallelGroups.build(ParallelDims(world_size=1, fsdp=1), "cpu"))
    tcfg = megatron_config_from_spartron(cfg)
    torch.manual_seed(0)  # the input, not whatever the forking test process drew before
    x = torch.randn(6, 2, cfg.dim)
    tracked = {}
    for definition in ("spartron", "megatron"):
        layer = build_module(spartron_layer_spec(SideChannel(), "moe", cfg, pg_collection=pgc,
                                                 aux_loss_definition=definition),
                             config=tcfg, layer_number=1, pg_collection=pgc)
        router = layer.mlp.moe.router
        with torch.no_grad():  # bias and group-limited routing move the selection off the plain top-k
            router.expert_bias.copy_(torch.tensor([0.5, 0.5, -0.5, -0.5]))
        clear_aux_losses_tracker()
        layer.mlp(x)
        tracked[definition] = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"][0].item()
    logits = x.transpose(0, 1).reshape(-1, cfg.dim) @ router.weight.T
    routing_map, scores = compute_routing_scores_for_aux_loss(logits, 2, "sigmoid")
    megatron = switch_load_balancing_loss_func(scores, routing_map.sum(0), logits.shape[0], 2, 4, 1.0).item()
    try:
        spartron_layer_spec(SideChannel(), "moe", cfg, aux_loss_definition="plain")
        build_module(spartron_layer_spec(SideChannel(), "moe", cfg, pg_collection=pgc, aux_loss_definition="plain"),
                     config=tcfg, layer_number=1, pg_collection=pgc)
    except ValueError as e:
        tracked["bad"] = str(e)
    return tracked, megatron


def test_aux_loss_is_tracked_by_megatron_and_its_definition_is_selectable():
    ((tracked, megatron),) = run_distributed(_aux_definitions, 1)
    assert abs(tracked["megatron"] - megatron) < 1e-6, (tracked, megatron)
    assert abs(tracked["spartron"] - megatron) > 1e-3, (tracked, megatron)  # counted after bias + groups
    assert tracked["bad"].startswith("aux_loss_definition must be one of ['spartron', 'megatron'], got 'plain'")


def test_megatron_contracts_the_adapters_rely_on():
    """What megatron-core 0.16.1 reads from modules and parameters by name; a failure names the module to revisit."""
    import importlib
    import inspect

    from megatron.core.distributed import distributed_data_parallel

    ddp = inspect.getsource(distributed_data_parallel.DistributedDataParallel.__init__)
    assert "getattr(param, 'allreduce', True)" in ddp, \
        "Megatron DDP no longer tells expert parameters by param.allreduce: revisit interop/megatron/expert_params.py"
    finalize = inspect.getsource(importlib.import_module("megatron.core.distributed.finalize_model_grads"))
    assert "hasattr(module, 'expert_bias')" in finalize and "module.local_tokens_per_expert" in finalize, \
        "finalize_model_grads no longer reads expert_bias / local_tokens_per_expert: revisit router_hooks.py"
