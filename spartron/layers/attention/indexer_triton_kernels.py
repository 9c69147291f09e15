"""Triton kernels behind `spartron::indexer_topk` on CUDA: lightning-indexer scores of one query chunk,
and the fp8 row quantisation of its operands.

Imports triton at module level: import it only through `indexer_triton`, which checks that triton is
installed first. One program scores a [BM queries, BN keys] tile: it keeps the BN key rows on chip and
walks the heads, one [BM, d] x [d, BN] MMA per head, folding ReLU and the head weight into an fp32
[BM, BN] accumulator, so the [S, H, S_kv] per-head logits never exist. A tile with no key visible to
any of its queries (by position, and document start with q_starts) loads nothing and stores nothing,
-inf, or -inf unless the device flag `ranged` is set (key s is column s: the top-k reads each row's
visible range only): the kernel's DEAD modes. FP8: q and k arrive as e4m3
with their scales folded in by the caller (per (query, head) into the weights, per key in `k_scale`,
applied once per tile: ReLU commutes with a positive scale). Each head's q tile is re-read from L2 by
every key tile of its query block, so BN sets the q operand's reuse (BN flops per byte loaded).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["s_q", "s_kv", "q_start", "c_len", "n_cols", "dead_mode"])
def indexer_scores_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, qpos_ptr, kpos_ptr, qstart_ptr, ranged_ptr, out_ptr, s_q,
                          s_kv, q_start, c_len, n_cols, stride, dead_mode, H: tl.constexpr, D: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, HAS_KSCALE: tl.constexpr, HAS_STARTS: tl.constexpr,
                          PAIRS: tl.constexpr, STAGES: tl.constexpr, LIVE: tl.constexpr):
    """LIVE: score the tiles some query of them sees. dead_mode, for the tiles no query of them sees: 0
    leaves them unwritten, 1 stores -inf, 2 stores -inf when the device flag at ranged_ptr is 0 (keys not
    at their columns: the top-k then reads whole rows). The op scores with (LIVE, 0) before the flag
    exists, then fills with (not LIVE, 2): its first launch waits on no other device work. (A runtime
    mode, not a constexpr: with the dead branch empty, ptxas spilled the head loop.)"""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < c_len
    nmask = rn < n_cols  # the first n_cols keys (every visible one)
    qpos = tl.load(qpos_ptr + q_start + rm, mask=mmask, other=-1).to(tl.int32)
    kpos = tl.load(kpos_ptr + rn, mask=nmask, other=2147483647).to(tl.int32)
    dead = tl.min(kpos, 0) > tl.max(qpos, 0)  # no key of the tile at or before any query of it
    if HAS_STARTS:  # packed documents: key positions >= the query's document start
        qstart = tl.load(qstart_ptr + b * s_q + q_start + rm, mask=mmask, other=2147483647).to(tl.int32)
        dead = dead | (tl.max(tl.where(nmask, kpos, -1), 0) < tl.min(qstart, 0))
    # the output tile's base as a scalar, its [BM, BN] offsets in int32 and made only where stored: a
    # pointer tensor live across the head loop would hold 2 registers per element (the loop spilled)
    out_tile = out_ptr + (b * c_len + pid_m * BM) * stride + pid_n * BN
    omask = mmask[:, None] & nmask[None, :]
    if dead:
        o_off = tl.arange(0, BM)[:, None] * stride + tl.arange(0, BN)[None, :]
        if dead_mode == 2:
            fill = tl.load(ranged_ptr) == 0
        else:
            fill = dead_mode == 1
        if fill:
            tl.store(out_tile + o_off, tl.full([BM, BN], float("-inf"), tl.float32), mask=omask)
    elif LIVE:
        d = tl.arange(0, D)
        k_tile = tl.load(k_ptr + (b * s_kv + rn)[:, None] * D + d[None, :], mask=nmask[:, None], other=0.0)
        k_t = tl.trans(k_tile)
        tok0 = b * s_q + q_start + pid_m * BM  # the tile's first flat query row
        q_rows = q_ptr + tok0 * H * D + (tl.arange(0, BM) * (H * D))[:, None] + d[None, :]  # int32 offsets
        w_rows = w_ptr + tok0 * H + tl.arange(0, BM) * H
        acc = tl.zeros([BM, BN], tl.float32)
        if PAIRS:  # two heads a step: the second MMA can run while the first one's ReLU and weight apply
            for h in tl.range(0, H, 2, num_stages=STAGES):
                q0 = tl.load(q_rows + h * D, mask=mmask[:, None], other=0.0)
                q1 = tl.load(q_rows + (h + 1) * D, mask=mmask[:, None], other=0.0)
                w0 = tl.load(w_rows + h, mask=mmask, other=0.0)
                w1 = tl.load(w_rows + h + 1, mask=mmask, other=0.0)
                s0 = tl.dot(q0, k_t)
                s1 = tl.dot(q1, k_t)
                acc += tl.maximum(s0, 0.0) * w0[:, None]
                acc += tl.maximum(s1, 0.0) * w1[:, None]
        else:
            for h in tl.range(0, H, num_stages=STAGES):
                qh = tl.load(q_rows + h * D, mask=mmask[:, None], other=0.0)
                wh = tl.load(w_rows + h, mask=mmask, other=0.0)
                s = tl.dot(qh, k_t)
                acc += tl.maximum(s, 0.0) * wh[:, None]
        if HAS_KSCALE:
            acc = acc * tl.load(ks_ptr + b * s_kv + rn, mask=nmask, other=0.0)[None, :]
        visible = kpos[None, :] <= qpos[:, None]
        if HAS_STARTS:
            visible = visible & (kpos[None, :] >= qstart[:, None])
        o_off = tl.arange(0, BM)[:, None] * stride + tl.arange(0, BN)[None, :]
        tl.store(out_tile + o_off, tl.where(visible, acc, float("-inf")), mask=omask)


@triton.jit
def fp8_rows_kernel(x_ptr, w_ptr, x8_ptr, scale_ptr, w_out_ptr, n_rows, D: tl.constexpr, BR: tl.constexpr,
                    HAS_W: tl.constexpr):
    """Rows of x [n_rows, D] -> e4m3 x / scale and scale = max(amax * fp32(1 / 448), tiny) (IEEE division of
    x, as indexer_fp8.quantize_fp8 does); HAS_W: also w_out = w * scale (the query scales folded into the
    head weights)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < n_rows
    d = tl.arange(0, D)
    ptrs = rows.to(tl.int64)[:, None] * D + d[None, :]
    x = tl.load(x_ptr + ptrs, mask=rmask[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.maximum(amax * (1.0 / 448.0), 1.1754943508222875e-38)
    x8 = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], [BR, D])).to(tl.float8e4nv)
    tl.store(x8_ptr + ptrs, x8, mask=rmask[:, None])
    tl.store(scale_ptr + rows, scale, mask=rmask)
    if HAS_W:
        w = tl.load(w_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(w_out_ptr + rows, w * scale, mask=rmask)
