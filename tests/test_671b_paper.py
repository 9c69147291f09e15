"""DeepSeek-V3 671B and V3.2 (DSA) on paper: the configs/ presets built on the meta device at world size 256
on torch's fake process-group backend (no peer, no memory), parallelised the way the trainer does it
(FSDP2 with fp32 masters, EP 64, CP for V3.2), for a sample of ranks: the first, the last and one per EP
group. Every rank's parameter shard shapes must equal the planner's (spartron.layers.costs.param_shards),
the shards of all 256 ranks must add up to the model, and the memory plan (spartron.launch.plan) must fit
an H200 (141 GB) and an H100 (80 GB) with selective AC and offload (V3 at seq 4096; V3.2 at seq 32768 over
CP 8, i.e. 4096 tokens per rank)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from spartron.launch.plan import plan_memory
from spartron.layers.costs import count_parameters, param_shapes, param_shards
from spartron.layers.model import build_model
from spartron.layers.parallelize import parallelize
from spartron.parallel.groups import ParallelGroups
from spartron.runtime.config import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
WORLD = 256
GB = 10**9


def sample_ranks(dims) -> list[int]:
    """The first and last rank and one rank of each EP group, at a different EP index in each."""
    ep_groups = dims.rank_groups("ep")
    return sorted({0, dims.world_size - 1, *(g[(7 * i + 3) % len(g)] for i, g in enumerate(ep_groups))})


def built_shards(cfg, rank: int, world: int = WORLD) -> dict[str, tuple[int, ...]]:
    """{name: local shape} of `rank`'s model, built on meta and parallelised under a fake process group."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        groups = ParallelGroups.build(cfg.parallel.dims(world), "cpu")
        m = cfg.model
        model = build_model(m, groups, seed=0, device="meta")
        model = parallelize(model, groups, cfg.ac, param_dtype=getattr(torch, m.dtype) if m.master_dtype else None)
        assert all(p.is_meta for p in model.parameters())  # nothing was allocated
        out = {}
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and p.dtype == torch.float32, name  # fp32 sharded masters
            out[name] = tuple(p.to_local().shape)
        return out
    finally:
        dist.destroy_process_group()


# V3.2 keeps its sparse-attention outputs (33 GB per rank): on an H100 it keeps none (`ac.targets = []`)
@pytest.mark.parametrize(("name", "h100"), [("deepseek-v3-671b", []), ("deepseek-v3.2-671b", ["ac.targets=[]"])])
def test_671b_shards_match_the_planner_and_the_plan_fits_h200_and_h100(name, h100):
    cfg = load_config(CONFIGS / f"{name}.toml")
    dims = cfg.parallel.dims(WORLD)
    assert (dims.ep, dims.expert_fsdp) == (64, 4) and dims.cp == (8 if "3.2" in name else 1)
    total = count_parameters(cfg.model)
    assert 671e9 < total.total < 690e9  # 671 B + the MTP block (+ the V3.2 indexers)
    ranks = sample_ranks(dims)
    assert ranks[0] == 0 and ranks[-1] == WORLD - 1 and all(set(g) & set(ranks) for g in dims.rank_groups("ep"))
    for rank in ranks:
        built = built_shards(cfg, rank)
        assert built == param_shards(cfg.model, dims, rank), rank
    # the shards of all 256 ranks hold every element once per data-parallel replica (routed experts too)
    shapes = param_shapes(cfg.model)
    assert sum(math.prod(s) for s in shapes.values()) == total.total
    summed = dict.fromkeys(shapes, 0)
    for rank in range(WORLD):
        for n, s in param_shards(cfg.model, dims, rank).items():
            summed[n] += math.prod(s)
    assert summed == {n: math.prod(s) * dims.dp_replicate for n, s in shapes.items()}
    assert cfg.ac.mode == "selective" and cfg.offload.enabled
    h100_cfg = load_config(CONFIGS / f"{name}.toml", h100)
    for rank in ranks:
        plan = plan_memory(cfg, WORLD, rank)
        assert plan.fits(141 * GB), (rank, plan.peak / GB)
        plan = plan_memory(h100_cfg, WORLD, rank)
        assert plan.fits(80 * GB), (rank, plan.peak / GB)


def test_at_1024_gpus_the_experts_are_split_on_their_second_dim():
    """EP 64 x expert_fsdp 16: an EP rank's 4 experts cannot go whole to 16 ranks, so every rank holds a
    1/16 slice of each (spartron.layers.parallelize.expert_shard_dim), as the planner says."""
    cfg = load_config(CONFIGS / "deepseek-v3-671b.toml")
    dims = cfg.parallel.dims(1024)
    assert (dims.ep, dims.expert_fsdp, dims.fsdp) == (64, 16, 1024)
    for rank in (0, 1023):
        built = built_shards(cfg, rank, 1024)
        assert built == param_shards(cfg.model, dims, rank), rank
        assert built["layers.3.ffn.experts.w1"] == (4, 2048 // 16, 7168)
        assert built["layers.3.ffn.experts.w2"] == (4, 7168 // 16, 2048)
        assert plan_memory(cfg, 1024, rank).fits(80 * GB)
