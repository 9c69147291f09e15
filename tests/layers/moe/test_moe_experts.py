"""Routed experts: grouped GEMM path vs the per-expert loop; the SwiGLU FFN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spartron.layers.ffn import FeedForward
from spartron.layers.moe.experts import GroupedExperts, grouped_mm_available

needs_grouped = pytest.mark.skipif(not grouped_mm_available(),
                                   reason="needs torch._grouped_mm (torch >= 2.9)")


def _pair(dtype, device="cpu", n=4, dim=32, inter=16):
    torch.manual_seed(0)
    grouped = GroupedExperts(n, dim, inter, mode="grouped", dtype=dtype, device=device, init_std=0.2)
    loop = GroupedExperts(n, dim, inter, mode="loop", dtype=dtype, device=device)
    loop.load_state_dict(grouped.state_dict())
    return grouped, loop


def _run(experts, x, counts, grad):
    x = x.detach().clone().requires_grad_()
    y = experts(x, counts)
    y.backward(grad)
    return y, x.grad, [p.grad for p in (experts.w1, experts.w3, experts.w2)]


def _compare(dtype, device, atol, rtol):
    grouped, loop = _pair(dtype, device)
    counts = torch.tensor([5, 0, 7, 3], device=device)  # expert 1 receives no tokens
    x = torch.randn(15, 32, dtype=dtype, device=device)
    grad = torch.randn(15, 32, dtype=dtype, device=device)
    yg, xg, wg = _run(grouped, x, counts, grad)
    yl, xl, wl = _run(loop, x, counts, grad)
    torch.testing.assert_close(yg, yl, atol=atol, rtol=rtol)
    torch.testing.assert_close(xg, xl, atol=atol, rtol=rtol)
    for a, b in zip(wg, wl, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
        assert a[1].abs().max() == 0  # the empty expert gets an exactly zero gradient


@needs_grouped
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_equals_loop_cpu(dtype):
    _compare(dtype, "cpu", atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5 if dtype == torch.float32
             else 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the bf16 grouped GEMM kernel")
def test_grouped_equals_loop_cuda_bf16():
    _compare(torch.bfloat16, "cuda", atol=2e-2, rtol=2e-2)


def test_loop_matches_literal_per_token():
    torch.manual_seed(1)
    experts = GroupedExperts(3, 8, 4, mode="loop", init_std=0.3)
    x = torch.randn(6, 8)
    y = experts(x, [2, 3, 1])
    owner = [0, 0, 1, 1, 1, 2]
    for t, e in enumerate(owner):
        h = F.silu(experts.w1[e] @ x[t]) * (experts.w3[e] @ x[t])
        torch.testing.assert_close(y[t], experts.w2[e] @ h)


def test_auto_uses_loop_on_cpu_and_all_tokens_empty():
    experts = GroupedExperts(2, 8, 4, mode="auto")
    assert experts.resolved_mode(torch.zeros(1, 8)) == "loop"
    y = experts(torch.zeros(0, 8), [0, 0])
    assert y.shape == (0, 8)


def test_grouped_errors():
    with pytest.raises(ValueError, match="model.moe.grouped_mm must be auto, grouped or loop"):
        GroupedExperts(2, 8, 4, mode="fast")
    if grouped_mm_available():
        experts = GroupedExperts(2, 6, 4, mode="grouped")  # 6 fp32 = 24 bytes per row
        with pytest.raises(ValueError, match="needs 16-byte aligned rows: dim 6"):
            experts(torch.zeros(3, 6), [1, 2])
    loop = GroupedExperts(2, 8, 4, mode="loop")
    with pytest.raises(ValueError, match="tokens_per_expert sums to 2, x has 3 rows"):
        loop(torch.zeros(3, 8), [1, 1])
    with pytest.raises(ValueError, match="tokens_per_expert has 3 entries for 2 local experts"):
        loop(torch.zeros(3, 8), [1, 1, 1])


def test_ffn_is_swiglu():
    torch.manual_seed(2)
    ffn = FeedForward(8, 12, init_std=0.3)
    x = torch.randn(5, 8)
    ref = (F.silu(x @ ffn.w1.weight.T) * (x @ ffn.w3.weight.T)) @ ffn.w2.weight.T
    torch.testing.assert_close(ffn(x), ref)


@needs_grouped
def test_grouped_under_autocast_casts_like_linear():
    # fp32 weights, bf16 autocast: the grouped path computes in bf16 as F.linear would in the loop path.
    grouped, loop = _pair(torch.float32)
    counts = torch.tensor([5, 0, 7, 3])
    x = torch.randn(15, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yg, yl = grouped(x, counts), loop(x, counts)
    assert yg.dtype == yl.dtype == torch.bfloat16
    torch.testing.assert_close(yg, yl, atol=2e-2, rtol=2e-2)
