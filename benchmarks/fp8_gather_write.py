"""What model.fp8.param_gather does after each all-gather of an FP8 weight (gathered.JointBlocks.write): place the
gathered E4M3 values in their GEMM's joint operand ([w1; w3] for the experts) and, transposed, in the operand dgrad
reads. Times the Triton kernel (`triton_backend.place_gathered`: one read, 128 x 128 tiles) against the torch
copies it replaced (`copy_` of the transposed view, then of the rows) at DeepSeek-V3's per-rank weights: the
experts' w1 / w3 pair and w2 (8 local experts, dim 7168, moe_inter 2048) and a dense FFN weight. Every rep is
timed alone (CUDA events); both ways write the same bytes (checked).

GPU:  python benchmarks/fp8_gather_write.py --commit <sha> \
        --out benchmarks/results/fp8_gather_write/fp8_gather_write_<sha>.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import call_times_ms, device_name, triton_version, write_report  # noqa: E402

from spartron.layers.fp8 import triton_backend  # noqa: E402
from spartron.layers.fp8.quant import FP8  # noqa: E402

# name: (shape of one gathered weight, how many weights share the joint operand)
WEIGHTS = {"experts_w1_w3": ((8, 2048, 7168), 2), "experts_w2": ((8, 7168, 2048), 1), "dense_w1": ((18432, 7168), 1)}


def torch_write(q: torch.Tensor, out: torch.Tensor | None, out_t: torch.Tensor, start: int) -> None:
    n = q.shape[-2]
    out_t[..., :, start:start + n].copy_(q.transpose(-2, -1))
    if out is not None:
        out[..., start:start + n, :].copy_(q)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--commit", default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    runs = {}
    for name, (shape, parts) in WEIGHTS.items():
        *lead, n, k = shape
        q = torch.randint(0, 255, shape, dtype=torch.uint8, device=dev).view(FP8)
        out = torch.empty(*lead, n * parts, k, dtype=FP8, device=dev) if parts > 1 else None
        out_t = torch.empty(*lead, k, n * parts, dtype=FP8, device=dev)
        result = {}
        for way, fn in (("torch_copies", torch_write), ("triton_kernel", triton_backend.place_gathered)):
            for t in (out, out_t):  # each way writes into zeroed buffers: the comparison sees its own bytes
                if t is not None:
                    t.view(torch.uint8).zero_()
            for _ in range(args.warmup):
                fn(q, out, out_t, 0)
            times = call_times_ms(lambda fn=fn, q=q, out=out, out_t=out_t: fn(q, out, out_t, 0), args.iters, dev)
            written = [t.view(torch.uint8).clone() for t in (out, out_t) if t is not None]
            moved = q.numel() * (2 + (out is not None))  # bytes read + written
            med = statistics.median(times)
            result[way] = {"step_ms": times, "median_ms": med, "gb_per_s": moved / med / 1e6, "written": written}
        same = all(torch.equal(a, b) for a, b in zip(result["torch_copies"].pop("written"),
                                                     result["triton_kernel"].pop("written"), strict=True))
        runs[name] = {"shape": list(shape), "parts": parts, "same_bytes": same, **result}
        print(f"{name} {tuple(shape)}: torch copies {result['torch_copies']['median_ms']:.3f} ms "
              f"({result['torch_copies']['gb_per_s']:.0f} GB/s), kernel {result['triton_kernel']['median_ms']:.3f} ms "
              f"({result['triton_kernel']['gb_per_s']:.0f} GB/s), same bytes {same}")
    write_report(args.out, {"device": device_name(True), "torch": torch.__version__, "triton": triton_version(),
                            "commit": args.commit, "iters": args.iters, "warmup": args.warmup, "runs": runs})


if __name__ == "__main__":
    main()
