"""Layout-invariant init through the trainer: EP2, EP4 and EP2 x CP2 (with FSDP2) start from the 1-rank
model, from the seed alone (no weights loaded), and their step-1 losses equal the 1-rank run's.

The tiny preset (MLA + DSA, MoE with shared experts, MTP depth 2) on real gloo ranks, fp32 CPU. The
initial parameters are gathered after parallelize: DTensor shards by `full_tensor()`, EP expert
shards by an all-gather over the EP group in global expert order; they must equal the 1-rank
model's bitwise. The losses differ only by reduction order (the loss is a sum over ranks of partial
token sums): asserted to 1e-6 relative.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from spartron.layers.model import build_model
from spartron.runtime.config import load_config
from spartron.runtime.trainer import default_model_factory, train
from spartron.testing import run_distributed

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
SEED = 3
LOSS_RTOL = 1e-6


def _config(run_dir: str, ep: int, cp: int, extra: tuple[str, ...] = ()):
    return load_config(TINY, [*extra, "train.steps=1", "train.seq_len=32", "train.global_batch_size=4",
                              "train.progress=false", "train.peak_tflops=1.0", f"train.seed={SEED}",
                              f"train.run_dir={run_dir}", f"parallel.ep={ep}", f"parallel.cp={cp}",
                              "parallel.timeout_s=60"])


def gathered_parameters(model, groups) -> dict[str, torch.Tensor]:
    """Every parameter's global value: FSDP shards gathered, EP expert shards concatenated by EP rank
    (EP rank r holds global experts [r * E_local, (r + 1) * E_local))."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if ".experts." in name and groups.size("ep") > 1:
            parts = [torch.empty_like(t) for _ in range(groups.size("ep"))]
            dist.all_gather(parts, t.contiguous(), group=groups.ep)
            t = torch.cat(parts)
        out[name] = t.clone()
    return out


def _run(rank, world, run_dir: str, ep: int, cp: int, extra: tuple[str, ...] = ()):
    cfg = _config(run_dir, ep, cp, extra)
    seen = {}

    def factory(cfg, groups):
        model = default_model_factory(cfg, groups)
        seen["params"] = gathered_parameters(model, groups)
        return model

    result = train(cfg, model_factory=factory)
    reference = dict(build_model(cfg.model, seed=SEED).named_parameters())
    other_seed = dict(build_model(cfg.model, seed=SEED + 1).named_parameters())
    params = seen["params"]
    w1 = params["layers.1.ffn.experts.w1"]
    half = w1.shape[0] // 2
    return dict(
        names_match=sorted(params) == sorted(reference),
        differs=sorted(n for n, t in params.items() if not torch.equal(t, reference[n].detach())),
        # the defect: EP ranks drew their local experts from one RNG state, so e and e + E/2 were equal
        equal_expert_pairs=[e for e in range(half) if torch.equal(w1[e], w1[e + half])],
        seed_matters=not torch.equal(params["embed.weight"], other_seed["embed.weight"].detach()),
        record=result.records[0])


@pytest.fixture(scope="module")
def one_rank_step(tmp_path_factory):
    (r,) = run_distributed(_run, 1, str(tmp_path_factory.mktemp("one")), 1, 1, timeout=180)
    assert r["names_match"] and r["differs"] == [] and r["equal_expert_pairs"] == [] and r["seed_matters"]
    return r["record"]


@pytest.mark.parametrize(("world", "ep", "cp"), [(2, 2, 1), (4, 4, 1), (4, 2, 2)],
                         ids=["ep2-fsdp2", "ep4-fsdp4", "ep2-cp2-fsdp2"])
def test_layouts_start_from_the_one_rank_model_and_give_its_step1_loss(tmp_path, one_rank_step, world, ep, cp):
    results = run_distributed(_run, world, str(tmp_path), ep, cp, timeout=240)
    for r in results:
        assert r["names_match"], r
        assert r["differs"] == [], r["differs"]  # bitwise: every parameter, experts by global index
        assert r["equal_expert_pairs"] == []  # experts e and e + E/2 are distinct (they were equal)
        assert r["seed_matters"]
    record = results[0]["record"]
    assert all(r["record"]["loss"] == record["loss"] for r in results)  # all-reduced: one value
    for key in ("loss", "lm_loss"):
        assert record[key] == pytest.approx(one_rank_step[key], rel=LOSS_RTOL, abs=0), key
    assert record["mtp_losses"] == pytest.approx(one_rank_step["mtp_losses"], rel=LOSS_RTOL, abs=0)


def test_experts_sharded_on_dim_1_start_from_the_one_rank_model_and_give_its_step1_loss(tmp_path):
    """3 local experts over 2 expert_fsdp ranks do not split on dim 0: FSDP2 shards them on dim 1
    (spartron.layers.parallelize.expert_shard_dim)."""
    extra = ("model.moe.n_routed_experts=6",)
    (one,) = run_distributed(_run, 1, str(tmp_path / "one"), 1, 1, extra, timeout=180)
    results = run_distributed(_run, 4, str(tmp_path / "four"), 2, 1, extra, timeout=240)
    for r in results:
        assert r["names_match"] and r["differs"] == [] and r["equal_expert_pairs"] == [], r["differs"]
    for key in ("loss", "lm_loss"):
        assert results[0]["record"][key] == pytest.approx(one["record"][key], rel=LOSS_RTOL, abs=0), key
