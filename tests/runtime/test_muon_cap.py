"""Muon's byte cap (ns_batch_bytes): it splits the Newton-Schulz batches and the sharded buckets' exchange
rounds, and the step's result is bit-for-bit the uncapped one (one rank, and FSDP-sharded on two gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from spartron.runtime.muon import MuonWithAdamW, split_by_bytes
from spartron.testing import run_distributed

SHAPES = [(8, 4), (8, 4), (8, 4), (5, 6, 4), (4, 12), (3,)]  # three same-shape matrices, an expert stack, a vector


def _tensors(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _run(cap: int | None, params: list[torch.Tensor], steps: int = 2):
    groups = [{"params": [p for p in params if p.ndim >= 2], "muon": True, "weight_decay": 0.1},
              {"params": [p for p in params if p.ndim < 2]}]
    opt = MuonWithAdamW(groups, lr=0.02, betas=(0.9, 0.95), **({} if cap is None else {"ns_batch_bytes": cap}))
    counts = []
    for step in range(steps):
        for p, g in zip(params, _tensors(100 + step), strict=True):
            p.grad = g.to(p.dtype) if not hasattr(p, "device_mesh") else distribute_tensor(
                g, p.device_mesh, p.placements, src_data_rank=None)
        opt.step()
        counts.append((opt.orthogonalized, opt.exchanges))
    return opt, counts


def test_split_by_bytes_runs_are_consecutive_and_capped():
    assert split_by_bytes([4, 4, 4, 10, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    assert split_by_bytes([3, 3], 100) == [[0, 1]]
    assert split_by_bytes([], 8) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_capped_step_equals_the_uncapped_one_bit_for_bit(dtype):
    results = {}
    for cap in (None, 2 * 8 * 4 * dtype.itemsize):  # two 8x4 matrices per Newton-Schulz batch, the stack in 3
        params = [t.to(dtype) for t in _tensors(0)]
        opt, counts = _run(cap, params)
        results[cap] = (params, [opt.state[p]["momentum_buffer"] for p in params if p.ndim >= 2], counts)
    (want, want_bufs, want_counts), (got, got_bufs, got_counts) = results.values()
    for a, b in zip(want + want_bufs, got + got_bufs, strict=True):
        assert torch.equal(a, b)
    assert want_counts == got_counts == [(3 + 5 + 1, 0)] * 2  # every expert counts; nothing sharded


def test_ns_batch_bytes_must_be_positive():
    with pytest.raises(ValueError, match="Muon: ns_batch_bytes must be positive, got 0"):
        MuonWithAdamW([{"params": [torch.zeros(2, 2)], "muon": True}], lr=0.1, betas=(0.9, 0.95), ns_batch_bytes=0)


def _sharded(rank, world, cap):  # noqa: ANN001
    mesh = init_device_mesh("cpu", (world,))
    # experts split on their rows (dim 1): gathered like the matrices, so all five join the FSDP bucket
    params = [distribute_tensor(t, mesh, [Shard(1 if t.ndim == 3 else 0)]) for t in _tensors(0)]
    _, counts = _run(cap, params)
    return [p.full_tensor().numpy() for p in params], counts


def test_the_cap_splits_a_sharded_bucket_into_exchange_rounds_with_the_same_result():
    whole, split = (run_distributed(_sharded, 2, cap, timeout=120) for cap in (None, 8 * 4 * 4))
    for a, b in zip(whole[0][0], split[0][0], strict=True):
        assert (a == b).all()
    # one bucket (the FSDP group, fp32) of five tensors: one round, or one per tensor at a 128-byte cap
    assert [c[1] for r in whole for c in r[1]] == [1, 1, 1, 1]
    assert [c[1] for r in split for c in r[1]] == [5, 5, 5, 5]
    # each matrix orthogonalised once over the two ranks, either way
    assert sum(r[1][0][0] for r in whole) == sum(r[1][0][0] for r in split) == 3 + 5 + 1
