"""kl_dense (the dense warm-up's indexer KL) on CUDA: the op on bf16 inputs against the same inputs in float32.

    python benchmarks/kl_dense.py --out benchmarks/results/kl_dense/kl_dense_SHA.json --commit SHA   # GPU
    python benchmarks/kl_dense.py --smoke                                                 # CPU, tiny

`spartron::kl_dense` (attention/indexer_kl_dense.py) walks the queries in chunks and, per chunk, multiplies
the absorbed main queries (heads x 576) and the index queries (index heads x 128) with every key. On CUDA
with bf16 operands each product is one tensor-core GEMM with a float32 output; given float32 inputs it is a
float32 GEMM, which is what the op ran for bf16 inputs too until fd26120 (it upcast first). Timed on the same
values: the op's forward + backward on bf16 inputs and on their float32 copies, every timed call after
warm-up (CUDA events), the peak above the inputs, and the two paths' norm-wise difference in the KL rows and
the gradients. Default shape: DeepSeek-V3.2's attention (128 heads x 576, 64 index heads x 128, top-k 2048)
at --seq; `--batch 8 --seq 4096 --heads 8 --index-heads 16 --topk 512` is benchmarks/dsa_stages.py's warm-up.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name, triton_version, write_report  # noqa: E402
from kl_sparse import rel  # noqa: E402
from sparse_mla import git_commit, matmul_ceiling, timed  # noqa: E402

from spartron.layers.attention.indexer_kl_dense import chunk_rows, reference_backward, reference_forward  # noqa: E402


def gemm_flops(batch: int, seq: int, heads: int, width: int, index_heads: int, index_dim: int) -> dict:
    """The op's GEMM FLOPs, forward + backward, at full S x S (each chunk multiplies every key; the causal mask
    comes after): the forward's main and index products, the backward's recompute of both (bf16 operands on
    the tensor-core path) and its dq / dk products (float32 operands)."""
    pairs = batch * seq * seq
    main, index = 2 * pairs * heads * width, 2 * pairs * index_heads * index_dim
    return {"products": 2 * (main + index), "float32_products": 2 * index, "total": 2 * (main + index) + 2 * index}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=128, help="main attention heads (model.n_heads)")
    p.add_argument("--width", type=int, default=576, help="absorbed query / latent key width (kv_lora + rope)")
    p.add_argument("--index-heads", type=int, default=64, help="model.dsa.n_index_heads")
    p.add_argument("--index-dim", type=int, default=128, help="model.dsa.index_head_dim")
    p.add_argument("--topk", type=int, default=2048, help="model.dsa.index_topk")
    p.add_argument("--chunk", type=int, default=None, help="query rows per chunk (default: the op's 1 GiB rule)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--commit", default=None, help="the commit measured (a device copy's git may lie)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    args = p.parse_args()
    if args.smoke:
        args.batch, args.seq, args.heads, args.width, args.iters, args.warmup = 2, 48, 4, 24, 2, 1
        args.index_heads, args.index_dim, args.topk = 3, 8, 8
    device = torch.device("cpu" if args.smoke else "cuda")
    g = torch.Generator(device=device).manual_seed(0)
    b, s, h, hi, d = args.batch, args.seq, args.heads, args.index_heads, args.index_dim

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)

    bf16 = (randn(b, s, hi, d), randn(b, s, hi, scale=(hi * d) ** -0.5), randn(b, s, d),
            randn(b, s, h, args.width, scale=0.05), randn(b, s, args.width))
    fp32 = tuple(t.float() for t in bf16)
    pos = torch.arange(s, device=device)
    grad = torch.full((b, s), 1.0 / (b * s), device=device)
    chunk = args.chunk or chunk_rows(None, b, s, h, hi)
    scale = args.width ** -0.5

    def fwd_bwd(inputs):
        kl, _ = reference_forward(*inputs, pos, pos, None, scale, args.topk, chunk)
        return (kl, *reference_backward(grad, *inputs, pos, pos, None, scale, chunk))

    got, want = fwd_bwd(bf16), fwd_bwd(fp32)
    errors = {name: rel(x.float(), y.to(x.dtype).float()) for name, x, y in zip(("kl", "dq", "dw", "dk"), got, want,
                                                                                 strict=True)}
    results = {}
    for name, inputs in (("bf16_inputs", bf16), ("float32_inputs", fp32)):
        results[name] = timed(lambda inputs=inputs: fwd_bwd(inputs), device, args.iters, args.warmup)
        print(f"{name:15s} forward + backward {results[name]['ms']:10.2f} ms", flush=True)
    cuda = device.type == "cuda"
    flops = gemm_flops(b, s, h, args.width, hi, d)
    for r in results.values():
        r["gemm_tflops_per_s"] = flops["total"] / (r["ms"] * 1e-3) / 1e12
    ceiling = matmul_ceiling(device, torch.bfloat16, 8192 if cuda else 256, 20 if cuda else 2)
    report = dict(benchmark="kl_dense", device=device_name(cuda), torch=torch.__version__,
                  triton=triton_version(), gemm_flops=flops, bf16_matmul_ceiling_tflops=ceiling,
                  commit=args.commit or git_commit(), smoke=args.smoke, batch=b, seq=s, heads=h, width=args.width,
                  index_heads=hi, index_head_dim=d, topk=args.topk, chunk=chunk, iters=args.iters,
                  warmup=args.warmup, results=results,
                  float32_over_bf16=results["float32_inputs"]["ms"] / results["bf16_inputs"]["ms"],
                  rel_diff_bf16_vs_float32=errors)
    print(f"float32 / bf16 inputs: {report['float32_over_bf16']:.2f}x; differences {errors}; bf16 inputs at "
          f"{results['bf16_inputs']['gemm_tflops_per_s']:.1f} TFLOP/s of GEMM work (bf16 matmul ceiling "
          f"{ceiling:.0f})")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
