"""Meta-device construction (the trainer's default factory): built on meta, parallelised there, materialised
shard by shard. On real gloo ranks, every layout's parameters gathered after materialising equal a
1-rank eager build's bitwise, and no rank ever holds more than its shards plus one parameter's
temporaries (peak live bytes counted by a dispatch mode over every storage created while building)."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from spartron.layers.init import materialize_
from spartron.layers.model import build_model
from spartron.parallel.groups import ParallelGroups
from spartron.runtime.config import load_config
from spartron.runtime.trainer import default_model_factory
from spartron.testing import run_distributed

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
SEED = 11


def _alive(storage) -> bool:
    """A storage object can outlive its memory (a parameter swapped by `to_empty`): then it is freed."""
    if storage is None:
        return False
    try:
        storage.data_ptr()
    except RuntimeError:
        return False
    return True


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created under the mode that are alive at the same time."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                st = t.untyped_storage()
                if id(st) not in self.live:
                    self.live[id(st)] = (weakref.ref(st), st.nbytes())
        self.live = {k: v for k, v in self.live.items() if _alive(v[0]())}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _global(p: torch.Tensor, name: str, groups: ParallelGroups) -> torch.Tensor:
    """A parameter's global value: FSDP shards gathered, EP expert shards concatenated in EP rank order."""
    t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
    if ".experts." in name and groups.size("ep") > 1:
        parts = [torch.empty_like(t) for _ in range(groups.size("ep"))]
        dist.all_gather(parts, t.contiguous(), group=groups.ep)
        t = torch.cat(parts)
    return t


def _build(rank, world, overrides):
    cfg = load_config(TINY, [f"train.seed={SEED}", *overrides])
    groups = ParallelGroups.build(cfg.parallel.dims(world), "cpu")
    counter = LiveBytes()
    with counter:
        model = default_model_factory(cfg, groups)
    params = dict(model.named_parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).untyped_storage().nbytes() for p in params.values())
    reference = dict(build_model(cfg.model, seed=SEED).named_parameters())  # 1 rank, eager, same seed
    biggest = max(r.numel() for r in reference.values()) * 4  # one parameter's float32 temporary
    return dict(
        differs=sorted(n for n, p in params.items() if not torch.equal(_global(p, n, groups), reference[n].detach())),
        names_match=sorted(params) == sorted(reference),
        dtypes=sorted({str(p.dtype) for p in params.values()}),
        sharded=all(isinstance(p, DTensor) for p in params.values()),
        expert_dims=sorted({p.placements[-1].dim for n, p in params.items()
                            if ".experts." in n and isinstance(p, DTensor)}),
        buffers_zero=all(bool((b == 0).all()) for b in model.buffers()),
        peak=counter.peak, local=local, biggest=biggest,
        whole=sum(r.numel() * r.element_size() for r in reference.values()))


@pytest.mark.parametrize(("world", "overrides"), [
    (1, ["model.dtype=bfloat16", "model.master_dtype=float32"]),
    (2, ["parallel.ep=2", "model.dtype=bfloat16"]),
    (4, ["parallel.ep=4"]),
    (4, ["parallel.ep=2", "parallel.dp_replicate=2", "model.dtype=bfloat16", "model.master_dtype=float32"]),
    (4, ["parallel.ep=2", "model.moe.n_routed_experts=6"]),  # 3 local experts over 2 expert_fsdp ranks: Shard(1)
], ids=["1rank-fp32-masters", "ep2-fsdp2-bf16", "ep4-fsdp4-fp32", "ep2-hsdp2x2-fp32-masters", "ep2-experts-shard1"])
def test_a_meta_build_equals_the_one_rank_build_bitwise_and_holds_only_its_shards(world, overrides):
    for r in run_distributed(_build, world, overrides, timeout=120):
        assert r["names_match"] and r["differs"] == [], r["differs"]
        assert r["buffers_zero"]
        assert r["dtypes"] == (["torch.bfloat16"] if overrides[-1] == "model.dtype=bfloat16" else ["torch.float32"])
        assert r["sharded"] == (world > 1 or "model.master_dtype=float32" in overrides)
        # its shards plus one parameter's temporaries (its whole value and a slice or fp32 draw of it) and
        # a few scalars
        assert r["peak"] <= r["local"] + 2 * r["biggest"] + 4096, r
        assert r["expert_dims"] == ([1] if "model.moe.n_routed_experts=6" in overrides else [0])
        if world == 4:
            assert r["local"] + 2 * r["biggest"] + 4096 < r["whole"]  # so a whole build would fail the bound


def test_materialize_refuses_a_buffer_without_reset_buffers():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(3))

    with torch.device("meta"):
        model = nn.ModuleDict({"count": Counter()})
    with pytest.raises(ValueError) as err:
        materialize_(model, "cpu", 0, 0.02)
    assert str(err.value) == "cannot materialise buffer 'count.seen' (Counter has no reset_buffers()): give it one"


def test_a_meta_built_model_has_no_storage_until_materialised():
    cfg = load_config(TINY, []).model
    model = build_model(cfg, seed=SEED, device="meta")
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    materialize_(model, "cpu", SEED, cfg.init_std)
    eager = build_model(cfg, seed=SEED).state_dict()
    assert all(torch.equal(v, eager[k]) for k, v in model.state_dict().items())


def test_expert_weights_are_split_on_dim_1_only_when_whole_experts_do_not_divide():
    from spartron.layers.parallelize import expert_shard_dim

    assert expert_shard_dim((8, 32, 64), 4) == 0 and expert_shard_dim((4, 32, 64), 1) == 0
    assert expert_shard_dim((4, 2048, 7168), 16) == 1  # DeepSeek-V3, EP 64 on 1024 GPUs
    assert expert_shard_dim((3, 32, 64), 2) == 1
    assert expert_shard_dim((3, 33, 64), 2) == 0  # neither divides: whole experts, padded
