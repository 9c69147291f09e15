"""Activation checkpointing cost on one transformer block: Spartron's boundary vs torch.utils.checkpoint.

    python benchmarks/ac_block.py --out benchmarks/results/ac_block/ac_block.json   # one CUDA GPU, bf16
    python benchmarks/ac_block.py --smoke                                  # tiny, CPU, seconds

Block: RMSNorm -> fused QKV -> causal SDPA -> out proj -> RMSNorm -> SwiGLU MLP, hidden 4096,
32 heads, MLP 14336, batch 1 x seq 4096, bf16. Variants: no AC; Spartron full / selective
(reentrant, the default, and non-reentrant); torch.utils.checkpoint non-reentrant (= full) and
torch's selective contexts (create_selective_checkpoint_contexts) saving the same operators as
Spartron's default targets. One step = forward + backward with a fixed output gradient; grads
accumulate so their memory is in the baseline. Reports median step ms (CUDA events), memory kept
after forward (the saved activations) and peak memory during the step above the baseline, and the
issue's targets: boundary <= 1.02x torch at equal policy, full <= 1.38x no-AC step time,
selective <= 1.10x no-AC step time with activation memory <= 0.5x no-AC.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)

from spartron.checkpointing import DEFAULT_TARGETS, ACConfig, CheckpointRegion, region_options
from spartron.runtime.metrics import git_commit

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also under `python -m benchmarks.NAME`
from common import device_name, write_report  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.gate_up = nn.Linear(dim, 2 * mlp, bias=False)
        self.down = nn.Linear(mlp, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _torch_sac_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    names = {t for t in DEFAULT_TARGETS if "::" in t}
    namespaces = {t for t in DEFAULT_TARGETS if "::" not in t}
    saved = op._schema.name in names or op.namespace in namespaces
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _no_early_stop(fn):
    """torch's non-reentrant checkpoint replaying the whole block, as Spartron's regions do (the
    boundary validates the full replayed op sequence, so it cannot stop at the last saved tensor)."""
    def run(x):
        with set_checkpoint_early_stop(False):
            return fn(x)
    return run


def variants(block: nn.Module) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    def spartron(mode: str, reentrant: bool):
        region = CheckpointRegion(region_options(ACConfig(mode=mode, reentrant=reentrant), "block"))
        return lambda x: region(block, x)

    sac = functools.partial(create_selective_checkpoint_contexts, _torch_sac_policy)
    return {
        "none": block,
        "spartron_full": spartron("full", True),
        "spartron_selective": spartron("selective", True),
        "spartron_full_nonreentrant": spartron("full", False),
        "spartron_selective_nonreentrant": spartron("selective", False),
        "torch_full": lambda x: checkpoint(block, x, use_reentrant=False),
        "torch_full_reentrant": lambda x: checkpoint(block, x, use_reentrant=True),
        "torch_full_no_early_stop": _no_early_stop(lambda x: checkpoint(block, x, use_reentrant=False)),
        "torch_selective": lambda x: checkpoint(block, x, use_reentrant=False, context_fn=sac),
    }


def measure(fn, x: torch.Tensor, grad: torch.Tensor, iters: int, warmup: int) -> dict[str, float | None]:
    cuda = x.device.type == "cuda"
    for _ in range(warmup):
        fn(x).backward(grad)
    times, kept, peak = [], None, None
    for i in range(iters):
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        y = fn(x)
        if cuda and i == 0:
            kept = (torch.cuda.memory_allocated() - base) / 2**20
        y.backward(grad)
        del y
        if cuda:
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            if i == 0:
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        else:
            times.append((time.perf_counter() - t0) * 1e3)
    return {"step_ms": statistics.median(times), "kept_after_forward_mib": kept, "peak_above_base_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script runs)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if args.smoke:
        device, dtype, dim, heads, mlp, seq, iters, warmup = "cpu", torch.float32, 64, 4, 128, 32, 3, 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("ac_block.py needs a CUDA GPU (or --smoke for a CPU check)")
        device, dtype, dim, heads, mlp, seq, iters, warmup = "cuda", torch.bfloat16, 4096, 32, 14336, 4096, \
            args.iters, 3
    torch.manual_seed(0)
    block = Block(dim, heads, mlp).to(device=device, dtype=dtype)
    x = torch.randn(1, seq, dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    results = {name: measure(fn, x, grad, iters, warmup) for name, fn in variants(block).items()}
    none = results["none"]
    ratios = {name: r["step_ms"] / none["step_ms"] for name, r in results.items()}

    def mem_ratio(name: str) -> float | None:
        kept = results[name]["kept_after_forward_mib"]
        return None if kept is None or not none["kept_after_forward_mib"] else \
            kept / none["kept_after_forward_mib"]

    checks = {
        "full_vs_torch_full<=1.02": results["spartron_full_nonreentrant"]["step_ms"]
        / results["torch_full"]["step_ms"],
        "full_reentrant_vs_torch_reentrant<=1.02": results["spartron_full"]["step_ms"]
        / results["torch_full_reentrant"]["step_ms"],
        "full_vs_torch_full_no_early_stop<=1.02": results["spartron_full_nonreentrant"]["step_ms"]
        / results["torch_full_no_early_stop"]["step_ms"],
        "selective_vs_torch_sac<=1.02": results["spartron_selective_nonreentrant"]["step_ms"]
        / results["torch_selective"]["step_ms"],
        "full_step<=1.38x_none": ratios["spartron_full"],
        "selective_step<=1.10x_none": ratios["spartron_selective"],
        "selective_activation_mem<=0.5x_none": mem_ratio("spartron_selective"),
    }
    print(f"{'variant':34s} {'step ms':>9s} {'x none':>7s} {'kept MiB':>9s} {'peak MiB':>9s}")
    for name, r in results.items():
        kept = "-" if r["kept_after_forward_mib"] is None else f"{r['kept_after_forward_mib']:.0f}"
        peak = "-" if r["peak_above_base_mib"] is None else f"{r['peak_above_base_mib']:.0f}"
        print(f"{name:34s} {r['step_ms']:9.2f} {ratios[name]:7.3f} {kept:>9s} {peak:>9s}")
    for name, value in checks.items():
        print(f"{name:38s} {'-' if value is None else f'{value:.3f}'}")
    report = {
        "benchmark": "ac_block", "smoke": args.smoke, "commit": git_commit(), "torch": torch.__version__,
        "device": device_name(device == "cuda"),
        "shape": {"batch": 1, "seq": seq, "dim": dim, "heads": heads, "mlp": mlp, "dtype": str(dtype)},
        "iters": iters, "results": results, "ratio_to_none": ratios, "checks": checks,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
