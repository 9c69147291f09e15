"""Triton top-k selection behind the indexer on CUDA: the exact top-k of each score row's visible keys.

Imports triton at module level: import it only through `indexer_triton`, which checks that triton is
installed first. The grid is persistent: each program (one warp by default, so every reduction is
warp shuffles with no shared-memory barrier, and many rows stream per SM at once) takes rows
pid, pid + programs, ... and reads only a row's visible columns [lo, hi): with the device flag
`ranged` (key s is column s) a causal prefix or a packed document's range, else the whole row with
-inf marking the invisible keys. fp32 scores become order-preserving int32 keys (-0.0 read as +0.0;
-inf, i.e. not visible, becomes INT_MIN and is never counted).
1. A row with at most k keys takes every valid one (one pass).
2. Otherwise SAMPLE keys, in runs of 8 contiguous columns (one 32-byte sector) spread over the row,
   give a bracket [lower, upper) around the k-th key: the sample's ranks k*SAMPLE/n -+ (MARGIN sqrt + 8).
3. One streamed pass counts the keys above `upper` and compacts those inside the bracket into a
   scratch row of CAND slots. When the k-th key is among them, it is searched bit by bit over the
   bits of (key - lower) only. When more than CAND keys fell inside, the stored ones (the first CAND
   by column) sample the bracket and narrow it for another pass; a bracket that missed widens to
   the side holding the k-th key. After TRIES passes, four 8-bit tl.histogram passes find it exactly.
4. A compaction pass writes the ids of keys above the k-th key, plus the lowest-id keys equal to it
   until k are written, in ascending key order, then pads the row with -1: `indexer_topk.topk_ids`'s
   rule, so both give the same ids on the same scores.
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
    """Columns start..start+BLOCK (start a multiple of 16): (cols, keys, valid)."""
    cols = tl.multiple_of(start, 16) + tl.arange(0, BLOCK)
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
def _kth_in(few, n_few, r, lower, upper):
    """The r-th largest of the first n_few keys of `few`, all in [lower, upper): a bit search over the
    bits of key - lower (a bracket spanning 2^31 or more keys searches all 32 bits)."""
    slots = tl.arange(0, few.shape[0])
    span = upper.to(tl.int64) - 1 - lower.to(tl.int64)
    if span < 2147483648:
        off = tl.where(slots < n_few, few - lower, -1)
        n_bits = 0
        while (span >> n_bits) > 0:
            n_bits += 1
        t = tl.full((), 0, tl.int32)
        while n_bits > 0:  # while loops, not range(tensor): Triton's interpreter runs these too
            n_bits -= 1
            c = t + (1 << n_bits)
            t = tl.where(tl.sum((off >= c).to(tl.int32), 0) >= r, c, t)
        thr = lower + t
    else:
        zero = tl.full((), 0, tl.int32)
        keys = tl.where(slots < n_few, few, _int_min())
        thr = tl.where(tl.sum((keys >= 0).to(tl.int32), 0) >= r, zero, _int_min())
        for bit in tl.static_range(30, -1, -1):
            c = thr + (1 << bit)
            thr = tl.where(tl.sum((keys >= c).to(tl.int32), 0) >= r, c, thr)
    return thr


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
        start = lo // 16 * 16
        while start < hi:
            cols, key, valid = _load_keys(row_ptr, start, lo, hi, BLOCK)
            hist += _digit_hist(key, valid, thr, 24 - 8 * i)
            start += BLOCK
        k_rem, thr = _pick_digit(hist, k_rem, thr, 24 - 8 * i)
    return thr, k_rem


@triton.jit
def _bracket(row_ptr, lo, n, kk, SAMPLE: tl.constexpr, MARGIN: tl.constexpr):
    """[lower, upper) around the kk-th largest key of a row of n > 8 columns from lo: from SAMPLE keys in
    runs of 8 contiguous columns spread evenly over the row."""
    i = tl.arange(0, SAMPLE)
    pos = lo + ((i // 8).to(tl.int64) * (n - 8) // (SAMPLE // 8 - 1)).to(tl.int32) + i % 8
    skeys, _ = _keys(tl.load(row_ptr + pos), pos < lo + n)
    rank = tl.minimum(n, kk).to(tl.float32) * SAMPLE / n.to(tl.float32)
    margin = MARGIN * tl.sqrt(rank) + 8.0
    upper, lower = _kth_pair(skeys, tl.floor(rank - margin).to(tl.int32), tl.ceil(rank + margin).to(tl.int32))
    return tl.maximum(lower, _int_min() + 1), upper


@triton.jit
def _compact(row_ptr, lo, hi, lower, upper, scratch_row, BLOCK: tl.constexpr, CAND: tl.constexpr):
    """One streamed pass: (valid keys, keys >= upper, keys in [lower, upper)); the first CAND of the
    latter go to scratch_row in column order."""
    n_valid = tl.full((), 0, tl.int32)
    n_above = tl.full((), 0, tl.int32)
    n_cand = tl.full((), 0, tl.int32)
    start = lo // 16 * 16
    while start < hi:
        cols, key, valid = _load_keys(row_ptr, start, lo, hi, BLOCK)
        inside = (key >= lower) & (key < upper)
        slot = n_cand + tl.cumsum(inside.to(tl.int32), 0) - 1
        tl.store(scratch_row + slot, key, mask=inside & (slot < CAND))
        n_valid += tl.sum(valid.to(tl.int32), 0)
        n_above += tl.sum((key >= upper).to(tl.int32), 0)
        n_cand += tl.sum(inside.to(tl.int32), 0)
        start += BLOCK
    return n_valid, n_above, n_cand


@triton.jit
def _threshold(row_ptr, lo, hi, kk, scratch_row, BLOCK: tl.constexpr, SAMPLE: tl.constexpr, CAND: tl.constexpr,
               MARGIN: tl.constexpr, TRIES: tl.constexpr):
    """(thr, k_rem, n_eq) of a row with more than kk columns: the top min(kk, valid keys) are the keys
    above thr and the first k_rem keys equal to it; n_eq keys equal thr (-1: not counted)."""
    lower = _int_min() + 1
    upper = tl.full((), 2147483647, tl.int32)
    if hi - lo > CAND:
        lower, upper = _bracket(row_ptr, lo, hi - lo, kk, SAMPLE, MARGIN)
    slots = tl.arange(0, CAND)
    thr = upper
    k_rem = tl.full((), 0, tl.int32)
    n_eq = tl.full((), 0, tl.int32)
    k_t = tl.full((), 0, tl.int32)
    found = tl.full((), 0, tl.int32)
    tries = tl.full((), 0, tl.int32)
    while (found == 0) & (tries < TRIES):
        n_valid, n_above, n_cand = _compact(row_ptr, lo, hi, lower, upper, scratch_row, BLOCK, CAND)
        k_t = tl.minimum(n_valid, kk)
        need = k_t - n_above
        tl.debug_barrier()  # the scratch row's stores before its loads
        few = tl.load(scratch_row + slots, mask=slots < n_cand, other=_int_min())
        if k_t == 0:  # no valid key
            found = 1
        elif (need >= 1) & (need <= n_cand) & (n_cand <= CAND):
            thr = _kth_in(few, n_cand, need, lower, upper)
            k_rem = need - tl.sum((few > thr).to(tl.int32), 0)
            n_eq = tl.sum((few == thr).to(tl.int32), 0)
            found = 1
        elif (need >= 1) & (need <= n_cand):  # too many inside: the stored ones sample the bracket
            rank = need.to(tl.float32) * CAND / n_cand.to(tl.float32)
            margin = MARGIN * tl.sqrt(rank) + 8.0
            u2, l2 = _kth_pair(few, tl.floor(rank - margin).to(tl.int32), tl.ceil(rank + margin).to(tl.int32))
            lower = tl.maximum(l2, lower)
            upper = tl.minimum(u2, upper)
        elif need < 1:  # the k-th key is above the bracket
            lower = upper
            upper = tl.full((), 2147483647, tl.int32)
        else:  # below it
            upper = lower
            lower = _int_min() + 1
        tl.debug_barrier()  # the loads before the next pass overwrites the scratch row
        tries += 1
    if found == 0:
        thr, k_rem = _histogram_kth(row_ptr, lo, hi, k_t, BLOCK)
        n_eq = -1
    return thr, k_rem, n_eq


@triton.jit(do_not_specialize=["n_rows", "row0", "n_sel", "n_cols", "q_start", "s_q", "kk", "n_batch",
                               "n_programs"])
def select_topk_kernel(scores_ptr, qpos_ptr, qstart_ptr, ranged_ptr, ids_ptr, scratch_ptr, n_rows, row0, n_sel,
                       n_cols, stride, q_start, s_q, kk, n_batch, n_programs, HAS_STARTS: tl.constexpr,
                       BLOCK: tl.constexpr, SAMPLE: tl.constexpr, CAND: tl.constexpr, MARGIN: tl.constexpr,
                       TRIES: tl.constexpr):
    """Rows row0 .. row0 + n_sel of scores [n_batch, n_rows, stride] (the first n_cols columns; row r is
    query q_start + r) -> ids [n_batch, s_q, kk] int32. ranged_ptr: int32 flag, key s is column s (the
    visible columns of query t are [q_starts[b, t] (HAS_STARTS) or 0, q_positions[t] + 1)); otherwise
    every column is read and -inf marks the invisible ones. scratch: [n_programs (the grid), CAND] int32."""
    pid = tl.program_id(0)
    scratch_row = scratch_ptr + pid.to(tl.int64) * CAND
    ranged = tl.load(ranged_ptr) != 0
    job = pid
    while job < n_batch * n_sel:
        b = (job // n_sel).to(tl.int64)
        r = row0 + job % n_sel
        t = q_start + r
        row_ptr = scores_ptr + (b * n_rows + r) * stride
        ids_row = ids_ptr + (b * s_q + t) * kk
        lo = tl.full((), 0, tl.int32)
        hi = tl.full((), 0, tl.int32) + n_cols
        if ranged:
            hi = tl.minimum(tl.load(qpos_ptr + t) + 1, hi)
            if HAS_STARTS:
                lo = tl.maximum(tl.load(qstart_ptr + b * s_q + t), lo)
        thr = _int_min() + 1  # a row of at most kk keys: every valid one
        k_rem = tl.full((), 0, tl.int32)
        n_eq = tl.full((), 0, tl.int32)
        if hi - lo > kk:
            thr, k_rem, n_eq = _threshold(row_ptr, lo, hi, kk, scratch_row, BLOCK, SAMPLE, CAND, MARGIN, TRIES)
        n_taken = tl.full((), 0, tl.int32)
        start = lo // 16 * 16
        if n_eq == k_rem:  # every key equal to thr is taken
            while start < hi:
                cols, key, valid = _load_keys(row_ptr, start, lo, hi, BLOCK)
                take = valid & (key >= thr)
                tl.store(ids_row + n_taken + tl.cumsum(take.to(tl.int32), 0) - 1, cols, mask=take)
                n_taken += tl.sum(take.to(tl.int32), 0)
                start += BLOCK
        else:  # the first k_rem keys equal to thr, by column
            eq_seen = tl.full((), 0, tl.int32)
            while start < hi:
                cols, key, valid = _load_keys(row_ptr, start, lo, hi, BLOCK)
                eq = valid & (key == thr)
                take = (valid & (key > thr)) | (eq & (tl.cumsum(eq.to(tl.int32), 0) + eq_seen <= k_rem))
                tl.store(ids_row + n_taken + tl.cumsum(take.to(tl.int32), 0) - 1, cols, mask=take)
                n_taken += tl.sum(take.to(tl.int32), 0)
                eq_seen += tl.sum(eq.to(tl.int32), 0)
                start += BLOCK
        while n_taken < kk:
            slots = n_taken + tl.arange(0, BLOCK)
            tl.store(ids_row + slots, tl.full([BLOCK], -1, tl.int32), mask=slots < kk)
            n_taken += BLOCK
        job += n_programs
