"""DeepEP vs all_to_all MoE dispatcher on 2 GPUs (EP=2, spawned NCCL ranks).

    python benchmarks/deepep.py --out benchmarks/results/deepep/deepep.json   # 2 CUDA GPUs + deep_ep, bf16
    python benchmarks/deepep.py --smoke                                # CPU/gloo: all_to_all side only

Shapes (the MoE benchmark's: configs/moe-layer-bench.toml): 64 routed experts, top-8, hidden 2048,
expert hidden 1408, 2 shared experts, 16k tokens per rank, bf16. Median of CUDA-event timed iterations,
worst rank reported.
- dispatch+combine: the dispatcher's whole token path without experts (prepare -> dispatch ->
  post_dispatch -> combine -> finalize, no grad), and the bare exchanges alone (all_to_all: the two
  uneven all-to-alls of the rows; DeepEP: the dispatch op incl. layout + the combine op), with the
  bytes each rank sends per direction and GB/s = 2 * bytes / time.
- layer: MoELayer forward + backward, each dispatcher (goal: DeepEP >= 1.3x faster).
- all_to_all_fp8: the all_to_all dispatcher with model.fp8.dispatch's wire (spartron.layers.fp8.wire: each
  dispatched row as E4M3 bytes plus its 1x128 fp32 scales, quantised before and dequantised after the
  exchange; the combine stays bf16), on the same bf16 experts: what FP8 dispatch costs and saves on the
  wire alone, bytes per direction counted (issue 38: time it on 2 GPUs). Backend triton on CUDA,
  reference on CPU.
- deepep_fp8: DeepEP with model.fp8.dispatch (its own FP8 dispatch: E4M3 values and their 1x128 fp32 scales,
  quantised before the dispatch op and dequantised in it; the combine stays bf16), on the same buffer.
- replay dispatch: what a checkpoint replay of the dispatch would cost: `fresh` recomputes the layout
  + notify + exchange, `cached_handle` re-sends along the original handle, `saved_op` is Spartron's
  replay (the mandatory-save op's outputs handed back by the checkpoint policy, no communication).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (imported lazily by custom ops; load it once before forking)
import torch.distributed as dist

from spartron.checkpointing import build_policy
from spartron.checkpointing.saved_ops import PolicyMode, RegionStats, SavedOps
from spartron.comm.collectives import all_to_all
from spartron.comm.deepep import deepep_cached_dispatch, deepep_combine, deepep_dispatch
from spartron.comm.deepep_buffer import load_deep_ep
from spartron.comm.transport import EPTransport
from spartron.layers.fp8.apply import install_wire
from spartron.layers.fp8.wire import wire_row_bytes
from spartron.layers.moe import MoELayer
from spartron.runtime.metrics import git_commit

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also under `python -m benchmarks.NAME`
from common import device_name, median_ms, moe_bench_model, run_ranks, write_report  # noqa: E402

GOAL_SPEEDUP = 1.3
WORLD = 2


def _token_path(layer: MoELayer, x: torch.Tensor, routing: dict):
    """The dispatcher's full path without experts (identity experts), no grad."""
    d = layer.dispatcher
    with torch.no_grad():
        rows, state = d.prepare(x, routing["topk_ids"], routing["topk_weights"])
        rows, _ = d.post_dispatch(d.dispatch(rows, state), state)
        return d.finalize(d.combine(d.pre_combine(rows, state), state), state)


def _layer_fwd_bwd(layer: MoELayer, x: torch.Tensor, g: torch.Tensor):
    xg = x.detach().requires_grad_()
    layer(xg)["hidden_states"].backward(g)


def _measure_all_to_all(layer, x, x3, g, routing, group, iters, warmup) -> dict:
    dev = x.device
    d = layer.dispatcher
    with torch.no_grad():
        rows, state = d.prepare(x, routing["topk_ids"], routing["topk_weights"])
        d.exchange_counts(state)  # split sizes once: exchanges() times the token all-to-alls alone

    def exchanges():
        with torch.no_grad():
            all_to_all(d.dispatch(rows, state), state.input_splits, state.output_splits, group)

    sent = rows.numel() * rows.element_size()  # the combine's bytes; the dispatch's too without a wire
    dispatched = rows.shape[0] * wire_row_bytes(rows.shape[1]) if d.wire is not None else sent
    res = {"bytes_sent_per_direction": sent, "dispatch_bytes": dispatched, "combine_bytes": sent,
           "token_path_ms": median_ms(lambda: _token_path(layer, x, routing), iters, warmup, dev),
           "exchanges_ms": median_ms(exchanges, iters, warmup, dev),
           "layer_fwd_bwd_ms": median_ms(lambda: _layer_fwd_bwd(layer, x3, g), iters, warmup, dev)}
    res["exchanges_GBps"] = (dispatched + sent) / res["exchanges_ms"] / 1e6
    res["token_path_GBps"] = (dispatched + sent) / res["token_path_ms"] / 1e6
    return res


def _measure_deepep(layer, x, x3, g, routing, iters, warmup, replay: bool = True) -> dict:
    """`replay`: also time the replay variants of the dispatch (bf16 rows only)."""
    dev = x.device
    buf, wire = layer.dispatcher.buffer, layer.dispatcher.wire
    ids, weights = routing["topk_ids"], routing["topk_weights"]

    def dispatch():  # with model.fp8.dispatch the rows' quantisation is part of the dispatch's cost
        return deepep_dispatch(buf, x, ids, weights, None if wire is None else wire.rows(x))

    with torch.no_grad():
        recv, _, _, _, handle = dispatch()
    tokens_sent = int(handle.is_token_in_rank.sum())
    sent = tokens_sent * x.shape[1] * x.element_size()  # the combine's bytes; the dispatch's too without a wire
    dispatched = tokens_sent * wire_row_bytes(x.shape[1]) if wire is not None else sent
    recv_rows = torch.randn_like(recv)

    def exchanges():
        with torch.no_grad():
            r, _, _, _, h = dispatch()
            deepep_combine(buf, r, h)

    def fresh():
        with torch.no_grad():
            deepep_dispatch(buf, x, ids, weights)

    def cached():
        with torch.no_grad():
            deepep_cached_dispatch(buf, x, handle)

    policy = build_policy("full")
    saved = {}

    def record():  # the original pass of a checkpoint region: the op runs and is saved
        saved["ops"] = SavedOps(policy, RegionStats("bench"))
        with torch.no_grad(), PolicyMode(saved["ops"], "original"):
            deepep_dispatch(buf, x, ids, weights)

    def replay_saved():  # the replay: the policy hands the saved outputs back
        with torch.no_grad(), PolicyMode(saved["ops"], "replay"):
            deepep_dispatch(buf, x, ids, weights)
        saved["ops"].finish_replay()

    res = {"bytes_sent_per_direction": sent, "dispatch_bytes": dispatched, "combine_bytes": sent,
           "received_tokens": recv.shape[0], "num_sms": buf.num_sms, "num_nvl_bytes": buf.num_nvl_bytes,
           "token_path_ms": median_ms(lambda: _token_path(layer, x, routing), iters, warmup, dev),
           "exchanges_ms": median_ms(exchanges, iters, warmup, dev),
           "combine_only_ms": median_ms(lambda: deepep_combine(buf, recv_rows, handle), iters, warmup, dev),
           "layer_fwd_bwd_ms": median_ms(lambda: _layer_fwd_bwd(layer, x3, g), iters, warmup, dev)}
    if replay:
        res["replay_dispatch_ms"] = {"fresh": median_ms(fresh, iters, warmup, dev),
                                     "cached_handle": median_ms(cached, iters, warmup, dev),
                                     "saved_op": median_ms(replay_saved, iters, warmup, dev, setup=record)}
    res["exchanges_GBps"] = (dispatched + sent) / res["exchanges_ms"] / 1e6
    res["token_path_GBps"] = (dispatched + sent) / res["token_path_ms"] / 1e6
    return res


def _rank_measure(rank: int, world: int, configs: dict, shape: dict, dtype: str, iters: int, warmup: int) -> dict:
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    group = dist.group.WORLD
    torch.manual_seed(0)
    a2a = MoELayer(configs["all_to_all"], EPTransport(group), device=device)
    torch.manual_seed(1 + rank)
    x3 = torch.randn(1, shape["tokens"], shape["dim"], device=device, dtype=getattr(torch, dtype))
    g = torch.randn_like(x3)
    x = x3.reshape(-1, shape["dim"])
    with torch.no_grad():
        routing = a2a.router(x3)
    res = {"rank": rank, "all_to_all": _measure_all_to_all(a2a, x, x3, g, routing, group, iters, warmup)}
    backend = "triton" if cuda else "reference"
    fp8 = MoELayer(configs["all_to_all"], EPTransport(group), device=device)
    fp8.load_state_dict(a2a.state_dict())
    install_wire([fp8], backend)
    res["all_to_all_fp8"] = _measure_all_to_all(fp8, x, x3, g, routing, group, iters, warmup)
    try:
        transport = EPTransport(group)  # one DeepEP buffer for both layers
        dep, dep_fp8 = (MoELayer(configs["deepep"], transport, device=device) for _ in range(2))
        dep.load_state_dict(a2a.state_dict())
        dep_fp8.load_state_dict(a2a.state_dict())
        install_wire([dep_fp8], backend)
        try:
            res["deepep"] = _measure_deepep(dep, x, x3, g, routing, iters, warmup)
            res["deepep_fp8"] = _measure_deepep(dep_fp8, x, x3, g, routing, iters, warmup, replay=False)
        finally:
            transport.destroy()  # collective; DeepEP's destructor must not run at exit
    except ValueError as err:  # DeepEP missing or unsupported here: every rank reports the same
        res["deepep"] = res["deepep_fp8"] = {"error": str(err)}
    except Exception:  # noqa: BLE001 - keep the all_to_all numbers; the traceback goes into the JSON
        res["deepep"] = res["deepep_fp8"] = {"error": traceback.format_exc()}
    if cuda:
        res["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    dist.barrier()
    return res


def _worst(ranks: list[dict], path: tuple[str, ...]):
    values = []
    for r in ranks:
        v = r
        for key in path:
            v = v.get(key) if isinstance(v, dict) else None
        values.append(v)
    return max(values) if all(isinstance(v, (int, float)) for v in values) else None


def run(args) -> dict:
    dtype = "bfloat16"
    # configs/moe-layer-bench.toml, once per dispatcher compared
    configs = {name: moe_bench_model(args.smoke, args.tokens, dtype, dispatcher=name, deepep_num_sms=args.num_sms)[0]
               for name in ("all_to_all", "deepep")}
    shape = moe_bench_model(args.smoke, args.tokens, dtype)[1]
    try:
        load_deep_ep()
        deepep_status = "importable"
    except ValueError as err:
        deepep_status = str(err)
        print(f"DeepEP not installed: {err}")
    cuda = not args.smoke
    if cuda and torch.cuda.device_count() < WORLD:
        raise SystemExit(f"needs {WORLD} CUDA GPUs (found {torch.cuda.device_count()}); use --smoke on CPU")
    iters, warmup = (2, 1) if args.smoke else (args.iters, args.warmup)
    measure_args = (configs, shape, dtype, iters, warmup)
    ranks = run_ranks(_rank_measure, WORLD, *measure_args, cuda=cuda)
    summary = {}
    for name in ("all_to_all", "all_to_all_fp8", "deepep", "deepep_fp8"):
        summary[name] = {k: _worst(ranks, (name, k)) for k in
                         ("token_path_ms", "exchanges_ms", "layer_fwd_bwd_ms")}
    for plain, fp8 in (("all_to_all", "all_to_all_fp8"), ("deepep", "deepep_fp8")):
        bytes_bf16, bytes_fp8 = _worst(ranks, (plain, "dispatch_bytes")), _worst(ranks, (fp8, "dispatch_bytes"))
        b, f = summary[plain]["exchanges_ms"], summary[fp8]["exchanges_ms"]
        summary[fp8]["dispatch_bytes_over_bf16"] = bytes_fp8 / bytes_bf16 if bytes_bf16 and bytes_fp8 else None
        summary[fp8]["exchanges_speedup"] = b / f if b and f else None
    summary["deepep_replay_dispatch_ms"] = {k: _worst(ranks, ("deepep", "replay_dispatch_ms", k))
                                            for k in ("fresh", "cached_handle", "saved_op")}
    a, d = summary["all_to_all"]["layer_fwd_bwd_ms"], summary["deepep"]["layer_fwd_bwd_ms"]
    summary["layer_speedup"] = a / d if a and d else None
    summary["goal_speedup"] = GOAL_SPEEDUP
    summary["goal_met"] = None if summary["layer_speedup"] is None else summary["layer_speedup"] >= GOAL_SPEEDUP
    return {"benchmark": "deepep vs all_to_all MoE dispatcher, EP=2",
            "device": "cpu (gloo, smoke)" if args.smoke else device_name(cuda=True),
            "backend": "gloo" if args.smoke else "nccl", "world_size": WORLD, "dtype": dtype,
            "torch": torch.__version__, "commit": git_commit(), "smoke": args.smoke, "shape": shape,
            "num_sms": args.num_sms, "iters": iters, "warmup": warmup, "deepep": deepep_status,
            "summary": summary, "ranks": ranks}


def _fmt(v, unit="ms") -> str:
    return f"{v:8.3f} {unit}" if isinstance(v, (int, float)) else f"{'n/a':>8}   "


def print_table(r: dict) -> None:
    s = r["summary"]
    print(f"DeepEP vs all_to_all on {r['device']} (torch {r['torch']}, {r['dtype']}, commit {r['commit'][:10]}, "
          f"{r['num_sms']} SMs): {r['shape']}")
    names = ("all_to_all", "all_to_all_fp8", "deepep", "deepep_fp8")
    print(f"  {'(worst rank)':28s} {'all_to_all':>12s} {'+ fp8 wire':>12s} {'deepep':>12s} {'+ fp8 wire':>12s}")
    for key, label in (("token_path_ms", "dispatch+combine path"), ("exchanges_ms", "exchanges only"),
                       ("layer_fwd_bwd_ms", "MoE layer fwd+bwd")):
        print(f"  {label:28s} " + " ".join(_fmt(s[name][key]) for name in names))
    for name in ("all_to_all_fp8", "deepep_fp8"):
        f = s[name]
        print(f"  {name}: {_fmt(f['dispatch_bytes_over_bf16'], 'x')} the bf16 dispatch bytes, exchanges "
              f"{_fmt(f['exchanges_speedup'], 'x')} as fast as the bf16 ones")
    for rank in r["ranks"]:
        a, d = rank["all_to_all"], rank["deepep"]
        line = f"  rank {rank['rank']}: all_to_all {a['exchanges_GBps']:.1f} GB/s"
        line += f", deepep {d['exchanges_GBps']:.1f} GB/s" if "exchanges_GBps" in d else ""
        print(line)
    rp = s["deepep_replay_dispatch_ms"]
    print(f"  replay dispatch: fresh (layout recomputed) {_fmt(rp['fresh'])}, cached handle "
          f"{_fmt(rp['cached_handle'])}, saved op (Spartron) {_fmt(rp['saved_op'])}")
    sp = s["layer_speedup"]
    print(f"  layer speedup deepep / all_to_all: {'n/a' if sp is None else f'{sp:.2f}x'} "
          f"(goal >= {s['goal_speedup']}x, met: {s['goal_met']})")
    for rank in r["ranks"]:
        if "error" in rank["deepep"]:
            print(f"  rank {rank['rank']} deepep: {rank['deepep']['error'].strip().splitlines()[-1][:300]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="write the JSON report here")
    p.add_argument("--smoke", action="store_true", help="tiny CPU/gloo run (checks the script works)")
    p.add_argument("--tokens", type=int, default=0, help="tokens per rank (default 16384, smoke 256)")
    p.add_argument("--num-sms", type=int, default=24, help="model.moe.deepep_num_sms")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    report = run(args)
    print_table(report)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
