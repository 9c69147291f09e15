"""spartron::sparse_mla: forward / backward against dense attention with the equivalent mask."""

from __future__ import annotations

import pytest
import torch

from spartron.layers.attention.sparse_mla import sparse_mla


def _case(b=2, s_q=7, s_kv=9, h=3, d=6, k=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, h, d, generator=g, dtype=dtype)
    kv = torch.randn(b, s_kv, d, generator=g, dtype=dtype)
    ids = torch.stack([torch.stack([torch.randperm(s_kv, generator=g)[:k] for _ in range(s_q)])
                       for _ in range(b)]).to(torch.int32)
    ids[0, 0, 1:] = -1  # partly empty row
    ids[1, 2, :] = -1  # fully empty row
    ids[1, 3, 0] = s_kv  # out of range counts as empty
    return q, kv, ids


def _dense_reference(q, kv, ids, scale, d_v):
    """Attention over all keys with a boolean mask built from the ids (plain softmax)."""
    b, s_q, h, _ = q.shape
    s_kv = kv.shape[1]
    mask = torch.zeros(b, s_q, s_kv + 1, dtype=torch.bool)
    mask.scatter_(-1, torch.where((ids >= 0) & (ids < s_kv), ids, s_kv).long(), True)
    mask = mask[..., :s_kv]
    scores = torch.einsum("bthd,bsd->bhts", q, kv) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    out = torch.einsum("bhts,bsv->bthv", probs, kv[..., :d_v])
    return out, lse.transpose(1, 2)


def test_forward_and_lse_match_dense_masked_attention():
    q, kv, ids = _case()
    out, lse = sparse_mla(q, kv, ids, 0.7, 4, chunk_size=3)
    ref_out, ref_lse = _dense_reference(q, kv, ids, 0.7, 4)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    assert torch.all(out[1, 2] == 0) and torch.all(torch.isneginf(lse[1, 2]))


def test_gradients_match_dense_masked_attention():
    q, kv, ids = _case()
    grad_out = torch.randn(2, 7, 3, 4, dtype=torch.float64)
    q1, kv1 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    (sparse_mla(q1, kv1, ids, 0.7, 4, chunk_size=2)[0] * grad_out).sum().backward()
    q2, kv2 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    (_dense_reference(q2, kv2, ids, 0.7, 4)[0] * grad_out).sum().backward()
    torch.testing.assert_close(q1.grad, q2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kv1.grad, kv2.grad, rtol=1e-10, atol=1e-12)


def test_fp64_gradcheck_out_and_lse():
    q, kv, ids = _case(s_q=5, s_kv=6, h=2, d=5, k=3)
    q.requires_grad_()
    kv.requires_grad_()

    def fn(q, kv):
        out, lse = sparse_mla(q, kv, ids, 0.9, 3, chunk_size=2)
        return out, lse.nan_to_num(neginf=0.0)  # an empty row's -inf has no finite difference

    assert torch.autograd.gradcheck(fn, (q, kv))


def test_chunk_size_changes_nothing():
    q, kv, ids = _case(dtype=torch.float32)
    a = sparse_mla(q, kv, ids, 0.5, 6, chunk_size=1)
    b = sparse_mla(q, kv, ids, 0.5, 6, chunk_size=100)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bfloat16_accumulates_in_float32():
    q, kv, ids = _case(dtype=torch.float64)
    out, lse = sparse_mla(q.bfloat16(), kv.bfloat16(), ids, 0.7, 4)
    ref, _ = _dense_reference(q.bfloat16().double(), kv.bfloat16().double(), ids, 0.7, 4)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_opcheck_fake_and_autograd_registration():
    q, kv, ids = _case(b=2, s_q=4, s_kv=4, h=2, d=3, k=2)
    q.requires_grad_()
    kv.requires_grad_()
    for deterministic in (False, True):
        torch.library.opcheck(torch.ops.spartron.sparse_mla.default, (q, kv, ids, 0.7, 2, 2, deterministic))


@pytest.mark.parametrize("change, message", [
    (lambda q, kv, ids: (q, kv, ids.long()), "topk_ids must be int32"),
    (lambda q, kv, ids: (q, kv[..., :-1], ids), "must match q"),
    (lambda q, kv, ids: (q, kv, ids[:, :-1]), "must match q"),
    (lambda q, kv, ids: (q.float(), kv, ids), "must share a dtype"),
    (lambda q, kv, ids: (q[0], kv, ids), "expects q"),
])
def test_bad_inputs_are_rejected(change, message):
    q, kv, ids = _case()
    with pytest.raises(ValueError, match=message):
        sparse_mla(*change(q, kv, ids), 0.7, 4)


def test_value_dim_must_fit_the_latent():
    q, kv, ids = _case()
    with pytest.raises(ValueError, match="d_v 7 must be in 1..6"):
        sparse_mla(q, kv, ids, 0.7, 7)


def _cp_op_parity(rank, world):
    """The CP layout at the op: local (load-balanced) queries with global-position ids attend over the
    all-gathered kv; out, lse and dq equal the CP=1 rows, and the gather's backward sums dkv into each
    rank's own kv shard, equal to CP=1's; the indexer picks the CP=1 ids of the local queries."""
    import torch.distributed as dist

    from spartron.layers.attention.context_parallel import gather_sequence, local_positions, shard_sequence
    from spartron.layers.attention.indexer_topk import indexer_topk

    group = dist.new_group(list(range(world)))
    s = 16
    q, kv, _ = _case(b=2, s_q=s, s_kv=s, h=3, d=6, k=4, seed=5)
    pos = torch.arange(s)
    g = torch.Generator().manual_seed(6)
    iq, ik, iw = (torch.randn(2, s, 2, 8, generator=g, dtype=torch.float64), torch.randn(2, s, 8, generator=g,
                  dtype=torch.float64), torch.randn(2, s, 2, generator=g, dtype=torch.float64))
    ids = indexer_topk(iq, iw, ik, pos, pos, 5)
    go = torch.randn(2, s, 3, 4, generator=g, dtype=torch.float64)
    q1, kv1 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out1, lse1 = sparse_mla(q1, kv1, ids, 0.7, 4, chunk_size=3)
    (out1 * go).sum().backward()

    local = local_positions(s, world, rank)
    ids_r = indexer_topk(shard_sequence(iq, world, rank), shard_sequence(iw, world, rank),
                         gather_sequence(shard_sequence(ik, world, rank), group), local, pos, 5)
    assert torch.equal(ids_r, shard_sequence(ids, world, rank))
    q_r = shard_sequence(q, world, rank).requires_grad_()
    kv_r = shard_sequence(kv, world, rank).requires_grad_()
    out_r, lse_r = sparse_mla(q_r, gather_sequence(kv_r, group), ids_r, 0.7, 4, chunk_size=3)
    (out_r * shard_sequence(go, world, rank)).sum().backward()
    torch.testing.assert_close(out_r, shard_sequence(out1, world, rank), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_r, shard_sequence(lse1, world, rank), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(q_r.grad, shard_sequence(q1.grad, world, rank), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kv_r.grad, shard_sequence(kv1.grad, world, rank), rtol=1e-10, atol=1e-12)
    return True


def test_cp2_equals_cp1_at_the_op():
    from spartron.testing import run_distributed

    assert run_distributed(_cp_op_parity, 2, timeout=60) == [True, True]
