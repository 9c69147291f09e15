"""Triton top-k selection behind the indexer on CUDA: the exact top-k of each score row's visible keys.

Imports triton at module level: import it only through `indexer_triton`, which checks that triton is
installed first. One program (4 warps) takes one query row and reads only its visible columns
[lo, hi) (a causal prefix, or a packed document's range); fp32 scores become order-preserving int32
keys (-0.0 read as +0.0; -inf, i.e. not visible, becomes INT_MIN and is never counted).
1. A strided sample of SAMPLE keys gives two thresholds that bracket the k-th key with high
   probability: the sample's ranks k*SAMPLE/n -+ (4 sqrt + 8).
2. One streamed pass counts the keys above the upper threshold and compacts those between the two
   (at most CAND) into a scratch row.
3. The k-th key is searched bit by bit among those few (32 counting passes on registers). Should the
   bracket miss (ties, odd distributions), four 8-bit tl.histogram passes over the row find it.
4. A compaction pass writes the ids of keys above it, plus the lowest-id keys equal to it until k are
   written, in ascending key order, and pads the row with -1: `indexer_topk.topk_ids`'s rule, so
   both give the same ids on the same scores.
Every reduction spans one 4-warp program, so many rows are in flight per SM: a whole row held
across 16 warps and searched in 32 passes leaves each SM one latency-bound program.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _int_min():
    return tl.full((), -2147483647, tl.int32) - 1


@triton.jit
def _keys(x, inside):
    """(order-preserving int32 keys, INT_MIN where not inside or -inf, valid)."""
    valid = inside & (x > float("-inf"))
    bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))
    return tl.where(valid, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), _int_min()), valid


@triton.jit
def _load_keys(row_ptr, start, lo, hi, BLOCK: tl.constexpr):
    """Columns start..start+BLOCK: (cols, keys, valid)."""
    cols = start + tl.arange(0, BLOCK)
    inside = (cols >= lo) & (cols < hi)
    key, valid = _keys(tl.load(row_ptr + cols, mask=inside, other=float("-inf")), inside)
    return cols, key, valid


@triton.jit
def _kth_pair(keys, r1, r2):
    """The r1-th and r2-th largest keys (INT_MIN never counted; r <= 0 gives INT_MAX, r above the count
    INT_MIN): for each, the largest T with at least r keys >= T, decided bit by bit from the top."""
    zero = tl.full((), 0, tl.int32)
    n_pos = tl.sum((keys >= 0).to(tl.int32), 0)
    t1 = tl.where(n_pos >= r1, zero, _int_min())
    t2 = tl.where(n_pos >= r2, zero, _int_min())
    for bit in tl.static_range(30, -1, -1):
        c1 = t1 + (1 << bit)
        c2 = t2 + (1 << bit)
        t1 = tl.where(tl.sum((keys >= c1).to(tl.int32), 0) >= r1, c1, t1)
        t2 = tl.where(tl.sum((keys >= c2).to(tl.int32), 0) >= r2, c2, t2)
    return t1, t2


@triton.jit
def _kth(keys, r):
    """The r-th largest key, as _kth_pair."""
    zero = tl.full((), 0, tl.int32)
    t = tl.where(tl.sum((keys >= 0).to(tl.int32), 0) >= r, zero, _int_min())
    for bit in tl.static_range(30, -1, -1):
        c = t + (1 << bit)
        t = tl.where(tl.sum((keys >= c).to(tl.int32), 0) >= r, c, t)
    return t


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
def _histogram_kth(row_ptr, lo, hi, k, BLOCK: tl.constexpr):
    """(the k-th largest key of the row, how many keys equal to it are within the top k): four streamed
    8-bit digit passes (the fallback)."""
    thr = tl.full((), 0, tl.int32)
    k_rem = k
    for i in tl.static_range(4):
        hist = tl.zeros([256], tl.int32)
        start = lo
        while start < hi:
            cols, key, valid = _load_keys(row_ptr, start, lo, hi, BLOCK)
            hist += _digit_hist(key, valid, thr, 24 - 8 * i)
            start += BLOCK
        k_rem, thr = _pick_digit(hist, k_rem, thr, 24 - 8 * i)
    return thr, k_rem


@triton.jit
def _take(key, valid, thr, k_rem, eq_seen):
    """Keys above thr, and the first k_rem keys equal to it (eq_seen equal ones came before)."""
    eq = valid & (key == thr)
    rank = tl.cumsum(eq.to(tl.int32), 0) + eq_seen
    return (valid & (key > thr)) | (eq & (rank <= k_rem)), tl.sum(eq.to(tl.int32), 0)


@triton.jit(do_not_specialize=["n_rows", "row0", "n_cols", "q_start", "s_q", "kk"])
def radix_topk_kernel(scores_ptr, qpos_ptr, qstart_ptr, ids_ptr, scratch_ptr, n_rows, row0, n_cols, stride, q_start,
                      s_q, kk, RANGED: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr,
                      SAMPLE: tl.constexpr, CAND: tl.constexpr, KP: tl.constexpr):
    """Rows row0.. of scores [B, n_rows, stride] (the first n_cols columns; row r is query q_start + r) ->
    ids [B, s_q, kk] int32. RANGED: key s is column s, visible columns [q_starts[b, t] (HAS_STARTS) or 0,
    q_positions[t] + 1); otherwise every column is read and -inf marks the invisible ones. scratch:
    [B * programs, CAND] int32."""
    r = row0 + tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    t = q_start + r
    row_ptr = scores_ptr + (b * n_rows + r) * stride
    ids_row = ids_ptr + (b * s_q + t) * kk
    scratch_row = scratch_ptr + (tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)).to(tl.int64) * CAND
    lo = tl.full((), 0, tl.int32)
    hi = tl.full((), 0, tl.int32) + n_cols
    if RANGED:
        hi = tl.minimum(tl.load(qpos_ptr + t) + 1, hi)
        if HAS_STARTS:
            lo = tl.maximum(tl.load(qstart_ptr + b * s_q + t), lo)
    n_est = hi - lo
    # 1. the bracket [lower, upper) from a strided sample (every key is a candidate in a short row)
    upper = tl.full((), 2147483647, tl.int32)
    lower = _int_min() + 1
    if n_est > CAND:
        i = tl.arange(0, SAMPLE)
        spos = lo + ((i.to(tl.int64) * n_est) // SAMPLE).to(tl.int32)
        skeys, _ = _keys(tl.load(row_ptr + spos), spos < hi)
        rank = tl.minimum(n_est, kk).to(tl.float32) * SAMPLE / n_est.to(tl.float32)
        margin = 4.0 * tl.sqrt(rank) + 8.0
        upper, lower = _kth_pair(skeys, tl.floor(rank - margin).to(tl.int32), tl.ceil(rank + margin).to(tl.int32))
        lower = tl.maximum(lower, _int_min() + 1)
    # 2. count the keys above the bracket, compact those inside it
    n_valid = tl.full((), 0, tl.int32)
    n_above = tl.full((), 0, tl.int32)
    n_cand = tl.full((), 0, tl.int32)
    start = lo
    while start < hi:
        cols, key, valid = _load_keys(row_ptr, start, lo, hi, BLOCK)
        inside = (key >= lower) & (key < upper)
        slot = n_cand + tl.cumsum(inside.to(tl.int32), 0) - 1
        tl.store(scratch_row + slot, key, mask=inside & (slot < CAND))
        n_valid += tl.sum(valid.to(tl.int32), 0)
        n_above += tl.sum((key >= upper).to(tl.int32), 0)
        n_cand += tl.sum(inside.to(tl.int32), 0)
        start += BLOCK
    k_t = tl.minimum(n_valid, kk)
    need = k_t - n_above
    # 3. the k-th key: among the candidates when the bracket holds it, else by histogram passes
    if (need >= 1) & (need <= n_cand) & (n_cand <= CAND):
        tl.debug_barrier()  # the scratch row's stores before its loads
        slots = tl.arange(0, CAND)
        few = tl.load(scratch_row + slots, mask=slots < n_cand, other=_int_min())
        thr = _kth(few, need)
        k_rem = need - tl.sum((few > thr).to(tl.int32), 0)
    else:
        thr, k_rem = _histogram_kth(row_ptr, lo, hi, k_t, BLOCK)
    # 4. the ids, ascending
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
