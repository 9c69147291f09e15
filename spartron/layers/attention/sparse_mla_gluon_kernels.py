"""Gluon (Triton's explicit-layout dialect) sparse-MLA forward for Hopper: 64 heads x 64 keys per block.

Imports triton at module level: import it only through `sparse_mla_triton`, which checks that triton
is installed first. Same contract as `sparse_mla_fwd_kernel` in sparse_mla_triton_kernels.py (one
program = one query token x a block of BH heads; invalid ids load zeros and score -inf; lse in natural
log, -inf for a query with no valid id). Why a second forward: plain Triton gives a dot whose result
feeds another dot a rows-only warp layout, so at 64 rows on two warpgroups both compute the whole score
tile, and its pipeliner loads each block's ids synchronously right before issuing that block's
gather. Here the layouts and the schedule are explicit:
- S = Q K^T is split by key columns across the two warpgroups; P goes to the PV product's operand
  layout through one layout conversion, and O = P V is split by value columns.
- Two shared-memory stages: block j+1's gather (cp.async) is issued before block j's score product,
  with ids loaded one block earlier still, so the gather overlaps a whole block of compute.
- The row sum of P is kept per element and reduced once at the end; only the row max crosses
  warpgroups each block.
About 1.25x the Triton kernel's speed at 64 heads (docs/KERNEL_NOTES.md). Hopper only (wgmma); Gluon is
Triton's experimental dialect, written against triton 3.6.
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

LOG2E = 1.4426950408889634


@gluon.jit
def _ids(id_row, k0, topk, s_kv, layout: gl.constexpr, BK: gl.constexpr):
    """Slots k0 .. k0+BK of an id row in `layout`: (row index, 0 where invalid, int64; validity)."""
    kk = k0 + gl.arange(0, BK, layout=layout)
    ids = gl.load(id_row + kk, mask=kk < topk, other=-1)
    valid = (ids >= 0) & (ids < s_kv)
    return gl.where(valid, ids, 0).to(gl.int64), valid


@gluon.jit
def _gather(lat_s, pe_s, kv_base, safe_g, valid_g, safe_r, valid_r, D: gl.constexpr, DV: gl.constexpr,
            DR: gl.constexpr, GL: gl.constexpr, RL: gl.constexpr):
    """Issue one block's kv row gather into a shared-memory stage (zeros where not valid)."""
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, GL))
    async_copy.async_copy_global_to_shared(lat_s, kv_base + safe_g[:, None] * D + cols[None, :],
                                           mask=valid_g[:, None])
    cols_r = gl.arange(0, DR, layout=gl.SliceLayout(0, RL))
    async_copy.async_copy_global_to_shared(pe_s, kv_base + safe_r[:, None] * D + DV + cols_r[None, :],
                                           mask=valid_r[:, None])
    async_copy.commit_group()


@gluon.jit(do_not_specialize=["s_q", "s_kv", "n_heads", "topk"])
def sparse_mla_fwd_gluon_kernel(q_ptr, kv_ptr, ids_ptr, out_ptr, lse_ptr, s_q, s_kv, n_heads, topk, scale_log2,
                                BH: gl.constexpr, BK: gl.constexpr, DV: gl.constexpr, DR: gl.constexpr,
                                KP: gl.constexpr, STAGES: gl.constexpr, EARLY: gl.constexpr):
    """Launch with num_warps=8 (two warpgroups) and BH = 64. STAGES shared-memory stages (2 or 3):
    block j+STAGES-1's gather is issued in block j's step, before its score product (EARLY) or right
    after it (the score wait then also covers block j-1's PV product, which can overlap it)."""
    D: gl.constexpr = DV + DR
    # register layouts: gathers (16-byte vectors along a row), the two MMA accumulators, P as operand
    GL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    RL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BK // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, DV // 2, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    LAT_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, DV], gl.bfloat16)
    PE_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, DR], gl.bfloat16)
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
    kk = gl.arange(0, KP, layout=gl.BlockedLayout([1], [32], [8], [0]))
    ids = gl.load(id_row + kk, mask=kk < topk, other=-1)
    n_used = gl.max(gl.where((ids >= 0) & (ids < s_kv), kk + 1, 0), 0)
    n_blocks = gl.cdiv(n_used, BK)

    # q rows to shared memory once
    hg = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, GL))
    q_rows = q_ptr + (tok * n_heads + hg)[:, None] * D
    q_lat = gl.load(q_rows + gl.arange(0, DV, layout=gl.SliceLayout(0, GL))[None, :],
                    mask=(hg < n_heads)[:, None], other=0.0)
    q_lat_s = gl.allocate_shared_memory(dtype, [BH, DV], QL_S, q_lat)
    hr = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, RL))
    cols_r = gl.arange(0, DR, layout=gl.SliceLayout(0, RL))
    q_pe = gl.load(q_ptr + (tok * n_heads + hr)[:, None] * D + DV + cols_r[None, :], mask=(hr < n_heads)[:, None],
                   other=0.0)
    q_pe_s = gl.allocate_shared_memory(dtype, [BH, DR], QR_S, q_pe)
    lat_s = gl.allocate_shared_memory(dtype, [STAGES, BK, DV], LAT_S)
    pe_s = gl.allocate_shared_memory(dtype, [STAGES, BK, DR], PE_S)

    kv_base = kv_ptr + b * s_kv * D
    # the first STAGES-1 blocks' gathers, one commit group each; the next block's ids
    for i in gl.static_range(STAGES - 1):
        sg, vg = _ids(id_row, i * BK, topk, s_kv, gl.SliceLayout(1, GL), BK)
        sr, vr = _ids(id_row, i * BK, topk, s_kv, gl.SliceLayout(1, RL), BK)
        _gather(lat_s.index(i), pe_s.index(i), kv_base, sg, vg & (i < n_blocks), sr, vr & (i < n_blocks), D, DV,
                DR, GL, RL)
    sg, vg = _ids(id_row, (STAGES - 1) * BK, topk, s_kv, gl.SliceLayout(1, GL), BK)
    sr, vr = _ids(id_row, (STAGES - 1) * BK, topk, s_kv, gl.SliceLayout(1, RL), BK)

    m = gl.full([BH], -1.0e30, gl.float32, layout=gl.SliceLayout(1, S_L))  # finite: an all-invalid block gives p = 0
    l2d = gl.zeros([BH, BK], gl.float32, layout=S_L)
    acc = warpgroup_mma_init(gl.zeros([BH, DV], gl.float32, layout=O_L))
    s0 = gl.zeros([BH, BK], gl.float32, layout=S_L)
    for j in range(0, n_blocks):
        st = j % STAGES
        nxt = (j + STAGES - 1) % STAGES  # the stage block j-1 used, refilled with block j+STAGES-1
        more = j + STAGES - 1 < n_blocks
        async_copy.wait_group(STAGES - 2)  # block j is in shared memory
        if EARLY:  # refill before block j's products: block j-1's PV product must be done in both warpgroups
            acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()
        fence_async_shared()
        if EARLY:
            _gather(lat_s.index(nxt), pe_s.index(nxt), kv_base, sg, vg & more, sr, vr & more, D, DV, DR, GL, RL)
            sg, vg = _ids(id_row, (j + STAGES) * BK, topk, s_kv, gl.SliceLayout(1, GL), BK)
            sr, vr = _ids(id_row, (j + STAGES) * BK, topk, s_kv, gl.SliceLayout(1, RL), BK)
        lat = lat_s.index(st)
        pe = pe_s.index(st)
        s = warpgroup_mma(q_lat_s, lat.permute((1, 0)), s0, use_acc=False, is_async=True)
        s = warpgroup_mma(q_pe_s, pe.permute((1, 0)), s, is_async=True)
        _, v_this = _ids(id_row, j * BK, topk, s_kv, gl.SliceLayout(0, S_L), BK)  # under the score product
        if EARLY:
            s = warpgroup_mma_wait(0, deps=[s])
        else:  # the score product waits out block j-1's PV product too (in order): refill after it
            s, acc = warpgroup_mma_wait(0, deps=[s, acc])
            gl.thread_barrier()
            _gather(lat_s.index(nxt), pe_s.index(nxt), kv_base, sg, vg & more, sr, vr & more, D, DV, DR, GL, RL)
            sg, vg = _ids(id_row, (j + STAGES) * BK, topk, s_kv, gl.SliceLayout(1, GL), BK)
            sr, vr = _ids(id_row, (j + STAGES) * BK, topk, s_kv, gl.SliceLayout(1, RL), BK)
        s = gl.where(v_this[None, :], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, 1))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[:, None])
        l2d = l2d * alpha[:, None] + p
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), P_L), lat, acc, is_async=True)
        m = m_new

    acc = warpgroup_mma_wait(0, deps=[acc])
    async_copy.wait_group(0)
    denom = gl.sum(l2d, 1)
    has = denom > 0.0
    lse = gl.where(has, (m + gl.log2(gl.where(has, denom, 1.0))) * 0.6931471805599453, float("-inf"))
    acc = acc / gl.convert_layout(gl.where(has, denom, 1.0), gl.SliceLayout(1, O_L))[:, None]
    out = gl.convert_layout(acc.to(dtype), GL)
    out_rows = out_ptr + (tok * n_heads + hg)[:, None] * DV
    gl.store(out_rows + gl.arange(0, DV, layout=gl.SliceLayout(0, GL))[None, :], out, mask=(hg < n_heads)[:, None])
    hs = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, S_L))
    gl.store(lse_ptr + tok * n_heads + hs, lse, mask=hs < n_heads)
