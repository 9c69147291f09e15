"""spartron::record_routing_stats: exact counts, in-place, once per token even under full AC."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

from spartron.checkpointing import CheckpointOptions, CheckpointRegion, build_policy, checkpoint
from spartron.layers.moe import telemetry
from spartron.layers.moe.telemetry import record_routing_stats

NUM_EXPERTS = 5


def test_counts_are_added_in_place():
    counts = torch.tensor([1, 0, 0, 0, 7])
    ptr = counts.data_ptr()
    record_routing_stats(torch.tensor([[0, 3], [3, 2], [3, 0]]), counts)
    assert counts.tolist() == [3, 0, 1, 3, 7]
    assert counts.data_ptr() == ptr


def test_counts_match_bincount_for_random_ids():
    ids = torch.randint(0, NUM_EXPERTS, (64, 3), generator=torch.Generator().manual_seed(0))
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    record_routing_stats(ids, counts)
    record_routing_stats(ids, counts)
    assert counts.tolist() == (2 * torch.bincount(ids.flatten(), minlength=NUM_EXPERTS)).tolist()


def test_empty_ids_leave_counts_unchanged():
    counts = torch.tensor([1, 2, 3])
    record_routing_stats(torch.zeros(0, 2, dtype=torch.int64), counts)
    assert counts.tolist() == [1, 2, 3]


@pytest.mark.parametrize(("ids", "counts", "message"), [
    (torch.tensor([0, 5]), torch.zeros(5, dtype=torch.int64),
     r"expert ids span \[0, 5\] but counts has 5 slots"),
    (torch.tensor([-1, 2]), torch.zeros(5, dtype=torch.int64), r"expert ids span \[-1, 2\]"),
    (torch.tensor([0.0]), torch.zeros(5, dtype=torch.int64), "topk_ids must be integer expert ids"),
    (torch.tensor([0]), torch.zeros(5), "counts must be a 1-D integer buffer, got torch.float32"),
    (torch.tensor([0]), torch.zeros(1, 5, dtype=torch.int64), "counts must be a 1-D integer buffer"),
    (torch.tensor([0]), torch.zeros(5, dtype=torch.int64, device="meta"),
     "topk_ids on cpu but counts on meta"),
])
def test_bad_inputs_raise_clear_errors(ids, counts, message):
    with pytest.raises(ValueError, match=message):
        record_routing_stats(ids, counts)


def test_op_declares_its_mutation_and_passes_opcheck():
    schema = torch.ops.spartron.record_routing_stats.default._schema
    assert [a.name for a in schema.arguments] == ["topk_ids", "counts"]
    assert [bool(a.alias_info and a.alias_info.is_write) for a in schema.arguments] == [False, True]
    assert schema.returns == []
    torch.library.opcheck(torch.ops.spartron.record_routing_stats.default,
                          (torch.tensor([[1, 2], [2, 4]]), torch.zeros(NUM_EXPERTS, dtype=torch.int64)))


def test_op_is_mandatory_in_the_checkpoint_policy():
    assert telemetry.OPS == ("spartron::record_routing_stats",)
    for mode in ("full", "selective"):
        policy = build_policy(mode)
        assert policy.decide(torch.ops.spartron.record_routing_stats.default, (), {}) == "mandatory"


def _routed_block(lin: torch.nn.Linear, counts: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A router: `counts` is bound (like an MoE layer's buffer), not a region input."""
    logits = lin(x)
    ids = logits.topk(2, dim=-1).indices
    record_routing_stats(ids, counts)
    return logits.softmax(-1).square().sum(-1)


def _expected_counts(lin, x):
    with torch.no_grad():
        ids = lin(x).topk(2, dim=-1).indices
    return torch.bincount(ids.flatten(), minlength=NUM_EXPERTS).tolist()


@pytest.mark.parametrize("reentrant", [True, False])
def test_full_ac_region_counts_each_token_once(reentrant):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, NUM_EXPERTS)
    x = torch.randn(16, 4, requires_grad=True)
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    region = CheckpointRegion(CheckpointOptions(policy=build_policy("full"), reentrant=reentrant))
    region(functools.partial(_routed_block, lin, counts), x).sum().backward()
    assert counts.tolist() == _expected_counts(lin, x)
    assert x.grad is not None and lin.weight.grad is not None


def test_default_checkpoint_counts_each_token_once():
    torch.manual_seed(1)
    lin = torch.nn.Linear(4, NUM_EXPERTS)
    x = torch.randn(16, 4, requires_grad=True)
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    checkpoint(functools.partial(_routed_block, lin, counts), x).sum().backward()
    assert counts.tolist() == _expected_counts(lin, x)


def test_plain_torch_checkpoint_would_count_twice():
    """Control: without the policy's mandatory save, a replay applies the side effect again."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(4, NUM_EXPERTS)
    x = torch.randn(16, 4, requires_grad=True)
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    torch_checkpoint.checkpoint(functools.partial(_routed_block, lin, counts), x,
                                use_reentrant=False).sum().backward()
    assert counts.tolist() == [2 * c for c in _expected_counts(lin, x)]


def test_compiled_function_updates_counts_without_graph_break():
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.int64)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(ids, counts):
        record_routing_stats(ids, counts)
        return ids.sum()

    step(torch.tensor([[0, 1], [1, 4]]), counts)
    assert counts.tolist() == [1, 2, 0, 0, 1]
