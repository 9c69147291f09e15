"""MoE layer benchmark: fwd+bwd time, grouped-GEMM efficiency, EP=2 dispatch/combine bandwidth.

    python benchmarks/moe_layer.py --out benchmarks/results/moe_layer.json   # 1 or 2 CUDA GPUs, bf16
    python benchmarks/moe_layer.py --smoke                                   # tiny, CPU/gloo, seconds

Shapes (issue 5): 64 routed experts, top-8, hidden 2048, expert hidden 1408, 2 shared experts,
16k tokens per rank, bf16, softmax router in fp32. Measured (median of CUDA-event timed iters):
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
import json
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (imported lazily by custom ops; load it once before forking)
import torch.distributed as dist
import torch.multiprocessing as mp

from spartron.layers.config import ModelConfig
from spartron.layers.moe import MoELayer
from spartron.layers.moe.experts import grouped_mm_available
from spartron.runtime.metrics import git_commit  # noqa: E402
from spartron.runtime.ops.collectives import all_to_all

FULL = {"n_experts": 64, "top_k": 8, "dim": 2048, "inter": 1408, "shared": 2, "tokens": 16384}
SMOKE = {"n_experts": 8, "top_k": 2, "dim": 64, "inter": 32, "shared": 1, "tokens": 256}


def model_cfg(shape: dict, dtype: str) -> ModelConfig:
    moe = {"n_routed_experts": shape["n_experts"], "top_k": shape["top_k"], "moe_inter_dim": shape["inter"],
           "n_shared_experts": shape["shared"], "score_func": "softmax", "router_fp32": True,
           "dispatcher": "all_to_all", "grouped_mm": "auto"}
    return ModelConfig.model_validate({"dim": shape["dim"], "dtype": dtype, "moe": moe})


def median_ms(fn, iters: int, warmup: int, device: torch.device) -> float:
    """Median wall time of `fn()` in ms; CUDA events around each call on GPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


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

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ep_measure(rank: int, world: int, shape: dict, dtype: str, iters: int, warmup: int) -> dict:
    """One EP rank's measurements; the default process group is initialised (NCCL or gloo)."""
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    group = dist.group.WORLD
    torch.manual_seed(0)
    layer = MoELayer(model_cfg(shape, dtype), ep_group=group, device=device)
    torch.manual_seed(1 + rank)
    x = torch.randn(1, shape["tokens"], shape["dim"], device=device, dtype=getattr(torch, dtype))
    d = layer.dispatcher
    with torch.no_grad():
        routing = layer.router(x)
        rows, state = d.prepare(x.reshape(-1, shape["dim"]), routing["topk_ids"], routing["topk_weights"])

    def prepare():
        with torch.no_grad():
            d.prepare(x.reshape(-1, shape["dim"]), routing["topk_ids"], routing["topk_weights"])

    def dispatch_combine():  # the two token all-to-alls alone (combine without the regrouping)
        with torch.no_grad():
            all_to_all(d.dispatch(rows, state), state.input_splits, state.output_splits, group)

    def dispatch_post_combine():
        with torch.no_grad():
            recv, _ = d.post_dispatch(d.dispatch(rows, state), state)
            d.combine(recv, state)

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


def _nccl_worker(rank: int, world: int, shape: dict, dtype: str, iters: int, warmup: int, port: int,
                 result_path: str) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300),
                            device_id=torch.device("cuda", rank))
    try:
        res = _ep_measure(rank, world, shape, dtype, iters, warmup)
        gathered = [None] * world
        dist.all_gather_object(gathered, res)
        if rank == 0:
            Path(result_path).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def bench_ep(shape: dict, dtype: str, iters: int, warmup: int, cuda: bool, world: int = 2) -> list[dict]:
    if not cuda:  # CPU smoke: gloo ranks forked by the test harness (fast start)
        from spartron.testing import run_distributed

        return run_distributed(_ep_measure, world, shape, dtype, iters, warmup, timeout=120)
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        path = os.path.join(tmp, "ep.json")
        mp.spawn(_nccl_worker, args=(world, shape, dtype, iters, warmup, _free_port(), path), nprocs=world,
                 join=True)
        return json.loads(Path(path).read_text())


# --------------------------------------------------------------------------------------------

def run(args) -> dict:
    shape = dict(SMOKE if args.smoke else FULL)
    if args.tokens:
        shape["tokens"] = args.tokens
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = "bfloat16" if cuda else "float32"
    iters, warmup = (3, 1) if args.smoke else (args.iters, args.warmup)
    report = {"benchmark": "moe_layer", "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "commit": git_commit(), "dtype": dtype, "shape": shape,
              "iters": iters, "warmup": warmup}
    torch.manual_seed(0)
    layer = MoELayer(model_cfg(shape, dtype), device=device)
    x = torch.randn(1, shape["tokens"], shape["dim"], device=device, dtype=getattr(torch, dtype))
    report["ep1_layer"] = bench_layer(layer, x, iters, warmup)
    report["grouped_gemm"] = bench_grouped_gemm(layer, x, iters, warmup)
    if cuda:
        report["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del layer, x
    gpus = torch.cuda.device_count() if cuda else 0
    if args.smoke or gpus >= 2:
        report["ep2"] = bench_ep(shape, dtype, iters, warmup, cuda)
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
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
