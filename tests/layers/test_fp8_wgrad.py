"""model.fp8.wgrad = "model_dtype" (Megatron's fp8_wgrad = False): the forward and dgrad stay the recipe's FP8
GEMMs bitwise, and each weight gradient is the unquantised GEMM of the bf16 layers' backward on the same
gradient and inputs (torch._grouped_mm over the experts' offsets; grad^T @ x for a dense linear), bitwise.
Reference backend on CPU; the Triton and DeepGEMM backends on the GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from spartron.layers.config import FP8Config
from spartron.layers.fp8 import apply_fp8
from spartron.layers.fp8.expert_ops import grouped_mm_pair, swiglu_grouped_mm


def _has_deep_gemm() -> bool:
    return importlib.util.find_spec("deep_gemm") is not None  # installed (a broken build fails its tests, not skips)


_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
_GPU = [pytest.mark.gpu, pytest.mark.skipif(not _HOPPER, reason="needs an sm90 GPU")]
BACKENDS = [
    pytest.param("reference", "cpu", id="reference"),
    pytest.param("triton", "cuda", id="triton", marks=_GPU),
    pytest.param("deep_gemm", "cuda", id="deep_gemm", marks=[*_GPU, pytest.mark.skipif(
        not _has_deep_gemm(), reason="needs DeepGEMM (benchmarks/build_deep_gemm.sh)")]),
]


def _experts(backend: str, device: str, fp8_wgrad: bool, tensors, grad, counts, order):
    """The fused expert ops forward and backward -> out, h13's gradient and every leaf's."""
    x, w1, w3, w2 = (t.detach().clone().requires_grad_() for t in tensors)
    inverse = None if order is None else torch.argsort(order)
    h13 = grouped_mm_pair(x, w1, w3, counts, backend, True, fp8_wgrad, [], order, inverse, 1, [])
    h13.retain_grad()
    out = swiglu_grouped_mm(h13, w2, counts, backend, True, fp8_wgrad, [], [])
    out.backward(grad)
    return out, h13, x.grad, w1.grad, w3.grad, w2.grad


@pytest.mark.parametrize("permuted", [False, True], ids=["packed", "ep-permuted"])
@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_experts_wgrad_in_model_dtype_is_the_bf16_grouped_gemm(backend, device, permuted):
    g = torch.Generator(device=device).manual_seed(7)
    x = torch.randn(512, 256, device=device, generator=g).bfloat16()
    w1, w3 = ((torch.randn(3, 128, 256, device=device, generator=g) * 0.05).bfloat16() for _ in range(2))
    w2 = (torch.randn(3, 256, 128, device=device, generator=g) * 0.05).bfloat16()
    grad = torch.randn(512, 256, device=device, generator=g).bfloat16()
    counts = torch.tensor([130, 0, 382], dtype=torch.int32, device=device)
    order = torch.randperm(512, device=device, generator=g) if permuted else None
    out, h13, dx, dw1, dw3, dw2 = _experts(backend, device, False, (x, w1, w3, w2), grad, counts, order)
    fp8 = _experts(backend, device, True, (x, w1, w3, w2), grad, counts, order)
    assert torch.equal(out, fp8[0]) and torch.equal(dx, fp8[2])  # forward and dgrad: the recipe's, unchanged
    assert not torch.equal(dw1, fp8[3])  # the FP8 wgrad differs: this test can tell them apart
    rows = x if order is None else x[order]
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    g13, gate, up = h13.grad, h13[:, :128].detach(), h13[:, 128:].detach()
    assert torch.equal(dw1, torch._grouped_mm(g13[:, :128].t(), rows, offs=offs))
    assert torch.equal(dw3, torch._grouped_mm(g13[:, 128:].t(), rows, offs=offs))
    assert torch.equal(dw2, torch._grouped_mm(grad.t(), F.silu(gate) * up, offs=offs))
    assert not dw1[1].any() and not dw2[1].any()  # the expert with no rows gets zeros
    assert dw1.dtype == dw2.dtype == torch.bfloat16


@pytest.mark.parametrize(("backend", "device"), [p for p in BACKENDS if p.id != "deep_gemm"])
def test_dense_linear_wgrad_in_model_dtype_is_grad_t_at_x(backend, device):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 384, bias=False, device=device, dtype=torch.bfloat16) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    for layer, wgrad in zip(layers, ("model_dtype", "fp8"), strict=True):
        apply_fp8([torch.nn.ModuleList([layer])], FP8Config(backend=backend, modules=["dense"], wgrad=wgrad))
    x = torch.randn(2, 96, 256, device=device, dtype=torch.bfloat16)
    grad = torch.randn(2, 96, 384, device=device, dtype=torch.bfloat16)
    inputs = [x.clone().requires_grad_() for _ in layers]
    outs = [layer(xi) for layer, xi in zip(layers, inputs, strict=True)]
    for out in outs:
        out.backward(grad)
    assert torch.equal(outs[0], outs[1]) and torch.equal(inputs[0].grad, inputs[1].grad)
    assert torch.equal(layers[0].weight.grad, grad.reshape(-1, 384).t() @ x.reshape(-1, 256))
    assert not torch.equal(layers[1].weight.grad, layers[0].weight.grad)


def test_wgrad_option_is_validated_by_name():
    with pytest.raises(ValueError, match="wgrad"):
        FP8Config(wgrad="bf16")
    assert FP8Config().wgrad == "fp8"
