"""MoE layer benchmark: fwd+bwd time, grouped-GEMM efficiency, EP=2 dispatch/combine bandwidth.

    python benchmarks/moe_layer.py --out benchmarks/results/moe_layer/moe_layer.json   # 1 or 2 CUDA GPUs, bf16
    python benchmarks/moe_layer.py --smoke                                   # tiny, CPU/gloo, seconds

Shapes (issue 5: configs/moe-layer-bench.toml): 64 routed experts, top-8, hidden 2048, expert hidden
1408, 2 shared experts, 16k tokens per rank, bf16, softmax router in fp32. Measured (median of CUDA-event timed iters):
- layer: forward and forward+backward of MoELayer on one GPU (EP=1);
- grouped GEMM: the routed experts (3 grouped GEMMs + SwiGLU) on the rows the router actually
  produced, as achieved TFLOP/s, against the ceiling = three bare `torch._grouped_mm` calls on the
  same rows and offsets (goal: achieved >= 70% of ceiling), forward and forward+backward;
- EP=2 (when 2 GPUs are present; gloo on CPU for --smoke): dispatch + combine through the
  all_to_all dispatcher, bytes each rank sends / time, against raw NCCL `all_to_all_single` moving
  the same bytes twice with even splits (goal >= 80%), plus the EP=2 layer fwd+bwd time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (imported lazily by custom ops; load it once before forking)
import torch.distributed as dist

from spartron.comm.collectives import all_to_all
from spartron.comm.transport import EPTransport
from spartron.layers.config import ModelConfig
from spartron.layers.moe import MoELayer
from spartron.layers.moe.experts import grouped_mm_available
from spartron.runtime.metrics import git_commit

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also under `python -m benchmarks.NAME`
from common import device_name, median_ms, moe_bench_model, run_ranks, write_report  # noqa: E402


def bench_layer(layer: MoELayer, x: torch.Tensor, iters: int, warmup: int) -> dict:
    g = torch.randn_like(x)
    xg = x.detach().clone().requires_grad_()

    def fwd():
        with torch.no_grad():
            layer(x)

    def fwd_bwd():
        layer(xg)["hidden_states"].backward(g)

    return {"fwd_ms": median_ms(fwd, iters, warmup, x.device),
            "fwd_bwd_ms": median_ms(fwd_bwd, iters, warmup, x.device)}


def routed_rows(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows and per-expert counts the experts of this layer see for batch `x` (no EP)."""
    with torch.no_grad():
        routing = layer.router(x)
        d = layer.dispatcher
        rows, state = d.prepare(x.reshape(-1, x.shape[-1]), routing["topk_ids"], routing["topk_weights"])
        rows, counts = d.post_dispatch(d.dispatch(rows, state), state)
    return rows.contiguous(), counts


def bench_grouped_gemm(layer: MoELayer, x: torch.Tensor, iters: int, warmup: int) -> dict:
    experts = layer.experts
    rows, counts = routed_rows(layer, x)
    n, dim, inter = rows.shape[0], experts.w1.shape[2], experts.w1.shape[1]
    flops_fwd = 3 * 2 * n * dim * inter
    dev = x.device
    out = {"rows": n, "mode": experts.resolved_mode(rows), "tokens_per_expert_min": int(counts.min()),
           "tokens_per_expert_max": int(counts.max()), "flops_fwd": flops_fwd}
    rg = rows.detach().clone().requires_grad_()
    gy = torch.randn(n, dim, device=dev, dtype=rows.dtype)

    def experts_fwd():
        with torch.no_grad():
            experts(rows, counts)

    def experts_fwd_bwd():
        experts(rg, counts).backward(gy)

    out["achieved_fwd_ms"] = median_ms(experts_fwd, iters, warmup, dev)
    out["achieved_fwd_bwd_ms"] = median_ms(experts_fwd_bwd, iters, warmup, dev)
    out["achieved_fwd_tflops"] = flops_fwd / out["achieved_fwd_ms"] / 1e9
    out["achieved_fwd_bwd_tflops"] = 3 * flops_fwd / out["achieved_fwd_bwd_ms"] / 1e9
    aligned = (dim * rows.element_size()) % 16 == 0 and (inter * rows.element_size()) % 16 == 0
    if not (grouped_mm_available() and aligned):
        out["ceiling"] = "torch._grouped_mm unavailable for these shapes/dtype"
        return out
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    w1t, w3t, w2t = (w.detach().clone().requires_grad_().transpose(-2, -1)
                     for w in (experts.w1, experts.w3, experts.w2))
    h = torch.randn(n, inter, device=dev, dtype=rows.dtype, requires_grad=True)
    gh = torch.randn(n, inter, device=dev, dtype=rows.dtype)

    def bare_fwd():
        with torch.no_grad():
            torch._grouped_mm(rows, w1t, offs=offs)
            torch._grouped_mm(rows, w3t, offs=offs)
            torch._grouped_mm(h, w2t, offs=offs)

    def bare_fwd_bwd():
        torch._grouped_mm(rg, w1t, offs=offs).backward(gh)
        torch._grouped_mm(rg, w3t, offs=offs).backward(gh)
        torch._grouped_mm(h, w2t, offs=offs).backward(gy)

    out["ceiling_fwd_ms"] = median_ms(bare_fwd, iters, warmup, dev)
    out["ceiling_fwd_bwd_ms"] = median_ms(bare_fwd_bwd, iters, warmup, dev)
    out["ceiling_fwd_tflops"] = flops_fwd / out["ceiling_fwd_ms"] / 1e9
    out["ceiling_fwd_bwd_tflops"] = 3 * flops_fwd / out["ceiling_fwd_bwd_ms"] / 1e9
    out["fwd_fraction_of_ceiling"] = out["achieved_fwd_tflops"] / out["ceiling_fwd_tflops"]
    out["fwd_bwd_fraction_of_ceiling"] = out["achieved_fwd_bwd_tflops"] / out["ceiling_fwd_bwd_tflops"]
    return out


# --------------------------------------------------------------------------------------------
# EP=2: spawned ranks
# --------------------------------------------------------------------------------------------

def _ep_measure(rank: int, world: int, cfg: ModelConfig, shape: dict, dtype: str, iters: int, warmup: int) -> dict:
    """One EP rank's measurements; the default process group is initialised (NCCL or gloo)."""
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    group = dist.group.WORLD
    torch.manual_seed(0)
    layer = MoELayer(cfg, EPTransport(group), device=device)
    torch.manual_seed(1 + rank)
    x = torch.randn(1, shape["tokens"], shape["dim"], device=device, dtype=getattr(torch, dtype))
    d = layer.dispatcher
    with torch.no_grad():
        routing = layer.router(x)
        rows, state = d.prepare(x.reshape(-1, shape["dim"]), routing["topk_ids"], routing["topk_weights"])
        d.exchange_counts(state)  # split sizes once: the timings below reuse them

    def prepare():  # sort + count + count exchange + split sizes to the host
        with torch.no_grad():
            d.exchange_counts(d.prepare(x.reshape(-1, shape["dim"]), routing["topk_ids"], routing["topk_weights"])[1])

    def dispatch_combine():  # the two token all-to-alls alone (combine without the regrouping)
        with torch.no_grad():
            all_to_all(d.dispatch(rows, state), state.input_splits, state.output_splits, group)

    def dispatch_post_combine():
        with torch.no_grad():
            recv, _ = d.post_dispatch(d.dispatch(rows, state), state)
            d.combine(d.pre_combine(recv, state), state)

    sent_bytes = rows.numel() * rows.element_size()
    even_rows = -(-rows.shape[0] // world) * world
    flat = torch.randn(even_rows * shape["dim"], device=device, dtype=rows.dtype)
    flat_out = torch.empty_like(flat)

    def raw_all_to_all():
        dist.all_to_all_single(flat_out, flat, group=group)
        dist.all_to_all_single(flat, flat_out, group=group)

    res = {"rank": rank, "rows_sent": rows.shape[0], "input_splits": state.input_splits,
           "output_splits": state.output_splits, "bytes_sent_per_direction": sent_bytes,
           "prepare_ms": median_ms(prepare, iters, warmup, device),
           "dispatch_combine_ms": median_ms(dispatch_combine, iters, warmup, device),
           "dispatch_post_combine_ms": median_ms(dispatch_post_combine, iters, warmup, device),
           "raw_all_to_all_x2_ms": median_ms(raw_all_to_all, iters, warmup, device)}
    res["dispatch_combine_GBps"] = 2 * sent_bytes / res["dispatch_combine_ms"] / 1e6
    res["raw_GBps"] = 2 * flat.numel() * flat.element_size() / res["raw_all_to_all_x2_ms"] / 1e6
    res["fraction_of_raw"] = res["dispatch_combine_GBps"] / res["raw_GBps"]
    res.update({f"layer_{k}": v for k, v in bench_layer(layer, x, iters, warmup).items()})
    dist.barrier()
    return res


def bench_ep(cfg: ModelConfig, shape: dict, dtype: str, iters: int, warmup: int, cuda: bool,
             world: int = 2) -> list[dict]:
    return run_ranks(_ep_measure, world, cfg, shape, dtype, iters, warmup, cuda=cuda)


# --------------------------------------------------------------------------------------------

def run(args) -> dict:
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = "bfloat16" if cuda else "float32"
    cfg, shape = moe_bench_model(args.smoke, args.tokens, dtype)  # configs/moe-layer-bench.toml
    iters, warmup = (3, 1) if args.smoke else (args.iters, args.warmup)
    report = {"benchmark": "moe_layer", "device": device_name(cuda),
              "torch": torch.__version__, "commit": git_commit(), "dtype": dtype, "shape": shape,
              "iters": iters, "warmup": warmup}
    torch.manual_seed(0)
    layer = MoELayer(cfg, device=device)
    x = torch.randn(1, shape["tokens"], shape["dim"], device=device, dtype=getattr(torch, dtype))
    report["ep1_layer"] = bench_layer(layer, x, iters, warmup)
    report["grouped_gemm"] = bench_grouped_gemm(layer, x, iters, warmup)
    if cuda:
        report["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del layer, x
    gpus = torch.cuda.device_count() if cuda else 0
    if args.smoke or gpus >= 2:
        report["ep2"] = bench_ep(cfg, shape, dtype, iters, warmup, cuda)
    else:
        report["ep2"] = f"skipped: needs 2 CUDA GPUs, found {gpus}"
    return report


def print_table(r: dict) -> None:
    print(f"MoE layer on {r['device']} (torch {r['torch']}, {r['dtype']}, commit {r['commit'][:10]}): {r['shape']}")
    e = r["ep1_layer"]
    print(f"  EP=1 layer     fwd {e['fwd_ms']:.2f} ms   fwd+bwd {e['fwd_bwd_ms']:.2f} ms")
    g = r["grouped_gemm"]
    print(f"  experts ({g['mode']}, {g['rows']} rows)  fwd {g['achieved_fwd_tflops']:.1f} TFLOP/s  "
          f"fwd+bwd {g['achieved_fwd_bwd_tflops']:.1f} TFLOP/s")
    if "ceiling_fwd_tflops" in g:
        print(f"  bare _grouped_mm ceiling  fwd {g['ceiling_fwd_tflops']:.1f}  "
              f"fwd+bwd {g['ceiling_fwd_bwd_tflops']:.1f} TFLOP/s  -> "
              f"{100 * g['fwd_fraction_of_ceiling']:.0f}% / {100 * g['fwd_bwd_fraction_of_ceiling']:.0f}% "
              "of ceiling (goal >= 70%)")
    if isinstance(r["ep2"], str):
        print(f"  EP=2 {r['ep2']}")
        return
    for res in r["ep2"]:
        print(f"  EP=2 rank {res['rank']}: dispatch+combine {res['dispatch_combine_ms']:.2f} ms "
              f"{res['dispatch_combine_GBps']:.1f} GB/s vs raw {res['raw_GBps']:.1f} GB/s "
              f"({100 * res['fraction_of_raw']:.0f}%, goal >= 80%); prepare {res['prepare_ms']:.2f} ms; "
              f"layer fwd+bwd {res['layer_fwd_bwd_ms']:.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="write the JSON report here")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (checks the script works)")
    p.add_argument("--tokens", type=int, default=0, help="tokens per rank (default: 16384, smoke 256)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    report = run(args)
    print_table(report)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
