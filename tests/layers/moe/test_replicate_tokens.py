"""replicate_tokens: the dispatcher's token -> slot copy, equal to `x[slot_order // top_k]` with its gradient."""

import pytest
import torch

from spartron.layers.moe.dispatch import LocalDispatcher, replicate_tokens


def _slots(tokens: int, top_k: int, experts: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    order = torch.argsort(ids.reshape(-1), stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    return ids, order, inverse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_indexing_values_and_gradient_exactly(dtype):
    ids, order, inverse = _slots(9, 3, 5, seed=0)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-8, 9, (9, 4), generator=g).to(dtype)  # small integers: every sum exact
    grad = torch.randint(-8, 9, (27, 4), generator=g).to(dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = x1[order // 3]
    out = replicate_tokens(x2, order, inverse, 3)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    (ref_grad,) = torch.autograd.grad(ref, x1, grad)
    (got,) = torch.autograd.grad(out, x2, grad)
    torch.testing.assert_close(got, ref_grad, rtol=0, atol=0)
    # token 0's gradient is the sum of the gradients of its 3 slots
    torch.testing.assert_close(got[0], grad[inverse[:3]].sum(0), rtol=0, atol=0)


def test_random_fp32_gradient_matches_indexing_and_the_dispatcher_uses_it():
    ids, order, inverse = _slots(33, 6, 16, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(33, 8, generator=g, requires_grad=True)
    grad = torch.randn(33 * 6, 8, generator=g)
    (ref,) = torch.autograd.grad(x[order // 6], x, grad)
    (got,) = torch.autograd.grad(replicate_tokens(x, order, inverse, 6), x, grad)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    d = LocalDispatcher(16)
    tokens, state = d.prepare(x, ids, torch.rand(33, 6, generator=g))
    assert tokens is x  # one rank: nothing travels, the tokens are replicated where the experts take them
    rows, _ = d.post_dispatch(d.dispatch(tokens, state), state)
    assert rows.grad_fn is not None and type(rows.grad_fn).__name__ == "_ReplicateTokensBackward"
    torch.testing.assert_close(rows, x[order // 6], rtol=0, atol=0)
    assert torch.equal(state.slot_order, order) and torch.equal(state.slot_inverse, inverse)
