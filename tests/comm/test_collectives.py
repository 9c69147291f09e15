"""spartron_collectives ops on real gloo ranks, checked against a single-process reference.

Every rank generates every rank's input from a seed, so each rank can build the exact expected
output and (through a reference autograd graph over all ranks' inputs) the exact expected gradient
of the global loss sum_r <w_r, out_r>.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo  # noqa: F401  (the first custom-op call imports it: once here, not in each forked rank)
import torch.distributed as dist
import torch.utils._python_dispatch

from spartron.comm import collectives as C
from spartron.testing import DistributedTestError, run_distributed

D = 3


def _input(rank: int, rows: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(rows, D, generator=g, dtype=dtype)


def _weight(rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + rank)
    return torch.randn(*shape, generator=g, dtype=dtype)


def _reference_all_to_all(xs: list[torch.Tensor], splits: list[list[int]]) -> list[torch.Tensor]:
    """out[r] = concat over source ranks j of the rows j sends to r (splits[j][r] of them)."""
    world = len(xs)
    chunks = [list(torch.split(xs[j], splits[j])) for j in range(world)]
    return [torch.cat([chunks[j][r] for j in range(world)]) for r in range(world)]


def _reference_grads(xs, fn):
    """Grad of sum_r <w_r, fn(xs)[r]> w.r.t. every rank's input, in one process."""
    xs = [x.clone().requires_grad_() for x in xs]
    outs = fn(xs)
    loss = sum((o * _weight(r, o.shape, o.dtype)).sum() for r, o in enumerate(outs))
    grads = torch.autograd.grad(loss, xs)
    return [o.detach() for o in outs], list(grads)


# Split matrices: SPLITS[world][j][r] = rows rank j sends to rank r (uneven, with zeros).
SPLITS = {
    2: [[1, 3], [0, 2]],
    4: [[1, 0, 2, 0], [0, 0, 0, 0], [3, 1, 0, 0], [1, 1, 1, 0]],  # rank 1 sends, rank 3 gets: 0 rows
}


def _all_to_all_worker(rank, world):
    return [_all_to_all_case(rank, world, kind) for kind in ("list", "tensor")]


def _all_to_all_case(rank, world, split_kind):
    splits = SPLITS[world]
    xs = [_input(j, sum(splits[j])) for j in range(world)]
    want, want_grads = _reference_grads(xs, lambda xs: _reference_all_to_all(xs, splits))
    in_splits = splits[rank]
    out_splits = [splits[j][rank] for j in range(world)]
    if split_kind == "tensor":
        in_splits = torch.tensor(in_splits)
        out_splits = C.exchange_split_sizes(in_splits)
        assert out_splits.tolist() == [splits[j][rank] for j in range(world)]
    x = xs[rank].clone().requires_grad_()
    out = C.all_to_all(x, out_splits, in_splits)
    (out * _weight(rank, out.shape)).sum().backward()
    torch.testing.assert_close(out, want[rank], rtol=0, atol=0)
    torch.testing.assert_close(x.grad, want_grads[rank], rtol=0, atol=0)
    return out.shape[0]


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_uneven_and_zero_splits_match_reference(world):
    """Splits as lists and as tensors (output splits learnt through exchange_split_sizes)."""
    rows = run_distributed(_all_to_all_worker, world)
    assert rows == [[sum(SPLITS[world][j][r] for j in range(world))] * 2 for r in range(world)]


def _even_all_to_all_worker(rank, world):
    xs = [_input(j, 2 * world) for j in range(world)]
    even = [[2] * world for _ in range(world)]
    want, want_grads = _reference_grads(xs, lambda xs: _reference_all_to_all(xs, even))
    x = xs[rank].clone().requires_grad_()
    out = C.all_to_all(x, None, None)
    (out * _weight(rank, out.shape)).sum().backward()
    torch.testing.assert_close(out, want[rank], rtol=0, atol=0)
    torch.testing.assert_close(x.grad, want_grads[rank], rtol=0, atol=0)


def test_all_to_all_none_splits_are_even():
    run_distributed(_even_all_to_all_worker, 2)


def _finite_difference_worker(rank, world):
    """d(global loss)/d(x_j[k]) by central differences, one element of one rank at a time."""
    splits = SPLITS[world]
    x = _input(rank, sum(splits[rank]), torch.float64)
    out_splits = [splits[j][rank] for j in range(world)]

    def global_loss(x_local):
        out = C.all_to_all(x_local, out_splits, splits[rank])
        local = (_weight(rank, out.shape, torch.float64) * out.square()).sum()
        total = local.detach().clone()
        dist.all_reduce(total)
        return local, total

    xg = x.clone().requires_grad_()
    local, _ = global_loss(xg)
    local.backward()
    eps = 1e-6
    numeric = torch.zeros_like(x)
    for owner in range(world):
        for k in range(sum(splits[owner])):
            for c in range(D):
                vals = []
                for sign in (1.0, -1.0):
                    xp = x.clone()
                    if owner == rank:
                        xp[k, c] += sign * eps
                    vals.append(global_loss(xp)[1])
                if owner == rank:
                    numeric[k, c] = (vals[0] - vals[1]) / (2 * eps)
    torch.testing.assert_close(xg.grad, numeric, rtol=1e-6, atol=1e-8)


def test_all_to_all_gradient_matches_finite_differences_float64():
    run_distributed(_finite_difference_worker, 2)


def _all_gather_worker(rank, world):
    for dim in (0, 1, -1):
        _all_gather_case(rank, world, dim)


def _all_gather_case(rank, world, dim):
    xs = [torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(j)) for j in range(world)]
    want, want_grads = _reference_grads(xs, lambda xs: [torch.cat(xs, dim)] * world)
    x = xs[rank].clone().requires_grad_()
    out = C.all_gather(x, dim=dim)
    (out * _weight(rank, out.shape)).sum().backward()
    torch.testing.assert_close(out, want[rank], rtol=0, atol=0)
    torch.testing.assert_close(x.grad, want_grads[rank], rtol=1e-6, atol=1e-6)
    assert out.is_contiguous()


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_values_and_grads_match_reference_along_dims_0_1_and_last(world):
    run_distributed(_all_gather_worker, world)


def _reduce_scatter_worker(rank, world):
    for dim in (0, 1, 2):
        _reduce_scatter_case(rank, world, dim)


def _reduce_scatter_case(rank, world, dim):
    shape = [2, 3, 4]
    shape[dim] = world * 2
    xs = [torch.randn(*shape, generator=torch.Generator().manual_seed(j)) for j in range(world)]

    def reference(xs):
        return list(torch.chunk(sum(xs), world, dim))

    want, want_grads = _reference_grads(xs, reference)
    x = xs[rank].clone().requires_grad_()
    out = C.reduce_scatter(x, dim=dim)
    (out * _weight(rank, out.shape)).sum().backward()
    torch.testing.assert_close(out, want[rank], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, want_grads[rank], rtol=0, atol=0)
    assert out.is_contiguous()


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_values_and_grads_match_reference_along_dims_0_1_2(world):
    run_distributed(_reduce_scatter_worker, world)


def _subgroup_worker(rank, world):
    """Ops on a subgroup resolve that group by name, not the world."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    out = C.all_gather(torch.tensor([float(rank)]), mine)
    return out.tolist()


def test_ops_use_the_given_subgroup():
    assert run_distributed(_subgroup_worker, 4) == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]


def _bad_input_worker(rank, world):
    """Every case on every rank; all ranks must reach the end (no one stuck in a collective)."""
    messages = {case: _bad_input_case(case) for case in BAD_INPUTS}
    dist.barrier()
    return messages


def _bad_input_case(case):
    x = torch.zeros(4, 2)
    cases = {
        "sum": lambda: C.all_to_all(x, [2, 2], [1, 2]),
        "negative": lambda: C.all_to_all(x, [2, 2], [5, -1]),
        "not_int": lambda: C.all_to_all(x, [2, 2], [2.0, 2.0]),
        "length": lambda: C.all_to_all(x, [4], [2, 2]),
        "float_tensor": lambda: C.all_to_all(x, [2, 2], torch.tensor([2.0, 2.0])),
        "meta_tensor": lambda: C.all_to_all(x, [2, 2], torch.tensor([2, 2], device="meta")),
        "uneven_none": lambda: C.all_to_all(torch.zeros(3, 2), None, None),
        "group_name": lambda: torch.ops.spartron_collectives.all_to_all(x, [2, 2], [2, 2], "no-such-group"),
        "rs_divisible": lambda: C.reduce_scatter(torch.zeros(3, 2)),
        "dim": lambda: C.all_gather(x, dim=2),
        "exchange": lambda: C.exchange_split_sizes(torch.tensor([1, 2], dtype=torch.int32)),
    }
    try:
        cases[case]()
    except ValueError as err:
        return str(err)
    return None


BAD_INPUTS = {
    "sum": "input_split_sizes [1, 2] sum to 3, but x.size(0) is 4",
    "negative": "input_split_sizes has negative sizes: [5, -1]",
    "not_int": "input_split_sizes must be ints, got [2.0, 2.0]",
    "length": "output_split_sizes has 1 entries, the group has 2 ranks",
    "float_tensor": "input_split_sizes tensor must be int64 (or int32), got torch.float32",
    "meta_tensor": "input_split_sizes tensor is on meta, expected the host or x's device cpu",
    "uneven_none": "needs x.size(0)=3 divisible by the group size 2",
    "group_name": "no process group named 'no-such-group'",
    "rs_divisible": "reduce_scatter: x.size(0)=3 is not divisible by the group size 2",
    "dim": "all_gather: dim 2 is out of range for a 2-D tensor",
    "exchange": "exchange_split_sizes: expected an int64 tensor of shape (2,)",
}


def test_bad_inputs_raise_value_error_on_every_rank():
    for rank, messages in enumerate(run_distributed(_bad_input_worker, 2)):
        for case, want in BAD_INPUTS.items():
            got = messages[case]
            assert got is not None and want in got, f"rank {rank}, case {case!r}: {got!r}"


def test_all_to_all_without_process_group_is_a_clear_error():
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        C.all_to_all(torch.zeros(2, 2), [2], [2])


def test_every_listed_op_is_registered():
    assert C.OPS == ("spartron_collectives::all_to_all", "spartron_collectives::all_gather",
                     "spartron_collectives::reduce_scatter", "spartron_collectives::splits_to_host")
    for name in C.OPS:
        ns, op = name.split("::")
        assert getattr(getattr(torch.ops, ns), op).default is not None


def test_splits_to_host_returns_a_fresh_host_int64_tensor():
    splits = torch.tensor([3, 0, 1], dtype=torch.int32)
    host = torch.ops.spartron_collectives.splits_to_host(splits)
    assert host.dtype == torch.int64 and host.device.type == "cpu" and host.tolist() == [3, 0, 1]
    same = torch.tensor([1, 2])
    assert torch.ops.spartron_collectives.splits_to_host(same).data_ptr() != same.data_ptr()


def test_run_distributed_reports_a_failing_rank():
    """Guard: the bad-input test above would be vacuous if rank errors were swallowed."""
    with pytest.raises(DistributedTestError, match="ValueError"):
        run_distributed(_raise_worker, 2)


def _raise_worker(rank, world):
    C.all_to_all(torch.zeros(3, 1), [1, 1], [1, 1])


def _tensor_worker(rank, world):
    return torch.full((3,), float(rank))


def test_run_distributed_results_arrive_by_value():
    """A rank exits right after sending its result: a tensor whose storage it shared (multiprocessing's
    default for tensors) could no longer be fetched, and under load the parent got ConnectionResetError."""
    results = run_distributed(_tensor_worker, 2)
    assert [t.tolist() for t in results] == [[0.0] * 3, [1.0] * 3]
    assert [t.is_shared() for t in results] == [False, False]


def _checkpointed_dispatch_worker(rank, world):
    """All-to-all inside a checkpoint region: same grads as no AC; selective keeps the collective
    (no second exchange on replay), full replays it; tensor splits' host copy is always kept."""
    from spartron.checkpointing import CheckpointOptions, CheckpointRegion, build_policy

    torch.manual_seed(0)
    lin = torch.nn.Linear(D, D)
    splits = SPLITS[world]
    x = _input(rank, sum(splits[rank]))
    in_counts = torch.tensor(splits[rank])
    out_counts = [splits[j][rank] for j in range(world)]

    def block(x):
        routed = C.all_to_all(x, out_counts, in_counts)
        return C.all_to_all(lin(routed).relu(), in_counts, out_counts)

    grads, stats = {}, {}
    for mode in ("none", "full", "selective"):
        lin.zero_grad()
        xg = x.clone().requires_grad_()
        if mode == "none":
            out = block(xg)
        else:
            region = CheckpointRegion(CheckpointOptions(policy=build_policy(mode)))
            out = region(block, xg)
        (out * _weight(rank, out.shape)).sum().backward()
        grads[mode] = (xg.grad, lin.weight.grad.clone())
        if mode != "none":
            stats[mode] = (dict(region.last_stats.saved_by_op), dict(region.last_stats.recomputed_by_op))
    for mode in ("full", "selective"):
        for want, got in zip(grads["none"], grads[mode], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    return stats


def test_all_to_all_under_full_and_selective_checkpoint_regions():
    for stats in run_distributed(_checkpointed_dispatch_worker, 2):
        full_saved, full_recomputed = stats["full"]
        sel_saved, sel_recomputed = stats["selective"]
        assert full_saved.get("spartron_collectives::splits_to_host") == 2
        assert "spartron_collectives::all_to_all" not in full_saved
        assert full_recomputed.get("spartron_collectives::all_to_all") == 2
        assert sel_saved.get("spartron_collectives::all_to_all") == 2
        assert sel_saved.get("spartron_collectives::splits_to_host") == 2
        assert "spartron_collectives::all_to_all" not in sel_recomputed


class _RecordOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Names of the spartron_collectives ops that reach the dispatch-mode layer."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "spartron_collectives":
            self.seen.append(func._opname)
        return func(*args, **(kwargs or {}))


def _entries_worker(rank, world):
    """Each eager entry (no grad / wrapper with grad / torch.ops with registered autograd) gives the
    same values and gradients, and a dispatch mode sees the op on every one of them."""
    splits = SPLITS[world]
    x = _input(rank, sum(splits[rank]))
    out_splits = [splits[j][rank] for j in range(world)]
    name = dist.group.WORLD.group_name
    w = _weight(rank, (sum(out_splits), D))
    same_shape = _input(rank, 2)
    results = {}
    for entry in ("wrapper", "torch_ops"):
        for watched in (False, True):
            xg = x.clone().requires_grad_()
            mode = _RecordOps()
            with mode if watched else contextlib.nullcontext():
                if entry == "wrapper":
                    out = C.all_to_all(xg, out_splits, splits[rank])
                else:
                    out = torch.ops.spartron_collectives.all_to_all(xg, out_splits, splits[rank], name)
                (out * w).sum().backward()
                with torch.no_grad():
                    gathered = C.all_gather(same_shape)
                    scattered = C.reduce_scatter(gathered)
            results[entry, watched] = (out.detach(), xg.grad, gathered, scattered, mode.seen)
    want = results["wrapper", False]
    for got in results.values():
        for a, b in zip(want[:4], got[:4], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert want[4] == [] and results["torch_ops", False][4] == []
    for entry in ("wrapper", "torch_ops"):  # forward, reverse all-to-all in backward, the no-grad pair
        assert results[entry, True][4] == ["all_to_all", "all_to_all", "all_gather", "reduce_scatter"], entry
    torch.testing.assert_close(want[3], same_shape * world, rtol=0, atol=0)


def test_every_eager_entry_gives_the_same_values_and_grads_and_is_seen_by_dispatch_modes():
    run_distributed(_entries_worker, 2)


def _gather_grad_worker(rank, world):
    """all_gather / reduce_scatter through the wrapper's autograd and through the registered autograd."""
    x = _input(rank, 4)
    name = dist.group.WORLD.group_name
    grads = []
    for gather in (lambda t: C.all_gather(t, dim=1),
                   lambda t: torch.ops.spartron_collectives.all_gather(t, 1, "", name)):
        xg = x.clone().requires_grad_()
        out = gather(xg)
        (out * _weight(rank, out.shape)).sum().backward()
        grads.append(xg.grad)
    for scatter in (lambda t: C.reduce_scatter(t, dim=1),
                    lambda t: torch.ops.spartron_collectives.reduce_scatter(t, 1, "", name)):
        xg = torch.cat([x] * world, dim=1).requires_grad_()
        out = scatter(xg)
        (out * _weight(rank, out.shape)).sum().backward()
        grads.append(xg.grad)
    return grads


def test_gather_and_scatter_grads_are_equal_through_both_autograd_entries():
    for rank, (g_wrap, g_ops, s_wrap, s_ops) in enumerate(run_distributed(_gather_grad_worker, 2)):
        torch.testing.assert_close(g_wrap, g_ops, rtol=0, atol=0)
        torch.testing.assert_close(s_wrap, s_ops, rtol=0, atol=0)
        # d/dx of sum_r <w_r, gather(x)_r> = sum over ranks of rank-r's weight slice for this rank
        want = sum(_weight(r, (4, D * 2))[:, rank * D:(rank + 1) * D] for r in range(2))
        torch.testing.assert_close(g_wrap, want, rtol=1e-6, atol=1e-6)
