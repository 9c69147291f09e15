"""Triton kernels behind `spartron::sparse_mla` on CUDA (absorbed MLA: 512 latent + 64 RoPE, one KV head).

Imports triton at module level: import it only through `sparse_mla_triton`, which checks that triton
is installed first. One program handles one query token and a block of BH heads, and walks that
token's K selected ids in blocks of BK, gathering the kv rows by id (an invalid id loads zeros and
scores -inf). Scores use exp2 with log2(e) folded into the scale; lse is returned in natural log.

Backward recomputes P from the saved lse and takes Delta = rowsum(dO * O) - dlse from `delta_kernel`
(one read of the bf16 rows, no float32 copies). It adds dkv rows into a float32 buffer with relaxed
atomics (order-dependent rounding: not bitwise deterministic), or, with FIXED > 0 (the deterministic
mode, FIXED = 2^fraction bits), into an int64 fixed-point buffer. The latent is handled as four
column chunks of 128 so that each dkv chunk is a small register tile, added and dropped at once.
With KEY_ROWS (the 16-row head block) a dkv chunk is the [keys, columns] tile dS^T q_c + P^T dO_c,
which leaves room to pipeline the gathers; Triton moves it through shared memory into a 4-column
layout for its v4 adds, and that pays: a warp's adds then cover whole 128-byte lines, where red.v2
straight from the MMA layout covers 32-byte pieces of 8 rows, which the L2 takes far slower.
Otherwise (the 64-row three walks) it is computed transposed (q_c^T dS, dO_c^T P), so that q and dO
are only ever the A operand and sit in shared memory once.
Two schedules (WALKS): one walk keeps dq in registers and adds dkv per block (the 16-row head
block); three walks (the 64-row block) first write P and dS to a per-program scratch, then add dkv
from it, then regather K for dq. Why three: Triton gives any dot whose result reaches another dot
(an accumulator chain counts) a rows-only warp layout, so on 8 warps both warpgroups would compute
the whole 64-row S and dP tiles and a single walk spills. In the first of three walks S and dP are
sums of separate chunk products (fma, so Triton does not fold them into one chain) with no dot
downstream, so they keep the warpgroup-split layout. The 64-row forward is the Gluon kernel
(sparse_mla_gluon_kernels.py); the Triton forward here serves 16-row blocks (and 64-row blocks off
Hopper), with q and the gathered rows in the backward's four latent chunks and rope part. The measurements
behind these choices, and the designs that lost, are in docs/GPU_NOTES.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _used_slots(id_row, topk, s_kv, KP: tl.constexpr):
    """1 + the last slot holding a valid id (0 for none): the walk stops there, so the -1 padding
    that top-k leaves at the end of short rows costs nothing."""
    offs = tl.arange(0, KP)
    ids = tl.load(id_row + offs, mask=offs < topk, other=-1)
    return tl.max(tl.where((ids >= 0) & (ids < s_kv), offs + 1, 0), 0)


@triton.jit
def _work_item(w, ids_ptr, s_q, s_kv, n_heads, topk, BH: tl.constexpr, KP: tl.constexpr):
    """Work item w = one query token (flat b * s_q + t) x one block of BH heads: its q/out rows
    (token * n_heads + head), head mask, id row, used slot count and batch index."""
    n_hb = tl.cdiv(n_heads, BH)
    tok = (w // n_hb).to(tl.int64)
    heads = (w % n_hb) * BH + tl.arange(0, BH)
    id_row = ids_ptr + tok * topk
    return tok * n_heads + heads, heads < n_heads, id_row, _used_slots(id_row, topk, s_kv, KP), tok // s_q


@triton.jit
def _id_block(id_row, k0, topk, s_kv, BK: tl.constexpr):
    """Slots k0 .. k0+BK of an id row: (row index, 0 where invalid, as int64; validity)."""
    kk = k0 + tl.arange(0, BK)
    ids = tl.load(id_row + kk, mask=kk < topk, other=-1)
    valid = (ids >= 0) & (ids < s_kv)
    return tl.where(valid, ids, 0).to(tl.int64), valid


@triton.jit(do_not_specialize=["s_q", "s_kv", "n_heads", "topk"])
def sparse_mla_fwd_kernel(q_ptr, kv_ptr, ids_ptr, out_ptr, lse_ptr, s_q, s_kv, n_heads, topk,
                          scale_log2, BH: tl.constexpr, BK: tl.constexpr, DC: tl.constexpr,
                          DR: tl.constexpr, KP: tl.constexpr):
    D: tl.constexpr = 4 * DC + DR
    hrow, hmask, id_row, n_used, b = _work_item(tl.program_id(0), ids_ptr, s_q, s_kv, n_heads, topk, BH, KP)
    dc = tl.arange(0, DC)
    dr = tl.arange(0, DR)
    q0, q1, q2, q3, qr = _load_kv(q_ptr + hrow[:, None] * D, hmask, dc, dr, DC)

    m = tl.full([BH], -1.0e30, tl.float32)  # finite start: an all-invalid block gives p = 0, no NaN
    denom = tl.zeros([BH], tl.float32)
    acc0 = tl.zeros([BH, DC], tl.float32)
    acc1 = tl.zeros([BH, DC], tl.float32)
    acc2 = tl.zeros([BH, DC], tl.float32)
    acc3 = tl.zeros([BH, DC], tl.float32)
    kv_base = kv_ptr + b * s_kv * D
    for k0 in tl.range(0, n_used, BK):
        safe, valid = _id_block(id_row, k0, topk, s_kv, BK)
        c0, c1, c2, c3, cr = _load_kv(kv_base + safe[:, None] * D, valid, dc, dr, DC)
        s = _scores(q0, q1, q2, q3, qr, c0, c1, c2, c3, cr, False)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        pb = p.to(c0.dtype)
        acc0 = tl.dot(pb, c0, acc0 * alpha[:, None])
        acc1 = tl.dot(pb, c1, acc1 * alpha[:, None])
        acc2 = tl.dot(pb, c2, acc2 * alpha[:, None])
        acc3 = tl.dot(pb, c3, acc3 * alpha[:, None])
        m = m_new

    has = denom > 0.0
    inv = 1.0 / tl.where(has, denom, 1.0)
    out_rows = out_ptr + hrow[:, None] * (4 * DC)
    ty = out_ptr.dtype.element_ty
    tl.store(out_rows + dc[None, :], (acc0 * inv[:, None]).to(ty), mask=hmask[:, None])
    tl.store(out_rows + DC + dc[None, :], (acc1 * inv[:, None]).to(ty), mask=hmask[:, None])
    tl.store(out_rows + 2 * DC + dc[None, :], (acc2 * inv[:, None]).to(ty), mask=hmask[:, None])
    tl.store(out_rows + 3 * DC + dc[None, :], (acc3 * inv[:, None]).to(ty), mask=hmask[:, None])
    lse = tl.where(has, (m + tl.log2(tl.where(has, denom, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + hrow, lse, mask=hmask)


@triton.jit
def delta_kernel(do_ptr, out_ptr, dlse_ptr, delta_ptr, n_rows, DV: tl.constexpr, BR: tl.constexpr):
    """Delta [rows] = rowsum(dO * out) - dlse in float32, reading the bf16 rows once (BR rows a program)."""
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    live = rows < n_rows
    cols = tl.arange(0, DV)
    do = tl.load(do_ptr + rows[:, None] * DV + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    o = tl.load(out_ptr + rows[:, None] * DV + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    dlse = tl.load(dlse_ptr + rows, mask=live, other=0.0)
    tl.store(delta_ptr + rows, tl.sum(do * o, 1) - dlse, mask=live)


@triton.jit
def _atomic_add_dkv(ptrs, part, mask, FIXED: tl.constexpr):
    """Add an fp32 tile into dkv: float atomics, or (FIXED > 0) int64 fixed point in units of 1 / FIXED,
    rounded to nearest; integer addition is associative, so that sum is bitwise reproducible."""
    if FIXED > 0:
        scaled = part * FIXED
        fixed = (scaled + tl.where(scaled >= 0, 0.5, -0.5)).to(tl.int64)
        tl.atomic_add(ptrs, fixed, mask=mask, sem="relaxed")
    else:
        tl.atomic_add(ptrs, part, mask=mask, sem="relaxed")


@triton.jit
def _add_dkv_chunk(dkv_rows, cols, valid, p, ds, do_c, q_c, FIXED: tl.constexpr, KEY_ROWS: tl.constexpr):
    """dkv[rows, cols] += dS^T q_c + P^T dO_c (dS already carries the softmax scale). KEY_ROWS: the tile
    is [keys, cols] as written; otherwise it is computed transposed (q_c^T dS + dO_c^T P), so that q and
    dO are only ever the A operand."""
    if KEY_ROWS:
        part = tl.dot(tl.trans(ds), q_c)
        part = tl.dot(tl.trans(p), do_c, part)
        _atomic_add_dkv(dkv_rows + cols[None, :], part, valid[:, None] & (cols[None, :] >= 0), FIXED)
    else:
        part = tl.dot(tl.trans(q_c), ds)
        part = tl.dot(tl.trans(do_c), p, part)
        _atomic_add_dkv(tl.trans(dkv_rows) + cols[:, None], part, valid[None, :], FIXED)


@triton.jit
def _load_kv(rows, valid, dc, dr, DC: tl.constexpr):
    """The gathered kv rows as four latent chunks and the rope part (zeros where not valid)."""
    k0 = tl.load(rows + dc[None, :], mask=valid[:, None], other=0.0)
    k1 = tl.load(rows + DC + dc[None, :], mask=valid[:, None], other=0.0)
    k2 = tl.load(rows + 2 * DC + dc[None, :], mask=valid[:, None], other=0.0)
    k3 = tl.load(rows + 3 * DC + dc[None, :], mask=valid[:, None], other=0.0)
    kr = tl.load(rows + 4 * DC + dr[None, :], mask=valid[:, None], other=0.0)
    return k0, k1, k2, k3, kr


@triton.jit
def _latent_products(a0, a1, a2, a3, k0, k1, k2, k3, SUMS: tl.constexpr):
    """a K^T over the four latent chunks: one accumulator chain, or (SUMS) a sum of separate chunk
    products (fma, not +: Triton folds dot + x back into the accumulator chain)."""
    if SUMS:
        x = tl.fma(tl.dot(a0, tl.trans(k0)), 1.0, tl.dot(a1, tl.trans(k1)))
        x = tl.fma(tl.dot(a2, tl.trans(k2)), 1.0, x)
        x = tl.fma(tl.dot(a3, tl.trans(k3)), 1.0, x)
    else:
        x = tl.dot(a0, tl.trans(k0))
        x = tl.dot(a1, tl.trans(k1), x)
        x = tl.dot(a2, tl.trans(k2), x)
        x = tl.dot(a3, tl.trans(k3), x)
    return x


@triton.jit
def _scores(q0, q1, q2, q3, qr, k0, k1, k2, k3, kr, SUMS: tl.constexpr):
    """S = q K^T: the latent chunks' products, then the rope part's (see _latent_products)."""
    s = _latent_products(q0, q1, q2, q3, k0, k1, k2, k3, SUMS)
    if SUMS:
        s = tl.fma(tl.dot(qr, tl.trans(kr)), 1.0, s)
    else:
        s = tl.dot(qr, tl.trans(kr), s)
    return s


@triton.jit
def _bwd_probs(q0, q1, q2, q3, qr, do0, do1, do2, do3, k0, k1, k2, k3, kr, valid, lse2, delta, scale,
               scale_log2, SUMS: tl.constexpr):
    """(P, dS * scale) of one key block, both in the inputs' dtype. SUMS: add separate chunk products
    instead of chaining them through the accumulator; Triton gives a dot whose result reaches another
    dot a rows-only warp layout (at 64 rows on 8 warps both warpgroups then compute the whole tile),
    so this keeps S and dP split across the warpgroups when nothing downstream is a dot."""
    s = _scores(q0, q1, q2, q3, qr, k0, k1, k2, k3, kr, SUMS)
    dp = _latent_products(do0, do1, do2, do3, k0, k1, k2, k3, SUMS)
    s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
    p = tl.exp2(s - lse2[:, None])
    ds = (p * (dp - delta[:, None]) * scale).to(k0.dtype)
    return p.to(k0.dtype), ds


@triton.jit
def _bwd_dkv(pb, ds, drows, valid, q0, q1, q2, q3, qr, do0, do1, do2, do3, dc, dr, DC: tl.constexpr,
             FIXED: tl.constexpr, KEY_ROWS: tl.constexpr):
    """dkv[rows] += P^T dO + dS^T q (atomics), one 128-column chunk at a time."""
    _add_dkv_chunk(drows, dc, valid, pb, ds, do0, q0, FIXED, KEY_ROWS)
    _add_dkv_chunk(drows, DC + dc, valid, pb, ds, do1, q1, FIXED, KEY_ROWS)
    _add_dkv_chunk(drows, 2 * DC + dc, valid, pb, ds, do2, q2, FIXED, KEY_ROWS)
    _add_dkv_chunk(drows, 3 * DC + dc, valid, pb, ds, do3, q3, FIXED, KEY_ROWS)
    if KEY_ROWS:
        part = tl.dot(tl.trans(ds), qr)
        _atomic_add_dkv(drows + 4 * DC + dr[None, :], part, valid[:, None] & (dr[None, :] >= 0), FIXED)
    else:
        part = tl.dot(tl.trans(qr), ds)
        _atomic_add_dkv(tl.trans(drows) + 4 * DC + dr[:, None], part, valid[None, :], FIXED)


@triton.jit
def _bwd_item(w, q_ptr, kv_ptr, ids_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, ds_ptr, s_q, s_kv,
              n_heads, topk, scale, scale_log2, BH: tl.constexpr, BK: tl.constexpr, DC: tl.constexpr,
              DR: tl.constexpr, KP: tl.constexpr, FIXED: tl.constexpr, WALKS: tl.constexpr,
              STAGES2: tl.constexpr, KEY_ROWS: tl.constexpr):
    """One work item's dq and dkv contribution. WALKS = 1: one walk; dq accumulates in registers and
    dkv is added per key block. WALKS = 3: the first walk computes P and dS (no dot downstream, so S
    and dP keep the warpgroup-split layout) into this program's scratch tiles [BH, topk]; the second
    adds dkv from them (no gathers); the third regathers K and sums dq = dS K. Each walk holds only
    its own operands, so the register pressure (and the spills) of the single walk are gone."""
    D: tl.constexpr = 4 * DC + DR
    DV: tl.constexpr = 4 * DC
    hrow, hmask, id_row, n_used, b = _work_item(w, ids_ptr, s_q, s_kv, n_heads, topk, BH, KP)
    dc = tl.arange(0, DC)
    dr = tl.arange(0, DR)
    q0, q1, q2, q3, qr = _load_kv(q_ptr + hrow[:, None] * D, hmask, dc, dr, DC)
    do_rows = do_ptr + hrow[:, None] * DV
    do0 = tl.load(do_rows + dc[None, :], mask=hmask[:, None], other=0.0)
    do1 = tl.load(do_rows + DC + dc[None, :], mask=hmask[:, None], other=0.0)
    do2 = tl.load(do_rows + 2 * DC + dc[None, :], mask=hmask[:, None], other=0.0)
    do3 = tl.load(do_rows + 3 * DC + dc[None, :], mask=hmask[:, None], other=0.0)
    lse = tl.load(lse_ptr + hrow, mask=hmask, other=float("-inf"))
    # +inf for an empty query or a padding head: every p becomes exp2(-inf) = 0
    lse2 = tl.where(lse > float("-inf"), lse * 1.4426950408889634, float("inf"))
    delta = tl.load(delta_ptr + hrow, mask=hmask, other=0.0)
    kv_base = kv_ptr + b * s_kv * D
    dkv_base = dkv_ptr + b * s_kv * D
    ks = tl.cdiv(topk, BK) * BK  # scratch row length
    ds_rows = ds_ptr + tl.program_id(0).to(tl.int64) * 2 * BH * ks + tl.arange(0, BH)[:, None] * ks
    p_rows = ds_rows + BH * ks

    dq0 = tl.zeros([BH, DC], tl.float32)
    dq1 = tl.zeros([BH, DC], tl.float32)
    dq2 = tl.zeros([BH, DC], tl.float32)
    dq3 = tl.zeros([BH, DC], tl.float32)
    dqr = tl.zeros([BH, DR], tl.float32)
    for k0 in tl.range(0, n_used, BK):
        safe, valid = _id_block(id_row, k0, topk, s_kv, BK)
        c0, c1, c2, c3, cr = _load_kv(kv_base + safe[:, None] * D, valid, dc, dr, DC)
        pb, ds = _bwd_probs(q0, q1, q2, q3, qr, do0, do1, do2, do3, c0, c1, c2, c3, cr, valid, lse2, delta,
                            scale, scale_log2, WALKS == 3)
        if WALKS == 3:
            tl.store(ds_rows + k0 + tl.arange(0, BK)[None, :], ds)
            tl.store(p_rows + k0 + tl.arange(0, BK)[None, :], pb)
        else:
            dq0 = tl.dot(ds, c0, dq0)
            dq1 = tl.dot(ds, c1, dq1)
            dq2 = tl.dot(ds, c2, dq2)
            dq3 = tl.dot(ds, c3, dq3)
            dqr = tl.dot(ds, cr, dqr)
            _bwd_dkv(pb, ds, dkv_base + safe[:, None] * D, valid, q0, q1, q2, q3, qr, do0, do1, do2, do3, dc, dr,
                     DC, FIXED, KEY_ROWS)
    if WALKS == 3:
        tl.debug_barrier()  # this program's scratch tiles are written before they are read back
        for k0 in tl.range(0, n_used, BK, num_stages=STAGES2):
            safe, valid = _id_block(id_row, k0, topk, s_kv, BK)
            ds = tl.load(ds_rows + k0 + tl.arange(0, BK)[None, :])
            pb = tl.load(p_rows + k0 + tl.arange(0, BK)[None, :])
            _bwd_dkv(pb, ds, dkv_base + safe[:, None] * D, valid, q0, q1, q2, q3, qr, do0, do1, do2, do3, dc, dr,
                     DC, FIXED, KEY_ROWS)
        for k0 in tl.range(0, n_used, BK, num_stages=STAGES2):
            safe, valid = _id_block(id_row, k0, topk, s_kv, BK)
            c0, c1, c2, c3, cr = _load_kv(kv_base + safe[:, None] * D, valid, dc, dr, DC)
            ds = tl.load(ds_rows + k0 + tl.arange(0, BK)[None, :])
            dq0 = tl.dot(ds, c0, dq0)
            dq1 = tl.dot(ds, c1, dq1)
            dq2 = tl.dot(ds, c2, dq2)
            dq3 = tl.dot(ds, c3, dq3)
            dqr = tl.dot(ds, cr, dqr)
        tl.debug_barrier()  # ... and read before the next work item overwrites them

    dq_rows = dq_ptr + hrow[:, None] * D
    ty = dq_ptr.dtype.element_ty
    tl.store(dq_rows + dc[None, :], dq0.to(ty), mask=hmask[:, None])
    tl.store(dq_rows + DC + dc[None, :], dq1.to(ty), mask=hmask[:, None])
    tl.store(dq_rows + 2 * DC + dc[None, :], dq2.to(ty), mask=hmask[:, None])
    tl.store(dq_rows + 3 * DC + dc[None, :], dq3.to(ty), mask=hmask[:, None])
    tl.store(dq_rows + DV + dr[None, :], dqr.to(ty), mask=hmask[:, None])


@triton.jit(do_not_specialize=["s_q", "s_kv", "n_heads", "topk", "n_work"])
def sparse_mla_bwd_kernel(q_ptr, kv_ptr, ids_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, ds_ptr, s_q, s_kv,
                          n_heads, topk, n_work, scale, scale_log2, BH: tl.constexpr, BK: tl.constexpr,
                          DC: tl.constexpr, DR: tl.constexpr, KP: tl.constexpr, FIXED: tl.constexpr,
                          WALKS: tl.constexpr, STAGES2: tl.constexpr, KEY_ROWS: tl.constexpr):
    """With WALKS = 3 the grid is persistent (one program per SM, striding over the n_work items, so
    the scratch is two [BH, topk] tiles per program); with one walk, one program per work item."""
    if WALKS == 3:
        for w in range(tl.program_id(0), n_work, tl.num_programs(0)):
            _bwd_item(w, q_ptr, kv_ptr, ids_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, ds_ptr, s_q, s_kv,
                      n_heads, topk, scale, scale_log2, BH, BK, DC, DR, KP, FIXED, WALKS, STAGES2, KEY_ROWS)
    else:
        _bwd_item(tl.program_id(0), q_ptr, kv_ptr, ids_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, ds_ptr,
                  s_q, s_kv, n_heads, topk, scale, scale_log2, BH, BK, DC, DR, KP, FIXED, WALKS, STAGES2,
                  KEY_ROWS)
