"""Precision modes (model.dtype = compute, model.master_dtype = stored masters, model.reduce_dtype): the
config's rules, and training the tiny preset on one gloo rank in three modes — plain fp32 (the
reference), bf16-only, and fp32 masters with bf16 compute (FSDP2 on one rank) — at a learning rate
whose updates are below bf16's resolution of the weights: bf16-only parameters mostly do not move,
fp32 masters follow the fp32 reference's updates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from spartron.runtime.config import ConfigError, load_config
from spartron.runtime.trainer import Trainer
from spartron.testing import run_distributed

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
STEPS = 3
MODES = {"fp32": [], "bf16": ["model.dtype=bfloat16"],
         "masters": ["model.dtype=bfloat16", "model.master_dtype=float32"]}


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.dtype=bfloat16", "model.master_dtype=bfloat16"],
     "model.master_dtype = 'bfloat16' equals model.dtype: leave it unset (parameters are then stored in model.dtype)"),
    (["model.master_dtype=bfloat16"],
     "model.master_dtype = 'bfloat16' with model.dtype = 'float32' keeps masters less precise than the compute: "
     "set model.dtype = 'bfloat16' and leave model.master_dtype unset (bf16-only), or model.master_dtype = "
     "'float32' with model.dtype = 'bfloat16'"),
    (["model.dtype=bfloat16", "model.master_dtype=float32", "model.reduce_dtype=bfloat16"],
     "model.reduce_dtype = 'bfloat16' with float32 gradients (model.master_dtype or model.dtype 'float32') rounds "
     "every gradient to bf16 before an fp32 update: use model.reduce_dtype = 'float32'"),
    (["model.master_dtype=float16"], "model.master_dtype: Input should be 'float32' or 'bfloat16' (got 'float16')"),
])
def test_contradictory_precision_settings_are_errors_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert str(err.value) == f"invalid config: {message}"


def test_each_dtype_has_its_meaning():
    masters = load_config(TINY, MODES["masters"]).model
    assert (masters.dtype, masters.stored_dtype, masters.reduce_dtype) == ("bfloat16", "float32", "float32")
    bf16 = load_config(TINY, MODES["bf16"] + ["model.reduce_dtype=bfloat16"]).model
    assert (bf16.dtype, bf16.stored_dtype, bf16.reduce_dtype) == ("bfloat16", "bfloat16", "bfloat16")


def test_a_hugging_face_checkpoint_starts_fp32_master_training():
    """The precision keys say how Spartron trains, not which function: a bf16 checkpoint's model matches."""
    from spartron.interop.hf import check_config_matches

    run = load_config(TINY, MODES["masters"] + ["model.reduce_dtype=float32"]).model
    check_config_matches(run, load_config(TINY, MODES["bf16"]).model)  # raises HFConfigError if not


def _global(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p.detach()).float().clone()


def _train(overrides: list[str], run_dir: str) -> dict:
    cfg = load_config(TINY, [f"train.steps={STEPS}", "train.progress=false", "train.peak_tflops=1.0",
                             f"train.run_dir={run_dir}", "train.lr=1e-5", "train.warmup_steps=0",
                             "train.min_lr_ratio=1.0", *overrides])
    trainer = Trainer(cfg).setup()
    start = {n: _global(p) for n, p in trainer.model.named_parameters()}
    losses = [trainer.step()["loss"] for _ in range(STEPS)]
    update = torch.cat([(_global(p) - start[n]).flatten() for n, p in trainer.model.named_parameters()])
    out = dict(losses=losses, update=update,
               params=sorted({(type(p).__name__, str(p.dtype)) for p in trainer.model.parameters()}),
               states=sorted({str(v.dtype) for s in trainer.optimizer.state.values() for k, v in s.items()
                              if k != "step"}))
    trainer.close()
    return out


def _three_modes(rank, world, root):
    runs = {mode: _train(o, f"{root}/{mode}") for mode, o in MODES.items()}
    ref = runs["fp32"]["update"]
    for r in runs.values():
        u = r.pop("update")
        r["cosine"] = F.cosine_similarity(u, ref, dim=0).item()  # update direction vs the fp32 reference's
        r["unchanged"] = (u == 0).float().mean().item()  # fraction of parameter elements that never moved
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    (r,) = run_distributed(_three_modes, 1, str(tmp_path_factory.mktemp("prec")), timeout=240)
    return r


def test_fp32_masters_are_sharded_fp32_with_fp32_optimizer_state_on_one_rank(runs):
    assert runs["masters"]["params"] == [("DTensor", "torch.float32")]  # FSDP2 on one rank: the cast is its
    assert runs["masters"]["states"] == ["torch.float32"]
    assert runs["bf16"]["params"] == [("Parameter", "torch.bfloat16")] and runs["bf16"]["states"] == ["torch.bfloat16"]
    assert runs["fp32"]["params"] == [("Parameter", "torch.float32")]


def test_fp32_masters_compute_in_bf16_and_keep_the_updates_bf16_loses(runs):
    fp32, bf16, masters = runs["fp32"], runs["bf16"], runs["masters"]
    # step 1 computes with the same bf16 weights (the fp32 init cast): the same loss, bitwise
    assert masters["losses"][0] == bf16["losses"][0] != fp32["losses"][0]
    assert masters["losses"] == pytest.approx(fp32["losses"], rel=2e-4, abs=0)  # measured 5e-5
    # lr 1e-5 is below half a bf16 ulp of most weights: bf16-only parameters mostly stay where they were
    assert bf16["unchanged"] > 0.5 and bf16["cosine"] < 0.6  # measured 0.86 and 0.36
    assert masters["unchanged"] < 0.05 and masters["cosine"] > 0.95  # measured 0.016 (as fp32) and 0.98
