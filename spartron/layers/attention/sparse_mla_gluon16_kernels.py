"""Gluon sparse-MLA forward for Hopper at up to 16 heads: keys along the warpgroup MMA's rows.

Imports triton at module level: import it only through `sparse_mla_triton`, which checks that triton
is installed first. Same contract as the other forwards (one program = one query token x a block of
16 heads; invalid ids load zeros and score -inf; lse in natural log, -inf for a query with no valid
id). Why keys as rows: wgmma's rows come in 64s, so 16 heads as rows would waste three quarters of
every product. With the 64 gathered keys as rows the products are transposed (one warpgroup, N = 16):
- S^T [64, 16] = K_lat q_lat^T + K_pe q_pe^T, the gathered stage as A, q (once in shared memory) as B;
- the online softmax runs down the key axis, one max per head column; the row sum is kept per
  element and reduced once at the end;
- P [16, 64] goes to shared memory (K-major, as q is; P^T as an MN-major 32-byte-swizzled B faulted)
  and O^T [512, 16] += V^T P^T takes the stage's latent transposed (MN-major A), so each gathered
  row is read by the tensor cores twice and never copied to registers.
Not the default: on the H200 at 16k x 16 heads, top-k 2048 every schedule here runs 8.1-8.3 ms
against 7.06-7.09 for the Triton 16-row kernel, and the gather alone takes 4.0 ms
(benchmarks/results/sparse_mla_fwd16_4225a68.json, sparse_mla_fwd16_d4850c5.json). Neither two
blocks in flight (3 stages) nor the refill under the score product nor the softmax under the PV
product (the overlap kernel) moved it, and A from registers (ldmatrix chunks under the products)
was slower still (9.4-9.6 ms, sparse_mla_fwd16_rs_a48283a.json): the step is limited by something
all of them share (one warp per scheduler, or the gather path at one program per SM), not by the
order of its parts. Kept, tested, as the base for that profile. Hopper only (wgmma); written against triton 3.6's Gluon.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)


@gluon.jit
def _ids(id_row, k0, topk, s_kv, layout: gl.constexpr, BK: gl.constexpr):
    """Slots k0 .. k0+BK of an id row in `layout`: (row index, 0 where invalid; validity). Kept int32
    between steps (registers); widened where an address is formed."""
    kk = k0 + gl.arange(0, BK, layout=layout)
    ids = gl.load(id_row + kk, mask=kk < topk, other=-1)
    valid = (ids >= 0) & (ids < s_kv)
    return gl.where(valid, ids, 0), valid


@gluon.jit
def _rows(id_row, k0, topk, s_kv, layout: gl.constexpr, BK: gl.constexpr):
    """Slots k0 .. k0+BK of an id row in `layout` as one int32 each, -1 where invalid: what a step
    carries for a later gather (validity folded in, so no predicate registers)."""
    kk = k0 + gl.arange(0, BK, layout=layout)
    ids = gl.load(id_row + kk, mask=kk < topk, other=-1)
    return gl.where((ids >= 0) & (ids < s_kv), ids, -1)


@gluon.jit
def _row_ptrs(kv_base, rows, col0: gl.constexpr, D: gl.constexpr, W: gl.constexpr, L: gl.constexpr):
    """Pointers to W columns from col0 of kv rows `rows` (row 0 where -1), and the row mask."""
    cols = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, L))
    return kv_base + gl.maximum(rows, 0).to(gl.int64)[:, None] * D + cols[None, :], (rows >= 0)[:, None]


@gluon.jit
def _gather(dst, kv_base, safe, valid, col0: gl.constexpr, D: gl.constexpr, W: gl.constexpr, L: gl.constexpr):
    """Issue the cp.async gather of W columns from col0 of the rows `safe` into dst (zeros where not
    valid), as one commit group."""
    cols = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, L))
    async_copy.async_copy_global_to_shared(dst, kv_base + safe.to(gl.int64)[:, None] * D + cols[None, :],
                                           mask=valid[:, None])
    async_copy.commit_group()


@gluon.jit(do_not_specialize=["s_q", "s_kv", "n_heads", "topk"])
def sparse_mla_fwd16_gluon_kernel(q_ptr, kv_ptr, ids_ptr, out_ptr, lse_ptr, s_q, s_kv, n_heads, topk, scale_log2,
                                  BH: gl.constexpr, BK: gl.constexpr, DV: gl.constexpr, DR: gl.constexpr,
                                  KP: gl.constexpr, STAGES: gl.constexpr, EARLY: gl.constexpr):
    """Launch with num_warps=4 (one warpgroup), BH = 16 (the MMA's N), BK = 64, one program per token
    and 16-head block. Per step j: the latent of block j+STAGES-1 and the rope rows of block j+1 are
    gathered into the slots block j-1 used, once block j-1's PV product is done: while block j's score
    product runs (EARLY) or after it (the score wait then covers that PV product too, in issue order)."""
    D: gl.constexpr = DV + DR
    GL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])  # latent rows, 16-byte vectors
    RL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # rope rows
    OL: gl.constexpr = gl.BlockedLayout([8, 1], [32, 1], [1, 4], [0, 1])  # O^T columns = out rows, for the store
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    LAT_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, DV], gl.bfloat16)
    PE_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, DR], gl.bfloat16)
    P_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BK], gl.bfloat16)
    QL_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, DV], gl.bfloat16)
    QR_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, DR], gl.bfloat16)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    pid = gl.program_id(0)
    n_hb = gl.cdiv(n_heads, BH)
    tok = (pid // n_hb).to(gl.int64)
    h0 = (pid % n_hb) * BH
    b = tok // s_q
    id_row = ids_ptr + tok * topk
    # used slots: 1 + the last valid one, so the -1 padding at the end of short rows costs nothing
    kk = gl.arange(0, KP, layout=gl.BlockedLayout([1], [32], [4], [0]))
    ids = gl.load(id_row + kk, mask=kk < topk, other=-1)
    n_used = gl.max(gl.where((ids >= 0) & (ids < s_kv), kk + 1, 0), 0)
    n_blocks = gl.cdiv(n_used, BK)

    # q rows to shared memory once (heads past n_heads: zeros, their columns are never stored)
    hg = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, GL))
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, GL))
    q_lat = gl.load(q_ptr + (tok * n_heads + hg)[:, None] * D + cols[None, :], mask=(hg < n_heads)[:, None], other=0.0)
    q_lat_s = gl.allocate_shared_memory(dtype, [BH, DV], QL_S, q_lat)
    hr = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, RL))
    cols_r = DV + gl.arange(0, DR, layout=gl.SliceLayout(0, RL))
    q_pe = gl.load(q_ptr + (tok * n_heads + hr)[:, None] * D + cols_r[None, :], mask=(hr < n_heads)[:, None], other=0.0)
    q_pe_s = gl.allocate_shared_memory(dtype, [BH, DR], QR_S, q_pe)
    lat_s = gl.allocate_shared_memory(dtype, [STAGES, BK, DV], LAT_S)
    pe_s = gl.allocate_shared_memory(dtype, [2, BK, DR], PE_S)

    kv_base = kv_ptr + b * s_kv * D
    # prologue commit groups: rope 0, latent 0 .. STAGES-2; then the ids of the next gathers
    sr, vr = _ids(id_row, 0, topk, s_kv, gl.SliceLayout(1, RL), BK)
    _gather(pe_s.index(0), kv_base, sr, vr, DV, D, DR, RL)
    for i in gl.static_range(STAGES - 1):
        sg, vg = _ids(id_row, i * BK, topk, s_kv, gl.SliceLayout(1, GL), BK)
        _gather(lat_s.index(i), kv_base, sg, vg & (i < n_blocks), 0, D, DV, GL)
    sg, vg = _ids(id_row, (STAGES - 1) * BK, topk, s_kv, gl.SliceLayout(1, GL), BK)
    sr, vr = _ids(id_row, BK, topk, s_kv, gl.SliceLayout(1, RL), BK)
    _, v_this = _ids(id_row, 0, topk, s_kv, gl.SliceLayout(1, S_L), BK)  # block j's score mask, a step early

    m = gl.full([BH], -1.0e30, gl.float32, layout=gl.SliceLayout(0, S_L))  # finite: an all-invalid block gives p = 0
    l2d = gl.zeros([BK, BH], gl.float32, layout=S_L)
    acc = warpgroup_mma_init(gl.zeros([DV, BH], gl.float32, layout=S_L))
    s0 = gl.zeros([BK, BH], gl.float32, layout=S_L)
    for j in range(0, n_blocks):
        st = j % STAGES
        nxt = (j + STAGES - 1) % STAGES  # the latent slot block j-1 used, refilled with block j+STAGES-1
        more = j + STAGES - 1 < n_blocks
        # block j's rope and latent are in (pending at most: the later latent gathers)
        async_copy.wait_group(STAGES - 2)
        if EARLY:  # block j-1's PV product read its latent slot and P^T (in the rope slot): done first
            acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()
        fence_async_shared()
        lat = lat_s.index(st)
        pe = pe_s.index(j % 2)
        s = warpgroup_mma(lat, q_lat_s.permute((1, 0)), s0, use_acc=False, is_async=True)
        s = warpgroup_mma(pe, q_pe_s.permute((1, 0)), s, is_async=True)
        if EARLY:  # the refill's cp.async issue runs while the tensor cores do the score product
            _gather(pe_s.index((j + 1) % 2), kv_base, sr, vr & (j + 1 < n_blocks), DV, D, DR, RL)
            _gather(lat_s.index(nxt), kv_base, sg, vg & more, 0, D, DV, GL)
            sg, vg = _ids(id_row, (j + STAGES) * BK, topk, s_kv, gl.SliceLayout(1, GL), BK)
            sr, vr = _ids(id_row, (j + 2) * BK, topk, s_kv, gl.SliceLayout(1, RL), BK)
            s = warpgroup_mma_wait(0, deps=[s])
        else:  # the score product waits out block j-1's PV product too (in order): refill after it
            s, acc = warpgroup_mma_wait(0, deps=[s, acc])
            gl.thread_barrier()
            _gather(pe_s.index((j + 1) % 2), kv_base, sr, vr & (j + 1 < n_blocks), DV, D, DR, RL)
            _gather(lat_s.index(nxt), kv_base, sg, vg & more, 0, D, DV, GL)
            sg, vg = _ids(id_row, (j + STAGES) * BK, topk, s_kv, gl.SliceLayout(1, GL), BK)
            sr, vr = _ids(id_row, (j + 2) * BK, topk, s_kv, gl.SliceLayout(1, RL), BK)
        s = gl.where(v_this[:, None], s * scale_log2, float("-inf"))
        _, v_this = _ids(id_row, (j + 1) * BK, topk, s_kv, gl.SliceLayout(1, S_L), BK)
        m_new = gl.maximum(m, gl.max(s, 0))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[None, :])
        l2d = l2d * alpha[None, :] + p
        acc = acc * alpha[None, :]
        p_s = pe._reinterpret(dtype, [BH, BK], P_S)  # block j's rope rows are dead once S^T is done
        gl.thread_barrier()  # every warp's score product has read them
        p_s.store(gl.permute(p.to(dtype), (1, 0)))  # P [heads, keys]: K-major B, as q is for S^T
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(lat.permute((1, 0)), p_s.permute((1, 0)), acc, is_async=True)
        m = m_new

    acc = warpgroup_mma_wait(0, deps=[acc])
    async_copy.wait_group(0)
    denom = gl.sum(l2d, 0)
    has = denom > 0.0
    lse = gl.where(has, (m + gl.log2(gl.where(has, denom, 1.0))) * 0.6931471805599453, float("-inf"))
    acc = acc / gl.where(has, denom, 1.0)[None, :]
    out = gl.convert_layout(acc.to(dtype), OL)
    ho = h0 + gl.arange(0, BH, layout=gl.SliceLayout(0, OL))
    out_cols = out_ptr + (tok * n_heads + ho)[None, :] * DV
    gl.store(out_cols + gl.arange(0, DV, layout=gl.SliceLayout(1, OL))[:, None], out, mask=(ho < n_heads)[None, :])
    hs = h0 + gl.arange(0, BH, layout=gl.SliceLayout(0, S_L))
    gl.store(lse_ptr + tok * n_heads + hs, lse, mask=hs < n_heads)


@gluon.jit(do_not_specialize=["s_q", "s_kv", "n_heads", "topk"])
def sparse_mla_fwd16_overlap_kernel(q_ptr, kv_ptr, ids_ptr, out_ptr, lse_ptr, s_q, s_kv, n_heads, topk, scale_log2,
                                    BH: gl.constexpr, BK: gl.constexpr, DV: gl.constexpr, DR: gl.constexpr,
                                    KP: gl.constexpr):
    """The same product, with block j+1's softmax under block j's PV product: step j issues block
    j+1's score product, then block j's PV product, then block j+2's gather, and waits for the score
    alone (the PV keeps running) before the softmax. Every wait and both products sit in one step,
    so no wgmma is in flight across the loop's back edge (ptxas serialises every wgmma otherwise,
    warning C7514). Three latent slots are busy at once (PV, score, landing), so the rope rows come
    through registers, loaded a step ahead, into one shared slot, and P has its own 2 KB: 220 KB.
    Launch with num_warps=4, BH = 16, BK = 64."""
    D: gl.constexpr = DV + DR
    GL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    RL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    OL: gl.constexpr = gl.BlockedLayout([8, 1], [32, 1], [1, 4], [0, 1])
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    LAT_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, DV], gl.bfloat16)
    PE_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, DR], gl.bfloat16)
    P_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BK], gl.bfloat16)
    QL_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, DV], gl.bfloat16)
    QR_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, DR], gl.bfloat16)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    pid = gl.program_id(0)
    n_hb = gl.cdiv(n_heads, BH)
    tok = (pid // n_hb).to(gl.int64)
    h0 = (pid % n_hb) * BH
    b = tok // s_q
    id_row = ids_ptr + tok * topk
    kk = gl.arange(0, KP, layout=gl.BlockedLayout([1], [32], [4], [0]))
    ids = gl.load(id_row + kk, mask=kk < topk, other=-1)
    n_used = gl.max(gl.where((ids >= 0) & (ids < s_kv), kk + 1, 0), 0)
    n_blocks = gl.cdiv(n_used, BK)

    hg = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, GL))
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, GL))
    q_lat = gl.load(q_ptr + (tok * n_heads + hg)[:, None] * D + cols[None, :], mask=(hg < n_heads)[:, None], other=0.0)
    q_lat_s = gl.allocate_shared_memory(dtype, [BH, DV], QL_S, q_lat)
    hr = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, RL))
    cols_r = DV + gl.arange(0, DR, layout=gl.SliceLayout(0, RL))
    q_pe = gl.load(q_ptr + (tok * n_heads + hr)[:, None] * D + cols_r[None, :], mask=(hr < n_heads)[:, None], other=0.0)
    q_pe_s = gl.allocate_shared_memory(dtype, [BH, DR], QR_S, q_pe)
    lat_s = gl.allocate_shared_memory(dtype, [3, BK, DV], LAT_S)
    p_s = gl.allocate_shared_memory(dtype, [BH, BK], P_S)

    kv_base = kv_ptr + b * s_kv * D
    for i in gl.static_range(2):  # latent of blocks 0 and 1, one commit group each
        ptrs, mask = _row_ptrs(kv_base, _rows(id_row, i * BK, topk, s_kv, gl.SliceLayout(1, GL), BK), 0, D, DV, GL)
        async_copy.async_copy_global_to_shared(lat_s.index(i), ptrs, mask=mask)
        async_copy.commit_group()
    rg = _rows(id_row, 2 * BK, topk, s_kv, gl.SliceLayout(1, GL), BK)  # block 2's, refilled in step 0
    ptrs, mask = _row_ptrs(kv_base, _rows(id_row, 0, topk, s_kv, gl.SliceLayout(1, RL), BK), DV, D, DR, RL)
    pe_s = gl.allocate_shared_memory(dtype, [BK, DR], PE_S, gl.load(ptrs, mask=mask, other=0.0))
    ptrs, mask = _row_ptrs(kv_base, _rows(id_row, BK, topk, s_kv, gl.SliceLayout(1, RL), BK), DV, D, DR, RL)
    pe_next = gl.load(ptrs, mask=mask, other=0.0)  # block 1's rope rows
    rr = _rows(id_row, 2 * BK, topk, s_kv, gl.SliceLayout(1, RL), BK)
    v_this = _rows(id_row, 0, topk, s_kv, gl.SliceLayout(1, S_L), BK) >= 0
    async_copy.wait_group(1)
    fence_async_shared()
    gl.thread_barrier()
    s = warpgroup_mma(lat_s.index(0), q_lat_s.permute((1, 0)), gl.zeros([BK, BH], gl.float32, layout=S_L),
                      use_acc=False, is_async=True)
    s = warpgroup_mma(pe_s, q_pe_s.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s])
    s = gl.where(v_this[:, None], s * scale_log2, float("-inf"))
    m = gl.maximum(gl.full([BH], -1.0e30, gl.float32, layout=gl.SliceLayout(0, S_L)), gl.max(s, 0))  # finite
    l2d = gl.exp2(s - m[None, :])
    p_s.store(gl.permute(l2d.to(dtype), (1, 0)))
    gl.thread_barrier()
    pe_s.store(pe_next)
    acc = gl.zeros([DV, BH], gl.float32, layout=S_L)
    for j in range(0, n_blocks):  # block j's P is in p_s, block j+1's rope rows in pe_s
        pe_ptrs, pe_mask = _row_ptrs(kv_base, rr, DV, D, DR, RL)
        pe_next = gl.load(pe_ptrs, mask=pe_mask, other=0.0)  # block j+2's rope rows, stored at the step's end
        rr = _rows(id_row, (j + 3) * BK, topk, s_kv, gl.SliceLayout(1, RL), BK)
        v_this = _rows(id_row, (j + 1) * BK, topk, s_kv, gl.SliceLayout(1, S_L), BK) >= 0
        async_copy.wait_group(0)  # block j+1's latent
        fence_async_shared()
        gl.thread_barrier()
        s = warpgroup_mma(lat_s.index((j + 1) % 3), q_lat_s.permute((1, 0)), gl.zeros([BK, BH], gl.float32,
                                                                                    layout=S_L),
                          use_acc=False, is_async=True)
        s = warpgroup_mma(pe_s, q_pe_s.permute((1, 0)), s, is_async=True)
        acc = warpgroup_mma(lat_s.index(j % 3).permute((1, 0)), p_s.permute((1, 0)), acc, is_async=True)
        # under both products: block j+2's latent into block j-1's slot (its PV product ended last step)
        lat_ptrs, lat_mask = _row_ptrs(kv_base, rg, 0, D, DV, GL)
        async_copy.async_copy_global_to_shared(lat_s.index((j + 2) % 3), lat_ptrs, mask=lat_mask)
        async_copy.commit_group()
        rg = _rows(id_row, (j + 3) * BK, topk, s_kv, gl.SliceLayout(1, GL), BK)
        s = warpgroup_mma_wait(1, deps=[s])  # block j+1's scores; block j's PV product still runs
        s = gl.where(v_this[:, None], s * scale_log2, float("-inf"))  # past the last block: all -inf, p = 0
        m_new = gl.maximum(m, gl.max(s, 0))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[None, :])
        l2d = l2d * alpha[None, :] + p
        m = m_new
        acc = warpgroup_mma_wait(0, deps=[acc])
        acc = acc * alpha[None, :]
        gl.thread_barrier()  # both products are done with p_s and pe_s
        p_s.store(gl.permute(p.to(dtype), (1, 0)))
        pe_s.store(pe_next)

    acc = warpgroup_mma_wait(0, deps=[acc])
    async_copy.wait_group(0)
    denom = gl.sum(l2d, 0)
    has = denom > 0.0
    lse = gl.where(has, (m + gl.log2(gl.where(has, denom, 1.0))) * 0.6931471805599453, float("-inf"))
    acc = acc / gl.where(has, denom, 1.0)[None, :]
    out = gl.convert_layout(acc.to(dtype), OL)
    ho = h0 + gl.arange(0, BH, layout=gl.SliceLayout(0, OL))
    out_cols = out_ptr + (tok * n_heads + ho)[None, :] * DV
    gl.store(out_cols + gl.arange(0, DV, layout=gl.SliceLayout(1, OL))[:, None], out, mask=(ho < n_heads)[None, :])
    hs = h0 + gl.arange(0, BH, layout=gl.SliceLayout(0, S_L))
    gl.store(lse_ptr + tok * n_heads + hs, lse, mask=hs < n_heads)
