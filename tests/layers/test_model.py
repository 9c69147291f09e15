"""The reference model: TypedDict dataflow, MTP, DSA ids, chunked loss, state_dict keys, 1 vs 4 rank parity."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from spartron.checkpointing import apply_activation_checkpointing
from spartron.checkpointing.config import ACConfig
from spartron.layers.model import SparseMoEModel, build_model
from spartron.layers.outputs import DecoderLayerOutput, ModelOutput, MTPOutput
from spartron.layers.parallelize import parallelize
from spartron.parallel.dims import ParallelDims
from spartron.parallel.groups import ParallelGroups
from spartron.runtime.config import load_config
from spartron.testing import run_distributed

SEQ = 32


def tiny(*overrides: str):
    return load_config("configs/tiny.toml", [f"train.seq_len={SEQ}", *overrides])


def batch(cfg, n: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (n, SEQ), generator=g)
    labels = torch.randint(0, cfg.model.vocab_size, (n, SEQ), generator=g)
    return tokens, labels


def make_model(cfg, seed: int = 0) -> SparseMoEModel:
    return build_model(cfg.model, seed=seed)


def test_model_and_layer_outputs_are_the_typed_dicts():
    cfg = tiny()
    model = make_model(cfg)
    seen = {}
    model.layers["1"].register_forward_hook(lambda m, a, out: seen.setdefault("layer", out))
    model.layers["1"].attn.register_forward_hook(lambda m, a, out: seen.setdefault("attn", out))
    out = model(*batch(cfg, 2))
    assert set(out) == set(ModelOutput.__annotations__)
    assert set(seen["layer"]) == set(DecoderLayerOutput.__annotations__)
    assert set(seen["attn"]) == {"hidden_states", "dsa_topk_ids", "indexer_loss"}
    moe_out = model.layers["1"].ffn(torch.randn(2, SEQ, cfg.model.dim))
    assert {"hidden_states", "topk_ids", "topk_weights", "tokens_per_expert", "aux_loss"} <= set(moe_out)
    assert len(out["mtp_losses"]) == cfg.model.mtp.depth
    # 3 MoE layers in the main stack + 2 MTP depths, every token counted top_k times per MoE layer.
    assert out["tokens_per_expert"].shape == (3 + 2, cfg.model.moe.n_routed_experts)
    assert torch.all(out["tokens_per_expert"].sum(-1) == 2 * SEQ * cfg.model.moe.top_k)
    torch.testing.assert_close(out["loss"], out["lm_loss"] + sum(out["mtp_losses"]))


@pytest.mark.parametrize("share", [True, False])
def test_mtp_shared_and_unshared(share):
    cfg = tiny(f"model.mtp.share_weights={str(share).lower()}")
    model = make_model(cfg)
    assert len(model.mtp.blocks) == (1 if share else cfg.model.mtp.depth)
    captured = []
    hook = model.mtp.register_forward_hook(lambda m, a, out: captured.append(out[0]))
    out = model(*batch(cfg, 2))
    hook.remove()
    mtp_out = captured[0]
    assert set(mtp_out) == set(MTPOutput.__annotations__)
    assert len(mtp_out["hidden_states"]) == len(mtp_out["losses"]) == cfg.model.mtp.depth
    out["loss"].backward()
    missing = [n for n, p in model.mtp.named_parameters() if p.grad is None and ".indexer." not in n]
    assert missing == []  # every MTP weight but the frozen indexer's is trained


def test_unshared_mtp_has_more_parameters():
    models = {s: make_model(tiny(f"model.mtp.share_weights={s}")) for s in ("true", "false")}
    n = {s: sum(p.numel() for p in m.mtp.parameters()) for s, m in models.items()}
    indexer = sum(p.numel() for name, p in models["true"].mtp.named_parameters() if ".indexer." in name)
    assert indexer > 0
    # Two blocks instead of one; the second depth is a DSA consumer, so it has no indexer of its own.
    assert n["false"] == 2 * n["true"] - indexer


def test_dsa_ids_from_sources_reach_consumers_and_mtp():
    cfg = tiny("model.mtp.share_weights=false")
    model = make_model(cfg)
    calls = []

    def hook(module, args, kwargs, out):
        calls.append((module.dsa_role, kwargs.get("dsa_topk_ids"), out["dsa_topk_ids"]))

    attns = [model.layers[str(i)].attn for i in range(cfg.model.n_layers)] + [b.layer.attn for b in model.mtp.blocks]
    for attn in attns:
        attn.register_forward_hook(hook, with_kwargs=True)
    model(*batch(cfg, 2))
    roles = [c[0] for c in calls]
    assert roles == [None, "source", "consumer", "source", "source", "consumer"]
    assert calls[0][1] is None and calls[0][2] is None  # dense attention layer
    assert calls[1][1] is None and calls[1][2] is not None  # source computes
    assert calls[2][1] is calls[1][2]  # consumer gets exactly the source's ids
    assert calls[5][1] is calls[4][2]  # MTP depth 2 reuses depth 1's ids (one indexer for the MTP depths)
    assert calls[1][2].dtype == torch.int32 and calls[1][2].shape == (2, SEQ, cfg.model.dsa.index_topk)


def test_chunked_loss_in_the_model_equals_plain_loss():
    plain_cfg, chunk_cfg = tiny(), tiny("model.loss_chunk_size=8")
    a, b = make_model(plain_cfg), make_model(chunk_cfg)
    b.load_state_dict(a.state_dict())
    data = batch(plain_cfg, 2)
    la, lb = a(*data)["loss"], b(*data)["loss"]
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        if pa.grad is not None:
            torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_state_dict_keys_unchanged_by_activation_checkpointing():
    cfg = tiny()
    plain = make_model(cfg)
    wrapped = make_model(cfg)
    for name, layer in list(wrapped.layers.items()):
        setattr(wrapped.layers, name, apply_activation_checkpointing(layer, ACConfig(mode="full")))
    assert list(plain.state_dict()) == list(wrapped.state_dict())


def _expert_slice(name: str, tensor: torch.Tensor, ep_rank: int, ep: int) -> torch.Tensor:
    if ".experts." not in name:
        return tensor
    n_local = tensor.shape[0] // ep
    return tensor[ep_rank * n_local:(ep_rank + 1) * n_local]


def _parity_worker(rank, world, ac_mode, cp=2, ep=2):
    cfg = tiny(f"parallel.cp={cp}", f"parallel.ep={ep}", f"ac.mode={ac_mode}")
    dims = ParallelDims(world, fsdp=world // cp, cp=cp, ep=ep)
    groups = ParallelGroups.build(dims, "cpu")
    tokens, labels = batch(cfg, 4)
    reference = make_model(tiny())
    ref_out = reference(tokens, labels)
    ref_out["loss"].backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}

    torch.manual_seed(1 + rank)  # the init may not depend on the RNG state: nothing is loaded below
    model = build_model(cfg.model, groups)
    ep_rank, ep = groups.rank_in("ep"), groups.size("ep")
    keys = list(model.state_dict())
    ref_state = reference.state_dict()
    for n, t in model.state_dict().items():  # the EP x CP model from the seed is the reference's slice
        assert torch.equal(t, _expert_slice(n, ref_state[n], ep_rank, ep)), n
    parallelize(model, groups, cfg.ac)
    assert list(model.state_dict()) == keys  # AC and FSDP keep every key
    per_dp = 4 // groups.size("dp")
    dp = groups.rank_in("dp")
    out = model(tokens[per_dp * dp:per_dp * (dp + 1)], labels[per_dp * dp:per_dp * (dp + 1)])
    out["loss"].backward()
    loss = out["loss"].detach().clone()
    dist.all_reduce(loss, group=groups.dp_cp)
    torch.testing.assert_close(loss / world, ref_out["loss"].detach(), rtol=1e-5, atol=1e-5)
    sq_local = torch.zeros((), dtype=torch.float64)
    sq_ref = sum(g.double().pow(2).sum() for g in ref_grads.values())
    for name, p in model.named_parameters():
        if p.grad is None:
            assert name not in ref_grads, name
            continue
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        expected = _expert_slice(name, ref_grads[name], ep_rank, ep)
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=2e-6, msg=name)
        sq_local += grad.double().pow(2).sum() / (1 if ".experts." in name else ep)
    dist.all_reduce(sq_local, group=groups.ep)
    torch.testing.assert_close(sq_local.sqrt(), sq_ref.sqrt(), rtol=1e-5, atol=1e-6)
    groups.destroy()


@pytest.mark.parametrize("ac_mode", ["none", "full", "selective"])
def test_one_rank_and_four_ranks_ep2_cp2_fsdp_give_the_same_loss_and_grads(ac_mode):
    run_distributed(_parity_worker, 4, ac_mode, timeout=240)


def test_two_ranks_ep2_without_cp_give_the_same_loss_and_grads():
    run_distributed(_parity_worker, 2, "selective", 1, 2, timeout=240)


def test_compiled_blocks_match_eager():
    # torch.compile per block without checkpoint regions (with AC: tests/test_compile_ac.py).
    eager_cfg = tiny("ac.mode=none")
    compiled_cfg = tiny("ac.mode=none", "train.compile=true", "train.compile_backend=aot_eager")
    eager, compiled = make_model(eager_cfg), make_model(compiled_cfg)
    parallelize(compiled, None, compiled_cfg.ac, compile_backend=compiled_cfg.train.compile_backend)
    assert list(eager.state_dict()) == list(compiled.state_dict())
    data = batch(eager_cfg, 2)
    a, b = eager(*data)["loss"], compiled(*data)["loss"]
    a.backward()
    b.backward()
    torch.testing.assert_close(a, b)
    for (name, pa), pb in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        if pa.grad is not None:
            torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-6, msg=name)
