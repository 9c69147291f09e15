"""Triton radix select behind the indexer's top-k on CUDA: the exact top-k of each score row's visible keys.

Imports triton at module level: import it only through `indexer_triton`, which checks that triton is
installed first. One program takes one query row and reads only its visible columns [lo, hi) (a
causal prefix, or a packed document's range). fp32 scores become order-preserving int32 keys
(-0.0 read as +0.0, -inf = not visible); four 8-bit digit passes (tl.histogram over the keys that
match the digits found so far) find the k-th largest key exactly; a compaction pass then writes the
ids of keys above it, plus the lowest-id keys equal to it until k are written, in ascending key
order, and pads the row with -1. That is `indexer_topk.topk_ids`'s rule, so both give the same ids
on the same scores. A row that fits one block (SINGLE) is loaded once and kept in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_keys(row_ptr, start, lo, hi, BLOCK: tl.constexpr):
    """Columns start..start+BLOCK: (cols, order-preserving int32 keys, visible and finite)."""
    cols = start + tl.arange(0, BLOCK)
    inside = (cols >= lo) & (cols < hi)
    x = tl.load(row_ptr + cols, mask=inside, other=float("-inf"))
    valid = inside & (x > float("-inf"))
    bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))
    return cols, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), valid


@triton.jit
def _digit_hist(key, valid, thr, SHIFT: tl.constexpr):
    """Histogram of the 8-bit digit at SHIFT (unsigned order: the top digit's sign bit flipped) over the
    valid keys whose higher digits equal thr's."""
    d = (key >> SHIFT) & 0xFF
    if SHIFT == 24:
        return tl.histogram(d ^ 0x80, 256, mask=valid)
    return tl.histogram(d, 256, mask=valid & (((key ^ thr) >> (SHIFT + 8)) == 0))


@triton.jit
def _pick_digit(hist, k_rem, thr, SHIFT: tl.constexpr):
    """The digit holding the k_rem-th largest remaining key: (k_rem within that digit, thr with it set)."""
    bins = tl.arange(0, 256)
    suffix = tl.cumsum(hist, 0, reverse=True)  # keys at or above each digit
    d = tl.max(tl.where(suffix >= k_rem, bins, 0), 0)
    k_rem = k_rem - tl.sum(tl.where(bins > d, hist, 0), 0)
    if SHIFT == 24:
        d = d ^ 0x80
    return k_rem, thr | (d << SHIFT)


@triton.jit
def _take(key, valid, thr, k_rem, eq_seen):
    """Keys above thr, and the first k_rem keys equal to it (eq_seen equal ones came before)."""
    eq = valid & (key == thr)
    rank = tl.cumsum(eq.to(tl.int32), 0) + eq_seen
    return (valid & (key > thr)) | (eq & (rank <= k_rem)), tl.sum(eq.to(tl.int32), 0)


@triton.jit(do_not_specialize=["n_rows", "row0", "n_cols", "q_start", "s_q", "kk"])
def radix_topk_kernel(scores_ptr, qpos_ptr, qstart_ptr, ids_ptr, n_rows, row0, n_cols, stride, q_start, s_q, kk,
                      RANGED: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr,
                      SINGLE: tl.constexpr, KP: tl.constexpr):
    """Rows row0.. of scores [B, n_rows, stride] (the first n_cols columns; row r is query q_start + r) ->
    ids [B, s_q, kk] int32. RANGED: key s is column s, visible columns [q_starts[b, t] (HAS_STARTS) or 0,
    q_positions[t] + 1), and a SINGLE block must hold that range; otherwise every column is read and -inf
    marks the invisible ones."""
    r = row0 + tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    t = q_start + r
    row_ptr = scores_ptr + (b * n_rows + r) * stride
    ids_row = ids_ptr + (b * s_q + t) * kk
    lo = tl.full((), 0, tl.int32)
    hi = tl.full((), 0, tl.int32) + n_cols
    if RANGED:
        hi = tl.minimum(tl.load(qpos_ptr + t) + 1, hi)
        if HAS_STARTS:
            lo = tl.maximum(tl.load(qstart_ptr + b * s_q + t), lo)
    thr = tl.full((), 0, tl.int32)
    if SINGLE:  # the row fits one block: load once, keep in registers
        cols, key, valid = _load_keys(row_ptr, lo, lo, hi, BLOCK)
        k_rem = tl.minimum(tl.sum(valid.to(tl.int32), 0), kk)
        for i in tl.static_range(4):
            k_rem, thr = _pick_digit(_digit_hist(key, valid, thr, 24 - 8 * i), k_rem, thr, 24 - 8 * i)
        take, _ = _take(key, valid, thr, k_rem, 0)
        tl.store(ids_row + tl.cumsum(take.to(tl.int32), 0) - 1, cols, mask=take)
        n_taken = tl.sum(take.to(tl.int32), 0)
    else:  # several blocks: every pass reads the row again (from L2 while it stays there)
        n_valid = tl.full((), 0, tl.int32)
        hist = tl.zeros([256], tl.int32)
        start = lo
        while start < hi:
            cols, key, valid = _load_keys(row_ptr, start, lo, hi, BLOCK)
            n_valid += tl.sum(valid.to(tl.int32), 0)
            hist += _digit_hist(key, valid, thr, 24)
            start += BLOCK
        k_rem, thr = _pick_digit(hist, tl.minimum(n_valid, kk), thr, 24)
        for i in tl.static_range(1, 4):
            hist = tl.zeros([256], tl.int32)
            start = lo
            while start < hi:
                cols, key, valid = _load_keys(row_ptr, start, lo, hi, BLOCK)
                hist += _digit_hist(key, valid, thr, 24 - 8 * i)
                start += BLOCK
            k_rem, thr = _pick_digit(hist, k_rem, thr, 24 - 8 * i)
        n_taken = tl.full((), 0, tl.int32)
        eq_seen = tl.full((), 0, tl.int32)
        start = lo
        while start < hi:
            cols, key, valid = _load_keys(row_ptr, start, lo, hi, BLOCK)
            take, n_eq = _take(key, valid, thr, k_rem, eq_seen)
            tl.store(ids_row + n_taken + tl.cumsum(take.to(tl.int32), 0) - 1, cols, mask=take)
            n_taken += tl.sum(take.to(tl.int32), 0)
            eq_seen += n_eq
            start += BLOCK
    slots = tl.arange(0, KP)
    tl.store(ids_row + slots, tl.full([KP], -1, tl.int32), mask=(slots >= n_taken) & (slots < kk))
