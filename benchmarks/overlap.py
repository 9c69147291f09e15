"""Can the token exchange hide under the experts' GEMMs on this machine? Contention, measured.

    python benchmarks/overlap.py --out benchmarks/results/overlap/overlap.json   # 2 CUDA GPUs

Intra-layer micro-batching (train.intra_layer_micro_batches = 2) only pays when one micro-batch's
all-to-all runs while the other's compute runs *and neither slows down much*. This measures that
directly on the shapes of the offload benchmark's MoE layer (one micro-batch of two: the rows one
rank's experts receive, and the rows it sends to the other rank), per rank:

- `gemm`: the experts' forward (three `torch._grouped_mm`, SwiGLU) alone;
- `comm`: the exchange alone, by one of two transports:
  - `nccl`: `all_to_all_single` (NCCL kernels: they occupy SMs while they move data),
  - `copy_engine`: the MoE dispatcher's copy-engine exchange (`ExchangeBuffer.exchange`,
    comm/copy_engine.py): peer copies into the receiver's symmetric-memory slot
    (cudaMemcpyAsync over NVLink: the copy engines, no SMs), one barrier, a copy out;
- `both`: the exchange on a side stream started with the GEMMs on the compute stream.
`hidden_fraction` = (gemm + comm - both) / min(gemm, comm): 1 = the shorter one fully hidden at no
cost to the other, 0 = no gain from overlapping. `over_longer_ms` = both - max(gemm, comm): what
sharing the GPU costs over a perfect overlap (SMs or memory bandwidth taken by the other). Also
with the SM carve-out for GEMMs (torch._C._set_sm_carveout_experimental) where this torch has it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from spartron.runtime.metrics import git_commit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, median_ms, run_ranks, write_report  # noqa: E402

WORLD = 2


def hidden_fraction(gemm_ms: float, comm_ms: float, both_ms: float) -> float:
    """Share of the shorter of the two that overlapping saved (1 = all of it, 0 = nothing, < 0 = worse)."""
    return (gemm_ms + comm_ms - both_ms) / min(gemm_ms, comm_ms)


def _rank(rank: int, world: int, rows: int, experts: int, dim: int, inter: int, iters: int, warmup: int) -> dict:
    dev = torch.device("cuda", rank)
    torch.manual_seed(rank)
    bf16 = torch.bfloat16
    x = torch.randn(rows, dim, device=dev, dtype=bf16)
    w1, w3 = (torch.randn(experts, dim, inter, device=dev, dtype=bf16) * 0.02 for _ in range(2))
    w2 = torch.randn(experts, inter, dim, device=dev, dtype=bf16) * 0.02
    offs = torch.full((experts,), rows // experts, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    offs[-1] = rows

    def gemm():
        h = torch.nn.functional.silu(torch._grouped_mm(x, w1, offs=offs)) * torch._grouped_mm(x, w3, offs=offs)
        return torch._grouped_mm(h, w2, offs=offs)

    send = torch.randn(rows, dim, device=dev, dtype=bf16)  # half stays, half goes to the peer
    recv = torch.empty_like(send)
    half = [rows // world] * world

    def nccl():
        dist.all_to_all_single(recv, send, half, half)

    transports = {"nccl": nccl}
    try:  # the MoE dispatcher's own exchange (spartron_symm::exchange's protocol), the same rows
        from spartron.comm.copy_engine import ExchangeBuffer

        buffer = ExchangeBuffer(dist.group.WORLD)  # symmetric memory, allocated collectively at the first call
        counts = [rows // world] * (world * world)  # every rank sends half its rows to each rank

        def copy_engine():
            buffer.exchange(send, counts)

        copy_engine()  # allocate now: an allocation error lands in copy_engine_error
        transports["copy_engine"] = copy_engine
        ce_error = None
    except Exception as err:  # noqa: BLE001 - reported in the JSON, the NCCL rows still run
        ce_error = f"{type(err).__name__}: {err}"

    side = torch.cuda.Stream(dev)

    def timed(fn) -> float:  # both ranks start each call together
        return median_ms(fn, iters, warmup, dev, setup=dist.barrier)

    def overlapped(comm):
        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                comm()
            gemm()
            torch.cuda.current_stream().wait_stream(side)
        return both

    carveouts = [0]
    if hasattr(torch._C, "_set_sm_carveout_experimental"):
        carveouts += [16, 32]
    rows_out = []
    gemm_alone = {}
    for carve in carveouts:
        if carve:
            torch._C._set_sm_carveout_experimental(carve)
        gemm_alone[carve] = timed(gemm)
        for name, comm in transports.items():
            try:
                comm_ms = timed(comm)
                both_ms = timed(overlapped(comm))
            except Exception as err:  # noqa: BLE001 - reported, the other transports still run
                rows_out.append({"transport": name, "sm_carveout": carve, "error": f"{type(err).__name__}: {err}"})
                continue
            rows_out.append({"transport": name, "sm_carveout": carve, "gemm_ms": gemm_alone[carve],
                             "comm_ms": comm_ms, "both_ms": both_ms,
                             "hidden_fraction": hidden_fraction(gemm_alone[carve], comm_ms, both_ms),
                             "over_longer_ms": both_ms - max(gemm_alone[carve], comm_ms)})
        if carve:
            torch._C._set_sm_carveout_experimental(None)
    flops = 3 * 2 * rows * dim * inter
    return {"rows": rows_out, "copy_engine_error": ce_error,
            "gemm_tflops": flops / (gemm_alone[0] * 1e-3) / 1e12,
            "exchange_bytes_to_peer": rows // world * dim * 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=98304, help="rows per rank (one of two micro-batches)")
    parser.add_argument("--experts", type=int, default=32, help="local experts")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=1408)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if torch.cuda.device_count() < WORLD:
        raise SystemExit(f"benchmarks/overlap.py needs {WORLD} CUDA GPUs, found {torch.cuda.device_count()}")
    ranks = run_ranks(_rank, WORLD, args.rows, args.experts, args.dim, args.inter, args.iters, args.warmup,
                      cuda=True)
    r0 = ranks[0]
    print(f"== grouped GEMMs ({args.rows} rows, {args.experts} experts, {args.dim}->{args.inter}) vs "
          f"exchange of {r0['exchange_bytes_to_peer'] / 2**20:.0f} MiB to the peer; rank 0, median ms")
    print(f"   GEMMs alone run at {r0['gemm_tflops']:.0f} TFLOP/s")
    if r0["copy_engine_error"]:
        print("   copy_engine transport unavailable:", r0["copy_engine_error"])
    print(f"{'transport':>12} {'carveout':>8} {'gemm':>7} {'comm':>7} {'both':>7} {'hidden':>7} {'over longer':>12}")
    for row in r0["rows"]:
        if "error" in row:
            print(f"{row['transport']:>12} {row['sm_carveout']:>8} failed: {row['error']}")
            continue
        print(f"{row['transport']:>12} {row['sm_carveout']:>8} {row['gemm_ms']:7.2f} {row['comm_ms']:7.2f} "
              f"{row['both_ms']:7.2f} {row['hidden_fraction']:7.2f} {row['over_longer_ms']:12.2f}")
    write_report(args.out, {"benchmark": "overlap", "device": device_name(True), "torch": torch.__version__,
                            "commit": git_commit(), "shapes": vars(args) | {"out": None}, "ranks": ranks})


if __name__ == "__main__":
    main()
