"""spartron::absorb_query / absorb_output: the einsum + cat / reshape they replace, in values, gradients,
FLOP counts, the op contract, compile, and on CUDA bitwise in bf16 with no copy kernel in forward."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from spartron.layers.attention.absorb import absorb_output, absorb_query

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: cuBLAS writing strided outputs")
B, S, H, N, R, C, V = 2, 5, 3, 8, 4, 16, 6


def _inputs(device="cpu", dtype=torch.float64, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, S, H, N + R, device=device, dtype=dtype, generator=g)
    wkv_b = torch.randn(H * (N + V), C, device=device, dtype=dtype, generator=g)
    lat = torch.randn(B, S, H, C, device=device, dtype=dtype, generator=g)
    return q, wkv_b, lat


def _both(q, wkv_b, lat, fused: bool):
    """The DSA layer's use: q split into views, W_uk / W_uv views of wkv_b (as MLA._absorbed_weights)."""
    w = wkv_b.view(H, N + V, C)
    w_uk, w_uv = w[:, :N], w[:, N:]
    q_nope, q_pe = q.split([N, R], dim=-1)
    q_pe = q_pe * 2  # a tensor of its own, as RoPE makes it
    if fused:
        return absorb_query(q_nope, q_pe, w_uk), absorb_output(lat, w_uv)
    q_abs = torch.cat((torch.einsum("bshn,hnc->bshc", q_nope, w_uk), q_pe), dim=-1)
    return q_abs, torch.einsum("bshc,hvc->bshv", lat, w_uv).reshape(B, S, H * V)


def test_values_and_gradients_equal_einsum_and_cat():
    results = {}
    for fused in (False, True):
        q, wkv_b, lat = (t.requires_grad_() for t in _inputs())
        q_abs, out = _both(q, wkv_b, lat, fused)
        g = torch.Generator().manual_seed(1)
        loss = (q_abs * torch.randn(q_abs.shape, dtype=q_abs.dtype, generator=g)).sum() + (
            out * torch.randn(out.shape, dtype=out.dtype, generator=g)).sum()
        results[fused] = (q_abs, out, *torch.autograd.grad(loss, (q, wkv_b, lat)))
    assert results[True][0].shape == (B, S, H, C + R) and results[True][1].shape == (B, S, H * V)
    for new, ref in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(new, ref, rtol=1e-12, atol=1e-12)


def test_op_contract_and_flop_counts():
    q, wkv_b, lat = _inputs(dtype=torch.float32)
    w = wkv_b.view(H, N + V, C)
    q_nope, q_pe = (t.requires_grad_() for t in q.clone().split([N, R], dim=-1))
    w_uk, w_uv = w[:, :N].clone().requires_grad_(), w[:, N:].clone().requires_grad_()
    torch.library.opcheck(torch.ops.spartron.absorb_query, (q_nope, q_pe, w_uk))
    torch.library.opcheck(torch.ops.spartron.absorb_output, (lat.clone().requires_grad_(), w_uv))
    for fn, args, product in ((absorb_query, (q_nope, q_pe, w_uk), B * S * H * N * C),
                              (absorb_output, (lat.clone().requires_grad_(), w_uv), B * S * H * C * V)):
        with FlopCounterMode(display=False) as counter:
            fn(*args).sum().backward()
        assert counter.get_total_flops() == 3 * 2 * product  # forward, then the two gradients' products


def test_compiled_equals_eager():
    q, wkv_b, lat = _inputs(dtype=torch.float32)
    compiled = torch.compile(lambda *a: tuple(t * 2 for t in _both(*a, fused=True)), backend="aot_eager")
    for got, want in zip(compiled(q, wkv_b, lat), _both(q, wkv_b, lat, fused=True), strict=True):
        assert torch.equal(got, want * 2)


@pytest.mark.gpu
@needs_cuda
def test_cuda_bf16_equals_einsum_and_cat_bitwise_without_copies():
    q, wkv_b, lat = _inputs("cuda", torch.bfloat16)
    new, ref = _both(q, wkv_b, lat, True), _both(q, wkv_b, lat, False)
    assert all(torch.equal(a, b) for a, b in zip(new, ref, strict=True))
    kernels = {}
    for fused in (True, False):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            _both(q, wkv_b, lat, fused)
            torch.cuda.synchronize()
        kernels[fused] = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert not [n for n in kernels[True] if "Cat" in n], kernels[True]
    assert len(kernels[True]) < len(kernels[False]), kernels
