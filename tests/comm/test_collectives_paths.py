"""Every entry into the spartron_collectives ops gives torch.distributed's own answer, bit for bit.

The eager wrappers and the ops' Autograd kernel each pick the cheapest path their observers allow
(the transport when nothing watches, the op below autograd under a dispatch mode, one
autograd.Function when a gradient is recorded). Each path, with and without a watching mode, is
checked against dist.all_to_all_single / all_gather_into_tensor / reduce_scatter_tensor on 2 gloo
ranks; a checkpoint policy (a dispatch mode) still records every op by name; on one GPU a 1-rank
NCCL group gives the same on a side stream.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from spartron.comm import collectives as C
from spartron.testing import run_distributed

IN_SPLITS = [[1, 3], [2, 0]]  # IN_SPLITS[r][j] = rows rank r sends to rank j (uneven, one empty)


class _Names(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "spartron_collectives":
            self.names.append(func._opname)
        return func(*args, **(kwargs or {}))


def _reference_all_to_all(x, out_splits, in_splits):
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
    return out


# torch 2.13 renamed the flat collectives (the old names warn); torch 2.11 only has the old ones
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _paths_worker(rank, world, device="cpu"):
    group = dist.group.WORLD if device == "cpu" else dist.new_group(list(range(world)), backend="nccl")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    in_splits = IN_SPLITS[rank] if world == 2 else [3]
    out_splits = [IN_SPLITS[j][rank] for j in range(world)] if world == 2 else [3]
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(sum(in_splits), 5, generator=gen).to(device, dtype)
    w = torch.randn(sum(out_splits), 5, generator=gen).to(device, dtype)
    with torch.no_grad():
        want = _reference_all_to_all(x, out_splits, in_splits)
        want_grad = _reference_all_to_all(w, in_splits, out_splits)  # d<w, out>/dx: w sent back
    name = group.group_name
    entries = {
        "wrapper": lambda t: C.all_to_all(t, out_splits, in_splits, group),
        "wrapper_tensor_splits": lambda t: C.all_to_all(t, torch.tensor(out_splits, device=device),
                                                        torch.tensor(in_splits), group),
        "op": lambda t: torch.ops.spartron_collectives.all_to_all(t, out_splits, in_splits, name),
    }
    seen = {}
    for entry, fn in entries.items():
        for grad in (False, True):
            for watched in (False, True):
                mode = _Names()
                xg = x.clone().requires_grad_(grad)
                with mode if watched else contextlib.nullcontext():
                    out = fn(xg)
                    if grad:
                        (out * w).sum().backward()
                assert torch.equal(out.detach(), want), (entry, grad, watched)
                if grad:
                    assert torch.equal(xg.grad, want_grad), (entry, grad, watched)
                seen[entry, grad, watched] = mode.names
    # gather / scatter: the wrappers and the ops against torch.distributed's flat collectives
    y = torch.randn(2, 3, generator=gen).to(device, dtype)
    gathered = y.new_empty(2 * world, 3)
    _all_gather_flat(gathered, y, group=group)
    scattered = y.new_empty(2 // world, 3)
    _reduce_scatter_flat(scattered, y.clone(), group=group)
    for watched in (False, True):
        mode = _Names()
        with mode if watched else contextlib.nullcontext():
            assert torch.equal(C.all_gather(y, group), gathered)
            assert torch.equal(torch.ops.spartron_collectives.all_gather(y, 0, "", name), gathered)
            assert torch.equal(C.reduce_scatter(y, group), scattered)
            assert torch.equal(torch.ops.spartron_collectives.reduce_scatter(y, 0, "", name), scattered)
            assert torch.equal(C.all_gather(y, group, dim=1), torch.cat(gathered.split(2), dim=1))
        seen["gather_scatter", watched] = mode.names
    return seen


def _check_seen(seen):
    for (entry, *flags), names in seen.items():
        if entry == "gather_scatter":
            assert names == (["all_gather"] * 2 + ["reduce_scatter"] * 2 + ["all_gather"] if flags[0] else []), names
            continue
        grad, watched = flags
        if not watched:
            assert names == [], (entry, grad)
            continue
        want = ["splits_to_host"] * 2 if entry == "wrapper_tensor_splits" else []
        want += ["all_to_all"] * (2 if grad else 1)  # forward, and the reverse all-to-all of the backward
        assert names == want, (entry, grad, names)


def test_every_entry_matches_torch_distributed_exactly_and_a_mode_sees_each_op():
    for seen in run_distributed(_paths_worker, 2):
        _check_seen(seen)


def _policy_worker(rank, world):
    """A checkpoint region (its policy is a dispatch mode) records each collective by name, and its
    gradients equal the unchecked run's exactly."""
    from spartron.checkpointing import CheckpointOptions, CheckpointRegion, build_policy

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    in_counts = torch.tensor(IN_SPLITS[rank])
    out_splits = [IN_SPLITS[j][rank] for j in range(world)]
    x = torch.randn(sum(IN_SPLITS[rank]), 4, generator=torch.Generator().manual_seed(rank))

    def block(t):
        routed = C.all_to_all(t, out_splits, in_counts)  # list and tensor splits
        back = C.all_to_all(lin(routed).relu(), in_counts, out_splits)
        total = back.sum(dim=0, keepdim=True)  # the same shape on every rank
        return back * C.reduce_scatter(C.all_gather(total, dim=1).square(), dim=1)

    results = {}
    for mode in ("none", "full", "selective"):
        lin.zero_grad()
        xg = x.clone().requires_grad_()
        region = CheckpointRegion(CheckpointOptions(policy=build_policy(mode))) if mode != "none" else None
        out = region(block, xg) if region else block(xg)
        (out * torch.arange(out.numel()).view(out.shape)).sum().backward()
        stats = (dict(region.last_stats.saved_by_op), dict(region.last_stats.recomputed_by_op)) if region else None
        results[mode] = (out.detach(), xg.grad, lin.weight.grad.clone(), stats)
    for mode in ("full", "selective"):
        for want, got in zip(results["none"][:3], results[mode][:3], strict=True):
            assert torch.equal(got, want), mode
    return {mode: results[mode][3] for mode in ("full", "selective")}


def test_checkpoint_policy_records_every_collective_by_name_with_exact_grads():
    ns = "spartron_collectives::"
    for stats in run_distributed(_policy_worker, 2):
        (full_saved, full_recomputed), (sel_saved, sel_recomputed) = stats["full"], stats["selective"]
        assert full_saved == {ns + "splits_to_host": 2}, full_saved
        assert {k: v for k, v in full_recomputed.items() if k.startswith(ns)} == {
            ns + "all_to_all": 2, ns + "all_gather": 1, ns + "reduce_scatter": 1}, full_recomputed
        assert {k: v for k, v in sel_saved.items() if k.startswith(ns)} == {
            ns + "all_to_all": 2, ns + "all_gather": 1, ns + "reduce_scatter": 1, ns + "splits_to_host": 2}, sel_saved
        assert not [k for k in sel_recomputed if k.startswith(ns)], sel_recomputed


def test_unwatched_splits_to_host_is_the_ops_copy():
    splits = torch.tensor([3, 0, 1], dtype=torch.int32)
    assert C.splits_to_host(splits) == [3, 0, 1] == torch.ops.spartron_collectives.splits_to_host(splits).tolist()
    mode = _Names()
    with mode:
        assert C.splits_to_host(splits) == [3, 0, 1]
    assert mode.names == ["splits_to_host"]


def _side_stream_worker(rank, world):
    torch.cuda.set_device(rank)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        seen = _paths_worker(rank, world, "cuda")
    stream.synchronize()
    return seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a 1-rank NCCL group")
def test_one_rank_nccl_entries_on_a_side_stream_match_torch_distributed_gpu():
    """NCCL runs the waited (asyncOp=False) collectives on the current stream: a side stream here."""
    for seen in run_distributed(_side_stream_worker, 1, timeout=300, start_method="spawn"):
        _check_seen(seen)


class _SynchronousGroup:
    """Stands in for a ProcessGroup whose synchronous calls return no Work, as NCCL's do (asyncOp=False:
    the collective ran on the current stream): one rank, each call copies its input."""

    def size(self):
        return 1

    def alltoall_base(self, out, x, output_split_sizes, input_split_sizes, opts):
        assert opts.asyncOp is False
        out.copy_(x)

    def _allgather_base(self, out, x, opts):
        assert opts.asyncOp is False
        out.copy_(x)

    def _reduce_scatter_base(self, out, x, opts):
        assert opts.asyncOp is False
        out.copy_(x)


def test_synchronous_transports_accept_a_call_that_returns_no_work():
    x = torch.arange(6.0).view(3, 2)
    group = _SynchronousGroup()
    assert torch.equal(C.ALL_TO_ALL.on(group, x, [3], [3]), x)
    assert torch.equal(C.ALL_GATHER.on(group, x, 1), x)
    assert torch.equal(C.REDUCE_SCATTER.on(group, x, 0), x)
