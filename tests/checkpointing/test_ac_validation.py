"""Validation of every op: a replay whose op sequence differs from its original pass (a recomputed
or saved op added, removed or changed) raises naming the first differing op, its position and its
input shapes, in reentrant and non-reentrant regions; in non-reentrant regions before torch's own
"trying to save more tensors" check. Ops that are not the region's (views, FSDP's ranges, replay-only
profiler markers) are outside the sequence."""

from __future__ import annotations

import pytest
import torch

from spartron.checkpointing import CheckpointOptions, CheckpointRegion, CheckpointReplayError, build_policy

REENTRANT = pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "nonreentrant"])


def region(reentrant: bool) -> CheckpointRegion:
    # selective with matmuls saved: `@` is a saved op, sin / cos / exp are recomputed ones
    return CheckpointRegion(CheckpointOptions(policy=build_policy("selective", ["aten::mm"]),
                                              reentrant=reentrant, name="block 3"))


def original(x, w):
    return (x @ w).sin().exp()  # ops: mm #0, sin #1, exp #2


REPLAYS = {
    "recomputed op added": (lambda x, w: (x @ w).sin().cos().exp(),
                            "the replay diverged from the original pass at op #2: the original pass ran aten::exp, "
                            "the replay dispatched aten::cos (inputs [3, 4])"),
    "recomputed op removed": (lambda x, w: (x @ w).exp(),
                              "the replay diverged from the original pass at op #1: the original pass ran "
                              "aten::sin, the replay dispatched aten::exp (inputs [3, 4])"),
    "recomputed op changed": (lambda x, w: (x @ w).cos().exp(),
                              "the replay diverged from the original pass at op #1: the original pass ran "
                              "aten::sin, the replay dispatched aten::cos (inputs [3, 4])"),
    "saved op added": (lambda x, w: ((x @ w) @ w.T @ w).sin().exp(),
                       "the replay diverged from the original pass at op #1: the original pass ran aten::sin, "
                       "the replay dispatched aten::mm (inputs [3, 4], [4, 4])"),
    "saved op removed": (lambda x, w: x[:, :4].sin().exp(),
                         "the replay diverged from the original pass at op #0: the original pass ran aten::mm, "
                         "the replay dispatched aten::sin (inputs [3, 4])"),
    "op added at the end": (lambda x, w: (x @ w).sin().exp().neg(),
                            "the replay dispatched op #3 aten::neg (inputs [3, 4]) after the original pass's last "
                            "op (it ran 3 ops): the replay added an op"),
    "op missing at the end": (lambda x, w: (x @ w).sin(),
                              "the replay ended after 2 of the original pass's 3 ops; the first op it did not "
                              "dispatch is aten::exp (#2)"),
}


def _two_passes(replay):
    passes = []

    def fn(x, w):
        passes.append(1)
        return original(x, w) if len(passes) == 1 else replay(x, w)

    return fn


@REENTRANT
@pytest.mark.parametrize("case", list(REPLAYS))
def test_a_diverging_replay_names_the_first_differing_op(reentrant, case):
    replay, message = REPLAYS[case]
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    y = region(reentrant)(_two_passes(replay), x, w)
    with pytest.raises(CheckpointReplayError) as err:  # not torch's "trying to save more tensors"
        y.sum().backward()
    assert str(err.value) == "region 'block 3': " + message


@REENTRANT
def test_the_same_sequence_replays_exactly_and_views_are_not_part_of_it(reentrant):
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    original(x, w).sum().backward()
    want = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    # the replay adds views (t, view) only: they compute nothing, so the sequence is the same
    replay = _two_passes(lambda x, w: (x @ w.t().t()).view(3, 4).sin().exp())
    r = region(reentrant)
    r(replay, x, w).sum().backward()
    assert torch.equal(x.grad, want[0]) and torch.equal(w.grad, want[1])
    assert r.last_stats.ops_saved == 1 and r.last_stats.replay_count == 1


@REENTRANT
def test_a_saved_op_with_other_input_shapes_raises(reentrant):
    replay = _two_passes(lambda x, w: (x.view(4, 3)[:3, :3] @ w[:3]).sin().exp())
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    y = region(reentrant)(replay, x, w)
    with pytest.raises(CheckpointReplayError) as err:
        y.sum().backward()
    assert str(err.value) == ("region 'block 3': saved op aten::mm (#0) has other input shapes in the replay: "
                              "original [[3, 4], [4, 4]], replay [[3, 3], [3, 4]]")


@REENTRANT
def test_ops_inside_fsdp_profiler_ranges_are_fsdps_not_the_regions(reentrant):
    def replay(x, w):
        with torch.profiler.record_function("FSDP::pre_forward (test)"):
            torch.empty(8).copy_(torch.zeros(8))  # as FSDP2's unshard copy on a 1-rank shard group
        with torch.profiler.record_function("user range"):
            return original(x, w)

    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    region(reentrant)(_two_passes(replay), x, w).sum().backward()
    assert x.grad is not None
