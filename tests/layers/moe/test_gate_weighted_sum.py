"""gate_weighted_sum: the top-k combine of MoE finalize, equal to the bmm it replaces, values and gradients."""

import pytest
import torch

from spartron.layers.moe.dispatch import gate_weighted_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_bmm_values_and_gradients_exactly(dtype):
    g = torch.Generator().manual_seed(0)
    # small integers: every product and sum is exact, so any correct formula gives identical bits
    y = torch.randint(-4, 5, (7, 6, 16), generator=g).to(dtype)
    w = torch.randint(-3, 4, (7, 6), generator=g).to(dtype)
    grad = torch.randint(-2, 3, (7, 16), generator=g).to(dtype)
    y1, w1 = y.clone().requires_grad_(), w.clone().requires_grad_()
    y2, w2 = y.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch.bmm(w1.unsqueeze(1), y1).squeeze(1)
    out = gate_weighted_sum(w2, y2)
    assert out.dtype == dtype and out.shape == (7, 16)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    ref_gy, ref_gw = torch.autograd.grad(ref, (y1, w1), grad)
    gy, gw = torch.autograd.grad(out, (y2, w2), grad)
    torch.testing.assert_close(gy, ref_gy, rtol=0, atol=0)
    torch.testing.assert_close(gw, ref_gw, rtol=0, atol=0)
    assert gw.shape == (7, 6) and gy.shape == (7, 6, 16)
    # a known value: token 0's output is sum_k w[0, k] * y[0, k]
    torch.testing.assert_close(out[0], (w[0, :, None] * y[0]).sum(0), rtol=0, atol=0)


def test_random_fp32_matches_bmm_to_rounding():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(33, 6, 64, generator=g, requires_grad=True)
    w = torch.rand(33, 6, generator=g, requires_grad=True)
    grad = torch.randn(33, 64, generator=g)
    ref = torch.autograd.grad(torch.bmm(w.unsqueeze(1), y).squeeze(1), (y, w), grad)
    got = torch.autograd.grad(gate_weighted_sum(w, y), (y, w), grad)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_only_the_inputs_that_need_a_gradient_get_one():
    y = torch.ones(3, 2, 4, requires_grad=True)
    w = torch.full((3, 2), 0.5)
    (gy,) = torch.autograd.grad(gate_weighted_sum(w, y), (y,), torch.ones(3, 4))
    assert gy.tolist() == [[[0.5] * 4] * 2] * 3
    w2 = w.clone().requires_grad_()
    (gw,) = torch.autograd.grad(gate_weighted_sum(w2, y.detach()), (w2,), torch.ones(3, 4))
    assert gw.tolist() == [[4.0, 4.0]] * 3
