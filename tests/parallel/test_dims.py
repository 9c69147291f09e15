"""ParallelDims: rank groups equal megatron-core's RankGenerator; invalid layouts rejected clearly."""

from __future__ import annotations

import itertools

import pytest

from spartron.parallel.dims import GROUP_DIMS, ParallelDims, ParallelDimsError

RankGenerator = pytest.importorskip("megatron.core.parallel_state").RankGenerator

ALL_ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "cp", "ep", "dp", "pp"))]
# (world, dp_replicate, fsdp, cp, ep): small shapes in every order, large ones in a few orders.
SMALL = [(1, 1, 1, 1, 1), (8, 1, 8, 1, 8), (8, 2, 2, 2, 2), (8, 2, 2, 2, 4), (12, 1, 3, 4, 6),
         (16, 2, 4, 2, 8), (24, 3, 2, 4, 4)]
LARGE = [(64, 2, 8, 4, 16), (512, 4, 16, 8, 32), (4096, 8, 64, 8, 64), (4096, 1, 4096, 1, 256),
         (4096, 16, 16, 16, 128)]
LARGE_ORDERS = ["tp-cp-ep-dp-pp", "tp-dp-cp-ep-pp", "cp-ep-dp-tp-pp"]


def _canon(groups: list[list[int]]) -> list[list[int]]:
    return sorted(sorted(g) for g in groups)


def _megatron_groups(dims: ParallelDims) -> dict[str, list[list[int]]]:
    dense = RankGenerator(tp=1, ep=1, dp=dims.dp, pp=1, cp=dims.cp, order=dims.order)
    expert = RankGenerator(tp=1, ep=dims.ep, dp=dims.expert_dp, pp=1, cp=1, order=dims.order)
    return {"cp": dense.get_ranks("cp"), "dp": dense.get_ranks("dp"), "dp_cp": dense.get_ranks("dp-cp"),
            "ep": expert.get_ranks("ep"), "expert_dp": expert.get_ranks("dp")}


def _check_parity(world, dp_replicate, fsdp, cp, ep, order):
    dims = ParallelDims(world_size=world, fsdp=fsdp, cp=cp, ep=ep, dp_replicate=dp_replicate, order=order)
    for name, theirs in _megatron_groups(dims).items():
        ours = dims.rank_groups(name)
        assert _canon(ours) == _canon(theirs), (name, dims.describe())
        if name in ("cp", "ep", "dp", "expert_dp"):  # one-dimension groups: same member order too
            assert sorted(ours) == sorted(theirs), (name, dims.describe())


@pytest.mark.parametrize("shape", SMALL, ids=lambda s: "x".join(map(str, s)))
def test_megatron_parity_small_all_orders(shape):
    for order in ALL_ORDERS:
        _check_parity(*shape, order)


@pytest.mark.parametrize("shape", LARGE, ids=lambda s: "x".join(map(str, s)))
def test_megatron_parity_large(shape):
    for order in LARGE_ORDERS:
        _check_parity(*shape, order)


@pytest.mark.parametrize("shape", SMALL + LARGE[:2], ids=lambda s: "x".join(map(str, s)))
def test_every_group_partitions_the_world(shape):
    world, dp_replicate, fsdp, cp, ep = shape
    dims = ParallelDims(world_size=world, fsdp=fsdp, cp=cp, ep=ep, dp_replicate=dp_replicate,
                        order="tp-dp-cp-ep-pp")
    for name in GROUP_DIMS:
        groups = dims.rank_groups(name)
        assert sorted(r for g in groups for r in g) == list(range(world)), name
        assert {len(g) for g in groups} == {dims.group_size(name)}, name
    assert dims.group_size("fsdp_cp") == fsdp * cp and dims.group_size("expert_fsdp") == fsdp * cp // ep


def test_named_sizes_and_known_layout():
    dims = ParallelDims(world_size=8, fsdp=2, cp=2, ep=2, dp_replicate=2)
    assert (dims.dp, dims.expert_fsdp, dims.expert_dp) == (4, 2, 4)
    assert dims.rank_groups("cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.rank_groups("fsdp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.rank_groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.rank_groups("fsdp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.rank_groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.rank_groups("expert_fsdp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.mesh_ranks("dense") == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


BAD = [
    (dict(world_size=0, fsdp=1), "world_size must be >= 1, got 0"),
    (dict(world_size=4, fsdp=0), "fsdp must be >= 1, got 0"),
    (dict(world_size=4, fsdp=4, cp=-1), "cp must be >= 1, got -1"),
    (dict(world_size=4, fsdp=4, ep=0), "ep must be >= 1, got 0"),
    (dict(world_size=4, fsdp=4, dp_replicate=0), "dp_replicate must be >= 1, got 0"),
    (dict(world_size=4, fsdp=4.0), "fsdp must be an int, got float 4.0"),
    (dict(world_size=4, fsdp=4, cp=True), "cp must be an int, got bool True"),
    (dict(world_size="4", fsdp=4), "world_size must be an int, got str '4'"),
    (dict(world_size=8, fsdp=2, cp=2), "dp_replicate * fsdp * cp = 1 * 2 * 2 = 4 must equal world_size 8"),
    (dict(world_size=8, fsdp=4, cp=2, dp_replicate=2),
     "dp_replicate * fsdp * cp = 2 * 4 * 2 = 16 must equal world_size 8"),
    (dict(world_size=6, fsdp=3, cp=2, ep=4), "ep 4 must divide fsdp * cp = 3 * 2 = 6"),
    (dict(world_size=4, fsdp=4, ep=8), "ep 8 must divide fsdp * cp = 4 * 1 = 4"),
    (dict(world_size=4, fsdp=4, order="tp-cp-ep-dp"),
     "order must be a '-'-joined permutation of tp-cp-ep-dp-pp"),
    (dict(world_size=4, fsdp=4, order="tp-cp-cp-dp-pp"), "got 'tp-cp-cp-dp-pp'"),
    (dict(world_size=4, fsdp=4, order="tp-cp-ep-dp-xx"), "got 'tp-cp-ep-dp-xx'"),
    (dict(world_size=4, fsdp=4, order=None), "got None"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_invalid_dims_rejected(kwargs, message):
    with pytest.raises(ParallelDimsError) as err:
        ParallelDims(**kwargs)
    assert message in str(err.value)


def test_unknown_group_and_mesh_names():
    dims = ParallelDims(world_size=2, fsdp=2)
    with pytest.raises(ParallelDimsError, match="unknown group 'tp'; known: world, cp"):
        dims.rank_groups("tp")
    with pytest.raises(ParallelDimsError, match="mesh must be 'dense' or 'expert', got 'moe'"):
        dims.mesh_ranks("moe")
