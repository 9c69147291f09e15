"""How much do neighbouring queries' DSA selections overlap in a training run? (Is cross-query reuse worth a kernel?)

    python benchmarks/dsa_id_overlap.py --seq 16384 --steps 20 \
        --out benchmarks/results/dsa_id_overlap/dsa_id_overlap_16384_SHA.json  # GPU
    python benchmarks/dsa_id_overlap.py --smoke                                                             # CPU

The sparse kernels walk each query's own ids, so every selected (query, key) pair costs one kv row gather
and, in backward, one 576-wide dkv row add (issue 23's floors: docs/GPU_NOTES.md). A kernel that served a
group of G consecutive queries from one walk over the union of their ids would gather and add each union
key once, so its traffic scales with the union, not with G x K. This trains `configs/dsa-4l.toml` through
the public Trainer (MTP off, selective AC) and, at the steps of --at, takes the ids every DSA source layer
returned in that step's forward and reports, per group size G: the reuse factor (valid ids summed over the
group / distinct valid ids in it: 1 = nothing shared, G = identical selections), over the queries that
have a full top-k (t >= K), and the mean Jaccard overlap of adjacent queries' sets, each next to what
uniformly random causal selections of the same sizes would give (`random_baseline`): a factor at the
baseline means the indexer's choices share no more keys than chance.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name, triton_version, write_report  # noqa: E402
from dsa_e2e import SMOKE  # noqa: E402

from spartron.layers.attention.mla import MLA  # noqa: E402
from spartron.parallel.env import discover, init_distributed  # noqa: E402
from spartron.runtime.config import load_config  # noqa: E402
from spartron.runtime.metrics import git_commit  # noqa: E402
from spartron.runtime.trainer import Trainer  # noqa: E402

GROUPS = (2, 4, 8)


def distinct_valid(rows: torch.Tensor) -> torch.Tensor:
    """rows [N, M] int ids (-1 = none) -> [N] number of distinct ids >= 0 per row."""
    srt = rows.sort(-1).values
    new = torch.ones_like(srt, dtype=torch.bool)
    new[:, 1:] = srt[:, 1:] != srt[:, :-1]
    return (new & (srt >= 0)).sum(-1)


def overlap_stats(ids: torch.Tensor) -> dict:
    """ids [B, S, K] int32 (ascending, -1 padding) -> the reuse factor per group size and adjacent Jaccard."""
    b, s, k = ids.shape
    full = ids[:, k - 1:] if s > k else ids[:, :0]  # queries t >= K - 1 hold K valid ids (causal top-k)
    out: dict = {"queries_with_full_topk": int(full.shape[1]) * b}
    if full.shape[1] < 2:
        return out
    for g in GROUPS:
        n = full.shape[1] // g * g
        if n == 0:
            continue
        grouped = full[:, :n].reshape(b * n // g, g * k).long()
        summed = (grouped >= 0).sum(-1)
        out[f"reuse_factor_g{g}"] = float((summed / distinct_valid(grouped).clamp_min(1)).double().mean())
    pairs = torch.cat((full[:, 1:], full[:, :-1]), dim=-1).reshape(-1, 2 * k).long()
    union = distinct_valid(pairs)
    shared = (pairs >= 0).sum(-1) - union
    out["adjacent_jaccard"] = float((shared / union.clamp_min(1)).double().mean())
    return out


def random_baseline(s: int, k: int) -> dict:
    """overlap_stats' numbers (groups and pairs of the queries t >= K - 1) expected when each query t picks
    K of its t + 1 visible keys uniformly at random: group factor G K / E[distinct] with E[distinct] the sum
    over keys of P(some query of the group picks it), and E[shared] / E[union] for adjacent pairs."""
    t = torch.arange(k - 1, s, dtype=torch.float64)
    keep = 1 - k / (t + 1)  # P(query t leaves a visible key out)
    out: dict = {}
    for g in GROUPS:
        n = t.shape[0] // g * g
        if n == 0:
            continue
        tt, kk = t[:n].view(-1, g), keep[:n].view(-1, g)
        # keys 0..t_first are visible to the whole group, key t_first + j to queries j.. only
        none_of = torch.flip(torch.cumprod(torch.flip(kk, [1]), 1), [1])
        distinct = (tt[:, 0] + 1) * (1 - none_of[:, 0]) + (1 - none_of[:, 1:]).sum(1)
        out[f"reuse_factor_g{g}"] = float((g * k / distinct).mean())
    if t.shape[0] >= 2:
        shared = (t[:-1] + 1) * (1 - keep[:-1]) * (1 - keep[1:])
        out["adjacent_jaccard"] = float((shared / (2 * k - shared)).mean())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO / "configs" / "dsa-4l.toml")
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--at", type=int, nargs="*", default=None, help="steps to measure (default: first and last)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--commit", default=None, help="the commit measured (a device copy's git may lie)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, 2 steps")
    args = p.parse_args()
    if args.smoke:
        args.seq, args.steps = 64, 2
    at = set(args.at or (1, args.steps))
    if discover().world_size != 1:
        p.error("dsa_id_overlap.py measures one process; run it without torchrun")
    init_distributed(discover(), "auto")
    try:
        rows, overrides, device, topk = measure(args, at)
    finally:
        dist.destroy_process_group()
    write_report(args.out, dict(benchmark="dsa_id_overlap", config=str(args.config.relative_to(REPO)),
                                commit=args.commit or git_commit(), seq_len=args.seq, steps=args.steps,
                                overrides=overrides, device=device, device_name=device_name(device.startswith("cuda")),
                                torch=torch.__version__, triton=triton_version(), group_sizes=list(GROUPS),
                                random_baseline=random_baseline(args.seq, topk), results=rows))
    return 0


def measure(args: argparse.Namespace, at: set[int]) -> tuple[list[dict], list[str], str, int]:
    """Train args.steps steps; the overlap of every source layer's ids at the steps in `at` (rows, overrides,
    device, the config's top-k)."""
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [*(SMOKE if args.smoke else []), "model.mtp.depth=0", f"train.seq_len={args.seq}",
                     f"model.max_seq_len={args.seq}", f"train.steps={args.steps}", "train.save_every=0",
                     "train.resume=false", "train.progress=false", f"train.run_dir={run_dir}", *args.set]
        cfg = load_config(args.config, overrides)
        trainer = Trainer(cfg).setup()
        captured: list[torch.Tensor] = []

        def keep_ids(module, inputs, output):  # noqa: ANN001, ANN202
            captured.append(output["dsa_topk_ids"].detach())  # AC replays return the same ids again, later

        sources = [m for m in trainer.model.modules() if isinstance(m, MLA) and m.dsa_role == "source"]
        hooks = [m.register_forward_hook(keep_ids) for m in sources]
        rows = []
        for step in range(1, args.steps + 1):
            captured.clear()
            record = trainer.step()
            if step in at:
                for layer, ids in enumerate(captured[: len(sources)]):
                    rows.append(dict(step=step, source=layer, loss=record["loss"], **overlap_stats(ids)))
                    print(rows[-1], flush=True)
        for h in hooks:
            h.remove()
        trainer.close()
    return rows, overrides, str(trainer.device), cfg.model.dsa.index_topk


if __name__ == "__main__":
    sys.exit(main())
