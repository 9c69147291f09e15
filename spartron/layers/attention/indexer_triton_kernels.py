"""Triton kernel behind `spartron::indexer_topk` on CUDA: lightning-indexer scores of one query chunk.

Imports triton at module level: import it only through `indexer_triton`, which checks that triton is
installed first. One program scores a [BM queries, BN keys] tile: it keeps the BN key rows on chip and
walks the heads, one [BM, d] x [d, BN] MMA per head, folding ReLU and the head weight into an fp32
[BM, BN] accumulator, so the [S, H, S_kv] per-head logits never exist. A tile whose every key lies
after every query (by position) stores -inf without loading anything. FP8: q and k arrive as e4m3
with their scales folded in by the caller (per (query, head) into the weights, per key in `k_scale`,
applied once per tile: ReLU commutes with a positive scale).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["s_q", "s_kv", "q_start", "c_len", "n_cols"])
def indexer_scores_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, qpos_ptr, kpos_ptr, out_ptr, s_q, s_kv, q_start, c_len, n_cols,
                          H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          HAS_KSCALE: tl.constexpr, STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < c_len
    nmask = rn < n_cols  # the first n_cols keys (a prefix holding every visible one)
    qpos = tl.load(qpos_ptr + q_start + rm, mask=mmask, other=-1)
    kpos = tl.load(kpos_ptr + rn, mask=nmask, other=2147483647)
    out_ptrs = out_ptr + (b * c_len + rm)[:, None].to(tl.int64) * n_cols + rn[None, :]
    omask = mmask[:, None] & nmask[None, :]
    if tl.min(kpos, 0) > tl.max(qpos, 0):  # no key of the tile is visible to any query of it
        tl.store(out_ptrs, tl.full([BM, BN], float("-inf"), tl.float32), mask=omask)
    else:
        d = tl.arange(0, D)
        k_tile = tl.load(k_ptr + (b * s_kv + rn)[:, None] * D + d[None, :], mask=nmask[:, None], other=0.0)
        k_t = tl.trans(k_tile)
        tok = b * s_q + q_start + rm  # flat query row
        q_rows = q_ptr + (tok * H)[:, None] * D + d[None, :]
        w_rows = w_ptr + tok * H
        acc = tl.zeros([BM, BN], tl.float32)
        for h in tl.range(0, H, num_stages=STAGES):
            qh = tl.load(q_rows + h * D, mask=mmask[:, None], other=0.0)
            wh = tl.load(w_rows + h, mask=mmask, other=0.0)
            s = tl.dot(qh, k_t)
            acc += tl.maximum(s, 0.0) * wh[:, None]
        if HAS_KSCALE:
            acc = acc * tl.load(ks_ptr + b * s_kv + rn, mask=nmask, other=0.0)[None, :]
        acc = tl.where(kpos[None, :] <= qpos[:, None], acc, float("-inf"))
        tl.store(out_ptrs, acc, mask=omask)
