"""spartron::moe_combine (MoE finalize's top-k combine as one op): the same values and gradients as the separate
ops it replaces (the slots' gather into token order, then gate_weighted_sum), on the CPU bitwise, its Triton
kernels on the GPU or under Triton's interpreter; kept by selective AC as the product it replaces was."""

from __future__ import annotations

import pytest
import torch
from triton_device import DEVICE as KERNEL_DEVICE  # tests/triton_device.py
from triton_device import INTERPRET, needs_kernel

from spartron.checkpointing.policy import DEFAULT_TARGETS, validate_targets
from spartron.layers.moe.combine import combine_slots, moe_combine, moe_slot_sum
from spartron.layers.moe.dispatch import gate_weighted_sum, inverse_permutation, permute_rows
from spartron.layers.ops import load_ops


def _routing(tokens: int, top_k: int, experts: int, seed: int):
    """The local dispatcher's slot order of a random routing and its inverse."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    order = torch.argsort(ids.reshape(-1), stable=True)
    return order, inverse_permutation(order)


def _separate_ops(y, weights, slot_inverse, slot_order):
    tokens, top_k = weights.shape
    per_slot = permute_rows(y, slot_inverse, slot_order).view(tokens, top_k, y.shape[-1])
    return gate_weighted_sum(weights.to(y.dtype), per_slot)


def _values_and_grads(fn, y, weights, grad, *index):
    y, weights = y.clone().requires_grad_(), weights.clone().requires_grad_()
    out = fn(y, weights, *index)
    return (out, *torch.autograd.grad(out, (y, weights), grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_cpu_values_and_gradients_are_the_separate_ops_bitwise(dtype, top_k):
    tokens, dim = 37, 48
    slot_order, slot_inverse = _routing(tokens, top_k, 8, seed=top_k)
    g = torch.Generator().manual_seed(0)
    y = torch.randn(tokens * top_k, dim, generator=g).to(dtype)
    weights = torch.rand(tokens, top_k, generator=g).to(dtype)
    grad = torch.randn(tokens, dim, generator=g).to(dtype)
    want = _values_and_grads(_separate_ops, y, weights, grad, slot_inverse, slot_order)
    got = _values_and_grads(combine_slots, y, weights, grad, slot_inverse, slot_order)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # a known value: token 3's output is its slots' rows weighted (slot_inverse[3 * k + j] is its j-th row)
    rows = y.double()[slot_inverse[3 * top_k:4 * top_k]]
    torch.testing.assert_close(got[0][3].double(), (weights.double()[3, :, None] * rows).sum(0),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-2)


@pytest.mark.parametrize("top_k", [1, 6])
def test_slot_sum_is_the_gather_and_sum_bitwise_on_cpu(top_k):
    """The replication's backward (dispatch.replicate_tokens): each token's k slot rows summed."""
    slot_order, slot_inverse = _routing(21, top_k, 8, seed=5)
    rows = torch.randn(21 * top_k, 40).bfloat16()
    want = rows.index_select(0, slot_inverse).view(21, top_k, 40).sum(dim=1)
    assert torch.equal(moe_slot_sum(rows, slot_inverse, top_k), want)
    torch.library.opcheck(moe_slot_sum, (rows, slot_inverse, top_k))


def test_the_op_passes_torchs_registration_checks():
    """Schema, fake (meta) implementation and autograd registration, as torch.compile relies on them."""
    slot_order, slot_inverse = _routing(9, 2, 4, seed=1)
    y = torch.randn(18, 16, requires_grad=True)
    weights = torch.rand(9, 2, requires_grad=True)
    torch.library.opcheck(moe_combine, (y, weights, slot_inverse, slot_order))


def test_wrong_row_count_is_one_line_error_naming_the_shape():
    slot_order, slot_inverse = _routing(4, 2, 4, seed=2)
    with pytest.raises(ValueError, match=r"moe_combine: y must be \[tokens \* top_k = 8, dim\], got \(7, 16\)"):
        combine_slots(torch.randn(7, 16), torch.rand(4, 2), slot_inverse, slot_order)


def test_selective_ac_keeps_the_combine_as_it_kept_the_product():
    load_ops()
    assert "spartron::moe_combine" in DEFAULT_TARGETS
    validate_targets(["spartron::moe_combine"])  # a registered op: the policy's name matches it


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("top_k,dim", [(1, 64), (6, 7168), (8, 1000)])
def test_kernels_match_the_separate_ops(top_k, dim):
    """Small integers: every product and fp32 sum is exact, so the kernels' sums in their own order give the separate
    ops' bits; random values: the outputs within one bf16 rounding of the float64 sums, y's gradient (one product)
    bitwise (on the GPU; the interpreter's bf16 cast truncates). dim 1000: a partial last column block; top_k 6: the
    slots padded to 8 in the tile."""
    from spartron.layers.moe import combine_triton_kernels as kernels

    tokens = 40
    slot_order, slot_inverse = _routing(tokens, top_k, 8, seed=dim)
    g = torch.Generator().manual_seed(3)
    ints = [torch.randint(-4, 5, shape, generator=g).bfloat16() for shape in
            ((tokens * top_k, dim), (tokens, top_k), (tokens, dim))]
    rand = [torch.randn(tokens * top_k, dim, generator=g).bfloat16(), torch.rand(tokens, top_k, generator=g).bfloat16(),
            torch.randn(tokens, dim, generator=g).bfloat16()]
    for exact, (y, weights, grad) in ((True, ints), (False, rand)):
        want_out, want_dy, want_dw = _values_and_grads(_separate_ops, y, weights, grad, slot_inverse, slot_order)
        dev = [t.to(KERNEL_DEVICE) for t in (y, weights, grad, slot_inverse)]
        out = kernels.combine_forward(dev[0], dev[1], dev[3]).cpu()
        d_y, d_w = (t.cpu() for t in kernels.combine_backward(dev[2], dev[0], dev[1], dev[3]))
        if exact or not INTERPRET:  # the interpreter's fp32 -> bf16 cast truncates (the GPU's rounds to nearest)
            assert torch.equal(d_y, want_dy)
        else:
            torch.testing.assert_close(d_y, want_dy, rtol=2 ** -7, atol=0)
        if exact:  # the fp32 sums are exact; |out| <= 128 is a bf16 value, d_w (sums over dim) is rounded once
            assert torch.equal(out, want_out)
            if not INTERPRET:
                assert torch.equal(d_w, want_dw)
            continue
        ref_out = (weights.double()[:, :, None] * y.double()[slot_inverse].view(tokens, top_k, dim)).sum(1)
        ref_dw = (y.double()[slot_inverse].view(tokens, top_k, dim) * grad.double()[:, None]).sum(-1)
        rtol = 2 ** -7 if INTERPRET else 2 ** -8  # half a bf16 step rounding to nearest, a whole one truncating
        torch.testing.assert_close(out.double(), ref_out, rtol=rtol, atol=1e-6)
        torch.testing.assert_close(d_w.double(), ref_dw, rtol=rtol, atol=1e-6)


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("top_k,dim", [(1, 64), (6, 1000)])
def test_slot_sum_kernel_matches_the_gather_and_sum(top_k, dim):
    """Small integers (exact fp32 sums, bf16 values): bitwise; random values within one bf16 rounding."""
    from spartron.layers.moe import combine_triton_kernels as kernels

    slot_order, slot_inverse = _routing(33, top_k, 8, seed=dim)
    g = torch.Generator().manual_seed(4)
    for exact, rows in ((True, torch.randint(-8, 9, (33 * top_k, dim), generator=g).bfloat16()),
                        (False, torch.randn(33 * top_k, dim, generator=g).bfloat16())):
        got = kernels.slot_sum(rows.to(KERNEL_DEVICE), slot_inverse.to(KERNEL_DEVICE), top_k).cpu()
        want = rows.index_select(0, slot_inverse).view(33, top_k, dim).sum(dim=1)
        if exact:
            assert torch.equal(got, want)
        else:
            ref = rows.double().index_select(0, slot_inverse).view(33, top_k, dim).sum(dim=1)
            torch.testing.assert_close(got.double(), ref, rtol=2 ** -7 if INTERPRET else 2 ** -8, atol=1e-6)


@pytest.mark.gpu
@needs_kernel
def test_kernels_take_no_tokens():
    from spartron.layers.moe import combine_triton_kernels as kernels

    y, weights = torch.empty(0, 64, device=KERNEL_DEVICE), torch.empty(0, 2, device=KERNEL_DEVICE)
    index = torch.empty(0, dtype=torch.long, device=KERNEL_DEVICE)
    assert kernels.combine_forward(y, weights, index).shape == (0, 64)
    d_y, d_w = kernels.combine_backward(torch.empty(0, 64, device=KERNEL_DEVICE), y, weights, index)
    assert d_y.shape == (0, 64) and d_w.shape == (0, 2)
