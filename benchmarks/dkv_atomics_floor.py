"""How fast can the 16-head sparse-MLA backward add its dkv rows? The adds alone, no attention math.

    python benchmarks/dkv_atomics_floor.py --seq 16384 --out benchmarks/results/dkv_atomics_floor.json --commit SHA

Per selected (query, key) pair the one-walk backward adds a 576-wide float32 row into dkv (2304 bytes),
reduced over the heads only; at 16k tokens and top-k 2048 that is ~72 GB a step. This times that
traffic by itself on the benchmark's ids (random distinct causal keys, ascending): small programs, BK
rows at a time, as float32 relaxed atomics and, for comparison, as plain stores (wrong sums, same
bytes). Its time is a floor for any per-query backward that adds dkv rows one pair at a time.
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


def kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rows(dkv_ptr, ids_ptr, topk, BK: tl.constexpr, STORE: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, 512)
        colr = tl.arange(0, 64)
        val = (tok % 7).to(tl.float32) * 1e-3 + 1.0
        lat = tl.full([BK, 512], 1.0, tl.float32) * val
        pe = tl.full([BK, 64], 1.0, tl.float32) * val
        for k0 in range(0, topk, BK):
            ids = tl.load(ids_ptr + tok * topk + k0 + tl.arange(0, BK))
            valid = ids >= 0
            rows = dkv_ptr + tl.where(valid, ids, 0).to(tl.int64)[:, None] * 576
            if STORE:
                tl.store(rows + cols[None, :], lat, mask=valid[:, None])
                tl.store(rows + 512 + colr[None, :], pe, mask=valid[:, None])
            else:
                tl.atomic_add(rows + cols[None, :], lat, mask=valid[:, None], sem="relaxed")
                tl.atomic_add(rows + 512 + colr[None, :], pe, mask=valid[:, None], sem="relaxed")
    return add_rows


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
    kern = kernel()
    rows = []
    for store in (False, True):
        for bk, warps in ((8, 4), (16, 4), (32, 4), (32, 8)):
            def fn(bk=bk, warps=warps, store=store):
                kern[(args.seq,)](dkv, ids, ids.shape[1], BK=bk, STORE=store, num_warps=warps)
            for _ in range(2):
                fn()
            times = call_times_ms(fn, args.iters, device)
            ms = sorted(times)[len(times) // 2]
            row = dict(kind="store" if store else "atomic_add_f32", block_rows=bk, num_warps=warps, ms=ms,
                       steps_ms=times, tb_per_s=n_sel * 2304 / ms / 1e9)
            print(json.dumps({k: v for k, v in row.items() if k != "steps_ms"}), flush=True)
            rows.append(row)
    report = dict(benchmark="dkv_atomics_floor", device=device_name(True), torch=torch.__version__,
                  triton=__import__("triton").__version__, commit=args.commit, seq=args.seq, topk=args.topk,
                  selected_pairs=n_sel, bytes_per_pair=2304, dkv_bytes=dkv.numel() * 4,
                  l2_bytes=torch.cuda.get_device_properties(device).L2_cache_size, iters=args.iters,
                  warmup=2, results=rows)
    if args.out:
        write_report(args.out, report)


if __name__ == "__main__":
    main()
