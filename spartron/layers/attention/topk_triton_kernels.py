"""Triton radix select behind the indexer's top-k on CUDA: the exact top-k of each score row's visible keys.

Imports triton at module level: import it only through `indexer_triton`, which checks that triton is
installed first. One program takes one query row and reads only its visible columns [lo, hi) (a
causal prefix, or a packed document's range). fp32 scores become order-preserving int32 keys
(-0.0 read as +0.0, -inf = not visible) and the k-th largest key is found exactly: a row that fits
one block (SINGLE) is loaded once, kept in registers and searched bit by bit (32 counting passes); a
longer row is streamed through four 8-bit digit passes (tl.histogram over the keys that match the
digits found so far). A compaction pass then writes the ids of keys above it, plus the lowest-id keys
equal to it until k are written, in ascending key order, and pads the row with -1. That is
`indexer_topk.topk_ids`'s rule, so both give the same ids on the same scores.
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
def _search_bits(key, k, thr, HI: tl.constexpr, LO: tl.constexpr):
    """Bits HI..LO of the largest T (its higher bits as in thr) with at least k keys >= T: one counting
    pass per bit (two operations per key)."""
    for bit in tl.static_range(HI, LO - 1, -1):
        cand = thr + (1 << bit)
        thr = tl.where(tl.sum((key >= cand).to(tl.int32), 0) >= k, cand, thr)
    return thr


@triton.jit
def _kth_key(key, k, scratch_row, CAND: tl.constexpr):
    """The k-th largest key (keys at INT_MIN are never counted; k = 0 gives INT_MAX), bit by bit from the
    top: cheaper than tl.histogram's ballots for a row held on chip. CAND > 0: after the top 16 bits
    the keys sharing them (a few dozen on real scores) are compacted into scratch_row and the low 16
    bits are searched there when at most CAND of them, else over the whole row."""
    zero = tl.full((), 0, tl.int32)
    thr = tl.where(tl.sum((key >= 0).to(tl.int32), 0) >= k, zero, zero - 2147483647 - 1)
    if CAND == 0:
        return _search_bits(key, k, thr, 30, 0)
    thr = _search_bits(key, k, thr, 30, 16)
    same = (key >> 16) == (thr >> 16)
    n_same = tl.sum(same.to(tl.int32), 0)
    if n_same <= CAND:
        k_in = k - tl.sum(((key >> 16) > (thr >> 16)).to(tl.int32), 0)
        tl.store(scratch_row + tl.cumsum(same.to(tl.int32), 0) - 1, key, mask=same)
        tl.debug_barrier()
        slots = tl.arange(0, CAND)
        few = tl.load(scratch_row + slots, mask=slots < n_same, other=zero - 2147483647 - 1)
        thr = _search_bits(few, k_in, thr, 15, 0)
    else:
        thr = _search_bits(key, k, thr, 15, 0)
    return thr


@triton.jit
def _take(key, valid, thr, k_rem, eq_seen):
    """Keys above thr, and the first k_rem keys equal to it (eq_seen equal ones came before)."""
    eq = valid & (key == thr)
    rank = tl.cumsum(eq.to(tl.int32), 0) + eq_seen
    return (valid & (key > thr)) | (eq & (rank <= k_rem)), tl.sum(eq.to(tl.int32), 0)


@triton.jit(do_not_specialize=["n_rows", "row0", "n_cols", "q_start", "s_q", "kk"])
def radix_topk_kernel(scores_ptr, qpos_ptr, qstart_ptr, ids_ptr, scratch_ptr, n_rows, row0, n_cols, stride, q_start,
                      s_q, kk, RANGED: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr,
                      SINGLE: tl.constexpr, KP: tl.constexpr, CAND: tl.constexpr):
    """Rows row0.. of scores [B, n_rows, stride] (the first n_cols columns; row r is query q_start + r) ->
    ids [B, s_q, kk] int32. RANGED: key s is column s, visible columns [q_starts[b, t] (HAS_STARTS) or 0,
    q_positions[t] + 1), and a SINGLE block must hold that range; otherwise every column is read and -inf
    marks the invisible ones. scratch [B * programs, CAND] int32 (CAND > 0): see _kth_key."""
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
    if SINGLE:  # the row fits one block: load once, keep in registers, search the k-th key bit by bit
        cols, key, valid = _load_keys(row_ptr, lo, lo, hi, BLOCK)
        key = tl.where(valid, key, tl.full((), -2147483647, tl.int32) - 1)  # INT_MIN: never counted
        k_t = tl.minimum(tl.sum(valid.to(tl.int32), 0), kk)
        thr = _kth_key(key, k_t, scratch_ptr + (tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)) * CAND,
                       CAND)
        take, _ = _take(key, valid, thr, k_t - tl.sum((key > thr).to(tl.int32), 0), 0)
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
