"""Chunked cross-entropy with ignored labels: the ignored rows are zeroed on the [chunk, D] side of each
gradient product; the gradients equal those of masking the [chunk, V] logits gradient, bitwise."""

import pytest
import torch
import torch.nn.functional as F

from spartron.layers.loss import IGNORE_INDEX, linear_cross_entropy_sum


def _masked_logits_reference(hidden, weight, labels, chunk):
    """The per-chunk gradients with the logits gradient masked row by row (the formula this replaces)."""
    gh, gw = torch.zeros_like(hidden), torch.zeros(weight.shape, dtype=torch.float32)
    for s in range(0, hidden.shape[0], chunk):
        h, y = hidden[s:s + chunk], labels[s:s + chunk]
        logits = (h @ weight.t()).float()
        g = torch.softmax(logits, dim=-1)
        valid = (y != IGNORE_INDEX).unsqueeze(1)
        g.scatter_add_(1, torch.where(valid, y.unsqueeze(1), 0), -valid.to(g.dtype))
        g = (g * valid).to(hidden.dtype)
        gh[s:s + chunk] = g @ weight
        gw += (g.t() @ h).float()
    return gh, gw.to(weight.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ignored_rows_gradients_equal_masking_the_logits_gradient(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(24, 16, generator=g).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(40, 16, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, 40, (24,), generator=g)
    labels[[0, 5, 6, 17, 23]] = IGNORE_INDEX
    loss = linear_cross_entropy_sum(hidden, weight, labels, chunk_size=8)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    ref_gh, ref_gw = _masked_logits_reference(hidden.detach(), weight.detach(), labels, 8)
    torch.testing.assert_close(gh, ref_gh, rtol=0, atol=0)
    torch.testing.assert_close(gw, ref_gw, rtol=0, atol=0)
    assert torch.count_nonzero(gh[[0, 5, 6, 17, 23]]) == 0 and torch.count_nonzero(gh[1]) > 0
    plain = F.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(loss, plain, rtol=1e-6, atol=1e-6)
