"""kl_sparse's loss pieces on CUDA: the Triton kernels against the chunked PyTorch path they replaced.

    python benchmarks/kl_sparse.py --out benchmarks/results/kl_sparse/kl_sparse_SHA.json --commit SHA   # H200, 16k
    python benchmarks/kl_sparse.py --smoke                                                  # CPU, tiny

`model.dsa.indexer_mode = "kl_sparse"` (attention/indexer_kl.py) computes, per query over its top-k ids, the
detached KL target (the main attention's head-summed distribution, absorbed 16 heads x 576) and the
indexer's scores at the ids (32 index heads x 128) with their gradients. Timed per piece on the same
inputs (ascending random causal ids, as the indexer returns them): the ops as a run calls them (the
kernels on CUDA) and the PyTorch path (`_reference_*`, what CUDA ran before), plus the whole loss forward
+ backward through the ops; every timed call after warm-up, CUDA events, and the kernels' norm-wise
error against the PyTorch path. `--smoke` runs the ops at tiny sizes on CPU (the PyTorch path only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name, fill_attention_shape, write_report  # noqa: E402
from sparse_mla import causal_random_ids, git_commit, sorted_ids, timed  # noqa: E402

from spartron.layers.attention import indexer_kl  # noqa: E402


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=16384)
    shape_help = "(default: configs/dsa-12l.toml's, --smoke: configs/tiny.toml's)"
    p.add_argument("--index-heads", type=int, default=None, help=f"model.dsa.n_index_heads {shape_help}")
    p.add_argument("--index-dim", type=int, default=None, help=f"model.dsa.index_head_dim {shape_help}")
    p.add_argument("--heads", type=int, default=None, help=f"model.n_heads {shape_help}")
    p.add_argument("--topk", type=int, default=None, help=f"model.dsa.index_topk {shape_help}")
    p.add_argument("--kv-lora", dest="kv_lora", type=int, default=None, help=f"model.mla.kv_lora_rank {shape_help}")
    p.add_argument("--rope", type=int, default=None, help=f"model.mla.qk_rope_head_dim {shape_help}")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--commit", default=None, help="the commit measured (a device copy's git may lie)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    args = p.parse_args()
    if args.smoke:
        args.seq, args.iters, args.warmup = 40, 2, 1
    fill_attention_shape(args, args.smoke, {"index_heads": "dsa.n_index_heads", "index_dim": "dsa.index_head_dim",
                                            "heads": "n_heads", "topk": "dsa.index_topk", "kv_lora": "mla.kv_lora_rank",
                                            "rope": "mla.qk_rope_head_dim"})
    dqk = args.kv_lora + args.rope  # the absorbed MLA query / latent key width (576 in DeepSeek-V3)
    device = torch.device("cpu" if args.smoke else "cuda")
    g = torch.Generator(device=device).manual_seed(0)
    s, hi, d, h = args.seq, args.index_heads, args.index_dim, args.heads

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)

    q, w, k = randn(1, s, hi, d), randn(1, s, hi, scale=(hi * d) ** -0.5), randn(1, s, d)
    q_abs, kv = randn(1, s, h, dqk, scale=0.05), randn(1, s, dqk)
    ids = sorted_ids(causal_random_ids(s, args.topk, device)).contiguous()
    chunk = indexer_kl._rows(None, 1, ids.shape[-1], 4 * (2 * d + 3 * hi))
    chunk_t = indexer_kl._rows(None, 1, ids.shape[-1], 4 * (dqk + 3 * h))
    grad = torch.randn(ids.shape, generator=g, device=device).masked_fill(ids < 0, 0.0)
    qg, wg, kg = (t.clone().requires_grad_() for t in (q, w, k))

    def scores_fwd_bwd():
        qg.grad = wg.grad = kg.grad = None
        indexer_kl.selected_index_scores(qg, wg, kg, ids).backward(grad)

    def loss_fwd_bwd():
        qg.grad = wg.grad = kg.grad = None
        indexer_kl.sparse_indexer_kl(qg, wg, kg, ids, q_abs, kv, dqk**-0.5).backward()

    pieces = {
        "target": (lambda: indexer_kl.sparse_attention_target(q_abs, kv, dqk**-0.5, ids),
                   lambda: indexer_kl._reference_target(q_abs, kv, ids, dqk**-0.5, chunk_t)),
        "scores_fwd": (lambda: indexer_kl.selected_index_scores(q, w, k, ids),
                       lambda: indexer_kl._reference_scores(q, w, k, ids, chunk)),
        "scores_bwd": (lambda: torch.ops.spartron.kl_selected_scores_backward(grad, q, w, k, ids, chunk, False),
                       lambda: indexer_kl._reference_scores_backward(grad, q, w, k, ids, chunk, False)),
    }
    results = {}
    for name, (op, ref) in pieces.items():
        got, want = op(), ref()
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        errs = [rel(x[torch.isfinite(y)], y[torch.isfinite(y)]) for x, y in zip(got, want, strict=True)]
        results[name] = dict(op=timed(op, device, args.iters, args.warmup),
                             pytorch_path=timed(ref, device, max(2, args.iters // 5), 1), rel_err_vs_pytorch=errs)
        print(f"{name:12s} op {results[name]['op']['ms']:9.3f} ms   pytorch path "
              f"{results[name]['pytorch_path']['ms']:9.3f} ms   errors {errs}", flush=True)
    results["loss_fwd_bwd"] = dict(op=timed(loss_fwd_bwd, device, args.iters, args.warmup))
    results["scores_fwd_bwd"] = dict(op=timed(scores_fwd_bwd, device, args.iters, args.warmup))
    for name in ("scores_fwd_bwd", "loss_fwd_bwd"):
        print(f"{name:12s} op {results[name]['op']['ms']:9.3f} ms", flush=True)
    cuda = device.type == "cuda"
    report = dict(benchmark="kl_sparse", device=device_name(cuda), torch=torch.__version__,
                  triton=__import__("triton").__version__ if cuda else None,
                  commit=args.commit or git_commit(), smoke=args.smoke, seq=s, index_heads=hi, index_head_dim=d,
                  heads=h, head_dim=dqk, topk=args.topk, selected_pairs=int((ids >= 0).sum()), iters=args.iters,
                  warmup=args.warmup, ids="ascending random causal (benchmarks/sparse_mla.py)", results=results)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
