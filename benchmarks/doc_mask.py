"""Block-causal attention over packed documents (layers/attention/doc_mask.py) against plain causal SDPA.

    python benchmarks/doc_mask.py --commit SHA --out benchmarks/results/doc_mask/doc_mask.json   # CUDA, dsv3-12l dims
    python benchmarks/doc_mask.py --smoke                                                # tiny, CPU, seconds

Per-head dense MLA form (what MLA._dense runs): q, k [B, H, S, nope + rope], v [B, H, S, v], bf16.
Cases, each forward and forward+backward, every timed call recorded (CUDA events, after warm-up):
`sdpa_causal` (the plain causal path, is_causal), `flex_documents` (FlexAttention with the document
block mask, documents of the lengths below), `flex_one_document` (the same mask with one document per
row: its cost over the plain path), and the block-mask build alone. Correctness: flex_documents
against SDPA with the explicit boolean mask (max abs error of out and of dq). FLOPs count visible
(query, key) pairs: forward 2 x pairs x H x (d_qk + d_v), backward 2.5x that.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from spartron.layers.attention.doc_mask import (
    document_block_mask,
    document_visible,
    reference_block_mask,
    reference_document_attention,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also under `python -m benchmarks.NAME`
from common import device_name, triton_version, write_report  # noqa: E402


def document_positions(batch: int, seq: int, mean: int, seed: int = 0) -> torch.Tensor:
    """[batch, seq] per-document positions of documents with lengths drawn from an exponential of `mean`
    (at least 16 tokens), cut at the row end: what packed text looks like."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        pos: list[int] = []
        while len(pos) < seq:
            n = max(16, int(torch.empty(1).exponential_(1.0 / mean, generator=g)))
            pos += list(range(n))
        rows.append(pos[:seq])
    return torch.tensor(rows)


def timed(fn, device, iters: int, warmup: int) -> dict:
    for _ in range(warmup):
        fn()
    steps = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            steps.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            steps.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": sorted(steps)[len(steps) // 2], "steps_ms": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--commit", help="the commit measured (the device copy's git metadata is not the checkout's)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--qk-dim", type=int, default=192)
    p.add_argument("--v-dim", type=int, default=128)
    p.add_argument("--mean-doc", type=int, default=1024)
    p.add_argument("--block-mask-only", action="store_true",
                   help="time only the block-mask builds (from document starts vs create_block_mask)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if a.smoke:
        a.batch, a.heads, a.seq, a.qk_dim, a.v_dim, a.mean_doc, a.iters, a.warmup = 1, 2, 64, 24, 16, 16, 2, 1
    dtype = torch.bfloat16 if cuda else torch.float32
    b, h, s = a.batch, a.heads, a.seq
    scale = a.qk_dim**-0.5
    g = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(b, h, s, a.qk_dim, device=device, dtype=dtype, generator=g).requires_grad_() for _ in "qk")
    v = torch.randn(b, h, s, a.v_dim, device=device, dtype=dtype, generator=g).requires_grad_()
    grad = torch.randn(b, h, s, a.v_dim, device=device, dtype=dtype, generator=g)
    docs = document_positions(b, s, a.mean_doc).to(device)
    one_doc = torch.arange(s, device=device).expand(b, s).contiguous()

    if a.block_mask_only:
        builds = {"from_document_starts": lambda: document_block_mask(docs),
                  "create_block_mask": lambda: reference_block_mask(docs)}
        same = bool(torch.equal(builds["from_document_starts"]().to_dense(), builds["create_block_mask"]().to_dense()))
        results = {name: timed(fn, device, a.iters, a.warmup) for name, fn in builds.items()}
        print({name: round(r["median_ms"], 3) for name, r in results.items()}, "equal:", same)
        write_report(a.out, {"benchmark": "doc_mask --block-mask-only", "device": device_name(cuda),
                             "torch": torch.__version__, "triton": triton_version(), "commit": a.commit,
                             "shapes": {"batch": b, "seq": s, "mean_doc": a.mean_doc, "block": 128},
                             "iters": a.iters, "warmup": a.warmup, "equal": same, "builds": results})
        return

    from torch.nn.attention.flex_attention import flex_attention
    flex = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    masks = {"flex_documents": document_block_mask(docs), "flex_one_document": document_block_mask(one_doc)}

    def flex_case(name):
        if not cuda:  # it refuses inputs that require grad on CPU, even under no_grad
            return lambda: flex(q.detach(), k.detach(), v.detach(), block_mask=masks[name], scale=scale)
        return lambda: flex(q, k, v, block_mask=masks[name], scale=scale)

    def fwd_bwd(fn):
        def run():
            out = fn()
            out.backward(grad)
            q.grad = k.grad = v.grad = None
        return run

    # FlexAttention has no CPU backward: the smoke mode times and checks forward only (under no_grad)
    start = time.perf_counter()
    with torch.enable_grad() if cuda else torch.no_grad():
        out = flex_case("flex_documents")()
    if cuda:
        out.backward(grad)
    first_call_s = time.perf_counter() - start  # compile of forward and backward on CUDA
    dq = q.grad
    q.grad = k.grad = v.grad = None
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference_document_attention(qr, kr, vr, docs, scale)
    ref.backward(grad.float())
    ref = ref.detach()
    errors = {"out_max_abs": float((out.float() - ref).abs().max()), "ref_out_max_abs": float(ref.abs().max()),
              "dq_max_abs": float((dq.float() - qr.grad).abs().max()) if cuda else None,
              "ref_dq_max_abs": float(qr.grad.abs().max())}

    pairs = {"sdpa_causal": b * s * (s + 1) // 2, "flex_one_document": b * s * (s + 1) // 2,
             "flex_documents": int(document_visible(docs).sum())}
    cases = {"sdpa_causal": sdpa, "flex_documents": flex_case("flex_documents"),
             "flex_one_document": flex_case("flex_one_document")}
    results = {}
    for name, fn in cases.items():
        fwd_flops = 2 * pairs[name] * h * (a.qk_dim + a.v_dim)
        with torch.no_grad():
            f = timed(fn, device, a.iters, a.warmup)
        results[name] = {"visible_pairs": pairs[name], "forward": f, "forward_tflops": fwd_flops / f["median_ms"] / 1e9}
        line = f"{name:18s} fwd {f['median_ms']:.3f} ms ({results[name]['forward_tflops']:.0f} TFLOP/s)"
        if cuda or name == "sdpa_causal":
            fb = timed(fwd_bwd(fn), device, a.iters, a.warmup)
            results[name].update(forward_backward=fb, forward_backward_tflops=3.5 * fwd_flops / fb["median_ms"] / 1e9)
            line += f"  fwd+bwd {fb['median_ms']:.3f} ms ({results[name]['forward_backward_tflops']:.0f} TFLOP/s)"
        print(line)
    results["block_mask_build"] = timed(lambda: document_block_mask(docs), device, a.iters, a.warmup)
    print("block mask build", f"{results['block_mask_build']['median_ms']:.3f} ms", "errors", errors,
          f"first call {first_call_s:.1f} s")
    lengths = (docs == 0).sum().item()
    report = {"benchmark": "doc_mask", "device": device_name(cuda), "torch": torch.__version__,
              "triton": triton_version(), "commit": a.commit, "dtype": str(dtype),
              "shapes": {"batch": b, "heads": h, "seq": s, "qk_dim": a.qk_dim, "v_dim": a.v_dim,
                         "mean_doc": a.mean_doc, "documents": lengths},
              "iters": a.iters, "warmup": a.warmup, "first_flex_call_s": first_call_s, "errors": errors,
              "cases": results}
    write_report(a.out, report)


if __name__ == "__main__":
    main()
