"""Triton top-k selection behind the indexer on CUDA: the exact top-k of each score row's visible keys.

Imports triton at module level: import it only through `indexer_triton`, which checks that triton is
installed first. A row is read only over its visible columns [lo, hi): with the device flag `ranged`
(key s is column s) a causal prefix or a packed document's range, else the whole row with -inf marking
the invisible keys. Blocks wholly inside [lo, hi) load without masks; the streaming passes compare the
fp32 scores themselves, and order-preserving int32 keys (-0.0 read as +0.0; -inf, i.e. not visible,
INT_MIN, never counted) appear only in the sample and the candidate searches. Steps per row:
1. A row with at most k keys takes every valid one.
2. Otherwise SAMPLE keys, in runs of 8 contiguous columns (one 32-byte sector) spread over the row,
   give a bracket [lower, upper) around the k-th key: the sample's ranks k*SAMPLE/n -+ (MARGIN sqrt + 8),
   searched on the top 16 key bits and rounded outwards.
3. One streamed pass counts the scores above the bracket and compacts those inside it (at most CAND);
   the k-th key is then searched bit by bit over the bits of (key - lower) only.
4. A compaction pass writes the ids of keys above the k-th key, plus the lowest-id keys equal to it
   until k are written, in ascending key order, then pads the row with -1: `indexer_topk.topk_ids`'s
   rule, so both give the same ids on the same scores.
Launches (one program of topk_warps warps per row, few registers, so many rows stream per SM; a row's
passes issue the next block's load before a block's work, `topk_prefetch`):
`topk_bracket_kernel` (steps 2-3's pass), `topk_search_kernel` (step 3's search), `topk_write_kernel`
(step 4), then the persistent `select_topk_kernel` does all steps for the rows whose bracket missed:
more than CAND keys inside narrow the bracket from the stored ones for another pass, a miss widens it
towards the k-th key, and after TRIES passes four 8-bit tl.histogram passes find it exactly.
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
def _load_block(row_ptr, start, lo, hi, BLOCK: tl.constexpr):
    """(cols, scores) of columns start..start+BLOCK (start a multiple of 16), -inf outside [lo, hi): a block
    wholly inside loads without a mask (vector loads, no per-column predicates)."""
    cols = tl.multiple_of(start, 16) + tl.arange(0, BLOCK)
    if (start >= lo) & (start + BLOCK <= hi):
        x = tl.load(row_ptr + cols)
    else:
        x = tl.load(row_ptr + cols, mask=(cols >= lo) & (cols < hi), other=float("-inf"))
    return cols, x


@triton.jit
def _key_float(key):
    """The float of an order-preserving key; the bracket's open ends: INT_MAX -> +inf, INT_MIN + 1 (or
    below) -> -FLT_MAX, so a float compare partitions the valid scores as the key compare would."""
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    f = bits.to(tl.float32, bitcast=True)
    f = tl.where(key <= _int_min() + 1, -3.4028234663852886e38, f)
    return tl.where(key == 2147483647, float("inf"), f)


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
    """(thr, k_rem, n_eq): the r-th largest of the first n_few keys of `few` (r in 1 .. n_few), how many
    of those equal to it are within the top r, and how many equal it. A search over the bits of
    key - lower only, two bits a round: a round's three counts are independent reductions (their waits
    overlap), so a program a row takes half the rounds of a bit-by-bit search, each hardly longer. A
    bracket spanning 2^31 or more keys (the open one of a short row) is first split at key 0 by one
    count, which keeps the search in 31 bits (keys above the searched range count above every candidate
    threshold)."""
    valid = tl.arange(0, few.shape[0]) < n_few
    if upper.to(tl.int64) - 1 - lower.to(tl.int64) >= 2147483648:
        if tl.sum((valid & (few >= 0)).to(tl.int32), 0) >= r:
            lower = tl.full((), 0, tl.int32)
        else:
            upper = tl.full((), 0, tl.int32)
    span = upper - 1 - lower
    off = tl.where(valid, tl.where(few >= upper, 2147483647, few - lower), -1)
    n_bits = 0
    while (span >> n_bits) > 0:
        n_bits += 1
    t = tl.full((), 0, tl.int32)
    while n_bits > 1:  # t's bits below n_bits are 0: t + 3 * step stays below 2^31
        n_bits -= 2
        step = 1 << n_bits
        n1 = tl.sum((off >= t + step).to(tl.int32), 0)
        n2 = tl.sum((off >= t + 2 * step).to(tl.int32), 0)
        n3 = tl.sum((off >= t + 3 * step).to(tl.int32), 0)
        t += step * ((n1 >= r).to(tl.int32) + (n2 >= r).to(tl.int32) + (n3 >= r).to(tl.int32))
    if n_bits == 1:
        t = tl.where(tl.sum((off >= t + 1).to(tl.int32), 0) >= r, t + 1, t)
    k_rem = r - tl.sum((off > t).to(tl.int32), 0)
    n_eq = tl.sum((off == t).to(tl.int32), 0)
    return lower + t, k_rem, n_eq


@triton.jit
def _digit_hist(key, valid, thr, SHIFT: tl.constexpr):
    """Histogram of the 8-bit digit at SHIFT (unsigned order: the top digit's sign bit flipped) over the
    valid keys whose higher digits equal thr's."""
    d = (key >> SHIFT) & 0xFF
    if SHIFT == 24:  # if / else: the other branch is not traced (a shift by 32 would be)
        hist = tl.histogram(d ^ 0x80, 256, mask=valid)
    else:
        hist = tl.histogram(d, 256, mask=valid & (((key ^ thr) >> (SHIFT + 8)) == 0))
    return hist


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
    """(the k-th largest key of the row, k capped at its valid keys; how many keys equal to it are within
    the top k): four streamed 8-bit digit passes (the fallback)."""
    thr = tl.full((), 0, tl.int32)
    k_rem = k
    for i in tl.static_range(4):
        hist = tl.zeros([256], tl.int32)
        start = lo // 16 * 16
        while start < hi:
            cols, x = _load_block(row_ptr, start, lo, hi, BLOCK)
            key, valid = _keys(x, cols >= 0)
            hist += _digit_hist(key, valid, thr, 24 - 8 * i)
            start += BLOCK
        if i == 0:
            k_rem = tl.minimum(k_rem, tl.sum(hist, 0))
        k_rem, thr = _pick_digit(hist, k_rem, thr, 24 - 8 * i)
    return thr, k_rem


@triton.jit
def _bracket(row_ptr, lo, n, kk, SAMPLE: tl.constexpr, MARGIN: tl.constexpr):
    """[lower, upper) around the kk-th largest key of a row of n > 8 columns from lo: from SAMPLE keys in
    runs of 8 contiguous columns spread evenly over the row, the sample's ranks searched on the top 16
    key bits only (a grid of 2^16 keys, under 1% of a score) and each end rounded outwards."""
    i = tl.arange(0, SAMPLE)
    pos = lo + ((i // 8).to(tl.int64) * (n - 8) // (SAMPLE // 8 - 1)).to(tl.int32) + i % 8
    skeys, _ = _keys(tl.load(row_ptr + pos), pos < lo + n)
    rank = tl.minimum(n, kk).to(tl.float32) * SAMPLE / n.to(tl.float32)
    margin = MARGIN * tl.sqrt(rank) + 8.0
    r1 = tl.floor(rank - margin).to(tl.int32)
    r2 = tl.ceil(rank + margin).to(tl.int32)
    zero = tl.full((), 0, tl.int32)
    n_pos = tl.sum((skeys >= 0).to(tl.int32), 0)
    t1 = tl.where(n_pos >= r1, zero, _int_min())
    t2 = tl.where(n_pos >= r2, zero, _int_min())
    for bit in tl.static_range(30, 15, -1):
        c1 = t1 + (1 << bit)
        c2 = t2 + (1 << bit)
        t1 = tl.where(tl.sum((skeys >= c1).to(tl.int32), 0) >= r1, c1, t1)
        t2 = tl.where(tl.sum((skeys >= c2).to(tl.int32), 0) >= r2, c2, t2)
    # t1: the largest grid key with >= r1 sample keys at or above it; the next grid key has fewer
    upper = tl.where((r1 <= 0) | (t1 >= 2147483647 - 65535), 2147483647, t1 + 65536)
    return tl.maximum(t2, _int_min() + 1), upper


@triton.jit
def _compact(row_ptr, lo, hi, lower_f, upper_f, scratch_row, BLOCK: tl.constexpr, CAND: tl.constexpr,
             PREFETCH: tl.constexpr):
    """One streamed pass: (scores >= upper_f, scores in [lower_f, upper_f)); the first CAND of the latter
    go to scratch_row (their float bits) in column order. Float compares: -inf (not visible) is never
    inside, since lower_f >= -FLT_MAX. PREFETCH: the next block's load is issued before this block's
    scan and stores (a program a row waits on each load otherwise; past hi it is masked off)."""
    tl.static_assert(BLOCK < 65536, "the two counts share one int32 sum")
    n_above = tl.full((), 0, tl.int32)
    n_cand = tl.full((), 0, tl.int32)
    start = lo // 16 * 16
    _, x = _load_block(row_ptr, start, lo, hi, BLOCK)
    while start < hi:
        if PREFETCH:
            _, x_next = _load_block(row_ptr, start + BLOCK, lo, hi, BLOCK)
        inside = (x >= lower_f) & (x < upper_f)
        slot = n_cand + tl.cumsum(inside.to(tl.int32), 0) - 1
        tl.store(scratch_row + slot, x.to(tl.int32, bitcast=True), mask=inside & (slot < CAND))
        both = tl.sum((x >= upper_f).to(tl.int32) * 65536 + inside.to(tl.int32), 0)  # one reduction, two counts
        n_above += both >> 16
        n_cand += both & 0xFFFF
        start += BLOCK
        if PREFETCH:
            x = x_next
        else:
            _, x = _load_block(row_ptr, start, lo, hi, BLOCK)
    return n_above, n_cand


@triton.jit
def _threshold(row_ptr, lo, hi, kk, scratch_row, BLOCK: tl.constexpr, SAMPLE: tl.constexpr, CAND: tl.constexpr,
               MARGIN: tl.constexpr, TRIES: tl.constexpr, PREFETCH: tl.constexpr):
    """(thr, k_rem, n_eq) of a row with more than kk columns: the top min(kk, valid keys) are the keys
    above thr and the first k_rem keys equal to it; n_eq keys equal thr (-1: not counted). A bracket
    with an open lower end counts every valid key; otherwise k is kk, unless the pass finds fewer keys
    at or above the bracket than kk (then the bracket opens downwards and the next pass counts)."""
    lower = _int_min() + 1
    upper = tl.full((), 2147483647, tl.int32)
    if hi - lo > CAND:
        lower, upper = _bracket(row_ptr, lo, hi - lo, kk, SAMPLE, MARGIN)
    slots = tl.arange(0, CAND)
    thr = upper
    k_rem = tl.full((), 0, tl.int32)
    n_eq = tl.full((), 0, tl.int32)
    k_t = tl.full((), 0, tl.int32) + kk
    found = tl.full((), 0, tl.int32)
    tries = tl.full((), 0, tl.int32)
    while (found == 0) & (tries < TRIES):
        n_above, n_cand = _compact(row_ptr, lo, hi, _key_float(lower), _key_float(upper), scratch_row, BLOCK, CAND,
                                   PREFETCH)
        k_t = tl.where(lower == _int_min() + 1, tl.minimum(n_above + n_cand, kk), kk)
        need = k_t - n_above
        tl.debug_barrier()  # the scratch row's stores before its loads
        bits = tl.load(scratch_row + slots, mask=slots < n_cand, other=0)
        few, _ = _keys(bits.to(tl.float32, bitcast=True), slots < n_cand)
        if k_t == 0:  # no valid key
            thr = tl.full((), 2147483647, tl.int32)
            found = 1
        elif (need >= 1) & (need <= n_cand) & (n_cand <= CAND):
            thr, k_rem, n_eq = _kth_in(few, n_cand, need, lower, upper)
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
        else:  # below it (or fewer than kk valid keys): open the lower end
            upper = lower
            lower = _int_min() + 1
        tl.debug_barrier()  # the loads before the next pass overwrites the scratch row
        tries += 1
    if found == 0:
        thr, k_rem = _histogram_kth(row_ptr, lo, hi, k_t, BLOCK)
        n_eq = -1
    return thr, k_rem, n_eq


@triton.jit
def _row(job, n_sel, row0, q_start, n_rows, stride, s_q, kk, n_cols, scores_ptr, qpos_ptr, qstart_ptr, ids_ptr,
         ranged, HAS_STARTS: tl.constexpr):
    """Job j (row row0 + j % n_sel of batch j // n_sel): (its scores row, its ids row, lo, hi)."""
    b = (job // n_sel).to(tl.int64)
    r = row0 + job % n_sel
    t = q_start + r
    lo = tl.full((), 0, tl.int32)
    hi = tl.full((), 0, tl.int32) + n_cols
    if ranged:
        hi = tl.minimum(tl.load(qpos_ptr + t).to(tl.int32) + 1, hi)
        if HAS_STARTS:
            lo = tl.maximum(tl.load(qstart_ptr + b * s_q + t).to(tl.int32), lo)
    return scores_ptr + (b * n_rows + r) * stride, ids_ptr + (b * s_q + t) * kk, lo, hi


@triton.jit
def _write(row_ptr, ids_row, lo, hi, kk, thr, k_rem, n_eq, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """Step 4: the ids of the keys above thr and of the first k_rem keys equal to it (all of them when
    n_eq == k_rem), ascending, then -1 up to kk (PREFETCH as in `_compact`)."""
    t_f = _key_float(thr)  # score >= t_f: the key compare (-0.0 == +0.0 as keys; -inf and NaN never)
    n_taken = tl.full((), 0, tl.int32)
    eq_seen = tl.full((), 0, tl.int32)
    all_eq = n_eq == k_rem  # every key equal to thr is taken
    start = lo // 16 * 16
    cols, x = _load_block(row_ptr, start, lo, hi, BLOCK)
    while start < hi:
        if PREFETCH:
            cols_next, x_next = _load_block(row_ptr, start + BLOCK, lo, hi, BLOCK)
        if all_eq:  # the usual row: no key equal to thr is left out, so one scan a block
            take = x >= t_f
        else:
            eq = x == t_f
            take = (x > t_f) | (eq & (tl.cumsum(eq.to(tl.int32), 0) + eq_seen <= k_rem))
            eq_seen += tl.sum(eq.to(tl.int32), 0)
        tl.store(ids_row + n_taken + tl.cumsum(take.to(tl.int32), 0) - 1, cols, mask=take)
        n_taken += tl.sum(take.to(tl.int32), 0)
        start += BLOCK
        if PREFETCH:
            cols, x = cols_next, x_next
        else:
            cols, x = _load_block(row_ptr, start, lo, hi, BLOCK)
    while n_taken < kk:
        slots = n_taken + tl.arange(0, BLOCK)
        tl.store(ids_row + slots, tl.full([BLOCK], -1, tl.int32), mask=slots < kk)
        n_taken += BLOCK


@triton.jit
def _put4(ptr, a, b, c, d):
    i = tl.arange(0, 4)
    tl.store(ptr + i, tl.where(i == 0, a, tl.where(i == 1, b, tl.where(i == 2, c, d))))


@triton.jit
def _get4(ptr):
    i = tl.arange(0, 4)
    v = tl.load(ptr + i)
    return (tl.sum(tl.where(i == 0, v, 0), 0), tl.sum(tl.where(i == 1, v, 0), 0), tl.sum(tl.where(i == 2, v, 0), 0),
            tl.sum(tl.where(i == 3, v, 0), 0))


_ROW_ARGS = ["n_rows", "row0", "n_sel", "n_cols", "q_start", "s_q", "kk"]  # not specialised on their values


@triton.jit(do_not_specialize=_ROW_ARGS)
def topk_bracket_kernel(scores_ptr, qpos_ptr, qstart_ptr, ranged_ptr, meta_ptr, cand_ptr, n_rows, row0, n_sel,
                        n_cols, stride, q_start, s_q, kk, HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr,
                        SAMPLE: tl.constexpr, CAND: tl.constexpr, MARGIN: tl.constexpr,
                        PREFETCH: tl.constexpr):
    """Steps 2-3's pass for job program_id(0) (rows as in select_topk_kernel): meta[job] = (lower, upper,
    keys above, keys inside), the first CAND inside keys' bits in cand[job]. Rows of at most kk keys
    leave (INT_MIN + 1, INT_MAX, 0, 0)."""
    job = tl.program_id(0)
    row_ptr, _, lo, hi = _row(job, n_sel, row0, q_start, n_rows, stride, s_q, kk, n_cols, scores_ptr, qpos_ptr,
                              qstart_ptr, qpos_ptr, tl.load(ranged_ptr) != 0, HAS_STARTS)
    lower = _int_min() + 1
    upper = tl.full((), 2147483647, tl.int32)
    n_above = tl.full((), 0, tl.int32)
    n_cand = tl.full((), 0, tl.int32)
    if hi - lo > kk:
        if hi - lo > CAND:
            lower, upper = _bracket(row_ptr, lo, hi - lo, kk, SAMPLE, MARGIN)
        n_above, n_cand = _compact(row_ptr, lo, hi, _key_float(lower), _key_float(upper),
                                   cand_ptr + job.to(tl.int64) * CAND, BLOCK, CAND, PREFETCH)
    _put4(meta_ptr + job * 4, lower, upper, n_above, n_cand)


@triton.jit(do_not_specialize=[a for a in _ROW_ARGS if a != "n_rows"])
def topk_search_kernel(qpos_ptr, qstart_ptr, ranged_ptr, meta_ptr, cand_ptr, n_sel, row0, n_cols, q_start, s_q, kk,
                       HAS_STARTS: tl.constexpr, CAND: tl.constexpr):
    """Step 3's search for job program_id(0): meta[job] becomes (thr, k_rem, n_eq, 1), or (.., 0) when the
    bracket missed the k-th key or held more than CAND keys (select_topk_kernel takes those rows)."""
    job = tl.program_id(0)
    _, _, lo, hi = _row(job, n_sel, row0, q_start, 0, 0, s_q, kk, n_cols, qpos_ptr, qpos_ptr, qstart_ptr, qpos_ptr,
                        tl.load(ranged_ptr) != 0, HAS_STARTS)
    lower, upper, n_above, n_cand = _get4(meta_ptr + job * 4)
    thr = _int_min() + 1  # a row of at most kk keys: every valid one
    k_rem = tl.full((), 0, tl.int32)
    n_eq = tl.full((), 0, tl.int32)
    ok = tl.full((), 1, tl.int32)
    if hi - lo > kk:
        k_t = tl.where(lower == _int_min() + 1, tl.minimum(n_above + n_cand, kk), kk)
        need = k_t - n_above
        if k_t == 0:  # no valid key
            thr = tl.full((), 2147483647, tl.int32)
        elif (need >= 1) & (need <= n_cand) & (n_cand <= CAND):
            slots = tl.arange(0, CAND)
            bits = tl.load(cand_ptr + job.to(tl.int64) * CAND + slots, mask=slots < n_cand, other=0)
            few, _valid = _keys(bits.to(tl.float32, bitcast=True), slots < n_cand)
            thr, k_rem, n_eq = _kth_in(few, n_cand, need, lower, upper)
        else:
            ok = 0
    _put4(meta_ptr + job * 4, thr, k_rem, n_eq, ok)


@triton.jit(do_not_specialize=_ROW_ARGS)
def topk_write_kernel(scores_ptr, qpos_ptr, qstart_ptr, ranged_ptr, meta_ptr, ids_ptr, n_rows, row0, n_sel, n_cols,
                      stride, q_start, s_q, kk, HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr,
                      PREFETCH: tl.constexpr):
    """Step 4 for job program_id(0) when its search held (meta[job][3] == 1)."""
    job = tl.program_id(0)
    thr, k_rem, n_eq, ok = _get4(meta_ptr + job * 4)
    if ok == 1:
        row_ptr, ids_row, lo, hi = _row(job, n_sel, row0, q_start, n_rows, stride, s_q, kk, n_cols, scores_ptr,
                                        qpos_ptr, qstart_ptr, ids_ptr, tl.load(ranged_ptr) != 0, HAS_STARTS)
        _write(row_ptr, ids_row, lo, hi, kk, thr, k_rem, n_eq, BLOCK, PREFETCH)


@triton.jit(do_not_specialize=_ROW_ARGS + ["n_jobs", "n_programs"])
def select_topk_kernel(scores_ptr, qpos_ptr, qstart_ptr, ranged_ptr, meta_ptr, ids_ptr, cand_ptr, n_rows, row0,
                       n_sel, n_cols, stride, q_start, s_q, kk, n_jobs, n_programs, HAS_STARTS: tl.constexpr,
                       BLOCK: tl.constexpr, SAMPLE: tl.constexpr, CAND: tl.constexpr, MARGIN: tl.constexpr,
                       TRIES: tl.constexpr, PREFETCH: tl.constexpr):
    """The whole selection of each job whose meta[job][3] is 0 (persistent: jobs pid, pid + n_programs, ..
    below n_jobs). Jobs: rows row0 .. row0 + n_sel of scores [n_batch, n_rows, stride] (the first n_cols
    columns; row r is query q_start + r), job j row j % n_sel of batch j // n_sel -> ids [n_batch, s_q,
    kk] int32. ranged_ptr: int32 flag, key s is column s (the visible columns of query t are
    [q_starts[b, t] (HAS_STARTS) or 0, q_positions[t] + 1)); otherwise every column is read and -inf
    marks the invisible ones. cand: [n_jobs, CAND] int32 scratch."""
    job = tl.program_id(0)
    ranged = tl.load(ranged_ptr) != 0
    while job < n_jobs:  # while, not range(tensor): Triton's interpreter runs it too
        if tl.load(meta_ptr + job * 4 + 3) == 0:
            row_ptr, ids_row, lo, hi = _row(job, n_sel, row0, q_start, n_rows, stride, s_q, kk, n_cols, scores_ptr,
                                            qpos_ptr, qstart_ptr, ids_ptr, ranged, HAS_STARTS)
            thr = _int_min() + 1  # a row of at most kk keys: every valid one
            k_rem = tl.full((), 0, tl.int32)
            n_eq = tl.full((), 0, tl.int32)
            if hi - lo > kk:
                thr, k_rem, n_eq = _threshold(row_ptr, lo, hi, kk, cand_ptr + job.to(tl.int64) * CAND, BLOCK, SAMPLE,
                                              CAND, MARGIN, TRIES, PREFETCH)
            _write(row_ptr, ids_row, lo, hi, kk, thr, k_rem, n_eq, BLOCK, PREFETCH)
        job += n_programs
