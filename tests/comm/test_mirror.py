"""The mirrored process group (spartron.comm.mirror): every collective the project uses keeps true shapes and
finite values and returns what identical ranks would; bytes are recorded; peer-memory transports are refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from spartron.comm import EPTransport, all_gather, all_to_all, exchange_split_sizes, reduce_scatter
from spartron.comm.mirror import MirrorError, mirrored_world


def test_all_gather_fills_every_slot_and_is_recorded():
    with mirrored_world(2, 4) as ledger:
        x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        out = torch.empty(8, 2)
        dist.all_gather_into_tensor(out, x)
        assert torch.equal(out, x.repeat(4, 1))
        assert torch.equal(all_gather(x, dim=1), x.repeat(1, 4))
        assert torch.equal(funcol.all_gather_tensor(x, 0, dist.group.WORLD).wait(), x.repeat(4, 1))
        (rec,) = ledger.take()
        assert (rec.kind, rec.group, rec.size, rec.calls) == ("all_gather", "default_pg", 4, 3)
        assert rec.bytes == 3 * 8 * 2 * 4  # the output of each call
        assert ledger.take() == []


def _premul_sum(factor: float):
    """PREMUL_SUM(factor) as FSDP2 builds it: torch 2.13 calls ReduceOp.PREMUL_SUM; in torch 2.11 (the GPU
    image) that enum member is not callable and FSDP2 uses torch.distributed._make_nccl_premul_sum."""
    try:
        return dist.ReduceOp.PREMUL_SUM(factor)
    except TypeError:
        return dist._make_nccl_premul_sum(factor)  # noqa: SLF001 - what FSDP2 itself calls on this torch


@pytest.mark.parametrize(("op", "scale"), [("sum", 4.0), ("avg", 1.0), ("premul", 0.5), ("max", 1.0)])
def test_reduce_scatter_keeps_this_ranks_chunk(op, scale):
    op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}.get(op) or _premul_sum(0.125)
    with mirrored_world(1, 4):
        x = torch.arange(16.0).view(8, 2)
        out = torch.empty(2, 2)
        dist.reduce_scatter_tensor(out, x, op=op)
        assert torch.equal(out, x[2:4] * scale)


def test_all_reduce_without_options_sums():
    with mirrored_world(0, 8) as ledger:
        z = torch.tensor([0.5, -1.0])
        dist.group.WORLD.allreduce([z])  # no options: the group's default, a bare RedOpType SUM
        assert torch.equal(z, torch.tensor([4.0, -8.0]))
        assert [r.reduce_ops for r in ledger.take()] == [("SUM",)]


def test_reduce_scatter_op_and_all_reduce_broadcast_barrier():
    with mirrored_world(0, 8) as ledger:
        assert torch.equal(reduce_scatter(torch.ones(16, 3)), torch.full((2, 3), 8.0))
        y = torch.tensor([0.5, -1.0])
        dist.all_reduce(y)
        assert torch.equal(y, torch.tensor([4.0, -8.0]))
        dist.all_reduce(y, op=dist.ReduceOp.AVG)
        assert torch.equal(y, torch.tensor([4.0, -8.0]))
        dist.broadcast(y, src=5)
        dist.barrier()
        assert torch.equal(y, torch.tensor([4.0, -8.0]))
        kinds = {(r.kind, r.calls) for r in ledger.take()}
        assert kinds == {("reduce_scatter", 1), ("all_reduce", 2), ("broadcast", 1)}
        big = torch.full((4,), 1e30)
        dist.all_reduce(big)
        assert torch.isfinite(big).all() and big[0].item() == pytest.approx(8e30, rel=1e-6)


def test_all_to_all_uneven_splits_is_what_identical_ranks_send():
    with mirrored_world(1, 3) as ledger:
        counts = torch.tensor([2, 1, 0], dtype=torch.int64)
        assert torch.equal(exchange_split_sizes(counts), torch.tensor([1, 1, 1]))  # every rank sends me its [1]
        x = torch.arange(3.0).view(3, 1)  # rows 0-1 to rank 0, row 2 to rank 1 (me)
        recv = all_to_all(x, [1, 1, 1], [2, 1, 0])
        assert torch.equal(recv.flatten(), torch.tensor([2.0, 2.0, 2.0]))
        back = all_to_all(recv, [2, 1, 0], [1, 1, 1])  # the combine: true sizes, this rank's rows recycled
        assert back.shape == (3, 1) and torch.isfinite(back).all()
        assert {(r.kind, r.calls) for r in ledger.take()} == {("all_to_all", 3)}


def test_balanced_all_to_all_evens_the_counts_and_keeps_totals():
    with mirrored_world(0, 2, balanced=True):
        counts = torch.tensor([5, 0, 2, 1], dtype=torch.int64)  # 2 local experts per rank: [rank0 e0 e1, rank1 e0 e1]
        recv = all_to_all(counts, [2, 2], [2, 2])
        assert recv.tolist() == [4, 1, 3, 0] and recv.sum() == counts.sum()  # slot means (7, 1) / 2, remainder first
        rows = all_to_all(torch.arange(6.0).view(6, 1), [3, 5], [5, 1])
        assert rows.flatten().tolist() == [0, 1, 2, 0, 1, 2, 3, 4]  # each source: this rank's own chunk, cut
        wire = torch.arange(12, dtype=torch.uint8).view(6, 2)  # FP8 dispatch rows (E4M3 bytes + scales): data
        got = all_to_all(wire, [3, 5], [5, 1])
        assert got[:, 0].tolist() == [0, 2, 4, 0, 2, 4, 6, 8] and torch.equal(got[:, 1], got[:, 0] + 1)


def test_all_to_all_fills_runs_of_equal_sources_cyclically_from_this_ranks_chunk():
    with mirrored_world(0, 3) as ledger:
        x = torch.tensor([[1.0, 10.0], [2.0, 20.0]])  # both rows to myself (rank 0)
        recv = all_to_all(x, [3, 3, 2], [2, 0, 0])
        assert recv[:, 0].tolist() == [1, 2, 1, 1, 2, 1, 1, 2] and torch.equal(recv[:, 1], 10 * recv[:, 0])
        empty = all_to_all(x[:0], [2, 2, 0], [0, 0, 0])  # nothing anywhere: zeros of the right shape
        assert empty.shape == (4, 2) and not empty.any()
        assert [r.calls for r in ledger.take()] == [2]


def test_point_to_point_and_peer_memory_transports_are_refused():
    with mirrored_world(0, 2):
        with pytest.raises(MirrorError, match="send on a mirrored process group: a mirrored rank has no peer"):
            dist.send(torch.ones(1), dst=1)
        transport = EPTransport(dist.group.WORLD)
        with pytest.raises(MirrorError, match=r"model.moe.dispatcher = 'deepep' cannot run on a mirrored process"):
            transport.deepep_buffer(top_k=2, n_experts=8, num_sms=24, hidden=64)
        with pytest.raises(MirrorError, match="the copy-engine exchange .* cannot run on a mirrored process group"):
            transport.exchange_buffer()


def test_a_mirrored_world_needs_a_free_process_and_a_rank_inside_it():
    with pytest.raises(MirrorError, match="rank 4 is outside a world of 4"):
        with mirrored_world(4, 4):
            pass
    with mirrored_world(0, 2):
        with pytest.raises(MirrorError, match="already initialised"):
            with mirrored_world(0, 2):
                pass
    assert not dist.is_initialized()


def _shards(rank: int, world: int, balanced: bool) -> tuple:
    """An [8, 64] weight FSDP2-sharded over a mirrored world, built on meta and given storage (materialize_'s
    path): this rank's shard shape, its mesh's coordinate, the shard DTensor slices from that mesh, and what
    one all-gather of it recorded, with the world's group and ledger."""
    with mirrored_world(rank, world, balanced=balanced) as ledger:
        with torch.device("meta"):
            model = torch.nn.Linear(64, 8, bias=False)
        fully_shard(model, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
        model.to_empty(device="cpu")
        p = model.weight
        sliced = distribute_tensor(torch.zeros(8, 64), p.device_mesh, p.placements, src_data_rank=None)
        ledger.take()
        p.full_tensor()
        records = [(r.kind, r.size, r.calls, r.bytes) for r in ledger.take()]
        return (tuple(p.to_local().shape), p.device_mesh.get_coordinate(), tuple(sliced.to_local().shape),
                records, dist.group.WORLD.balanced), ledger


def test_two_mirrored_worlds_in_one_process_shard_as_fresh_ones():
    """A second world whose mesh equals the first's got the first's DeviceMesh (rank 13) back from DTensor's
    caches: rank 0 sliced a [0, 64] chunk for its [1, 64] shard. Each world now shards and records alone."""
    first, first_ledger = _shards(13, 16, balanced=True)
    registered = dist.Backend.register_backend
    calls = []
    dist.Backend.register_backend = lambda *a, **k: calls.append(a)  # the backend is registered once
    try:
        second, second_ledger = _shards(0, 16, balanced=False)
    finally:
        dist.Backend.register_backend = registered
    assert first == ((0, 64), (13,), (0, 64), [("all_gather", 16, 1, 16 * 64 * 4)], True)  # rows 0-7: ranks 0-7
    assert second == ((1, 64), (0,), (1, 64), [("all_gather", 16, 1, 16 * 64 * 4)], False)
    assert calls == [] and second_ledger is not first_ledger and first_ledger.take() == []
