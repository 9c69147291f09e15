"""Megatron-core's training machinery around Spartron's layers on one GPU: parity, then step time and memory.

    python benchmarks/megatron_gpt.py --out benchmarks/results/megatron_gpt/megatron_gpt.json   # CUDA, one GPU
    python benchmarks/megatron_gpt.py --smoke                                       # tiny, CPU, seconds

Everything trains through Megatron as examples/megatron_gpt.py does (GPTModel, DistributedDataParallel,
Megatron's optimizer, get_forward_backward_func, finalize_model_grads; bf16 under Float16Module on the GPU):

1. parity: configs/tiny.toml's model (DSA, MoE with expert bias; no MTP) in fp32 for --parity-steps
   steps, Spartron's own Trainer against the Megatron GPTModel built from Spartron's specs, on the same
   device, weights and data; the per-step losses and their largest difference go to the JSON.
2. cases at configs/dsv3-12l.toml's layer shapes (--layers of its 12: Megatron keeps fp32 master weights,
   Adam states and an fp32 gradient buffer, 18 bytes per parameter, which for 12 layers leave no room for
   activations on one H200; the router has no expert bias: Megatron's needs sigmoid scores):
   - "spartron-layers": Spartron MLA attention and Spartron MoE;
   - "spartron-mla+megatron-moe": the same attention, Megatron's own MoELayer from its local (no Transformer
     Engine) spec: top-k router, alltoall dispatcher, SequentialMLP experts (its grouped experts need TE or
     grouped_gemm). The router is TopKRouter with its gating as the plain matmul megatron-core's non-TE
     branch computes: 0.16.1's router_gating_linear names te_general_gemm, which is undefined without TE;
   - "megatron-mla+megatron-moe": Megatron's own MLA too. megatron-core 0.16.1 builds its MLA only with
     Transformer Engine (the local spec's DotProductAttention takes no k_channels), so without TE the case
     is recorded as refused (its reason in the JSON), not run.
   Per case: every step's time and loss, the median after --warmup steps (>= 10 timed steps by default),
   tokens/s and peak allocated memory. A case that fails records its error and the others still run.

--smoke runs the parity and the "spartron-layers" case at tiny shapes on CPU (Megatron's MoE needs CUDA:
its alltoall dispatcher creates a CUDA stream), through the test-only tests/interop/megatron/cpu_shim.py.
The GPU machine has no megatron-core: install its wheel first, without dependencies
(`pip install --no-deps .whl/megatron_core-0.16.1-*.whl`; it needs only torch, numpy and packaging).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also under `python -m benchmarks.NAME`

from common import device_name, write_report  # noqa: E402

from examples.megatron_gpt import DEFAULTS, MegatronTraining  # noqa: E402
from spartron.runtime.config import RunConfig, load_config  # noqa: E402
from spartron.runtime.metrics import git_commit  # noqa: E402
from spartron.runtime.trainer import Trainer  # noqa: E402

TINY, SHAPE = REPO / "configs" / "tiny.toml", REPO / "configs" / "dsv3-12l.toml"
# The fp32 parity on CUDA leaves DSA out: its indexer top-k kernel takes bf16 / fp16 only (CPU runs DSA)
TINY_NO_DSA = REPO / "configs" / "tiny-hf.toml"
NO_TE_MLA = "megatron-mla+megatron-moe"
MLA_NEEDS_TE = ("megatron-core 0.16.1 builds its MLA only with Transformer Engine (the local spec's "
                "DotProductAttention takes no k_channels) and Transformer Engine is not installed")


def have_transformer_engine() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def planned_cases(device_type: str, have_te: bool) -> tuple[list[str], list[dict]]:
    """The cases to run and the ones recorded without running (with why): Megatron's MoE needs CUDA,
    Megatron's MLA needs Transformer Engine."""
    if device_type == "cpu":
        return ["spartron-layers"], [{"case": "spartron-mla+megatron-moe", "skipped": "CPU: Megatron's alltoall "
                                      "dispatcher creates a torch.cuda.Stream"}]
    run = ["spartron-layers", "spartron-mla+megatron-moe"]
    return (run + [NO_TE_MLA], []) if have_te else (run, [{"case": NO_TE_MLA, "refused": MLA_NEEDS_TE}])


def torch_gating_router():  # noqa: ANN201 - a megatron class, imported late
    """Megatron's TopKRouter whose gating is the matmul in the router dtype that its non-TE branch computes
    (0.16.1's router_gating_linear reads te_general_gemm, undefined when Transformer Engine is missing)."""
    from megatron.core.transformer.moe.router import TopKRouter

    class TorchGatingRouter(TopKRouter):
        def gating(self, input):  # noqa: A002, ANN001, ANN202 - Megatron's signature
            dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
            bias = None if self.bias is None else self.bias.to(dtype)
            return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)

    return TorchGatingRouter


def megatron_local_layer(n_experts: int, native_mla: bool):  # noqa: ANN201 - Megatron's TransformerLayerSubmodules
    """Megatron's local (no Transformer Engine) layer spec: SequentialMLP experts, and its router with the
    TE-free gating."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    theirs = get_gpt_layer_local_spec(num_experts=n_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                      multi_latent_attention=native_mla, normalization="RMSNorm").submodules
    router = dataclasses.replace(theirs.mlp.submodules, router=torch_gating_router())
    return dataclasses.replace(theirs, mlp=dataclasses.replace(theirs.mlp, submodules=router))


class MegatronMoETraining(MegatronTraining):
    """The same set-up with Megatron's own MoE layer in the MoE layers' mlp slot (and, with `native_mla`,
    Megatron's own MLA in every attention slot): the comparison cases."""

    def __init__(self, *args, native_mla: bool = False, **kwargs):
        self.native_mla = native_mla
        super().__init__(*args, **kwargs)

    def block_spec(self, tcfg, m):  # noqa: ANN001, ANN201
        ours = super().block_spec(tcfg, m)
        theirs = megatron_local_layer(m.moe.n_routed_experts, self.native_mla)
        moe = theirs.mlp
        layers = []
        for i, spec in enumerate(ours.layer_specs):
            sub = spec.submodules
            if i >= m.first_k_dense:
                sub = dataclasses.replace(sub, mlp=moe)
            if self.native_mla:
                sub = dataclasses.replace(sub, self_attention=theirs.self_attention)
            layers.append(dataclasses.replace(spec, submodules=sub))
        return dataclasses.replace(ours, layer_specs=layers)


def init_single_rank(device: torch.device) -> None:
    """One-rank process group, Megatron's parallel_state and its RNG tracker (its own attention forks it)."""
    from megatron.core import parallel_state, tensor_parallel

    if device.type == "cuda":
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{tempfile.mktemp(prefix='spartron_mgpt_')}",
                                rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(0)


def parity(args, device: torch.device) -> dict:
    """Spartron's Trainer and the Megatron GPTModel from Spartron's specs, fp32, same device and data."""
    base = TINY if device.type == "cpu" else TINY_NO_DSA
    with tempfile.TemporaryDirectory(prefix="megatron_gpt_parity_") as tmp:
        cfg = load_config(base, [*DEFAULTS, f"device={device.type}", "model.dtype=float32",
                                 f"train.steps={args.parity_steps}", "train.save_every=0", "train.peak_tflops=1.0",
                                 f"train.run_dir={tmp}/run"])
        trainer = Trainer(cfg).setup()
        try:
            ours = [trainer.step()["loss"] for _ in range(cfg.train.steps)]
        finally:
            trainer.close()
        job = MegatronTraining(cfg, 1, device=device)
        theirs = [job.step(s) for s in range(1, cfg.train.steps + 1)]
    diff = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
    print(f"parity over {len(ours)} steps: max |loss difference| {diff:.3g}", flush=True)
    return {"spartron_trainer_losses": ours, "megatron_losses": theirs, "max_abs_diff": diff,
            "model": cfg.model.model_dump(), "config": f"configs/{base.name} + " + " ".join(DEFAULTS)}


def case_config(args, device: torch.device) -> RunConfig:
    if args.smoke:
        return load_config(TINY, [*DEFAULTS, "device=cpu", f"train.steps={args.steps}"])
    return load_config(SHAPE, [f"model.n_layers={args.layers}", "model.moe.bias_update_rate=0",
                               f"train.steps={args.steps}", f"train.seq_len={args.seq}",
                               f"train.micro_batch_size={args.batch}", f"train.global_batch_size={args.batch}",
                               "train.warmup_steps=0", "train.grad_clip=1.0", "ac.mode=none"])


def run_case(name: str, cfg: RunConfig, args, device: torch.device) -> dict:
    bf16 = device.type == "cuda"
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if name == "spartron-layers":
        job = MegatronTraining(cfg, 1, bf16=bf16, device=device)
    else:
        job = MegatronMoETraining(cfg, 1, bf16=bf16, device=device, native_mla=name == NO_TE_MLA)
    losses, times = [], []
    for step in range(1, args.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(job.step(step))  # .item() of the loss: the step's work has finished
        times.append(time.perf_counter() - t0)
        print(f"  {name} step {step}: loss {losses[-1]:.4f} ({times[-1] * 1e3:.1f} ms)", flush=True)
    timed = times[args.warmup:] or times
    step_s = statistics.median(timed)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    return {"case": name, "bf16_float16module": bf16, "losses": losses, "step_times_s": times,
            "timed_steps": len(timed), "step_time_s": step_s, "tokens_per_s": tokens / step_s,
            "params": sum(p.numel() for p in job.gpt.parameters()),
            "peak_memory_allocated_gib": (torch.cuda.max_memory_allocated() / 2**30
                                          if device.type == "cuda" else None),
            "loss_decreased": losses[-1] < losses[0]}


def print_table(rows: list[dict]) -> None:
    print(f"{'case':<28}{'step ms':>10}{'tokens/s':>12}{'peak GiB':>10}{'loss first':>12}{'loss last':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<28}  error: {r['error'].strip().splitlines()[-1][:90]}")
            continue
        peak = "-" if r["peak_memory_allocated_gib"] is None else f"{r['peak_memory_allocated_gib']:.2f}"
        print(f"{r['case']:<28}{r['step_time_s'] * 1e3:>10.1f}{r['tokens_per_s']:>12.0f}{peak:>10}"
              f"{r['losses'][0]:>12.4f}{r['losses'][-1]:>11.4f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, seconds")
    p.add_argument("--steps", type=int, default=None, help="steps per case (default 13; --smoke 3)")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps per case")
    p.add_argument("--layers", type=int, default=4, help="layers of dsv3-12l's 12 (first dense)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--parity-steps", type=int, default=4)
    args = p.parse_args()
    import megatron.core

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.smoke:
        print("no CUDA device: use --smoke for the CPU version", file=sys.stderr)
        return 2
    args.steps = args.steps or (3 if args.smoke else 13)
    args.warmup = min(args.warmup, args.steps - 1)
    init_single_rank(device)
    result = {"benchmark": "megatron_gpt", "device": device_name(device.type == "cuda"), "torch": torch.__version__,
              "megatron_core": getattr(megatron.core, "__version__", None), "commit": git_commit(),
              "smoke": args.smoke}
    try:
        result["parity"] = parity(args, device)
    except Exception:  # record and continue
        result["parity"] = {"error": traceback.format_exc()}
        print(result["parity"]["error"], file=sys.stderr)
    cfg = case_config(args, device)
    result["shapes"] = {"config": str((TINY if args.smoke else SHAPE).relative_to(REPO)), "layers": cfg.model.n_layers,
                        "batch": cfg.train.global_batch_size, "seq": cfg.train.seq_len, "steps": args.steps,
                        "warmup": args.warmup, "model": cfg.model.model_dump()}
    names, recorded = planned_cases(device.type, have_transformer_engine())
    rows = []
    for name in names:
        try:
            rows.append(run_case(name, cfg, args, device))
        except Exception:  # one failing case must not hide the others
            rows.append({"case": name, "error": traceback.format_exc()})
            print(rows[-1]["error"], file=sys.stderr)
    rows += recorded
    for r in recorded:
        print(f"{r['case']}: {r.get('refused') or r['skipped']}", flush=True)
    print_table([r for r in rows if "skipped" not in r and "refused" not in r])
    result["cases"] = rows
    write_report(args.out, result)
    dist.destroy_process_group()
    ours = rows[0]  # spartron-layers: must run and learn; the Megatron-layer cases only record what they do
    parity_ok = "error" not in result["parity"] and result["parity"]["max_abs_diff"] < 1e-5
    return 0 if parity_ok and "error" not in ours and ours["loss_decreased"] else 1


if __name__ == "__main__":
    sys.exit(main())
