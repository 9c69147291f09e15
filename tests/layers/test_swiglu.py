"""swiglu: silu(gate) * up with two saved tensors instead of three, values and gradients bitwise equal to autograd."""

import pytest
import torch
import torch.nn.functional as F
from triton_device import DEVICE as KERNEL_DEVICE  # tests/triton_device.py
from triton_device import needs_kernel

from spartron.layers.ffn import FeedForward
from spartron.layers.moe.experts import GroupedExperts
from spartron.layers.swiglu import swiglu, swiglu_backward_, swiglu_backward_into


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward_writes_the_gradients_into_gate_and_up_bitwise_equal(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 24, generator=g).to(dtype).requires_grad_()
    w = torch.randn(2, 24, 56, generator=g).to(dtype)
    grad = torch.randn(40, 56, generator=g).to(dtype)
    want = torch.autograd.grad(swiglu(x @ w[0], x @ w[1]), x, grad)[0]
    gate, up = x @ w[0], x @ w[1]  # fresh GEMM outputs, as the FFN and the experts pass them
    stores = (gate.data_ptr(), up.data_ptr())
    out = swiglu(gate, up, inplace_backward=True)
    grad_gate, grad_up = torch.autograd.grad(out, (gate, up), grad, retain_graph=True)
    assert (grad_gate.data_ptr(), grad_up.data_ptr()) == stores  # no new [rows, inter] buffers
    ref_gate = torch.ops.aten.silu_backward(grad * (x @ w[1]), x @ w[0])
    ref_up = grad * F.silu(x @ w[0])
    torch.testing.assert_close(grad_gate, ref_gate, rtol=0, atol=0)
    torch.testing.assert_close(grad_up, ref_up, rtol=0, atol=0)
    got = torch.autograd.grad(swiglu(x @ w[0], x @ w[1], inplace_backward=True), x, grad)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_inplace_backward_refuses_a_leaf_that_requires_grad_and_fails_loudly_when_another_op_saved_its_input():
    leaf = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"^swiglu\(inplace_backward=True\) overwrites gate and up in backward: a "
                                         r"leaf tensor that requires grad cannot be one of them"):
        swiglu(leaf, leaf * 2, inplace_backward=True)
    gate = leaf * 1
    sine = gate.sin()  # saves gate; its backward runs after swiglu's
    out = swiglu(gate, leaf * 2, inplace_backward=True) + sine
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_feedforward_under_compiled_checkpoint_equals_eager():
    torch.manual_seed(0)
    ffn = FeedForward(32, 64)
    x = torch.randn(16, 32, requires_grad=True)
    grads = []
    for fn in (ffn, torch.compile(lambda t: torch.utils.checkpoint.checkpoint(ffn, t, use_reentrant=False))):
        ffn.zero_grad()
        x.grad = None
        fn(x).square().sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in ffn.parameters()])
    for eager, compiled in zip(*grads, strict=True):
        torch.testing.assert_close(compiled, eager)


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_into_also_writes_the_forward_product_bitwise(dtype, inplace):
    """h = silu(gate) * up, as eager torch rounds it (the FP8 experts' w2 weight gradient reads it), written before
    the gradients overwrite gate and up in place; the gradients are those written without h."""
    g = torch.Generator().manual_seed(4)
    both = (torch.randn(37, 2 * 96, generator=g) * 4).to(dtype)
    grad = torch.randn(37, 96, generator=g).to(dtype)
    want_h = F.silu(both[:, :96]) * both[:, 96:]
    plain = torch.empty_like(both)
    swiglu_backward_into(grad, both[:, :96], both[:, 96:], plain[:, :96], plain[:, 96:])
    out = both if inplace else torch.empty_like(both)
    h = torch.full_like(grad, float("nan"))
    swiglu_backward_into(grad, both[:, :96], both[:, 96:], out[:, :96], out[:, 96:], h)
    assert torch.equal(h, want_h)
    assert torch.equal(out, plain)


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 1000), (33, 2048 + 5), (0, 64), (3, 4, 256)])
def test_triton_backward_writes_the_fp32_formula_rounded_once(dtype, shape, inplace):
    """Over gate and up (the op), or into the halves of another tensor (swiglu_backward_into: the FP8 experts'
    [M, 2I] gradient), inputs unchanged then."""
    from spartron.layers import swiglu_triton_kernels as kernels
    g = torch.Generator().manual_seed(3)
    both = torch.randn(*shape[:-1], 2 * shape[-1], generator=g).to(dtype).to(KERNEL_DEVICE)
    gate, up = both[..., :shape[-1]], both[..., shape[-1]:]  # row-strided halves of one GEMM output
    grad = torch.randn(shape, generator=g).to(dtype).to(KERNEL_DEVICE)
    a, b, d = (t.double() for t in (gate, up, grad))
    s = torch.sigmoid(a)
    want_gate, want_up = (d * b * s * (1 + a * (1 - s))).to(dtype), (d * a * s).to(dtype)
    inputs = both.clone()
    out = both if inplace else torch.full_like(both, float("nan"))
    d_gate, d_up = out[..., :shape[-1]], out[..., shape[-1]:]
    if KERNEL_DEVICE == "cuda":  # the op / the function pick the kernel on CUDA
        swiglu_backward_(grad, gate, up) if inplace else swiglu_backward_into(grad, gate, up, d_gate, d_up)
    else:
        kernels.swiglu_backward_rows(*(t.reshape(-1, shape[-1]) for t in (grad, gate, up, d_gate, d_up)))
    tol = {"rtol": 2 ** -7, "atol": 1e-6} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-7}
    torch.testing.assert_close(d_gate, want_gate, **tol)
    torch.testing.assert_close(d_up, want_up, **tol)
    if not inplace:
        assert torch.equal(both, inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA: the kernel's h uses libdevice's expf, which Triton's interpreter does not run")
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 1000), (33, 2048 + 5), (0, 64), (3, 4, 256)])
def test_triton_backward_writes_h_bitwise_eager_torch(dtype, shape, inplace):
    """With h (the FP8 experts' w2 weight gradient reads it): the gradients written without h, and h bitwise eager
    torch's silu(gate) * up on the GPU (gate scaled up so that exp's and the division's roundings matter)."""
    g = torch.Generator().manual_seed(6)
    both = (torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 8).to(dtype).cuda()
    gate, up = both[..., :shape[-1]], both[..., shape[-1]:]
    grad = torch.randn(shape, generator=g).to(dtype).cuda()
    want_h = F.silu(gate) * up
    plain = torch.empty_like(both)
    swiglu_backward_into(grad, gate, up, plain[..., :shape[-1]], plain[..., shape[-1]:])
    out = both if inplace else torch.empty_like(both)
    h = torch.full_like(grad, float("nan"))
    swiglu_backward_into(grad, gate, up, out[..., :shape[-1]], out[..., shape[-1]:], h)
    assert torch.equal(h, want_h)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("inplace, buffers", [(False, 6), (True, 3)])
def test_compiled_recomputed_ffn_backward_allocates_three_rows_by_inter_buffers_instead_of_six(inplace, buffers):
    """What the in-place backward is for: inductor fuses silu(gate) * up (w2's weight gradient) with both SwiGLU
    gradients into one kernel of three outputs, so h1, h3, d h, g, d gate and d up are six [rows, inter] buffers
    alive at once; with the opaque in-place op the backward allocates h1, h3 and g (d h reuses g's buffer)."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    ffn = FeedForward(64, 96, dtype=torch.bfloat16)
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)

    def forward(t):
        return ffn.w2(swiglu(ffn.w1(t), ffn.w3(t), inplace_backward=inplace))

    compiled = torch.compile(lambda t: torch.utils.checkpoint.checkpoint(forward, t, use_reentrant=False))
    _, (_, backward) = run_and_get_code(lambda: compiled(x).float().sum().backward())
    assert len(re.findall(r"empty_strided_cpu\(\(40, 96\)", backward)) == buffers


def test_swiglu_backward_op_passes_torch_opcheck():
    """Its schema declares the two mutated inputs, its fake impl and autograd registration are what torch expects."""
    g = torch.Generator().manual_seed(5)
    grad, gate, up = (torch.randn(8, 128, generator=g).bfloat16() for _ in range(3))
    torch.library.opcheck(swiglu_backward_, (grad, gate, up))
