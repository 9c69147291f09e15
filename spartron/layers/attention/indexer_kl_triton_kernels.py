"""Triton kernels behind kl_sparse's two per-slot quantities (indexer_kl.py) on CUDA.

Imports triton at module level: import it only through `indexer_kl_triton`, which checks that triton is
installed first. One program handles one query token and walks its K id slots in blocks of BK, gathering
the selected rows by id (an invalid id loads zeros), so nothing of size [S, K, D] is materialised:
- `kl_target_kernel`: the detached KL target, the main attention's softmax per head over the slots, summed
  over heads and L1-normalised (each head's softmax sums to 1, so the sum is divided by the head count).
  Two walks per head block: the first finds each head's log-sum-exp online, the second sums
  exp(s - lse) over the heads into the output row (only this program writes that row).
- `selected_scores_fwd_kernel`: I_sel[j] = sum_h w[h] ReLU(q[h] . k[ids[j]]), -inf at invalid slots.
- `selected_scores_bwd_kernel`: its gradients, the logits recomputed: dw, dq in registers, and the key
  rows' gradient added into a float32 buffer with relaxed atomics (order-dependent rounding).
Head and slot counts are compile-time constants (fixed per model), so the loops have static bounds.
Products of the 16-bit inputs are exact in the float32 accumulators; the backward's two products with
the float32 dlogits run in tf32 (10-bit mantissa, 3 bits more than bf16; the reference is float32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from spartron.layers.attention.sparse_mla_triton_kernels import _id_block


@triton.jit
def _target_scores(q_lat, q_pe, kv_base, id_row, k0, topk, s_kv, scale_log2, BK: tl.constexpr, DV: tl.constexpr,
                   DR: tl.constexpr):
    """Log2-scaled scores [BH, BK] of slots k0 .. k0+BK (-inf where invalid): the target's two walks."""
    safe, valid = _id_block(id_row, k0, topk, s_kv, BK)
    rows = kv_base + safe[:, None] * (DV + DR)
    s = tl.dot(q_lat, tl.trans(tl.load(rows + tl.arange(0, DV)[None, :], mask=valid[:, None], other=0.0)))
    s = tl.dot(q_pe, tl.trans(tl.load(rows + DV + tl.arange(0, DR)[None, :], mask=valid[:, None], other=0.0)), s)
    return tl.where(valid[None, :], s * scale_log2, float("-inf"))


@triton.jit(do_not_specialize=["s_q", "s_kv"])
def kl_target_kernel(q_ptr, kv_ptr, ids_ptr, out_ptr, s_q, s_kv, scale_log2, n_heads: tl.constexpr,
                     topk: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    b = tok // s_q
    id_row = ids_ptr + tok * topk
    out_row = out_ptr + tok * topk
    dv = tl.arange(0, DV)
    dr = tl.arange(0, DR)
    kv_base = kv_ptr + b * s_kv * (DV + DR)
    inv_heads = 1.0 / n_heads
    for h0 in range(0, n_heads, BH):
        heads = h0 + tl.arange(0, BH)
        hmask = heads < n_heads
        q_rows = q_ptr + (tok * n_heads + heads)[:, None] * (DV + DR)
        q_lat = tl.load(q_rows + dv[None, :], mask=hmask[:, None], other=0.0)
        q_pe = tl.load(q_rows + DV + dr[None, :], mask=hmask[:, None], other=0.0)
        m = tl.full([BH], -1.0e30, tl.float32)  # finite start: an all-invalid block adds 0, no NaN
        denom = tl.zeros([BH], tl.float32)
        for k0 in range(0, topk, BK):
            s = _target_scores(q_lat, q_pe, kv_base, id_row, k0, topk, s_kv, scale_log2, BK, DV, DR)
            m_new = tl.maximum(m, tl.max(s, 1))
            denom = denom * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
            m = m_new
        # +inf for a padding head or a query with no valid slot: every term is exp2(-inf) = 0
        lse2 = tl.where(hmask & (denom > 0.0), m + tl.log2(tl.where(denom > 0.0, denom, 1.0)), float("inf"))
        for k0 in range(0, topk, BK):
            s = _target_scores(q_lat, q_pe, kv_base, id_row, k0, topk, s_kv, scale_log2, BK, DV, DR)
            part = tl.sum(tl.exp2(s - lse2[:, None]), 0) * inv_heads
            kk = k0 + tl.arange(0, BK)
            tl.store(out_row + kk, tl.load(out_row + kk, mask=kk < topk, other=0.0) + part, mask=kk < topk)


@triton.jit
def _index_query(q_ptr, w_ptr, s_q, n_heads: tl.constexpr, HP: tl.constexpr, D: tl.constexpr):
    """This program's token (flat), batch index, padded head range and mask, columns, q [HP, D], w [HP] float32."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HP)
    hmask = heads < n_heads
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + (tok * n_heads + heads)[:, None] * D + cols[None, :], mask=hmask[:, None], other=0.0)
    w = tl.load(w_ptr + tok * n_heads + heads, mask=hmask, other=0.0).to(tl.float32)
    return tok, tok // s_q, heads, hmask, cols, q, w


@triton.jit(do_not_specialize=["s_q", "s_kv"])
def selected_scores_fwd_kernel(q_ptr, w_ptr, k_ptr, ids_ptr, out_ptr, s_q, s_kv, n_heads: tl.constexpr,
                               topk: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BK: tl.constexpr):
    tok, b, heads, hmask, cols, q, w = _index_query(q_ptr, w_ptr, s_q, n_heads, HP, D)
    id_row = ids_ptr + tok * topk
    k_base = k_ptr + b * s_kv * D
    for k0 in range(0, topk, BK):
        safe, valid = _id_block(id_row, k0, topk, s_kv, BK)
        keys = tl.load(k_base + safe[:, None] * D + cols[None, :], mask=valid[:, None], other=0.0)
        logits = tl.dot(q, tl.trans(keys))
        score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0)
        kk = k0 + tl.arange(0, BK)
        tl.store(out_ptr + tok * topk + kk, tl.where(valid, score, float("-inf")), mask=kk < topk)


@triton.jit(do_not_specialize=["s_q", "s_kv"])
def selected_scores_bwd_kernel(grad_ptr, q_ptr, w_ptr, k_ptr, ids_ptr, dq_ptr, dw_ptr, dk_ptr, s_q, s_kv,
                               n_heads: tl.constexpr, topk: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                               BK: tl.constexpr):
    tok, b, heads, hmask, cols, q, w = _index_query(q_ptr, w_ptr, s_q, n_heads, HP, D)
    q32 = q.to(tl.float32)
    id_row = ids_ptr + tok * topk
    k_base = k_ptr + b * s_kv * D
    dk_base = dk_ptr + b * s_kv * D
    dq = tl.zeros([HP, D], tl.float32)
    dw = tl.zeros([HP], tl.float32)
    for k0 in range(0, topk, BK):
        safe, valid = _id_block(id_row, k0, topk, s_kv, BK)
        kk = k0 + tl.arange(0, BK)
        g = tl.load(grad_ptr + tok * topk + kk, mask=valid & (kk < topk), other=0.0).to(tl.float32)
        keys = tl.load(k_base + safe[:, None] * D + cols[None, :], mask=valid[:, None], other=0.0)
        logits = tl.dot(q, tl.trans(keys))
        positive = logits > 0.0
        dw += tl.sum(tl.where(positive, logits, 0.0) * g[None, :], 1)
        dlogits = tl.where(positive, w[:, None] * g[None, :], 0.0)
        dq = tl.dot(dlogits, keys.to(tl.float32), dq, input_precision="tf32")
        dk = tl.dot(tl.trans(dlogits), q32, input_precision="tf32")
        tl.atomic_add(dk_base + safe[:, None] * D + cols[None, :], dk, mask=valid[:, None], sem="relaxed")
    tl.store(dq_ptr + (tok * n_heads + heads)[:, None] * D + cols[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=hmask[:, None])
    tl.store(dw_ptr + tok * n_heads + heads, dw.to(dw_ptr.dtype.element_ty), mask=hmask)
