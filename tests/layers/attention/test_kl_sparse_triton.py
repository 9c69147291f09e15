"""kl_sparse's Triton kernels (indexer_kl_triton) behind the ops of indexer_kl on CUDA.

CPU: the dispatch (CUDA has its own kernels, CPU runs the PyTorch code) and the shape limits. GPU (lent H200,
`pytest -m gpu`): the KL target, the selected index scores and their gradients against the PyTorch path on
the same bf16 inputs, with -1 padding, short rows, an empty query, a batch of two and head counts that are
not a power of two; the deterministic key gradient keeps its fixed-point path on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from spartron.layers.attention import indexer_kl, indexer_kl_triton

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the Triton kl_sparse kernels")


def rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def case(b, s, hi, d, h, k, device, seed=0):
    """Indexer q, w, k; absorbed q_abs, kv at the layers' scales; ascending causal ids, -1 padded, query 3 empty."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(device)

    ids = torch.full((b, s, k), -1, dtype=torch.int32)
    for bb in range(b):
        for t in range(s):
            n = 0 if t == 3 else min(t + 1, k)
            ids[bb, t, :n] = torch.randperm(t + 1, generator=g)[:n].sort().values.int()
    return (randn(b, s, hi, d), randn(b, s, hi, scale=(hi * d) ** -0.5), randn(b, s, d),
            randn(b, s, h, 576, scale=0.05), randn(b, s, 576), ids.to(device))


# --- CPU -----------------------------------------------------------------------------------------

def test_cuda_has_its_own_kernels_and_cpu_keeps_the_pytorch_path():
    for op in ("spartron::kl_sparse_target", "spartron::kl_selected_scores", "spartron::kl_selected_scores_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    q, w, k, q_abs, kv, ids = case(1, 9, 3, 16, 2, 4, "cpu")
    assert torch.equal(indexer_kl.sparse_attention_target(q_abs, kv, 0.3, ids),
                       indexer_kl._reference_target(q_abs, kv, ids, 0.3, 9))
    assert torch.equal(indexer_kl.selected_index_scores(q, w, k, ids), indexer_kl._reference_scores(q, w, k, ids, 9))


@pytest.mark.parametrize("call, message", [
    (lambda: indexer_kl_triton.target(torch.zeros(1, 2, 4, 320, dtype=torch.bfloat16),
                                      torch.zeros(1, 2, 320, dtype=torch.bfloat16),
                                      torch.zeros(1, 2, 2, dtype=torch.int32), 0.1),
     "the attention rows must be 512 latent \\+ 64 rope = 576 wide .absorbed MLA.; got 320"),
    (lambda: indexer_kl_triton.target(torch.zeros(1, 2, 4, 576), torch.zeros(1, 2, 576),
                                      torch.zeros(1, 2, 2, dtype=torch.int32), 0.1),
     "q_abs must be bfloat16 or float16; got torch.float32"),
    (lambda: indexer_kl_triton.selected_scores(torch.zeros(1, 2, 4, 24, dtype=torch.bfloat16), torch.zeros(1, 2, 4),
                                               torch.zeros(1, 2, 24, dtype=torch.bfloat16),
                                               torch.zeros(1, 2, 2, dtype=torch.int32)),
     "index_head_dim must be a power of two in 16..256; got 24"),
    (lambda: indexer_kl_triton.selected_scores(torch.zeros(1, 2, 65, 32, dtype=torch.bfloat16), torch.zeros(1, 2, 65),
                                               torch.zeros(1, 2, 32, dtype=torch.bfloat16),
                                               torch.zeros(1, 2, 2, dtype=torch.int32)),
     "at most 64 index heads; got 65"),
    (lambda: indexer_kl_triton.selected_scores_backward(
        torch.zeros(1, 2, 2), torch.zeros(1, 2, 4, 32, dtype=torch.bfloat16), torch.zeros(1, 2, 4),
        torch.zeros(1, 2, 32, dtype=torch.float16), torch.zeros(1, 2, 2, dtype=torch.int32)),
     "the indexer's k .torch.float16. must match its q .torch.bfloat16."),
])
def test_kernel_limits_are_errors_naming_the_limit(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- GPU -----------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("b, s, hi, d, h, k", [(1, 70, 32, 128, 16, 64), (2, 50, 3, 16, 5, 24),
                                               (1, 300, 8, 64, 20, 100)])
def test_kernels_match_the_pytorch_path(b, s, hi, d, h, k):
    q, w, k_, q_abs, kv, ids = case(b, s, hi, d, h, k, "cuda")
    target = indexer_kl.sparse_attention_target(q_abs, kv, 0.3, ids)
    ref_target = indexer_kl._reference_target(q_abs, kv, ids, 0.3, 64)
    assert target.dtype == torch.float32 and rel(target, ref_target) < 1e-4
    assert bool((target[ids < 0] == 0).all()) and bool((target[:, 3] == 0).all())  # padding and the empty query
    sums = target.sum(-1)
    assert torch.allclose(sums[:, torch.arange(s, device="cuda") != 3], torch.ones((), device="cuda"), atol=1e-5)

    q, w, k_ = (t.requires_grad_() for t in (q, w, k_))
    scores = indexer_kl.selected_index_scores(q, w, k_, ids)
    ref_scores = indexer_kl._reference_scores(q.detach(), w.detach(), k_.detach(), ids, 64)
    finite = torch.isfinite(ref_scores)
    assert torch.equal(torch.isfinite(scores), finite) and rel(scores[finite], ref_scores[finite]) < 1e-4
    grad = torch.randn(ids.shape, device="cuda").masked_fill(~finite, 0.0)
    scores.backward(grad)
    ref = indexer_kl._reference_scores_backward(grad, q.detach(), w.detach(), k_.detach(), ids, 64, False)
    for got, want in zip((q.grad, w.grad, k_.grad), ref, strict=True):
        assert torch.isfinite(got).all() and rel(got, want) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_deterministic_key_gradient_keeps_the_fixed_point_path_on_cuda():
    q, w, k_, _, _, ids = case(1, 80, 32, 128, 16, 48, "cuda")
    grad = torch.randn(ids.shape, device="cuda").masked_fill(ids < 0, 0.0)
    got = torch.ops.spartron.kl_selected_scores_backward(grad, q, w, k_, ids, 16, True)
    want = indexer_kl._reference_scores_backward(grad, q, w, k_, ids, 16, True)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)
