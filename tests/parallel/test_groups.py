"""ParallelGroups on real gloo ranks: named groups, meshes, coexistence, FSDP2 on the FSDP meshes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401 - imported before fork so ranks start fast
from torch.distributed.fsdp import fully_shard

from spartron.parallel.dims import DENSE_DIMS, EXPERT_DIMS, ParallelDims
from spartron.parallel.groups import GROUP_NAMES, ParallelGroups, ParallelGroupsError
from spartron.testing import run_distributed

LAYOUTS = {
    4: [dict(fsdp=2, cp=2, ep=2), dict(fsdp=4, ep=4)],
    8: [dict(fsdp=2, cp=2, ep=4, dp_replicate=2),
        dict(fsdp=2, cp=2, ep=2, dp_replicate=2, order="tp-dp-cp-ep-pp")],
}


def _mine(dims: ParallelDims, name: str, rank: int) -> list[int]:
    return next(g for g in dims.rank_groups(name) if rank in g)


def _check_groups(rank, world, kwargs):
    dims = ParallelDims(world_size=world, **kwargs)
    groups = ParallelGroups.build(dims, "cpu")
    for name in GROUP_NAMES:
        expected = _mine(dims, name, rank)
        assert groups.group_ranks(name) == sorted(expected), name
        assert getattr(groups, name) is groups.group(name)
        assert groups.size(name) == len(expected)
        assert groups.rank_in(name) == sorted(expected).index(rank)
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x, group=groups.group(name))
        assert x.item() == sum(r + 1 for r in expected), name
    meshes = ((groups.dense_mesh, DENSE_DIMS, "dense"), (groups.expert_mesh, EXPERT_DIMS, "expert"))
    for mesh, names, kind in meshes:
        assert mesh.mesh_dim_names == names
        assert mesh.mesh.tolist() == dims.mesh_ranks(kind)
        for name in names:
            ranks = dist.get_process_group_ranks(mesh.get_group(name))
            assert len(ranks) == getattr(dims, name)
            assert mesh.get_local_rank(name) == ranks.index(rank), (kind, name)
    # FSDP meshes: the shard group spans fsdp x cp (dense) or expert_fsdp (experts).
    for mesh, shard in ((groups.fsdp_mesh, "fsdp_cp"), (groups.expert_fsdp_mesh, "expert_fsdp")):
        assert mesh.ndim == (2 if dims.dp_replicate > 1 else 1)
        assert sorted(dist.get_process_group_ranks(mesh.get_group(shard))) == groups.group_ranks(shard)
        if dims.dp_replicate > 1:
            assert mesh.mesh_dim_names == ("dp_replicate", shard)
            assert len(dist.get_process_group_ranks(mesh.get_group("dp_replicate"))) == dims.dp_replicate
    return True


def _layout_id(value) -> str:
    return str(value) if isinstance(value, int) else "-".join(f"{k}{v}" for k, v in value.items())


@pytest.mark.parametrize("world,kwargs", [(w, k) for w, ks in LAYOUTS.items() for k in ks], ids=_layout_id)
def test_named_groups_match_rank_groups(world, kwargs):
    assert run_distributed(_check_groups, world, kwargs) == [True] * world


def _two_layouts(rank, world):
    a = ParallelGroups.build(ParallelDims(world_size=world, fsdp=world, ep=world), "cpu")
    b = ParallelGroups.build(ParallelDims(world_size=world, fsdp=2, cp=2, ep=2, dp_replicate=2), "cpu")
    b2 = ParallelGroups.build(ParallelDims(world_size=world, fsdp=2, cp=2, ep=2, dp_replicate=2), "cpu")
    assert b.cp is not b2.cp and b.dense_mesh is not b2.dense_mesh  # no shared caches between builds
    # Interleave collectives on the three sets of groups; each must see only its own members.
    sums = {}
    for label, groups in (("a", a), ("b", b), ("b2", b2)):
        for name in ("ep", "cp", "fsdp", "expert_fsdp", "dp_replicate"):
            x = torch.tensor([float(rank)])
            dist.all_reduce(x, group=groups.group(name))
            sums[label, name] = x.item()
    assert sums["a", "ep"] == sum(range(world)) and sums["a", "cp"] == rank
    assert sums["b", "ep"] == sum(b.group_ranks("ep")) and sums["b", "cp"] == sum(b.group_ranks("cp"))
    assert all(sums["b", name] == sums["b2", name] for _, name in sums)
    assert a.group_ranks("fsdp") == list(range(world)) and b.group_ranks("fsdp") != a.group_ranks("fsdp")
    b.destroy()  # tearing one build down leaves the others working
    for groups in (a, b2):
        x = torch.tensor([1.0])
        dist.all_reduce(x, group=groups.ep)
        assert x.item() == groups.size("ep")
    return True


def test_two_parallel_groups_coexist():
    assert run_distributed(_two_layouts, 8) == [True] * 8


def _fully_shard(rank, world, kwargs):
    dims = ParallelDims(world_size=world, **kwargs)
    groups = ParallelGroups.build(dims, "cpu")
    results = []
    for mesh in (groups.fsdp_mesh, groups.expert_fsdp_mesh):
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        model.load_state_dict(ref.state_dict())
        fully_shard(model, mesh=mesh)
        x = torch.linspace(-1, 1, 8).reshape(2, 4)  # same batch on every rank: averaged grads equal ref's
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.grad.full_tensor().allclose(q.grad, atol=1e-6), name
            results.append(p.to_local().numel())
    return results


# Local numel of (w1 [6,4], b1 [6], w2 [3,6], b2 [3]) per rank: FSDP2 shards dim 0 in ceil-sized chunks.
WHOLE = [24, 6, 18, 3]
HALVES = [[12, 3, 12, 2], [12, 3, 6, 1]]


@pytest.mark.parametrize("world,kwargs,dense,expert", [
    (2, dict(fsdp=2, ep=2), HALVES, [WHOLE] * 2),  # expert_fsdp = 1: expert params kept whole
    (2, dict(fsdp=1, dp_replicate=2), [WHOLE] * 2, [WHOLE] * 2),  # HSDP with shard size 1
    (4, dict(fsdp=1, cp=2, ep=2, dp_replicate=2, order="tp-dp-cp-ep-pp"),
     [HALVES[0], HALVES[0], HALVES[1], HALVES[1]], [WHOLE] * 4),  # shard rows [0, 2] and [1, 3]
], ids=["fsdp2", "hsdp2x1", "hsdp2x2-dp-before-cp"])
def test_fully_shard_on_fsdp_meshes(world, kwargs, dense, expert):
    out = run_distributed(_fully_shard, world, kwargs)
    assert [o[:4] for o in out] == dense
    assert [o[4:] for o in out] == expert


def _build_errors(rank, world):
    messages = []
    dims = ParallelDims(world_size=2, fsdp=2, ep=2)
    cases = ((ParallelDims(world_size=4, fsdp=4), "cpu", None), (ParallelDims(world_size=2, fsdp=2), "xpu", None),
             (dims, "cpu", {"ep": {"max_ctas": 8}}), (dims, "cuda", {"epx": {"max_ctas": 8}}))
    for dims, device, nccl in cases:
        try:
            ParallelGroups.build(dims, device, nccl=nccl)
        except ParallelGroupsError as err:
            messages.append(str(err))
    return messages


def test_build_errors_on_every_rank():
    out = run_distributed(_build_errors, 2)
    for messages in out:
        assert messages == ["ParallelDims.world_size is 4 but torch.distributed has 2 ranks "
                            "(world 4 = dp_replicate 1 x fsdp 4 x cp 1; ep 1 (expert_fsdp 4); "
                            "order tp-cp-ep-dp-pp)",
                            "device_type must be 'cpu' or 'cuda', got 'xpu'",
                            "parallel.nccl configures NCCL communicators, but this run's groups are for 'cpu' "
                            "tensors" + ("" if dist.is_nccl_available() else " and this torch has no NCCL"),
                            "parallel.nccl: unknown group 'epx'; known: " + ", ".join(GROUP_NAMES)]


def test_build_needs_initialized_distributed():
    assert not dist.is_initialized()
    with pytest.raises(ParallelGroupsError, match="needs torch.distributed initialized first"):
        ParallelGroups.build(ParallelDims(world_size=1, fsdp=1), "cpu")


def _nccl_settings_rank(rank, world):
    """The configured EP group has its own NCCL communicator carrying the settings, and works."""
    from spartron.comm.collectives import all_to_all

    torch.cuda.set_device(rank)
    groups = ParallelGroups.build(ParallelDims(world_size=world, fsdp=world, ep=world), "cuda",
                                  nccl={"ep": {"max_ctas": 8}})
    x = torch.arange(12.0, device="cuda").reshape(6, 2) + 100 * rank
    out = all_to_all(x, [3] * world, [3] * world, groups.ep)
    expected = torch.cat([torch.arange(12.0, device="cuda").reshape(6, 2)[3 * rank:3 * rank + 3] + 100 * r
                          for r in range(world)])
    config = groups.ep._get_backend(torch.device("cuda")).options.config
    return (groups.ep is not dist.group.WORLD, groups.fsdp is dist.group.WORLD, config.max_ctas,
            torch.equal(out, expected))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: NCCL communicator settings")
def test_nccl_settings_give_the_group_its_own_communicator():
    out = run_distributed(_nccl_settings_rank, 2, timeout=300, start_method="spawn")
    assert out == [(True, True, 8, True)] * 2
