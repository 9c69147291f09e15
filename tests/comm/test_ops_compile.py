"""The runtime ops under torch.compile(fullgraph=True) and the op-registration checks (opcheck,
policy classification) on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (the first custom-op call imports it: once here, not in each forked rank)

from spartron.checkpointing import build_policy
from spartron.comm import collectives as C
from spartron.layers.moe import telemetry
from spartron.testing import run_distributed

SPLITS = [[1, 3], [2, 0]]  # SPLITS[j][r] = rows rank j sends to rank r (uneven, one empty)


def _dispatch_compute_combine(x, lin, out_splits, in_splits, group):
    """MoE-shaped: all-to-all tokens out, local expert, all-to-all them back."""
    routed = C.all_to_all(x, out_splits, in_splits, group)
    return C.all_to_all(torch.nn.functional.gelu(lin(routed)), in_splits, out_splits, group)


def _compile_parity_worker(rank, world, backend):
    import torch.distributed as dist

    torch.manual_seed(0)  # same expert weights on both ranks (and in the eager copy)
    lin = torch.nn.Linear(4, 4)
    in_splits = SPLITS[rank]
    out_splits = [SPLITS[j][rank] for j in range(world)]
    x = torch.randn(sum(in_splits), 4, generator=torch.Generator().manual_seed(10 + rank))
    group = dist.group.WORLD

    results = []
    for fn in (_dispatch_compute_combine,
               torch.compile(_dispatch_compute_combine, fullgraph=True, backend=backend)):
        lin.zero_grad()
        xg = x.clone().requires_grad_()
        out = fn(xg, lin, out_splits, in_splits, group)
        (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
        results.append((out.detach(), xg.grad, lin.weight.grad.clone(), lin.bias.grad.clone()))
    (eager, compiled) = results
    for want, got in zip(eager, compiled, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    return eager[0].shape[0]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_all_to_all_dispatch_compute_combine_compiles_fullgraph_with_eager_parity(backend):
    assert run_distributed(_compile_parity_worker, 2, backend, timeout=120) == [4, 2]


def _tensor_splits_compile_worker(rank, world):
    """MoE-style: counts tensor -> exchange -> host splits (unbacked SymInts) -> dispatch/combine."""
    import torch.distributed as dist

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    group = dist.group.WORLD

    def fn(x, in_counts):
        out_counts = C.exchange_split_sizes(in_counts, group)
        routed = C.all_to_all(x, out_counts, in_counts, group)
        return C.all_to_all(lin(routed), in_counts, out_counts, group)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        for step, counts in enumerate(([1, 3], [4, 0], [0, 4])):
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            results = []
            for f in (fn, compiled):
                lin.zero_grad()
                xg = x.clone().requires_grad_()
                out = f(xg, torch.tensor(counts))
                (out * out).sum().backward()
                results.append((out.detach(), xg.grad, lin.weight.grad.clone()))
            for want, got in zip(*results, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_tensor_split_sizes_compile_fullgraph_with_captured_scalars():
    run_distributed(_tensor_splits_compile_worker, 2, timeout=120)


def _gather_scatter_compile_worker(rank, world):
    def fn(x):
        gathered = C.all_gather(x, dim=1)
        return C.reduce_scatter(gathered.square(), dim=0)

    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    outs = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        xg = x.clone().requires_grad_()
        out = f(xg)
        out.sum().backward()
        outs.append((out.detach(), xg.grad))
    for want, got in zip(*outs, strict=True):
        torch.testing.assert_close(got, want)


def test_all_gather_and_reduce_scatter_compile_fullgraph_with_eager_parity():
    run_distributed(_gather_scatter_compile_worker, 2)


def _opcheck_worker(rank, world):
    """torch.library.opcheck: schema, autograd registration, fake impl, AOT dispatch."""
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(0), requires_grad=True)
    ops = torch.ops.spartron_collectives
    cases = [
        (ops.all_to_all.default, (x, [1, 3] if rank == 0 else [3, 1], [1, 3] if rank == 0 else [3, 1], name)),
        (ops.all_gather.default, (x, 1, "", name)),
        (ops.reduce_scatter.default, (x, 0, "", name)),
        (ops.splits_to_host.default, (torch.tensor([1, 2], dtype=torch.int32),)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_collective_ops_pass_opcheck():
    run_distributed(_opcheck_worker, 2, timeout=120)


def test_every_op_is_classified_by_the_checkpoint_policy():
    """Each op name the policy table refers to must be one of ours, and each of ours classified."""
    selective, full = build_policy("selective"), build_policy("full")
    expected = {
        "spartron_collectives::all_to_all": "target",
        "spartron_collectives::all_gather": "target",
        "spartron_collectives::reduce_scatter": "target",
        "spartron_collectives::splits_to_host": "mandatory",
        "spartron::record_routing_stats": "mandatory",
    }
    assert set(expected) == set(C.OPS + telemetry.OPS)
    for name, kind in expected.items():
        ns, op = name.split("::")
        overload = getattr(getattr(torch.ops, ns), op).default
        assert selective.decide(overload, (), {}) == kind, name
        assert full.decide(overload, (), {}) == ("mandatory" if kind == "mandatory" else None), name
