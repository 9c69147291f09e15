"""What one attention layer holds for backward, by operator: dense MLA against DSA (kl_sparse source), unchunked and
query-chunked (model.dsa.attention_chunk), at V3 head dims and a reduced length, on CPU (issue 39).

    python benchmarks/dsa_saved.py --out benchmarks/results/dsa_saved/dsa_saved.json   # CPU, about a minute
    python benchmarks/dsa_saved.py --smoke                                             # tiny, seconds

Per variant: `no_ac` (bytes autograd saves, by the operator that made each storage, each storage once),
`selective` (the outputs the default selective-AC policy keeps, by operator, and the region's RegionStats
total) and `backward_peak` (the peak of live operator outputs, above what the forward left, during the layer's
backward under selective AC: the replay and the backward's gradients; temporaries inside an op are not seen).
Bytes are also given per token so they scale to any length (DSA's are linear in S: nothing O(S^2)). On CPU the
dense layer runs SDPA's math path (head dims 192 / 128 differ), which saves the [H, S, S] probabilities: its
row is not CUDA's flash attention (whose kept output is [S, H, 128] + lse); compare the DSA rows.
"""

from __future__ import annotations

import argparse
import collections
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py

from common import write_report  # noqa: E402

from spartron.checkpointing import CheckpointOptions, CheckpointRegion, build_policy  # noqa: E402
from spartron.checkpointing.policy import op_packet_name  # noqa: E402
from spartron.layers.attention.mla import MLA  # noqa: E402
from spartron.layers.config import ModelConfig  # noqa: E402
from spartron.runtime.metrics import git_commit  # noqa: E402


class OpStorages(TorchDispatchMode):
    """Which operator made each live storage; live bytes now and their peak since `reset_peak`."""

    def __init__(self, policy=None) -> None:  # noqa: ANN001
        super().__init__()
        self.maker: dict[int, tuple[str, int]] = {}
        self.current = self.peak = 0
        self.policy, self.kept = policy, collections.Counter()  # bytes of the outputs `policy` keeps, by op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.policy is not None and self.policy.decide(func, args, kwargs or {}) is not None:
            self.kept[op_packet_name(func)] += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                                                   if isinstance(t, torch.Tensor))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.maker and storage.nbytes():
                    self.maker[key] = (op_packet_name(func), storage.nbytes())
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.current -= self.maker.pop(key, ("", 0))[1]

    def reset_peak(self) -> None:
        self.peak = self.current


def layer(args: argparse.Namespace, variant: str) -> MLA:
    dsa = None if variant == "dense" else dict(
        n_index_heads=4, index_head_dim=128, index_topk=args.topk, indexer_mode="kl_sparse", indexer_loss_coeff=0.01,
        attention_chunk=args.seq // 4 if variant == "dsa_chunked" else 0)
    cfg = ModelConfig.model_validate(dict(
        dim=args.dim, n_heads=args.heads, n_layers=2, first_k_dense=1, dense_inter_dim=64,
        mla=dict(q_lora_rank=0, kv_lora_rank=args.lora, qk_nope_head_dim=args.nope, qk_rope_head_dim=64,
                 v_head_dim=args.nope), dsa=dsa))
    torch.manual_seed(0)
    return MLA(cfg, 1).to(torch.bfloat16)


def measure(args: argparse.Namespace, variant: str) -> dict:
    mla, s = layer(args, variant), args.seq
    x = torch.randn(1, s, args.dim, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(s)
    saved: dict[int, tuple[str, int]] = {}
    params = {p.untyped_storage()._cdata for p in mla.parameters()}
    with OpStorages() as made:
        made.maker.update({key: ("parameter", 0) for key in params})  # views of weights (aten::t) are not activations

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = t.untyped_storage()._cdata
            if key in made.maker and key not in params:  # the input is not made by an op either
                saved[key] = made.maker[key]
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = mla(x, positions)
        no_ac = collections.Counter()
        for name, nbytes in saved.values():
            no_ac[name] += nbytes
        del out
    policy = build_policy("selective")
    region = CheckpointRegion(CheckpointOptions(policy=policy, name=variant))
    with OpStorages(policy) as made:
        out = region(lambda t: mla(t, positions), x)
        kept, made.policy = made.kept, None  # the original pass only
        loss = out["hidden_states"].float().square().sum() + (out["indexer_loss"] or 0)
        made.reset_peak()
        after_forward = made.current
        loss.backward()
        peak = made.peak - after_forward
    stats = region.last_stats
    return {"no_ac_bytes_by_op": dict(no_ac.most_common()), "no_ac_bytes": sum(no_ac.values()),
            "selective_kept_bytes_by_op": dict(kept.most_common()), "selective_kept_bytes": stats.bytes_saved,
            "backward_peak_bytes": peak, "no_ac_bytes_per_token": sum(no_ac.values()) / s,
            "selective_kept_bytes_per_token": stats.bytes_saved / s, "backward_peak_bytes_per_token": peak / s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--lora", type=int, default=512, help="kv_lora_rank (V3: 512)")
    parser.add_argument("--nope", type=int, default=128, help="qk_nope_head_dim = v_head_dim (V3: 128)")
    parser.add_argument("--topk", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes")
    args = parser.parse_args()
    if args.smoke:
        args.seq, args.heads, args.dim, args.lora, args.nope, args.topk = 64, 2, 64, 32, 16, 16
    rows = {v: measure(args, v) for v in ("dense", "dsa", "dsa_chunked")}
    for name, r in rows.items():
        print(f"{name:12s} no AC {r['no_ac_bytes_per_token'] / 1024:8.1f} KiB/token, selective kept "
              f"{r['selective_kept_bytes_per_token'] / 1024:8.1f} KiB/token, backward peak "
              f"{r['backward_peak_bytes_per_token'] / 1024:8.1f} KiB/token", flush=True)
    write_report(args.out, {"benchmark": "dsa_saved", "device": "cpu", "commit": git_commit(),
                            "seq_len": args.seq, "heads": args.heads,
                            "dim": args.dim, "kv_lora_rank": args.lora, "topk": args.topk, "variants": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
