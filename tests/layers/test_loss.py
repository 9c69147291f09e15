import torch

from spartron.layers.loss import IGNORE_INDEX, linear_cross_entropy_sum, plain_cross_entropy_sum


def _inputs(n=37, d=8, v=23, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, d, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = IGNORE_INDEX
    return hidden, weight, labels


def test_chunked_loss_equals_plain_loss_and_grads():
    h, w, y = _inputs()
    ref = plain_cross_entropy_sum(h, w, y)
    gh_ref, gw_ref = torch.autograd.grad(ref * 3.0, (h, w))
    for chunk in (1, 4, 10, 36):
        out = linear_cross_entropy_sum(h, w, y, chunk_size=chunk)
        gh, gw = torch.autograd.grad(out * 3.0, (h, w))
        torch.testing.assert_close(out, ref.float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(gh, gh_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(gw, gw_ref.float().double(), rtol=1e-6, atol=1e-6)


def test_chunked_loss_ignores_all_ignored_rows_and_needs_no_weight_grad():
    h, w, y = _inputs()
    y[:] = IGNORE_INDEX
    out = linear_cross_entropy_sum(h, w.detach(), y, chunk_size=8)
    assert out.item() == 0.0
    (gh,) = torch.autograd.grad(out, (h,))
    assert torch.count_nonzero(gh) == 0


def test_chunked_loss_rejects_bad_shapes():
    h, w, y = _inputs()
    try:
        linear_cross_entropy_sum(h.unsqueeze(0), w, y, 4)
    except ValueError as err:
        assert "hidden must be [N, D]" in str(err)
    else:
        raise AssertionError("no error")
