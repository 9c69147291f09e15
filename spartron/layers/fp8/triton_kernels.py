"""Triton kernels of the blockwise FP8 recipe on Hopper: quantisation and grouped GEMMs.

torch 2.11 has no grouped GEMM with 1x128 / 128x128 scales on sm90 (its `scaled_grouped_mm` takes
rowwise scales there, MXFP8 on sm100), so the grouped experts' three GEMMs are written here. Each
GEMM keeps both operands contiguous along the contraction dim (the K-major form Hopper's FP8 MMA
reads) and multiplies every 128-deep partial product by its two scales before adding it to the fp32
accumulator: DeepSeek-V3's promotion to CUDA cores every 128 elements. Layouts and tilings are those
of spartron.layers.fp8.quant (the reference they are tested against). Imported only on that backend.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

FP8_MAX = tl.constexpr(448.0)  # a global a @triton.jit function reads must be a constexpr instance
# quantize_blocks_kernel's (CHUNK rows, warps). A whole 128 x 128 block at once needs 255 registers a thread at 4
# warps and spills 2 KB (sm_90a ptxas, benchmarks/triton_registers.py), 128 registers at 16 warps: one program an
# SM. Chunked: 124 registers at (32, 8), 146 at (16, 4), two or three programs an SM. Writing both layouts (the
# weight cache), the sweep of benchmarks/fp8_gemms.py on the H100 at 802d705 ran (32, 8) in 0.221 ms against the
# whole block's 0.302 (1,869-2,126 GB/s against 1,554; fp8_gemms/fp8_quantisers_802d705_h100.json): one layout
# alone already streams at ~2.6 TB/s whole-block, so it keeps that until a sweep of its own says otherwise.
QUANTIZE_BLOCKS_CONFIG = (128, 16)
QUANTIZE_BLOCKS_BOTH_CONFIG = (32, 8)


@triton.jit
def _div(x, y):
    """x / y rounded to nearest, as torch divides: Triton's `/` on fp32 is div.full.f32 (2 ulp), which
    can move a power-of-two scale by a factor 2 and a quantised value by one e4m3 step."""
    x, y = tl.broadcast(x, y)
    return tl.math.div_rn(x, y)


@triton.jit
def _scale(amax, POW2: tl.constexpr):
    scale = _div(amax, tl.zeros_like(amax) + FP8_MAX)
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        exponent = bits & 0x7F800000
        exponent = tl.where((bits & 0x007FFFFF) != 0, exponent + 0x00800000, exponent)
        scale = exponent.to(tl.float32, bitcast=True)
    return tl.where(amax > 0, scale, 1.0)


@triton.jit
def _cast(x, scale):
    return tl.clamp(_div(x, scale), -FP8_MAX, FP8_MAX).to(tl.float8e4nv)


@triton.jit
def _group_of_slot(slot, counts_ptr, N_GROUPS: tl.constexpr, TILE: tl.constexpr):
    """(first row, end row, group) of tile slot `slot`; first row -1 for an unused slot."""
    start = 0
    tiles = 0
    row_lo = -1
    row_hi = -1
    group = 0
    for g in range(N_GROUPS):
        cnt = tl.load(counts_ptr + g)
        nt = (cnt + TILE - 1) // TILE
        inside = (slot >= tiles) & (slot < tiles + nt)
        lo = start + (slot - tiles) * TILE
        row_lo = tl.where(inside, lo, row_lo)
        row_hi = tl.where(inside, tl.minimum(lo + TILE, start + cnt), row_hi)
        group = tl.where(inside, g, group)
        tiles += nt
        start += cnt
    return row_lo, row_hi, group


@triton.jit
def quantize_rows_kernel(x_ptr, up_ptr, idx_ptr, q_ptr, s_ptr, M, K, SX, POW2: tl.constexpr, SWIGLU: tl.constexpr,
                         GATHER: tl.constexpr, BM: tl.constexpr):
    """1x128 tiles of x [M, K] (SWIGLU: of silu(x) * up, each factor rounded to x's dtype as torch's
    eager silu and mul round them: expf and a correctly rounded division, as CUDA's expf and `/`).
    SX: the row stride of x and up (K, or 2K for the gate and up halves of the experts' [M, 2K] w1|w3 output).
    GATHER: output row r is x's row idx[r] (the experts' input in its regrouped order, never written)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    kb = tl.program_id(1)
    cols = kb * 128 + tl.arange(0, 128)
    mask = rows[:, None] < M
    offs = rows[:, None].to(tl.int64) * K + cols[None, :]
    src = tl.load(idx_ptr + rows, mask=rows < M, other=0) if GATHER else rows
    x_offs = src[:, None].to(tl.int64) * SX + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if SWIGLU:
        dtype = x_ptr.dtype.element_ty
        g = x.to(tl.float32)
        silu = _div(g, 1.0 + libdevice.exp(-g)).to(dtype)
        up = tl.load(up_ptr + x_offs, mask=mask, other=0.0)
        x = (silu.to(tl.float32) * up.to(tl.float32)).to(dtype)
    x = x.to(tl.float32)
    scale = _scale(tl.max(tl.abs(x), axis=1), POW2)
    tl.store(q_ptr + offs, _cast(x, scale[:, None]), mask=mask)
    tl.store(s_ptr + kb * M + rows, scale, mask=rows < M)


@triton.jit
def _store_blocks(q_ptr, qt_ptr, q, group, n, cols, K, N_OUT, ROWS: tl.constexpr, COLS: tl.constexpr):
    """q [len(n), 128] (rows n, columns cols of group's block) into q [G, N_OUT, K] and / or q^T [G, K, N_OUT]."""
    if COLS:
        tl.store(qt_ptr + group * N_OUT * K + cols[:, None].to(tl.int64) * N_OUT + n[None, :], tl.trans(q))
    if ROWS:
        tl.store(q_ptr + group * N_OUT * K + n[:, None].to(tl.int64) * K + cols[None, :], q)


@triton.jit
def quantize_blocks_kernel(w_ptr, q_ptr, qt_ptr, s_ptr, N, K, N_OUT, ROWS: tl.constexpr, COLS: tl.constexpr,
                           POW2: tl.constexpr, CHUNK: tl.constexpr):
    """128x128 blocks of w [G, N, K] -> (ROWS) q [G, N, K] and/or (COLS) q^T [G, K, N], scales
    [G, N/128, K/128] either way (the caller views them transposed for q^T): dgrad's operand without a
    transposing copy, both from one read of w when both are wanted (the experts' weight cache). N_OUT:
    the outputs' N per group (N, or 2N when w is one half of the experts' w1|w3 buffers, the pointers
    at that half). CHUNK < 128: CHUNK rows at a time, the block's amax over all its chunks, then each chunk read
    again (from L2) and cast, for more programs an SM than a whole block in registers leaves (one at 16 warps:
    the loads wait while it reduces, casts and stores); CHUNK = 128 reads it once."""
    row_block = tl.program_id(0)  # over groups x N/128
    kb = tl.program_id(1)
    cols = kb * 128 + tl.arange(0, 128)
    nblocks = N // 128
    group = (row_block // nblocks).to(tl.int64)
    nb = row_block % nblocks
    if CHUNK == 128:  # the block read once, held whole
        rows = row_block * 128 + tl.arange(0, 128)  # rows of the [G * N, K] view
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]).to(tl.float32)
        scale = _scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0), POW2)
        _store_blocks(q_ptr, qt_ptr, _cast(w, scale), group, nb * 128 + tl.arange(0, 128), cols, K, N_OUT, ROWS, COLS)
    else:
        amax = tl.zeros([CHUNK], dtype=tl.float32)
        for c in range(0, 128, CHUNK):  # loops, not unrolled: the second pass must not keep the first's loads
            rows = row_block * 128 + c + tl.arange(0, CHUNK)
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(w), axis=1))
        scale = _scale(tl.max(amax, axis=0), POW2)
        for c in range(0, 128, CHUNK):
            rows = row_block * 128 + c + tl.arange(0, CHUNK)
            q = _cast(tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]).to(tl.float32), scale)
            _store_blocks(q_ptr, qt_ptr, q, group, nb * 128 + c + tl.arange(0, CHUNK), cols, K, N_OUT, ROWS, COLS)
    tl.store(s_ptr + (group * (N_OUT // 128) + nb) * (K // 128) + kb, scale)


@triton.jit
def place_gathered_kernel(q_ptr, out_ptr, outt_ptr, N, K, N_OUT, START, ROWS: tl.constexpr):
    """All-gathered E4M3 values q [G, N, K] (bytes) -> (ROWS) out[:, START:START + N, :] of [G, N_OUT, K] and
    outt[:, :, START:START + N] of [G, K, N_OUT]: the gathered weight's place in its GEMM's joint operand and the
    transposed operand dgrad reads, from one read of q in 128 x 128 tiles (a strided copy_ of the transposed view
    reads or writes one byte per 128-byte line)."""
    row_block = tl.program_id(0)  # over groups x N/128
    kb = tl.program_id(1)
    nblocks = N // 128
    group = (row_block // nblocks).to(tl.int64)
    n = (row_block % nblocks) * 128 + tl.arange(0, 128)
    cols = kb * 128 + tl.arange(0, 128)
    q = tl.load(q_ptr + group * N * K + n[:, None].to(tl.int64) * K + cols[None, :])
    if ROWS:
        tl.store(out_ptr + group * N_OUT * K + (START + n[:, None]).to(tl.int64) * K + cols[None, :], q)
    tl.store(outt_ptr + group * N_OUT * K + cols[:, None].to(tl.int64) * N_OUT + START + n[None, :], tl.trans(q))


@triton.jit
def quantize_cols_kernel(x_ptr, idx_ptr, counts_ptr, q_ptr, s_ptr, C, L, N_GROUPS: tl.constexpr, POW2: tl.constexpr,
                         GATHER: tl.constexpr, BC: tl.constexpr):
    """128x1 tiles of x [M, C] into the slot-aligned layout: q_t [C, L = T*128] (slot s at columns
    s*128 ...), scales slot-major (slot s of column c at s*C + c). Every slot is written: rows past a
    group's count and unused slots are zeros (scale 0 for an unused slot), so no memset is needed.
    GATHER: row r is x's row idx[r]."""
    slot = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    ts = tl.arange(0, 128)
    row_lo, row_hi, _ = _group_of_slot(slot, counts_ptr, N_GROUPS, 128)
    rows = row_lo + ts
    mask = rows[:, None] < row_hi  # all false for an unused slot (row_lo = row_hi = -1)
    src = tl.load(idx_ptr + rows, mask=rows < row_hi, other=0) if GATHER else rows
    x = tl.load(x_ptr + src[:, None].to(tl.int64) * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = _scale(tl.max(tl.abs(x), axis=0), POW2)  # [BC]
    q = _cast(x, scale[None, :])
    col0 = tl.multiple_of(slot * 128, 128)
    tl.store(q_ptr + cols[None, :].to(tl.int64) * L + col0 + ts[:, None], q)
    tl.store(s_ptr + slot * C + cols, tl.where(row_lo >= 0, scale, 0.0))


@triton.jit
def slot_rows_kernel(counts_ptr, source_ptr, dest_ptr, ends_ptr, N_GROUPS: tl.constexpr):
    """The slot layout of the packed rows grouped by counts (deep_gemm_backend.padded_rows, one launch): per slot
    row its packed row (0 past the group's count and in unused slots), per packed row its slot row, and (slot 0's
    program) each group's end row, its first slot row plus its count."""
    slot = tl.program_id(0)
    ts = tl.arange(0, 128)
    row_lo, row_hi, _ = _group_of_slot(slot, counts_ptr, N_GROUPS, 128)
    rows = row_lo + ts
    valid = rows < row_hi  # all false for an unused slot (row_lo = row_hi = -1)
    slot_rows = slot.to(tl.int64) * 128 + ts
    tl.store(source_ptr + slot_rows, tl.where(valid, rows, 0).to(tl.int64))
    tl.store(dest_ptr + rows, slot_rows, mask=valid)
    if slot == 0:
        tiles = 0
        for g in range(N_GROUPS):
            cnt = tl.load(counts_ptr + g)
            tl.store(ends_ptr + g, (tiles * 128 + cnt).to(tl.int32))
            tiles += (cnt + 127) // 128


@triton.jit
def grouped_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, counts_ptr, M, NOUT, KC: tl.constexpr,
                        N_GROUPS: tl.constexpr,
                        stride_bg, stride_bn, stride_sbg, stride_sbn, stride_sbk,
                        BM: tl.constexpr, BN: tl.constexpr, num_stages_k: tl.constexpr):
    """out[rows of g] = A[rows of g] @ B[g]^T: A [M, KC] (scales [KC/128, M]), B [G, NOUT, KC] with the
    contraction contiguous (scales [G, NOUT/128, KC/128] by strides). BK = 128 (one scale block), BN =
    128, BM 128 or 64 (a slot is BM rows of one group: smaller groups waste less of the last tile).
    A 1-D grid, the output column block fastest: the CTAs running together share their A rows and
    their group's B, so A is read from memory about once (slot-fastest order re-read it per column block)."""
    n_blocks = NOUT // BN
    slot = tl.program_id(0) // n_blocks
    nb = tl.program_id(0) % n_blocks
    row_lo, row_hi, group = _group_of_slot(slot, counts_ptr, N_GROUPS, BM)
    if row_lo >= 0:
        rows = row_lo + tl.arange(0, BM)
        rmask = rows < row_hi
        cols = nb * BN + tl.arange(0, BN)
        ks = tl.arange(0, 128)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        b_base = b_ptr + group.to(tl.int64) * stride_bg
        for kb in tl.range(0, KC // 128, num_stages=num_stages_k):
            k0 = kb * 128
            a = tl.load(a_ptr + rows[:, None].to(tl.int64) * KC + (k0 + ks)[None, :], mask=rmask[:, None], other=0.0)
            b = tl.load(b_base + cols[None, :].to(tl.int64) * stride_bn + (k0 + ks)[:, None])
            sa = tl.load(sa_ptr + kb * M + rows, mask=rmask, other=0.0)
            sb = tl.load(sb_ptr + group * stride_sbg + nb * stride_sbn + kb * stride_sbk)
            acc += tl.dot(a, b) * (sa[:, None] * sb)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * NOUT + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def grouped_wgrad_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, counts_ptr, L, N, K, SA_SLOT, SB_SLOT,
                         N_GROUPS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, num_stages_t: tl.constexpr):
    """out[g] = A[:, slots of g] @ B[:, slots of g]^T: A = grad_out^T [N, L], B = x^T [K, L] in the
    slot-aligned column layout (L = T*128, tokens contiguous), scales slot-major (slot t of A's row n
    at t * SA_SLOT + n: SA_SLOT = N, or 2N for one half of the experts' w1|w3 gradient; B's likewise). Every tile is
    128-aligned and whole (zeros past a group's count): unmasked, vectorised
    loads, pipelined over the group's slots. A 1-D grid, one group at a time (its column blocks of x^T
    fastest): the CTAs running together read one group's operands, which stay in L2."""
    k_blocks = K // BK
    n_blocks = N // BN
    g = tl.program_id(0) // (k_blocks * n_blocks)
    ns = (tl.program_id(0) // k_blocks % n_blocks) * BN + tl.arange(0, BN)
    ks = (tl.program_id(0) % k_blocks) * BK + tl.arange(0, BK)
    slot0 = 0
    for i in range(N_GROUPS):
        slot0 += tl.where(i < g, (tl.load(counts_ptr + i) + 127) // 128, 0)
    n_tiles = (tl.load(counts_ptr + g) + 127) // 128
    ts = tl.arange(0, 128)
    a_rows = a_ptr + ns[:, None].to(tl.int64) * L + ts[None, :]
    b_rows = b_ptr + ks[None, :].to(tl.int64) * L + ts[:, None]
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for t in tl.range(0, n_tiles, num_stages=num_stages_t):
        slot = slot0 + t
        col0 = tl.multiple_of(slot * 128, 128)
        a = tl.load(a_rows + col0)
        b = tl.load(b_rows + col0)
        sa = tl.load(sa_ptr + slot * SA_SLOT + ns)
        sb = tl.load(sb_ptr + slot * SB_SLOT + ks)
        acc += (tl.dot(a, b) * sa[:, None]) * sb[None, :]
    out = out_ptr + g.to(tl.int64) * N * K + ns[:, None].to(tl.int64) * K + ks[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty))
