"""MasterAdamW's Triton kernel (CUDA) against its torch reference: the same fp32 masters and moments to fp32
rounding after several steps with clipping, bf16 and fp32 gradients, table and per-tensor launches, and the bf16
parameter exactly the master rounded to nearest even after every step (torch's `.to(torch.bfloat16)`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from spartron.runtime.adamw_triton import AdamWKernelConfig
from spartron.runtime.master_weights import MasterAdamW, attach_master_weights

HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON),
                                                  reason="needs CUDA and triton (the compiled kernel)")]
SHAPES = [(3, 5), (17,), (64, 33), (1,), (300,), (1024, 1040)]  # sizes off every block


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.ParameterList([nn.Parameter(torch.randn(s, device="cuda")) for s in SHAPES])
    attach_master_weights(model, torch.bfloat16)
    return model


def _grads(model: nn.Module, step: int, fp32: bool) -> None:
    torch.manual_seed(100 + step)
    for p in model:
        g = torch.randn(p.shape, device="cuda")
        p.main_grad = g if fp32 else g.to(torch.bfloat16)


@pytest.mark.parametrize("per_tensor", [None, 64])
@pytest.mark.parametrize("fp32", [False, True])
def test_the_kernel_equals_the_reference_and_writes_the_rounded_master(per_tensor, fp32):
    ref, tri = _model(0), _model(0)
    groups = lambda m: [{"params": list(m)[:3], "weight_decay": 0.1}, {"params": list(m)[3:], "weight_decay": 0.0}]  # noqa: E731
    a = MasterAdamW(groups(ref), lr=1e-2, betas=(0.9, 0.95), reference=True)
    b = MasterAdamW(groups(tri), lr=1e-2, betas=(0.9, 0.95), reference=False,
                    kernel=AdamWKernelConfig(per_tensor_min_numel=per_tensor))
    for step in range(4):
        _grads(ref, step, fp32)
        _grads(tri, step, fp32)
        scale = torch.tensor(0.37 if step % 2 else 1.0, device="cuda")
        a.step(grad_scale=scale)
        b.step(grad_scale=scale)
        for p, q in zip(ref, tri, strict=True):
            torch.testing.assert_close(q.main_param, p.main_param, rtol=2e-6, atol=1e-7)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(b.state[q][key], a.state[p][key], rtol=2e-6, atol=1e-9)
            assert torch.equal(q.detach(), q.main_param.to(torch.bfloat16))  # the kernel's own rounding
            assert q.dtype == torch.bfloat16 and b.state[q]["exp_avg"].dtype == torch.float32
