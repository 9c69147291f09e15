"""A megatron-core GPTModel built from Spartron's layer specs, trained for a few steps.

    python benchmarks/megatron_gpt.py --out benchmarks/results/megatron_gpt/megatron_gpt.json   # CUDA, one GPU
    python benchmarks/megatron_gpt.py --smoke                                       # tiny, CPU, seconds

What it shows: Megatron's GPTModel (embedding, TransformerBlock, output layer, vocab-parallel loss)
runs Spartron MLA / DSA attention and Spartron MoE through `spartron.interop.megatron`, with the aux
and indexer losses taken from the SideChannel and the expert bias updated once per step. Each case
trains on one fixed batch, so the loss must fall; per-step losses, median step time (after
--warmup steps), tokens/s and peak memory go to the JSON. A case that fails records its error and
the others still run.

The GPU machine has no megatron-core: install the wheel first, without dependencies
(`pip install --no-deps .whl/megatron_core-0.16.1-*.whl`; megatron-core 0.16.1 needs only torch,
numpy and packaging).
"""

from __future__ import annotations

import argparse
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

from spartron.interop.megatron import (  # noqa: E402
    SideChannel,
    megatron_config_from_spartron,
    moe_adapters,
    spartron_block_spec,
)
from spartron.interop.megatron.groups import to_process_group_collection  # noqa: E402
from spartron.layers.config import ModelConfig  # noqa: E402
from spartron.parallel.dims import ParallelDims  # noqa: E402
from spartron.parallel.groups import ParallelGroups  # noqa: E402
from spartron.runtime.config import load_config  # noqa: E402
from spartron.runtime.metrics import git_commit  # noqa: E402

PRESET = REPO / "configs" / "megatron-gpt-bench.toml"  # the model; its DSA section is the "dsa-moe" case's
# --smoke: the tiny preset's model, without MTP (GPTModel has none), on the router the GPU preset uses
SMOKE = ["model.mtp.depth=0", "model.moe.dispatcher='local'", "model.moe.aux_loss_coeff=1e-4",
         "model.moe.n_groups=1", "model.moe.topk_groups=1"]


def init_single_rank(device: torch.device):
    """One-rank process group, Spartron groups, Megatron's ProcessGroupCollection and parallel_state.

    parallel_state is initialised because GPTModel's vocab-parallel cross-entropy reads its TP group.
    """
    from megatron.core import parallel_state

    if device.type == "cuda":
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{tempfile.mktemp(prefix='spartron_mgpt_')}",
                                rank=0, world_size=1)
    groups = ParallelGroups.build(ParallelDims(world_size=1, fsdp=1), device.type)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    return to_process_group_collection(groups)


def build_model(cfg: ModelConfig, pgc, device: torch.device):
    from megatron.core.models.gpt.gpt_model import GPTModel

    tcfg = megatron_config_from_spartron(cfg, use_cpu_initialization=True)
    side = SideChannel()
    model = GPTModel(tcfg, spartron_block_spec(tcfg, side, base_config=cfg, pg_collection=pgc),
                     vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_seq_len,
                     position_embedding_type="none", share_embeddings_and_output_weights=cfg.tie_embeddings,
                     pg_collection=pgc)
    return model.to(device), side


def run_case(name: str, cfg: ModelConfig, args, pgc, device: torch.device, autocast: bool) -> dict:
    torch.manual_seed(0)
    model, side = build_model(cfg, pgc, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1,
                            fused=device.type == "cuda")
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        t0 = time.perf_counter()
        side.reset()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            lm = model(inputs, None, None, labels=labels).float().mean()
            loss = lm + side.loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for adapter in moe_adapters(model):  # aux-loss-free balancing: once per optimizer step
            adapter.moe.update_expert_bias()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        print(f"  {name} step {step}: loss {losses[-1]:.4f} ({times[-1] * 1e3:.1f} ms)", flush=True)
    timed = times[args.warmup:] or times
    step_s = statistics.median(timed)
    return {"case": name, "losses": losses, "step_times_s": times, "step_time_s": step_s,
            "tokens_per_s": args.batch * args.seq / step_s, "autocast_bf16": autocast,
            "params": sum(p.numel() for p in model.parameters()),
            "peak_memory_allocated_gib": (torch.cuda.max_memory_allocated() / 2**30
                                          if device.type == "cuda" else None),
            "loss_decreased": losses[-1] < losses[0]}


def print_table(rows: list[dict]) -> None:
    print(f"{'case':<22}{'step ms':>10}{'tokens/s':>12}{'peak GiB':>10}{'loss first':>12}{'loss last':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<22}  error: {r['error'].splitlines()[-1][:90]}")
            continue
        peak = "-" if r["peak_memory_allocated_gib"] is None else f"{r['peak_memory_allocated_gib']:.2f}"
        print(f"{r['case']:<22}{r['step_time_s'] * 1e3:>10.1f}{r['tokens_per_s']:>12.0f}{peak:>10}"
              f"{r['losses'][0]:>12.4f}{r['losses'][-1]:>11.4f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few seconds")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-4)
    args = p.parse_args()
    import megatron.core

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.smoke:
        print("no CUDA device: use --smoke for the CPU version", file=sys.stderr)
        return 2
    run_cfg = load_config(REPO / "configs" / "tiny.toml", SMOKE) if args.smoke else load_config(PRESET)
    with_dsa = run_cfg.model
    model = with_dsa.model_copy(update={"dsa": None})
    args.steps = args.steps or (4 if args.smoke else 10)
    args.seq = args.seq or (32 if args.smoke else run_cfg.train.seq_len)
    args.batch = args.batch or (2 if args.smoke else run_cfg.train.micro_batch_size)
    args.lr = args.lr if not args.smoke else 1e-2
    pgc = init_single_rank(device)
    cases = {"mla-moe": (model, False), "dsa-moe": (with_dsa, False)}
    if device.type == "cuda":
        cases["mla-moe-bf16-autocast"] = (model, True)
    rows = []
    for name, (cfg, autocast) in cases.items():
        try:
            rows.append(run_case(name, cfg, args, pgc, device, autocast))
        except Exception:  # record and continue: one failing case must not hide the others
            rows.append({"case": name, "error": traceback.format_exc()})
            print(rows[-1]["error"], file=sys.stderr)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(rows)
    result = {
        "benchmark": "megatron_gpt",
        "device": device_name(device.type == "cuda"),
        "torch": torch.__version__, "megatron_core": getattr(megatron.core, "__version__", None),
        "commit": git_commit(), "smoke": args.smoke,
        "shapes": {"batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
                   "model": model.model_dump(), "dsa": with_dsa.dsa.model_dump(), "config": str(
                       (REPO / "configs" / "tiny.toml" if args.smoke else PRESET).relative_to(REPO))},
        "cases": rows,
    }
    write_report(args.out, result)
    dist.destroy_process_group()
    return 0 if all("error" not in r and r["loss_decreased"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
