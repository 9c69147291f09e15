"""Routed experts of one MoE layer, forward + backward, blockwise FP8 vs bf16 (issue 38 item 2).

The three grouped GEMMs (w1, w3, w2) with SwiGLU between them, as GroupedExperts runs them (FP8: the fused
spartron_fp8::grouped_mm_pair and swiglu_grouped_mm), on rows
already grouped by expert (balanced counts): the part of the MoE layer FP8 changes; the router,
dispatch and combine are the same in both modes. Shapes: DeepSeek-V3 per rank (dim 7168, moe_inter
2048, 8 local experts, 8k and 32k routed rows) and dsv3-12l on one GPU (dim 2048, moe_inter 1408,
64 experts, 8192 tokens x top-6). Every timed step is in the JSON; the modes take turns step by step (a GPU
that heats under minutes of GEMMs slows its clock: each mode sees the same clocks), each mode's peak memory is
measured with its module alone.

Modes: "bf16"; "fp8" (model.fp8.weight_cache on, invalidated before every step as the Trainer does
after each optimizer step: one micro-batch per step, the weights quantised once per step: 3 kernel
launches, w1 and w3 into [w1; w3] and w2, blocks and transposed blocks from one read); "fp8_nocache"
(weight_cache off: quantised at every GEMM call, 6 launches); "fp8_mb4" (the cache invalidated every 4th step: 4
micro-batches per
optimizer step; its `mean_ms` over whole 4-step cycles is the per-micro-batch cost).

Layer shapes ("layer_*": the issue's unit, a whole MoELayer on one rank: router, the local dispatcher's
replication of the tokens into their top-k slots, the 8 routed experts, the gate-weighted combine; no shared
experts): "bf16" against "fp8" (model.fp8.modules = ["experts"], weight cache on) and "fp8_mb4". The routing is the
router's on fixed random tokens (the same in every mode: the same seed, the router in bf16 / fp32 in both), so the
groups are uneven and not multiples of 128 rows, as in training; the FP8 experts read the replicated rows through
the slot order (the bf16 layer writes them) and send their gradient back in one gather.

FFN shapes ("ffn_*": a SwiGLU FeedForward, DeepSeek-V3's dense layers and shared expert at one rank's 4,096
tokens): "bf16" against "fp8", FP8FeedForward (the FFN as one group of the experts' fused ops; dense weights
are not cached).

`--profile`: one more step of each mode under torch.profiler (a cycle's first micro-batch: with the weight cache,
the one that quantises the weights): its wall time, the device's kernel time and launch count (kernel time well
under the wall time: the step is host-bound) and the kernels that take the most.

GPU:  python benchmarks/fp8_moe.py --out benchmarks/results/fp8_moe_h200.json
CPU:  python benchmarks/fp8_moe.py --smoke --out /tmp/fp8_moe.json   (tiny shape, reference backend)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import profile_one, sync  # noqa: E402

from spartron.layers.config import FP8Config, ModelConfig, MoEConfig  # noqa: E402
from spartron.layers.ffn import FeedForward  # noqa: E402
from spartron.layers.fp8 import apply_fp8, check_backend, invalidate_weight_caches  # noqa: E402
from spartron.layers.moe import MoELayer  # noqa: E402
from spartron.layers.moe.experts import GroupedExperts  # noqa: E402

SHAPES = {
    "v3_8k": dict(dim=7168, inter=2048, experts=8, rows=8192),
    "v3_32k": dict(dim=7168, inter=2048, experts=8, rows=32768),
    "dsv3_12l": dict(dim=2048, inter=1408, experts=64, rows=8192 * 6),
    "layer_v3_8k": dict(dim=7168, inter=2048, experts=8, top_k=4, tokens=2048),
    "layer_v3_32k": dict(dim=7168, inter=2048, experts=8, top_k=4, tokens=8192),
    "ffn_v3_dense": dict(dim=7168, inter=18432, rows=4096),
    "ffn_v3_shared": dict(dim=7168, inter=2048, rows=4096),
}
SMOKE = {"smoke": dict(dim=128, inter=128, experts=2, rows=256),
         "layer_smoke": dict(dim=128, inter=128, experts=4, top_k=2, tokens=128),
         "ffn_smoke": dict(dim=128, inter=256, rows=256)}
# mode: (model.fp8.weight_cache, micro-batches per optimizer step)
MODES = {"bf16": None, "fp8": ("on", 1), "fp8_nocache": ("off", 1), "fp8_mb4": ("on", 4)}


def _micro(mode: str) -> int:
    """Micro-batches per optimizer step of `mode` (bf16: 1)."""
    return (MODES[mode] or ("off", 1))[1]


def build(shape: dict, mode: str, backend: str, wgrad: str, device: torch.device):
    """The mode's module on fixed inputs -> (step(i): its i-th micro-batch's forward + backward, reset(): drop the
    gradients, outside the timings)."""
    torch.manual_seed(0)
    micro = _micro(mode)
    if "top_k" in shape:
        cfg = ModelConfig(dim=shape["dim"], dtype="bfloat16", moe=MoEConfig(
            n_routed_experts=shape["experts"], n_shared_experts=0, top_k=shape["top_k"], moe_inter_dim=shape["inter"],
            dispatcher="local"))
        module = MoELayer(cfg, device=device)
        call = lambda x: module(x.unsqueeze(0))["hidden_states"].squeeze(0)  # noqa: E731
    elif "experts" in shape:
        module = GroupedExperts(shape["experts"], shape["dim"], shape["inter"], dtype=torch.bfloat16, device=device)
        counts = torch.full((shape["experts"],), shape["rows"] // shape["experts"], dtype=torch.int32, device=device)
        call = lambda x: module(x, counts)  # noqa: E731
    else:
        module = FeedForward(shape["dim"], shape["inter"], dtype=torch.bfloat16, device=device)
        call = module
    if MODES[mode] is not None:
        names = apply_fp8([module], FP8Config(backend=backend, modules=["experts" if "experts" in shape else "dense"],
                                              weight_cache=MODES[mode][0], wgrad=wgrad))
        assert names, f"nothing converted to FP8 at {shape}"
    rows = shape.get("tokens", shape.get("rows"))
    x = torch.randn(rows, shape["dim"], dtype=torch.bfloat16, device=device, requires_grad=True)
    grad = torch.randn(rows, shape["dim"], dtype=torch.bfloat16, device=device)

    def step(i: int) -> None:
        if i % micro == 0:  # an optimizer step before this micro-batch: the weights are new
            invalidate_weight_caches(module)
        call(x).backward(grad)

    def reset() -> None:
        x.grad = None
        module.zero_grad(set_to_none=True)

    return step, reset


def time_modes(shape: dict, modes: list[str], backend: str, wgrad: str, device: torch.device, warmup: int,
               steps: int, profiled: bool = False) -> dict[str, dict]:
    """Per mode: every timed step (ms), the peak memory of one cycle run alone (GiB; None on CPU) and, `profiled`,
    profile_one of one more step. The modes take turns: in round r (warm-up rounds, then timed ones) each mode
    whose cycle (`micro` steps, the weights refreshed at its first) starts at r runs that cycle, so every mode's
    steps are spread over the same minutes: the GPU's clock falls as it heats under minutes of GEMMs (bf16's
    32k-row step rose 12.4 -> 14.0 ms over its ten steps on the H200 at fa67fe9), and modes timed one after the
    other compared different clocks."""
    runners = {mode: build(shape, mode, backend, wgrad, device) for mode in modes}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    rounds = [(r, False) for r in range(warmup)] + [(r, True) for r in range(steps)]
    for r, timed in rounds:
        for mode, (step, reset) in runners.items():
            if r % _micro(mode):
                continue
            for i in range(_micro(mode)):
                sync(device)
                start = time.perf_counter()
                step(i)
                sync(device)
                if timed:
                    times[mode].append((time.perf_counter() - start) * 1e3)
                reset()
    out = {mode: {"step_ms": t} for mode, t in times.items()}
    if profiled:
        for mode, (step, reset) in runners.items():
            out[mode]["profile"] = profile_one(lambda step=step: step(0), device)
            reset()
    del runners
    for mode in modes:  # each mode's peak with its module alone
        out[mode]["peak_gib"] = None
        if device.type == "cuda":
            step, reset = build(shape, mode, backend, wgrad, device)
            for cycle in range(2):  # a warm cycle (the kernels compiled, the cache filled once), then the measured one
                if cycle:
                    sync(device)
                    torch.cuda.reset_peak_memory_stats()
                for i in range(_micro(mode)):
                    step(i)
                    reset()
            out[mode]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            del step, reset
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shape on CPU, reference backend")
    parser.add_argument("--backend", default="triton", choices=["triton", "torch_scaled_mm", "deep_gemm", "reference"])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--wgrad", default="fp8", choices=["fp8", "model_dtype"], help="model.fp8.wgrad")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", required=True)
    parser.add_argument("--profile", action="store_true", help="one more step per mode under torch.profiler")
    parser.add_argument("--commit", default=None, help="the commit measured (a device copy's git may lie)")
    args = parser.parse_args(argv)
    backend = "reference" if args.smoke else args.backend
    check_backend(backend)
    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    shapes = SMOKE if args.smoke else {k: SHAPES[k] for k in args.shapes}
    steps = 2 if args.smoke else args.steps
    warmup = 1 if args.smoke else args.warmup
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "commit": commit, "backend": backend, "wgrad": args.wgrad, "warmup": warmup, "runs": {}}
    for name, shape in shapes.items():
        run = {"shape": shape}
        rows = shape["tokens"] * shape["top_k"] if "top_k" in shape else shape["rows"]
        flops = 3 * 3 * 2 * rows * shape["dim"] * shape["inter"]  # the experts' 3 GEMMs, fwd + 2 bwd
        modes = (["bf16", "fp8", "fp8_mb4"] if "top_k" in shape else list(MODES) if "experts" in shape
                 else ["bf16", "fp8"])
        timed = time_modes(shape, modes, backend, args.wgrad, device, warmup, steps, args.profile)
        for mode in modes:
            times = timed[mode]["step_ms"]
            median = sorted(times)[len(times) // 2]
            run[mode] = {"step_ms": times, "median_ms": median, "mean_ms": sum(times) / len(times),
                         "tflops": flops / median / 1e9, "peak_gib": timed[mode]["peak_gib"]}
            if "profile" in timed[mode]:
                profiled = run[mode]["profile"] = timed[mode]["profile"]
                print(f"{name} {mode} profiled step: wall {profiled['wall_ms']:.2f} ms, kernels "
                      f"{profiled['kernel_ms']:.2f} ms in {profiled['launches']} launches; top: " + ", ".join(
                          f"{k['name'][:40]} {k['ms']:.2f}/{k['count']}" for k in profiled["top"][:6]), flush=True)
        run["speedup"] = run["bf16"]["median_ms"] / run["fp8"]["median_ms"]
        result["runs"][name] = run  # written after every shape: a call cut short keeps those done
        line = (f"{name}: bf16 {run['bf16']['median_ms']:.2f} ms, fp8 {run['fp8']['median_ms']:.2f} ms "
                f"({run['speedup']:.2f}x)")
        if "fp8_nocache" in run:
            run["speedup_nocache"] = run["bf16"]["median_ms"] / run["fp8_nocache"]["median_ms"]
            line += f", no cache {run['fp8_nocache']['median_ms']:.2f} ms ({run['speedup_nocache']:.2f}x)"
        if "fp8_mb4" in run:
            run["speedup_mb4"] = run["bf16"]["mean_ms"] / run["fp8_mb4"]["mean_ms"]
            line += f", 4 micro-batches a step {run['fp8_mb4']['mean_ms']:.2f} ms mean ({run['speedup_mb4']:.2f}x)"
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(line, flush=True)
    return result


if __name__ == "__main__":
    main()
