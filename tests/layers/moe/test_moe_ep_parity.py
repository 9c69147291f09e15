"""Expert parallelism on real gloo ranks: EP=2 and EP=4 equal EP=1 on the same global batch.

Every rank builds the EP=1 reference over the full batch, then an EP layer holding its E/ep experts
and its share of the batch. No weights are copied: the EP layer starts from the init rule alone
(spartron.layers.init, global expert index), and its experts must be the reference's slice bitwise.
Outputs, input grads and expert-weight grads must equal the matching slice of the reference,
replicated grads (router, shared experts) their all-reduced sum.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (custom ops import it lazily: 4 s in every forked rank otherwise)
import torch.distributed as dist

from spartron.comm.transport import EPTransport
from spartron.layers.config import ModelConfig
from spartron.layers.moe import AllToAllDispatcher, MoELayer
from spartron.testing import run_distributed

BATCH_PER_RANK, SEQ, DIM = 2, 5, 32


def _cfg(score_func: str) -> ModelConfig:
    moe = {"n_routed_experts": 8, "n_shared_experts": 1, "top_k": 3, "moe_inter_dim": 16,
           "score_func": score_func, "n_groups": 2, "topk_groups": 2, "aux_loss_coeff": 0.01,
           "dispatcher": "all_to_all"}
    return ModelConfig.model_validate({"dim": DIM, "init_std": 0.3, "moe": moe})


def _loss(out, g, world):
    # the reference's seq-level aux loss is the mean over all sequences = mean over ranks of theirs
    return (out["hidden_states"] * g).sum() + out["aux_loss"] / world


def _ep_parity_worker(rank, world, score_func, dead_last_rank):
    cfg = _cfg(score_func)
    torch.manual_seed(rank)  # neither layer's weights may depend on the RNG state
    ref = MoELayer(cfg)
    torch.manual_seed(100 + rank)
    ep = MoELayer(cfg, EPTransport(dist.group.WORLD))
    assert isinstance(ep.dispatcher, AllToAllDispatcher)
    n_local = 8 // world
    assert ep.n_local_experts == n_local and ep.first_local_expert == rank * n_local
    own = slice(rank * n_local, (rank + 1) * n_local)
    for name, p in ep.named_parameters():  # from the seed alone, bitwise
        expected = ref.get_parameter(name)[own] if name.startswith("experts.") else ref.get_parameter(name)
        assert torch.equal(p, expected), name
    if dead_last_rank:  # the last EP rank's experts are never selected: it receives zero rows
        with torch.no_grad():
            for layer in (ref, ep):
                layer.router.expert_bias[8 - 8 // world:] = -100.0
    torch.manual_seed(0)  # the same global batch on every rank
    x = torch.randn(world * BATCH_PER_RANK, SEQ, DIM)
    g = torch.randn_like(x)

    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref)
    _loss(out_ref, g, 1).backward()

    rows = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    x_ep = x[rows].clone().requires_grad_()
    out_ep = ep(x_ep)
    _loss(out_ep, g[rows], world).backward()

    tol = {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out_ep["hidden_states"], out_ref["hidden_states"][rows], **tol)
    torch.testing.assert_close(x_ep.grad, x_ref.grad[rows], **tol)
    tok = slice(rank * BATCH_PER_RANK * SEQ, (rank + 1) * BATCH_PER_RANK * SEQ)
    assert torch.equal(out_ep["topk_ids"], out_ref["topk_ids"][tok])
    for name, p in ep.experts.named_parameters():
        torch.testing.assert_close(p.grad, getattr(ref.experts, name).grad[own], **tol)
    for name, p in ep.named_parameters():
        if name.startswith("experts."):
            continue
        summed = p.grad.clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(summed, ref.get_parameter(name).grad, **tol)
    counts = out_ep["tokens_per_expert"].clone()
    dist.all_reduce(counts)
    assert torch.equal(counts, out_ref["tokens_per_expert"])
    if dead_last_rank and rank == world - 1:
        assert all(p.grad.abs().max() == 0 for p in ep.experts.parameters())
        assert int(counts[own].sum()) == 0
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_ep_matches_ep1(world, score_func):
    assert run_distributed(_ep_parity_worker, world, score_func, False) == [True] * world


def test_ep_rank_with_zero_tokens():
    assert run_distributed(_ep_parity_worker, 4, "sigmoid", True) == [True] * 4


def _interleaved_worker(rank, world):
    """Two micro-batches whose phases interleave give what each gives alone (no state on modules)."""
    cfg = _cfg("sigmoid")
    torch.manual_seed(rank)
    layer = MoELayer(cfg, EPTransport(dist.group.WORLD))
    torch.manual_seed(10 + rank)
    xs = [torch.randn(BATCH_PER_RANK, SEQ, DIM) for _ in range(2)]
    alone = [layer(x)["hidden_states"] for x in xs]
    d = layer.dispatcher
    routed = [layer.router(x) for x in xs]
    prepared = [d.prepare(x.reshape(-1, DIM), r["topk_ids"], r["topk_weights"])
                for x, r in zip(xs, routed, strict=True)]
    sent = [d.dispatch(rows, st) for rows, st in reversed(prepared)][::-1]
    grouped = [d.post_dispatch(rows, st) for rows, (_, st) in zip(sent, prepared, strict=True)]
    expert_out = [layer.experts(rows, counts) for rows, counts in grouped]
    unpermuted = [d.pre_combine(y, st) for y, (_, st) in zip(expert_out, prepared, strict=True)]
    back = [d.combine(y, st) for y, (_, st) in reversed(list(zip(unpermuted, prepared, strict=True)))][::-1]
    for i, (y, (_, st)) in enumerate(zip(back, prepared, strict=True)):
        out = d.finalize(y, st) + layer.shared_experts(xs[i].reshape(-1, DIM))
        torch.testing.assert_close(out.view_as(xs[i]), alone[i], atol=0, rtol=0)
    return True


def test_phases_interleave_across_micro_batches():
    assert run_distributed(_interleaved_worker, 2) == [True, True]


def _prepare_is_local_worker(rank, world):
    """prepare issues no collective and no host copy: the one sync of the path sits in dispatch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    cfg = _cfg("sigmoid")
    torch.manual_seed(rank)
    layer = MoELayer(cfg, EPTransport(dist.group.WORLD))
    x = torch.randn(BATCH_PER_RANK * SEQ, DIM)
    routing = layer.router(x.view(BATCH_PER_RANK, SEQ, DIM))
    d = layer.dispatcher
    with Ops() as ops:
        rows, state = d.prepare(x, routing["topk_ids"], routing["topk_weights"])
    assert not [op for op in ops.seen if "spartron_collectives" in op], ops.seen
    assert state.input_splits is None and state.output_splits is None and state.recv_counts is None
    with Ops() as ops:
        recv = d.dispatch(rows, state)
    collectives = [op for op in ops.seen if "spartron_collectives" in op]
    assert collectives == ["spartron_collectives.all_to_all.default", "spartron_collectives.splits_to_host.default",
                           "spartron_collectives.all_to_all.default"], collectives
    assert sum(state.input_splits) == rows.shape[0] and sum(state.output_splits) == recv.shape[0]
    with Ops() as ops:  # split sizes already known (a caller timing the token all-to-all alone)
        d.dispatch(rows, state)
    assert [op for op in ops.seen if "spartron_collectives" in op] == ["spartron_collectives.all_to_all.default"]
    return True


def test_prepare_is_local_and_dispatch_holds_the_split_sync():
    assert run_distributed(_prepare_is_local_worker, 2) == [True, True]


def _counts_together_worker(rank, world):
    """One count exchange for several states gives each the split sizes its own exchange gives, for
    the NCCL-style and the copy-engine dispatcher; the first dispatch among them runs it for all (the
    dispatch rule is the base class's, run here through the NCCL-style one)."""
    from spartron.layers.moe.dispatch import CopyEngineDispatcher

    torch.manual_seed(rank)
    out = []
    transport = EPTransport(dist.group.WORLD)
    for d in (AllToAllDispatcher(8, transport), CopyEngineDispatcher(8, transport)):
        x = torch.randn(6 + rank, DIM)
        ids = [torch.randint(0, 8, (6 + rank, 3)) for _ in range(3)]
        alone = [d.prepare(x, i, torch.rand(i.shape))[1] for i in ids]
        for state in alone:
            d.exchange_counts(state)
        together = [d.prepare(x, i, torch.rand(i.shape))[1] for i in ids]
        d.exchange_counts_together(together)
        assert all(s.exchanged_with == tuple(together) for s in together)
        if isinstance(d, CopyEngineDispatcher):  # its token exchange needs a buffer: counts only here
            d.exchange_counts(*together[0].exchanged_with)
        else:
            d.dispatch(x[together[0].slot_order // 3], together[0])  # exchanges the counts of all three
        for a, t in zip(alone, together, strict=True):
            assert (t.input_splits, t.output_splits, t.counts) == (a.input_splits, a.output_splits, a.counts)
            assert torch.equal(t.recv_counts, a.recv_counts)
            assert t.exchanged_with == ()  # cleared: no reference cycle between the states
        out.append(sum(t.output_splits[0] for t in together))
    return out


def test_counts_of_several_states_exchange_together():
    results = run_distributed(_counts_together_worker, 2)
    assert results[0] != results[1]  # the ranks received different rows
