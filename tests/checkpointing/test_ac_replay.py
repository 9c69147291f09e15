"""Replay frames: reuse_during_recompute stores in the original pass and hands back on replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spartron.checkpointing import (
    CheckpointOptions,
    CheckpointRegion,
    ReplayFrameError,
    build_policy,
    reuse_during_recompute,
)

REENTRANT = pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "nonreentrant"])


def region(reentrant: bool) -> CheckpointRegion:
    return CheckpointRegion(CheckpointOptions(policy=build_policy("full"), reentrant=reentrant))


class FrozenIndexer(nn.Module):
    """Stands in for the DSA source indexer: frozen, returns integer ids, counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4).requires_grad_(False)
        self.calls = 0

    def forward(self, x: torch.Tensor, k: int = 2) -> torch.Tensor:
        self.calls += 1
        return self.proj(x.detach()).topk(k, dim=-1).indices


class Consumer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.indexer = FrozenIndexer()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = reuse_during_recompute(self.indexer, x, k=2)
        return self.lin(x).gather(-1, ids).sin()


def consumer_and_eager_grads() -> tuple[Consumer, torch.Tensor, list[torch.Tensor]]:
    """A seeded Consumer, its input and the gradients of one uncheckpointed pass (weight, input).

    Gradients and the indexer's call count are reset, so a checkpointed pass that follows can be
    compared with the eager one exactly.
    """
    torch.manual_seed(0)
    m = Consumer()
    x = torch.randn(3, 4, requires_grad=True)
    m(x).sum().backward()
    expected = [m.lin.weight.grad.clone(), x.grad.clone()]
    m.zero_grad()
    x.grad = None
    m.indexer.calls = 0
    return m, x, expected


def test_outside_a_region_just_calls_fn():
    idx = FrozenIndexer()
    x = torch.randn(3, 4)
    a, b = reuse_during_recompute(idx, x), reuse_during_recompute(idx, x, k=2)
    assert idx.calls == 2 and torch.equal(a, b)


@REENTRANT
def test_replay_reuses_the_stored_result_and_gradients_match(reentrant):
    m, x, expected = consumer_and_eager_grads()
    r = region(reentrant)
    r(m, x).sum().backward()
    assert m.indexer.calls == 1
    assert r.last_stats.results_reused == 1 and r.last_stats.replay_count == 1
    assert torch.equal(m.lin.weight.grad, expected[0]) and torch.equal(x.grad, expected[1])


@REENTRANT
def test_fifo_per_callable_and_callables_do_not_mix(reentrant):
    log: list[tuple[str, int, bool]] = []

    def first(n):
        log.append(("first", n, torch.is_grad_enabled()))
        return torch.tensor([n])

    def second(n):
        log.append(("second", n, torch.is_grad_enabled()))
        return torch.tensor([100 + n])

    def fn(x):
        got = [reuse_during_recompute(first, 1), reuse_during_recompute(second, 1),
               reuse_during_recompute(first, 2), reuse_during_recompute(second, 2)]
        return x.sin() * torch.cat(got).float().sum(), torch.cat(got)

    x = torch.ones(2, requires_grad=True)
    y, ids = region(reentrant)(fn, x)
    assert ids.tolist() == [1, 101, 2, 102]
    y.sum().backward()
    assert [entry[:2] for entry in log] == [("first", 1), ("second", 1), ("first", 2), ("second", 2)]
    assert torch.allclose(x.grad, torch.cos(x.detach()) * 206)


@REENTRANT
def test_frames_of_two_regions_never_mix(reentrant):
    torch.manual_seed(0)
    m = Consumer()
    x1, x2 = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    (m(x1).sum() + 2 * m(x2).sum()).backward()
    expected = [m.lin.weight.grad.clone(), x1.grad.clone(), x2.grad.clone()]
    assert not torch.equal(m.indexer(x1), m.indexer(x2))  # the two calls store different ids
    m.zero_grad()
    x1.grad = x2.grad = None
    m.indexer.calls = 0
    r = region(reentrant)
    (r(m, x1).sum() + 2 * r(m, x2).sum()).backward()
    assert m.indexer.calls == 2
    for got, want in zip([m.lin.weight.grad, x1.grad, x2.grad], expected, strict=True):
        assert torch.equal(got, want)


def _uneven(calls_per_pass: list[int]):
    passes: list[int] = []

    def fn(x):
        n = calls_per_pass[len(passes)]
        passes.append(n)
        for i in range(n):
            reuse_during_recompute(torch.zeros, i + 1)
        return x.sin()

    return fn


@REENTRANT
def test_replay_that_finds_nothing_raises(reentrant):
    y = region(reentrant)(_uneven([1, 2]), torch.ones(2, requires_grad=True))
    with pytest.raises(ReplayFrameError, match="found no stored result while replaying region"):
        y.sum().backward()


@REENTRANT
def test_results_left_at_the_end_of_backward_raise(reentrant):
    y = region(reentrant)(_uneven([2, 1]), torch.ones(2, requires_grad=True))
    leftover = r"unconsumed reuse_during_recompute results \{'_VariableFunctionsClass.zeros': 1\}"
    with pytest.raises(ReplayFrameError, match=leftover):
        y.sum().backward()


@REENTRANT
def test_stored_result_that_requires_grad_raises(reentrant):
    lin = nn.Linear(4, 4)  # trainable: its output would need a gradient the replay cannot give

    def fn(x):
        return reuse_during_recompute(lin, x) * 2

    with pytest.raises(ReplayFrameError, match="returned a tensor that requires grad"):
        region(reentrant)(fn, torch.randn(2, 4))


@REENTRANT
def test_ops_inside_a_reused_callable_are_not_saved_by_the_selective_policy(reentrant):
    # The reused indexer runs aten::addmm once (original pass) and never on replay: the policy must
    # neither save it nor expect it in the replay's sequence of saved ops.
    m, x, expected = consumer_and_eager_grads()
    r = CheckpointRegion(CheckpointOptions(policy=build_policy("selective", ["aten::addmm"]),
                                           reentrant=reentrant))
    r(m, x).sum().backward()
    assert m.indexer.calls == 1
    assert r.last_stats.saved_by_op == {"aten::addmm": 1}  # the consumer's Linear only
    assert torch.equal(m.lin.weight.grad, expected[0]) and torch.equal(x.grad, expected[1])
