"""LR schedule values, optimizer groups, Muon, and the global gradient norm over sharded tensors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from spartron.runtime.config import TrainConfig
from spartron.runtime.muon import NS_COEFFICIENTS
from spartron.runtime.optim import (
    MuonWithAdamW,
    build_optimizer,
    clip_grads_,
    global_grad_norm,
    lr_at,
    newton_schulz_orthogonalize,
)
from spartron.testing import run_distributed


def test_lr_warmup_then_cosine_to_min():
    cfg = TrainConfig(steps=10, lr=1.0, warmup_steps=2, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in (1, 2)] == [0.5, 1.0]
    assert lr_at(6, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(10, cfg) == pytest.approx(0.1)
    assert lr_at(3, cfg) < 1.0
    with pytest.raises(ValueError, match="1-based"):
        lr_at(0, cfg)


def test_no_warmup_starts_at_peak():
    assert lr_at(1, TrainConfig(steps=4, lr=2.0, warmup_steps=0, min_lr_ratio=0.0)) == pytest.approx(
        1.0 + math.cos(math.pi * 0.25))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 50))


def test_adamw_decays_matrices_only():
    opt = build_optimizer(_model(), TrainConfig(weight_decay=0.1))
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.ndim == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.ndim == 1 for p in no_decay["params"])


def test_muon_takes_hidden_matrices_and_keeps_a_standard_state_dict():
    model = _model()
    opt = build_optimizer(model, TrainConfig(optimizer="muon", lr=0.02))
    assert isinstance(opt, MuonWithAdamW)
    muon = [g for g in opt.param_groups if g["muon"]]
    assert [p.shape for g in muon for p in g["params"]] == [torch.Size([8, 8])]  # not embedding / head
    before = model[1].weight.detach().clone()
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    assert not torch.equal(before, model[1].weight)
    state = opt.state_dict()
    assert set(state["state"][0]) == {"momentum_buffer"} and "exp_avg" in state["state"][1]
    opt2 = build_optimizer(model, TrainConfig(optimizer="muon", lr=0.02))
    opt2.load_state_dict(state)
    assert torch.equal(opt2.state_dict()["state"][0]["momentum_buffer"], state["state"][0]["momentum_buffer"])


def test_newton_schulz_gives_near_orthogonal_rows():
    g = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz_orthogonalize(g))
    assert s.min() > 0.5 and s.max() < 1.3  # the quintic iteration's known band around 1


def _norm_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    gen = torch.Generator().manual_seed(0)
    full_a = torch.randn(8, 3, generator=gen)  # FSDP-like: sharded over "shard", replicated over "rep"
    full_b = torch.randn(5, generator=gen)  # replicated plain tensor
    full_c = torch.randn(4, 2, generator=gen)  # plain tensor split over a process group (EP-like)
    a = nn.Parameter(distribute_tensor(torch.zeros(8, 3), mesh, [Replicate(), Shard(0)]))
    a.grad = distribute_tensor(full_a, mesh, [Replicate(), Shard(0)])
    b = nn.Parameter(torch.zeros(5))
    b.grad = full_b.clone()
    ep_group = mesh.get_group("shard")
    c = nn.Parameter(torch.zeros(2, 2))
    c.grad = full_c.chunk(2)[dist.get_rank(ep_group)].clone()
    params = [a, b, c]
    norm = global_grad_norm(params, {id(c): (ep_group,)})
    expected = torch.cat([full_a.flatten(), full_b, full_c.flatten()]).norm()
    without_extra = global_grad_norm(params)
    clip_grads_(params, 0.5, norm)
    clipped = global_grad_norm(params, {id(c): (ep_group,)})
    return float(norm), float(expected), float(without_extra), float(clipped)


def test_global_norm_over_sharded_and_replicated_tensors_on_4_ranks():
    results = run_distributed(_norm_worker, 4)
    for norm, expected, without_extra, clipped in results:
        assert norm == pytest.approx(expected, rel=1e-6)
        assert without_extra != pytest.approx(expected, rel=1e-3)  # the EP slice must be summed
        assert clipped == pytest.approx(0.5, rel=1e-5)
    assert len({r[0] for r in results}) == 1  # bitwise the same on every rank


def test_clip_is_noop_when_disabled_or_below_max():
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    clip_grads_([p], 0.0, torch.tensor(5.0))
    clip_grads_([p], 10.0, torch.tensor(5.0))
    assert p.grad.tolist() == [3.0, 4.0, 0.0]


def test_muon_vocabulary_is_the_models_not_the_largest_trainable_matrix():
    """A stage training one hidden matrix: it still goes to Muon (its first dim was once taken for the
    vocabulary's, which sent the largest trainable matrix, e.g. an indexer's wq_b, to AdamW)."""
    model = _model()
    for p in model.parameters():
        p.requires_grad_(p is model[1].weight)
    opt = build_optimizer(model, TrainConfig(optimizer="muon", lr=0.02))
    assert [(g["muon"], [p.shape for p in g["params"]]) for g in opt.param_groups] == [(True, [torch.Size([8, 8])])]
    head_only = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 50))  # no embedding: the largest first dim
    head_only[0].requires_grad_(False)
    opt = build_optimizer(head_only, TrainConfig(optimizer="muon", lr=0.02))
    assert [g["muon"] for g in opt.param_groups] == [False, False]  # the head [50, 8] and its bias: AdamW


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (3, 6, 10), (2, 3, 10, 6)], ids=["wide", "tall", "stack", "4d"])
def test_newton_schulz_is_the_quintic_iteration_per_matrix(shape):
    """The three-GEMM form ((a I + b A + c A A) x; a tall matrix through x^T x, keeping its layout) is the textbook
    x <- a x + (b A + c A A) x, A = x x^T, on each matrix by itself: the float64 textbook steps agree, the result
    has g's shape, dtype and layout, and a stack equals its matrices one by one."""
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a, b, c = NS_COEFFICIENTS
    x = g.mT if shape[-2] > shape[-1] else g
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(5):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    want = (x.mT if shape[-2] > shape[-1] else x).float()
    got = newton_schulz_orthogonalize(g.float())
    assert got.shape == g.shape and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    flat = g.float().reshape(-1, *shape[-2:])
    one_by_one = torch.stack([newton_schulz_orthogonalize(m) for m in flat]).reshape(shape)
    assert torch.equal(got, one_by_one)
