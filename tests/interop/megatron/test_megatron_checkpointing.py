"""Spartron's checkpoint manager inside Megatron GPTModels built from Spartron specs: exact gradients.

Every AC mode x reentrant setting (and freq, offload windows) against the no-AC run of the same
weights: gradients of every parameter (DSA indexer included), losses, the SideChannel's contents and
the MoE routing-count buffers, over two micro-batches per step (fp32, CPU).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core==0.16.1)")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.moe.moe_utils import (  # noqa: E402
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
)
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron_configs import DSA_SMALL, MOE_SMALL, small_cfg  # noqa: E402 - next to this file
from pydantic import ValidationError  # noqa: E402

from spartron.checkpointing import ACConfig, CheckpointReplayError, apply_activation_checkpointing  # noqa: E402
from spartron.interop.megatron import (  # noqa: E402
    MegatronConfigError,
    SideChannel,
    megatron_config_from_spartron,
    spartron_block_spec,
)
from spartron.interop.megatron.checkpointing import (  # noqa: E402
    apply_spartron_checkpointing,
    megatron_checkpoint_region_of,
)
from spartron.interop.megatron.groups import to_process_group_collection  # noqa: E402
from spartron.layers.config import ModelConfig  # noqa: E402
from spartron.parallel.dims import ParallelDims  # noqa: E402
from spartron.parallel.groups import ParallelGroups  # noqa: E402
from spartron.testing import run_distributed  # noqa: E402

DSA_KL = {**DSA_SMALL, "indexer_mode": "kl_dense", "indexer_loss_coeff": 0.5}
CONFIGS = {
    # aux loss and the expert bias's step counts: both must be counted once per forward
    "moe": dict(moe={**MOE_SMALL, "aux_loss_coeff": 0.01, "bias_update_rate": 1e-3}),
    # layers 0 and 2 are DSA sources (trained indexers), layer 1 a consumer
    "dsa": dict(dsa=DSA_KL, moe={**MOE_SMALL, "aux_loss_coeff": 0.01}),
}
CASES = {  # name -> (ac, offload)
    **{f"{mode}-{'reentrant' if r else 'non-reentrant'}": (dict(mode=mode, reentrant=r), None)
       for mode in ("full", "selective") for r in (True, False)},
    "selective-no-targets-reentrant": (dict(mode="selective", targets=[]), None),
    "selective-own-targets-non-reentrant": (dict(mode="selective", targets=["aten::mm", "spartron::sparse_mla",
                                                                            "spartron_collectives"],
                                                 reentrant=False), None),
    "full-freq2-reentrant": (dict(mode="full", freq=2), None),
    "selective-offload-reentrant": (dict(mode="selective"), dict(enabled=True)),
    "full-offload-non-reentrant": (dict(mode="full", reentrant=False), dict(enabled=True, window=[0, 1],
                                                                            what="inputs_and_dsa_ids")),
    "none": (dict(mode="none"), None),
}


def _gpt(cfg: ModelConfig, pgc, side: SideChannel) -> GPTModel:
    tcfg = megatron_config_from_spartron(cfg, use_cpu_initialization=True)
    return GPTModel(tcfg, spartron_block_spec(tcfg, side, base_config=cfg, pg_collection=pgc, init_seed=3),
                    vocab_size=cfg.vocab_size, max_sequence_length=32, position_embedding_type="none",
                    pg_collection=pgc)


def _step(model: GPTModel, side: SideChannel, batches: list[torch.Tensor], ckpt=None) -> dict:
    """Two micro-batches (forward, backward each) in one step; what the step produced."""
    model.zero_grad(set_to_none=True)
    for m in model.modules():
        if hasattr(m, "step_tokens_per_expert"):
            m.step_tokens_per_expert.zero_()
    clear_aux_losses_tracker()
    losses, side_losses, tpe, ids, stats = [], [], [], [], None
    with ckpt.session() if ckpt is not None else contextlib.nullcontext() as session:
        for tokens in batches:
            side.reset()
            loss = model(tokens[:, :-1], None, None, labels=tokens[:, 1:]).mean() + side.loss()
            loss.backward()
            losses.append(loss.detach())
            side_losses.append((_detached(side.aux_loss()), _detached(side.indexer_loss())))
            tpe.append(side.tokens_per_expert())
            ids.append(side.dsa_topk_ids)
        stats = None if session is None else dataclasses.asdict(session.stats)
    tracked = {k: v["values"].clone() for k, v in sorted(get_moe_layer_wise_logging_tracker().items())}
    return dict(losses=losses, side_losses=side_losses, tpe=tpe, ids=ids, session=stats, tracked=tracked,
                grads={k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None},
                counts={k: b.clone() for k, b in model.named_buffers() if k.endswith("step_tokens_per_expert")})


def _eval(model: GPTModel, side: SideChannel, tokens: torch.Tensor) -> list[torch.Tensor]:
    side.reset()
    with torch.no_grad():
        per_token = model(tokens[:, :-1], None, None, labels=tokens[:, 1:])
    return [per_token, side.indexer_loss(), side.tokens_per_expert(), side.dsa_topk_ids]


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _max_diff(a: list, b: list) -> float:
    diffs = [(x - y).abs().max().item() for x, y in zip(a, b, strict=True) if x is not None or y is not None]
    return max(diffs, default=0.0)


def _compare(ref: dict, got: dict) -> dict:
    return dict(
        # parameters whose gradient one run has and the other lacks (the issue: indexers under reentrant AC)
        grads_only_in_one=sorted(set(ref["grads"]) ^ set(got["grads"])),
        grads=max((ref["grads"][k] - got["grads"][k]).abs().max().item()
                  for k in set(ref["grads"]) & set(got["grads"])),
        losses=_max_diff(ref["losses"], got["losses"]),
        side_losses=max(_max_diff(list(a), list(b)) for a, b in zip(ref["side_losses"], got["side_losses"],
                                                                     strict=True)),
        tpe_equal=all(torch.equal(a, b) for a, b in zip(ref["tpe"], got["tpe"], strict=True)),
        ids_equal=all((a is None and b is None) or torch.equal(a, b)
                      for a, b in zip(ref["ids"], got["ids"], strict=True)),
        counts_equal=all(torch.equal(ref["counts"][k], got["counts"][k]) for k in ref["counts"]),
        # Megatron's aux-loss tracker (when the adapters log to it): added to once per layer call
        tracked_equal=sorted(ref["tracked"]) == sorted(got["tracked"])
        and all(torch.equal(ref["tracked"][k], got["tracked"][k]) for k in ref["tracked"]),
        session=got["session"])


def _ac_parity(rank, world, cfg_name):
    from megatron.core import parallel_state

    torch.manual_seed(0)
    cfg = small_cfg(**CONFIGS[cfg_name])
    pgc = to_process_group_collection(ParallelGroups.build(ParallelDims(world_size=1, fsdp=1), "cpu"))
    parallel_state.initialize_model_parallel()
    side = SideChannel()
    ref_model = _gpt(cfg, pgc, side)
    batches = [torch.randint(0, cfg.vocab_size, (2, 17)) for _ in range(2)]
    ref = _step(ref_model, side, batches)
    ref_eval = _eval(ref_model, side, batches[0])
    out = dict(indexer_grads=sorted(k for k in ref["grads"] if ".indexer." in k),
               n_grads=len(ref["grads"]), n_params=len(dict(ref_model.named_parameters())),
               counts=[c.sum().item() for c in ref["counts"].values()], cases={})
    for name, (ac, offload) in CASES.items():
        side = SideChannel()
        model = _gpt(cfg, pgc, side)
        model.load_state_dict(ref_model.state_dict())
        ckpt = apply_spartron_checkpointing(model, ac, offload)
        result = _compare(ref, _step(model, side, batches, ckpt))
        got_eval = _eval(model, side, batches[0])  # without grad the regions run their layers plainly, once
        result["eval_equal"] = all((a is None and b is None) or torch.equal(a, b)
                                   for a, b in zip(ref_eval, got_eval, strict=True))
        result["layers"] = list(ckpt.layers)
        result["classes"] = sorted({type(m).__name__ for m in model.decoder.layers})
        stats = [megatron_checkpoint_region_of(m) for m in model.decoder.layers]
        result["replays"] = [None if r is None else r.last_stats.replay_count for r in stats]
        out["cases"][name] = result
    return out


@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
def test_every_ac_mode_gives_the_no_ac_gradients(cfg_name):
    (r,) = run_distributed(_ac_parity, 1, cfg_name, timeout=300)
    assert r["n_grads"] == r["n_params"], r  # every parameter has a gradient without AC ...
    if cfg_name == "dsa":  # ... the trained DSA indexers of both source layers included (5 weights each)
        assert len(r["indexer_grads"]) == 10 and {k.split(".")[2] for k in r["indexer_grads"]} == {"0", "2"}
    assert r["counts"] == [2 * 2 * 16 * 2] * 2  # 2 micro-batches x 2 x 16 tokens x top-2, per MoE layer
    all_layers = [f"decoder.layers.{i}" for i in range(3)]
    for name, c in r["cases"].items():
        assert c["grads_only_in_one"] == [], (name, c)
        # fp32 on CPU, the same operators in the same order: bit-exact, not merely close
        assert c["grads"] == 0.0 and c["losses"] == 0.0 and c["side_losses"] == 0.0, (name, c)
        assert c["eval_equal"], (name, c)
        assert c["tpe_equal"] and c["ids_equal"] and c["counts_equal"] and c["tracked_equal"], (name, c)
        expected = {"none": [], "full-freq2-reentrant": all_layers[::2]}.get(name, all_layers)
        assert c["layers"] == expected, (name, c)
        # each region call replayed exactly once (the second micro-batch's call is the last one)
        assert c["replays"] == [1 if f"decoder.layers.{i}" in expected else None for i in range(3)], (name, c)
        assert c["classes"] == (["TransformerLayer"] if name == "none" else
                                ["SpartronCheckpointedTransformerLayer", "TransformerLayer"] if "freq2" in name
                                else ["SpartronCheckpointedTransformerLayer"]), (name, c)
        if "offload" in name:
            assert c["session"]["region_calls"] == 6 and c["session"]["offloaded_tensors"] > 0, (name, c)
            assert c["session"]["restored_tensors"] == c["session"]["offloaded_tensors"], (name, c)
        else:
            assert c["session"] is None, (name, c)


# ---------------------------------------------------------------- replay safety and refusals

def test_side_channel_capture_keeps_a_layer_s_writes_out_of_the_channel():
    side = SideChannel()
    latest, handed = torch.tensor([[[1, 2]]]), torch.tensor([[[3, 4]]])
    side.dsa_topk_ids = latest
    loss = torch.tensor(0.5)
    with side.capturing(1, handed) as capture:
        seen = side.dsa_topk_ids
        side.record_attention(1, {"hidden_states": torch.ones(1), "dsa_topk_ids": handed, "indexer_loss": loss})
        with pytest.raises(RuntimeError, match="layer 1 wrote its attention output while layer 1's capture is "
                                               r"open \(one layer per checkpoint region, one write per kind\)"):
            side.record_attention(1, {"hidden_states": None, "dsa_topk_ids": None, "indexer_loss": None})
        with pytest.raises(RuntimeError, match="layer 2 starts a capture while layer 1's is open"):
            with side.capturing(2, None):
                pass
    assert seen is handed and side.dsa_topk_ids is latest and side.attention == {} and side.indexer_loss() is None
    outputs = capture.outputs()
    assert outputs == {"attention": {"hidden_states": None, "dsa_topk_ids": handed, "indexer_loss": loss},
                       "moe": None}
    side.record_layer(1, outputs)
    assert side.indexer_loss().item() == 0.5
    assert side.dsa_topk_ids is handed
    with pytest.raises(RuntimeError, match="SideChannel already holds layer 1's output: call side.reset"):
        side.record_layer(1, outputs)


def _refusals(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    cfg = small_cfg(**CONFIGS["dsa"])
    pgc = to_process_group_collection(ParallelGroups.build(ParallelDims(world_size=1, fsdp=1), "cpu"))
    tokens = torch.randint(0, cfg.vocab_size, (2, 9))
    errors = {}

    def attempt(name, fn):
        try:
            fn()
        except (RuntimeError, ValueError, ValidationError) as e:
            errors[name] = f"{type(e).__name__}: {e}"

    def step(model, side):
        side.reset()
        (model(tokens[:, :-1], None, None, labels=tokens[:, 1:]).mean() + side.loss()).backward()

    side = SideChannel()  # the generic class swap: the layer writes inside a region that captures nothing
    model = _gpt(cfg, pgc, side)
    apply_activation_checkpointing(model.decoder.layers[0], ACConfig(mode="full"))
    attempt("generic", lambda: step(model, side))
    attempt("twice", lambda: apply_spartron_checkpointing(model, {"mode": "full"}))

    side = SideChannel()  # torch's own checkpoint replays the layer's writes into the channel
    model = _gpt(cfg, pgc, side)
    layer = model.decoder.layers[0]
    plain_forward = layer.forward
    layer.forward = lambda *a, **k: torch.utils.checkpoint.checkpoint(plain_forward, *a, use_reentrant=False, **k)
    attempt("torch_checkpoint", lambda: step(model, side))

    side = SideChannel()  # a user hook that changes the ids a consumer reads between forward and recompute
    model = _gpt(cfg, pgc, side)
    apply_spartron_checkpointing(model, {"mode": "selective", "reentrant": False})
    other_ids, calls = [], []
    # outside every region: after layer 0 (the source) returns, other ids of the same shape
    model.decoder.layers[0].register_forward_hook(lambda *_: other_ids.append(side.dsa_topk_ids.flip(-1)))

    def other_ids_on_recompute(module, args):  # inside the consumer's region: no op, only the swap
        calls.append(1)
        if len(calls) == 2:
            module.side_channel.dsa_topk_ids = other_ids[0]

    model.decoder.layers[1].self_attention.register_forward_pre_hook(other_ids_on_recompute)
    try:
        step(model, side)
    except CheckpointReplayError as e:
        errors["diverged"] = str(e)

    model = _gpt(cfg, pgc, SideChannel())
    attempt("offload_without_ac", lambda: apply_spartron_checkpointing(model, {"mode": "none"}, {"enabled": True}))
    attempt("unknown_key", lambda: apply_spartron_checkpointing(model, {"mode": "full", "granularity": "full"}))
    attempt("no_layers", lambda: apply_spartron_checkpointing(model.embedding, {"mode": "full"}))
    model.config.recompute_granularity = "full"  # set after the config check
    attempt("megatron_recompute", lambda: apply_spartron_checkpointing(model, {"mode": "full"}))
    plain = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True)
    megatron_layer = build_module(get_gpt_layer_local_spec(), config=plain, layer_number=1)
    attempt("megatron_layer", lambda: apply_spartron_checkpointing(megatron_layer, {"mode": "full"}))
    return errors


def test_what_the_checkpointing_refuses_names_the_way_out():
    (errors,) = run_distributed(_refusals, 1, timeout=300)
    assert errors["generic"] == (
        "RuntimeError: SideChannel: layer 0 wrote its attention output inside checkpoint region 'TransformerLayer', "
        "which does not capture the layer's side outputs (its losses would have no gradient): use "
        "spartron.interop.megatron.apply_spartron_checkpointing(model, ac) for activation checkpointing of "
        "Megatron layers")
    assert errors["twice"] == ("ValueError: apply_spartron_checkpointing: layer 'decoder.layers.0' is already "
                               "checkpointed")
    assert errors["torch_checkpoint"].startswith(
        "RuntimeError: SideChannel already holds layer 0's output: call side.reset() before each forward (a "
        "recompute outside Spartron's checkpointing writes twice: Megatron recompute is refused; use "
        "spartron.interop.megatron.apply_spartron_checkpointing(model, ac)"), errors["torch_checkpoint"]
    assert errors["diverged"] == ("decoder.layers.1: the recompute produced a different attention.dsa_topk_ids "
                                  "than the forward (the layer is not deterministic given its inputs)")
    assert errors["offload_without_ac"] == ("ValueError: offload.enabled needs checkpoint regions: set ac.mode to "
                                            "'full' or 'selective'")
    assert errors["unknown_key"].startswith("ValidationError: 1 validation error for ACConfig\ngranularity\n"
                                            "  Extra inputs are not permitted"), errors["unknown_key"]
    assert errors["no_layers"] == ("ValueError: apply_spartron_checkpointing: LanguageModelEmbedding has no "
                                   "Megatron TransformerLayer")
    assert errors["megatron_recompute"] == (
        "ValueError: apply_spartron_checkpointing: layer 'decoder.layers.0' has Megatron recompute_granularity="
        "'full'; set it to None (one recompute, Spartron's)")
    assert errors["megatron_layer"] == (
        "ValueError: apply_spartron_checkpointing: layer '' was not built from Spartron specs (its "
        "self_attention is SelfAttention, not SpartronMLAAttention)")


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_megatron_recompute_is_refused_with_the_spartron_way(granularity):
    with pytest.raises(MegatronConfigError) as e:
        megatron = dict(recompute_method="uniform", recompute_num_layers=1) if granularity == "full" else {}
        megatron_config_from_spartron(small_cfg(), recompute_granularity=granularity, **megatron)
    assert e.value.problems == [
        f"recompute_granularity={granularity!r}: must be one of [None] (Megatron recompute re-runs the layers "
        "through its own checkpoint, which replays the SideChannel writes and has no Spartron policy; use "
        "spartron.interop.megatron.apply_spartron_checkpointing(model, ac) with ac.mode 'full' or 'selective')"]


# ---------------------------------------------------------------- inside Megatron's DDP and schedule

def _ddp_schedule_grads(rank, world):
    """2 gloo ranks, EP 2: Megatron DDP + get_forward_backward_func (2 micro-batches) + finalize_model_grads;
    DDP's reduced main_grads of every parameter per AC case."""
    from cpu_shim import cpu_megatron  # next to this file: the test-only CPU placement of Megatron's bookkeeping
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    # DSA and an aux loss; the expert bias off: what finalize_model_grads does with it is item 1's
    cfg = small_cfg(dsa=DSA_KL, moe={**MOE_SMALL, "aux_loss_coeff": 0.01, "bias_update_rate": 0.0})
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, cfg.vocab_size, (2, 17), generator=gen) for _ in range(2)]
    grads = {}
    for name, ac in {"no-ac": None, "selective-reentrant": {"mode": "selective"},
                     "full-non-reentrant": {"mode": "full", "reentrant": False}}.items():
        torch.manual_seed(0)  # the same Megatron-owned weights (embedding, output layer) in every case
        tcfg = megatron_config_from_spartron(cfg, use_cpu_initialization=True, expert_model_parallel_size=2)
        side = SideChannel()
        gpt = GPTModel(tcfg, spartron_block_spec(tcfg, side, base_config=cfg, pg_collection=pgc, init_seed=3),
                       vocab_size=cfg.vocab_size, max_sequence_length=32, position_embedding_type="none",
                       pg_collection=pgc)
        if ac is not None:
            apply_spartron_checkpointing(gpt, ac)
        with cpu_megatron():
            model = DistributedDataParallel(tcfg, DistributedDataParallelConfig(), gpt, pg_collection=pgc)
        tcfg.finalize_model_grads_func = finalize_model_grads
        tcfg.no_sync_func = model.no_sync

        def forward_step(data_iterator, model, side=side):
            tokens = next(data_iterator)
            side.reset()
            per_token = model(tokens[:, :-1], None, None, labels=tokens[:, 1:])
            return per_token, lambda out: (out.float().mean() + side.loss(), {})

        with cpu_megatron():
            model.zero_grad_buffer()
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                                        num_microbatches=2, seq_length=16, micro_batch_size=2)
        grads[name] = {k: p.main_grad.clone() for k, p in gpt.named_parameters()}
    ref = grads.pop("no-ac")
    return dict(nonzero=sum(int(g.abs().sum() > 0) for g in ref.values()), n=len(ref),
                diffs={name: max((g[k] - ref[k]).abs().max().item() for k in ref) for name, g in grads.items()})


def test_megatron_ddp_schedule_gradients_are_the_no_ac_ones():
    results = run_distributed(_ddp_schedule_grads, 2, timeout=300)
    for r in results:
        assert r["nonzero"] == r["n"], r  # every parameter's reduced gradient is there (indexers included)
        assert r["diffs"] == {"selective-reentrant": 0.0, "full-non-reentrant": 0.0}, r
