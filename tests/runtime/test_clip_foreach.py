"""clip_grads_ scales every gradient (mixed dtypes, one foreach per dtype) exactly as a per-tensor mul_ would."""

import torch
from torch import nn

from spartron.runtime.optim import clip_grads_


def test_clip_equals_per_tensor_multiply_bitwise_for_mixed_dtypes():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, 5, generator=g), torch.randn(33, generator=g).to(torch.bfloat16),
             torch.randn(2, 3, 4, generator=g).to(torch.bfloat16), torch.randn(1, generator=g)]
    params = [nn.Parameter(torch.zeros_like(t)) for t in grads]
    for p, t in zip(params[:len(grads)], grads, strict=True):
        p.grad = t.clone()
    params.append(nn.Parameter(torch.zeros(2)))  # no grad: skipped
    total = torch.tensor(12.5)
    clip_grads_(params, 2.0, total)
    coef = torch.clamp(2.0 / (total + 1e-6), max=1.0)
    for p, t in zip(params[:len(grads)], grads, strict=True):
        expected = t * coef.to(t.dtype)
        assert p.grad.dtype == t.dtype
        torch.testing.assert_close(p.grad, expected, rtol=0, atol=0)
    assert params[-1].grad is None
    assert params[0].grad[0, 0].item() == (grads[0][0, 0] * coef).item() != grads[0][0, 0].item()
