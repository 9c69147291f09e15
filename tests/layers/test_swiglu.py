"""swiglu: silu(gate) * up with two saved tensors instead of three, values and gradients bitwise equal to autograd."""

import pytest
import torch
import torch.nn.functional as F

from spartron.layers.ffn import FeedForward, swiglu
from spartron.layers.moe.experts import GroupedExperts


def _saved_count(fn) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, len(saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_gradients_bitwise_and_one_tensor_fewer_saved(dtype):
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(64, 48, generator=g).to(dtype) for _ in range(2))
    grad = torch.randn(64, 48, generator=g).to(dtype)
    a1, b1 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    a2, b2 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    ref, ref_saved = _saved_count(lambda: F.silu(a1) * b1)
    out, saved = _saved_count(lambda: swiglu(a2, b2))
    assert (ref_saved, saved) == (3, 2)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for got, want in zip(torch.autograd.grad(out, (a2, b2), grad), torch.autograd.grad(ref, (a1, b1), grad),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    (only_up,) = torch.autograd.grad(swiglu(gate, b2), (b2,), grad)  # gate without grad
    torch.testing.assert_close(only_up, grad * F.silu(gate), rtol=0, atol=0)


def test_feedforward_and_grouped_experts_use_it():
    ffn = FeedForward(16, 32)
    x = torch.randn(5, 16, requires_grad=True)
    found = []

    def walk(fn):
        if fn is None or fn in found:
            return
        found.append(fn)
        for nxt, _ in fn.next_functions:
            walk(nxt)

    walk(ffn(x).grad_fn)
    names = {type(f).__name__ for f in found}
    assert "_SwiGLUBackward" in names and "SiluBackward0" not in names
    experts = GroupedExperts(2, 16, 32, mode="grouped", dtype=torch.bfloat16)
    rows = torch.randn(6, 16, dtype=torch.bfloat16, requires_grad=True)
    found.clear()
    walk(experts(rows, [4, 2]).grad_fn)
    assert "_SwiGLUBackward" in {type(f).__name__ for f in found}
