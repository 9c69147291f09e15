"""How fast can the 16-head sparse-MLA backward add its dkv rows? The adds alone, no attention math.

    python benchmarks/dkv_atomics_floor.py --commit SHA \
        --seq 16384 --out benchmarks/results/dkv_atomics_floor/dkv_atomics_floor_SHA.json

Per selected (query, key) pair the one-walk backward adds a 576-wide float32 row into dkv (2304 bytes),
reduced over the heads only; at 16k tokens and top-k 2048 that is ~72 GB a step. This times that
traffic by itself on the benchmark's ids (random distinct causal keys, ascending): small programs, BK
rows at a time, as float32 relaxed atomics and, for comparison, as plain stores (wrong sums, same
bytes). Its time is a floor for any per-query backward that adds dkv rows one pair at a time.
`tl.atomic_add` already emits the vector form here (PTX atom...add.v4.f32, whose unused result ptxas
turns into SASS REDG.E.ADD.F32x4), so an inline-asm red.v4 is the same instruction; the variants that
differ are: red.v2 by inline asm (what the backward's MMA-layout tiles can issue without a layout
change), the backward's bf16 kv row gather (1152 bytes a pair, from L2 too) with and without the
adds, since the kernel pays both, and Hopper's bulk reduction (cp.reduce.async.bulk ... add.f32, one
2304-byte row per instruction from shared memory through the TMA unit instead of the SM's load/store
path), written in Gluon with the instruction by inline asm.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import call_times_ms, device_name, write_report  # noqa: E402
from sparse_mla import causal_random_ids, sorted_ids  # noqa: E402

# what each pair's 576 float32 become: tl.atomic_add (v4), stores, nothing, red.v2 by inline asm
ADD_KINDS = ("atomic_add_f32", "store", "none", "red_v2_f32_asm")


def kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def red_v2(ptrs, part, mask):  # as the backward's _red_v2: column pairs by a split, one red.v2 each
        shape: tl.constexpr = [part.shape[0], part.shape[1] // 2, 2]
        lo, hi = tl.split(tl.reshape(part, shape))
        p_lo, _ = tl.split(tl.reshape(ptrs.to(tl.int64, bitcast=True), shape))
        m_lo, _ = tl.split(tl.reshape(mask.to(tl.int32), shape))
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $4, 0; @p red.global.add.v2.f32 [$1], {$2, $3}; mov.u32 $0, 0; }",
            "=r,l,r,r,r", [p_lo, lo, hi, m_lo], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def add_rows(dkv_ptr, kv_ptr, sink_ptr, ids_ptr, topk, BK: tl.constexpr, ADD: tl.constexpr,
                 GATHER: tl.constexpr):
        """ADD 0: atomics, 1: stores, 2: none, 3: red.global.add.v2.f32 (two adjacent columns each, as the
        backward's MMA-layout tiles can add without a layout change); GATHER: also load the pair's bf16 kv
        row (its values feed the added tile, or with no adds a per-program sum stored to `sink`)."""
        tok = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, 512)
        colr = tl.arange(0, 64)
        val = (tok % 7).to(tl.float32) * 1e-3 + 1.0
        lat = tl.full([BK, 512], 1.0, tl.float32) * val
        pe = tl.full([BK, 64], 1.0, tl.float32) * val
        acc = tl.zeros([512], tl.float32)
        for k0 in range(0, topk, BK):
            ids = tl.load(ids_ptr + tok * topk + k0 + tl.arange(0, BK))
            valid = ids >= 0
            safe = tl.where(valid, ids, 0).to(tl.int64)[:, None] * 576
            rows = dkv_ptr + safe
            if GATHER:
                g_lat = tl.load(kv_ptr + safe + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
                g_pe = tl.load(kv_ptr + safe + 512 + colr[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
                if ADD == 2:
                    acc += tl.sum(g_lat, 0) + tl.sum(g_pe, 0).sum() / 512
                else:
                    lat = g_lat * 1e-30 + val
                    pe = g_pe * 1e-30 + val
            if ADD == 1:
                tl.store(rows + cols[None, :], lat, mask=valid[:, None])
                tl.store(rows + 512 + colr[None, :], pe, mask=valid[:, None])
            elif ADD == 0:
                tl.atomic_add(rows + cols[None, :], lat, mask=valid[:, None], sem="relaxed")
                tl.atomic_add(rows + 512 + colr[None, :], pe, mask=valid[:, None], sem="relaxed")
            elif ADD == 3:
                red_v2(rows + cols[None, :], lat, valid[:, None] & (cols[None, :] >= 0))
                red_v2(rows + 512 + colr[None, :], pe, valid[:, None] & (colr[None, :] >= 0))
        if ADD == 2:
            tl.store(sink_ptr + tok * 512 + cols, acc)
    return add_rows


def bulk_kernel():
    """Gluon: each program fills a [BS, 576] float32 tile in shared memory once, then every one of its
    pairs is one cp.reduce.async.bulk of a 2304-byte tile row into dkv[id], issued by one thread
    (BI ids a round, one per thread). The instruction takes a shared-memory address, which Gluon does
    not expose: the tile is the kernel's only allocation, so it sits at the start of Triton's dynamic
    shared memory (`global_smem`); the result check against the atomics' dkv guards that."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

    @gluon.jit
    def bulk_rows(dkv_ptr, ids_ptr, topk, BS: gl.constexpr, BI: gl.constexpr):
        tok = gl.program_id(0).to(gl.int64)
        TL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])
        IL: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        val = (tok % 7).to(gl.float32) * 1e-3 + 1.0
        tile = gl.allocate_shared_memory(gl.float32, [BS, 1024], SL)  # row r: 576 values, r * 4096 bytes
        tile.store(gl.full([BS, 1024], 1.0, gl.float32, TL) * val)
        fence_async_shared()
        gl.thread_barrier()
        slot = gl.arange(0, BI, layout=IL)
        src = ((slot % BS) * 4096).to(gl.int32)
        done = gl.zeros([BI], gl.int32, IL)
        for k0 in range(0, topk, BI):
            ids = gl.load(ids_ptr + tok * topk + k0 + slot)
            dst = dkv_ptr + gl.where(ids >= 0, ids, 0).to(gl.int64) * 576
            done += gl.inline_asm_elementwise(
                """{ .reg .pred p; .reg .b32 s;
                setp.ge.s32 p, $2, 0;
                mov.u32 s, global_smem; add.u32 s, s, $3;
                @p cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$1], [s], 2304;
                @p cp.async.bulk.commit_group;
                mov.u32 $0, 0; }""",
                "=r,l,r,r", [dst, ids, src], dtype=gl.int32, is_pure=False, pack=1)
        done += gl.inline_asm_elementwise("cp.async.bulk.wait_group.read 0; mov.u32 $0, 0;", "=r,r", [done],
                                          dtype=gl.int32, is_pure=False, pack=1)
        gl.store(ids_ptr + tok * topk + slot, gl.load(ids_ptr + tok * topk + slot) + done)  # + 0: keeps `done`
    return bulk_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--commit", default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    ids = sorted_ids(causal_random_ids(args.seq, args.topk, device))[0].contiguous()
    n_sel = int((ids >= 0).sum())
    dkv = torch.zeros(args.seq, 576, device=device, dtype=torch.float32)
    kv = torch.randn(args.seq, 576, device=device, dtype=torch.bfloat16)
    sink = torch.empty(args.seq, 512, device=device, dtype=torch.float32)
    kern, bulk = kernel(), bulk_kernel()
    rows, checks = [], {}

    def record(row, fn):
        for _ in range(2):
            fn()
        times = call_times_ms(fn, args.iters, device)
        ms = sorted(times)[len(times) // 2]
        row.update(ms=ms, steps_ms=times, tb_per_s_dkv=n_sel * 2304 / ms / 1e9)
        print(json.dumps({k: v for k, v in row.items() if k != "steps_ms"}), flush=True)
        rows.append(row)

    for gather in (False, True):
        for add in range(4):
            if add == 2 and not gather:
                continue
            for bk, warps in ((16, 4), (32, 4), (32, 8)) if not gather else ((16, 4), (32, 4)):
                def fn(bk=bk, warps=warps, add=add, gather=gather):
                    kern[(args.seq,)](dkv, kv, sink, ids, ids.shape[1], BK=bk, ADD=add, GATHER=gather,
                                      num_warps=warps)
                record(dict(kind=ADD_KINDS[add], gather_kv_bf16=gather, block_rows=bk, num_warps=warps), fn)
                if add == 3 and not gather and (bk, warps) == (16, 4):  # its sums against the atomics'
                    dkv.zero_()
                    fn()
                    v2_sums = dkv.clone()
                    dkv.zero_()
                    kern[(args.seq,)](dkv, kv, sink, ids, ids.shape[1], BK=16, ADD=0, GATHER=False, num_warps=4)
                    checks["red_v2_rel_err_vs_atomics"] = ((v2_sums - dkv).norm() / dkv.norm()).item()
    # one atomic pass as the reference sums for the bulk reduction's check
    dkv.zero_()
    kern[(args.seq,)](dkv, kv, sink, ids, ids.shape[1], BK=16, ADD=0, GATHER=False, num_warps=4)
    ref = dkv.clone()
    for bs, bi, warps in ((16, 128, 4), (16, 256, 8), (8, 128, 4)):
        def fn(bs=bs, bi=bi, warps=warps):
            bulk[(args.seq,)](dkv, ids, ids.shape[1], BS=bs, BI=bi, num_warps=warps)
        try:
            dkv.zero_()
            fn()
            err = ((dkv - ref).norm() / ref.norm()).item()
            checks[f"bulk_{bs}x{bi}x{warps}_rel_err_vs_atomics"] = err
            record(dict(kind="bulk_reduce_f32", gather_kv_bf16=False, smem_rows=bs, ids_per_round=bi,
                        num_warps=warps, rel_err_vs_atomics=err), fn)
        except Exception as e:  # compile / launch failure recorded, not fatal
            rows.append(dict(kind="bulk_reduce_f32", smem_rows=bs, ids_per_round=bi, num_warps=warps,
                             error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(rows[-1], flush=True)
    report = dict(benchmark="dkv_atomics_floor", device=device_name(True), torch=torch.__version__,
                  triton=__import__("triton").__version__, commit=args.commit, seq=args.seq, topk=args.topk,
                  selected_pairs=n_sel, bytes_per_pair=2304, gather_bytes_per_pair=1152,
                  dkv_bytes=dkv.numel() * 4, l2_bytes=torch.cuda.get_device_properties(device).L2_cache_size,
                  iters=args.iters, warmup=2, checks=checks, results=rows)
    if args.out:
        write_report(args.out, report)


if __name__ == "__main__":
    main()
