"""Load-balanced causal sharding helpers, and MLA / DSA under context parallelism equal to CP=1."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from spartron.layers.attention.context_parallel import (
    global_chunk_order,
    local_positions,
    shard_sequence,
    unshard_sequence,
)
from spartron.layers.attention.mla import MLA
from spartron.layers.config import ModelConfig
from spartron.testing import run_distributed


def test_shard_gives_rank_chunks_r_and_mirror():
    x = torch.arange(16).view(1, 16)
    assert shard_sequence(x, 4, 0).tolist() == [[0, 1, 14, 15]]
    assert shard_sequence(x, 4, 3).tolist() == [[6, 7, 8, 9]]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert global_chunk_order(2) == [0, 2, 3, 1]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_unshard_inverts_shard(cp):
    x = torch.randn(2, 24, 3)
    gathered = torch.cat([shard_sequence(x, cp, r) for r in range(cp)], dim=1)
    assert torch.equal(unshard_sequence(gathered, cp), x)


def test_sequence_must_divide_into_2cp_chunks():
    with pytest.raises(ValueError, match="multiple of 2\\*cp = 8"):
        shard_sequence(torch.zeros(1, 12), 4, 0)


DSA = dict(n_index_heads=2, index_head_dim=8, index_topk=5, topk_freq=2)
MODES = {
    "dense": None,
    "frozen": DSA,
    "kl_dense": {**DSA, "indexer_mode": "kl_dense", "indexer_loss_coeff": 0.5},
    "kl_sparse": {**DSA, "indexer_mode": "kl_sparse", "indexer_loss_coeff": 0.5},
    # the query-chunked attention over a rank's local rows (8 or 4 of them: chunks of 3 end mid-shard)
    "kl_sparse_chunked": {**DSA, "indexer_mode": "kl_sparse", "indexer_loss_coeff": 0.5, "attention_chunk": 3},
}


def _cfg(dsa):
    return ModelConfig.model_validate(dict(
        dim=16, n_heads=2, n_layers=3, first_k_dense=1,
        mla=dict(q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
        dsa=dsa))


def _run(layers, x, positions, grad_h, cp=1):
    """Layer 1 (dense or DSA source), then layer 2 (dense or consumer of layer 1's ids).

    The indexer loss is a mean over local queries: like the LM loss it is averaged over CP ranks.
    """
    a = layers[0](x, positions)
    b = layers[1](x + a["hidden_states"], positions, a["dsa_topk_ids"] if layers[1].dsa_role else None)
    loss = (b["hidden_states"] * grad_h).sum()
    if a["indexer_loss"] is not None:
        loss = loss + a["indexer_loss"] / cp
    loss.backward()
    return b["hidden_states"].detach(), a["dsa_topk_ids"], a["indexer_loss"]


def _cp_parity(rank, world, seq):
    group = dist.new_group(list(range(world)))
    report = {}
    for mode, dsa in MODES.items():
        cfg = _cfg(dsa)
        torch.manual_seed(0)
        ref_layers = [MLA(cfg, 1).double(), MLA(cfg, 2).double()]
        cp_layers = [MLA(cfg, 1, cp_group=group).double(), MLA(cfg, 2, cp_group=group).double()]
        for ref, cp in zip(ref_layers, cp_layers, strict=True):
            cp.load_state_dict(ref.state_dict())
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, seq, 16, generator=g, dtype=torch.float64)
        grad_h = torch.randn(2, seq, 16, generator=g, dtype=torch.float64)
        x_ref = x.clone().requires_grad_()
        out_ref, ids_ref, loss_ref = _run(ref_layers, x_ref, torch.arange(seq), grad_h)

        x_cp = shard_sequence(x, world, rank).requires_grad_()
        positions = local_positions(seq, world, rank)
        out_cp, ids_cp, loss_cp = _run(cp_layers, x_cp, positions, shard_sequence(grad_h, world, rank), world)

        torch.testing.assert_close(out_cp, shard_sequence(out_ref, world, rank), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(x_cp.grad, shard_sequence(x_ref.grad, world, rank), rtol=1e-9, atol=1e-10)
        for (name, p_ref), p_cp in zip(
                [(n, p) for layer in ref_layers for n, p in layer.named_parameters()],
                [p for layer in cp_layers for p in layer.parameters()], strict=True):
            if p_ref.grad is None:
                assert p_cp.grad is None, name
                continue
            summed = p_cp.grad.clone()
            dist.all_reduce(summed, group=group)  # each rank holds its tokens' share
            torch.testing.assert_close(summed, p_ref.grad, rtol=1e-9, atol=1e-10, msg=f"{mode} {name}")
        if ids_ref is not None:  # global key positions, same sets as CP=1
            local_ref = shard_sequence(ids_ref, world, rank)
            assert torch.equal(ids_cp.sort(-1).values, local_ref.sort(-1).values), mode
        if loss_ref is not None:
            mean = loss_cp.detach().clone()
            dist.all_reduce(mean, group=group)
            torch.testing.assert_close(mean / world, loss_ref.detach(), rtol=1e-9, atol=1e-12)
        report[mode] = True
    return report


@pytest.mark.parametrize("world", [2, 4])
def test_cp_matches_single_rank_outputs_grads_and_ids(world):
    results = run_distributed(_cp_parity, world, 16, timeout=120)
    assert all(r == {m: True for m in MODES} for r in results)


def _bad_positions(rank, world):
    group = dist.new_group(list(range(world)))
    layer = MLA(_cfg(None), 0, cp_group=group)
    try:
        layer(torch.randn(1, 4, 16), torch.arange(4) + 4 * rank)  # contiguous, not load-balanced
    except ValueError as e:
        return str(e)
    return "no error"


def test_cp_rejects_positions_that_are_not_the_balanced_shard():
    messages = run_distributed(_bad_positions, 2)
    assert all("must hold positions" in m for m in messages)


def _compiled_layer_under_cp(rank, world):
    """A compiled region (fullgraph, as train.compile traces a block) over MLA with a CP group: the position
    check's torch.equal is data-dependent, so it runs only eagerly; the compiled forward equals eager."""
    from spartron.layers.attention.context_parallel import cp_positions

    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    layer = MLA(_cfg(None), 0, cp_group=group)
    x, positions = torch.randn(1, 4, 16), cp_positions(4 * world, group)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    return torch.equal(compiled(x, positions)["hidden_states"], layer(x, positions)["hidden_states"])


def test_a_compiled_mla_under_cp_traces_and_equals_eager():
    assert run_distributed(_compiled_layer_under_cp, 2, timeout=120) == [True, True]


def test_group_wrappers_are_identity_without_cp():
    from spartron.layers.attention.context_parallel import cp_positions, cp_shard

    x = torch.randn(1, 6, 2)
    assert cp_shard(x, None) is x
    assert cp_positions(6, None).tolist() == list(range(6))
