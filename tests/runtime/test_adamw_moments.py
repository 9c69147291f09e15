"""train.adamw_moments_dtype = "bfloat16": AdamW's moments stored in bf16 beside fp32 masters (DeepSeek-V3's recipe,
Megatron's precision-aware optimizer). The update runs in fp32 exactly as with fp32 moments, and each moment is
rounded to nearest even when stored; both holdings of the masters (FSDP2's on a gloo rank, the optimizer's) train
so, keep bf16 moments through save and resume, and the memory model counts 2 bytes a moment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from spartron.layers.costs import state_bytes_per_rank
from spartron.runtime.adamw_triton import TritonAdamW
from spartron.runtime.config import ConfigError, load_config
from spartron.runtime.saved_config import state_config, training_notes
from spartron.runtime.schedule import SCHEDULE_KEYS
from spartron.runtime.trainer import Trainer, train
from spartron.testing import run_distributed

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
MASTERS = ["model.dtype=bfloat16", "model.master_dtype=float32", "train.adamw_moments_dtype=bfloat16"]
HOLDERS = {"fsdp": MASTERS, "optimizer": [*MASTERS, "model.master_weights=optimizer"]}
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def _expected(param: torch.Tensor, grads: list[torch.Tensor], moments: torch.dtype) -> tuple[torch.Tensor, ...]:
    """torch's single-tensor AdamW in fp32, written out, its moments rounded into `moments` after every update."""
    p = param.clone()
    m = torch.zeros_like(p, dtype=moments)
    v = torch.zeros_like(p, dtype=moments)
    for step, g in enumerate(grads, start=1):
        m32, v32 = m.float(), v.float()
        p.mul_(1 - LR * WD)
        m32.lerp_(g, 1 - BETAS[0])
        v32.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
        denom = (v32.sqrt() / (1 - BETAS[1] ** step) ** 0.5).add_(EPS)
        p.addcdiv_(m32, denom, value=-(LR / (1 - BETAS[0] ** step)))
        m, v = m32.to(moments), v32.to(moments)
    return p, m, v


def _steps(opt: torch.optim.Optimizer, p: torch.Tensor, grads: list[torch.Tensor]) -> None:
    for g in grads:
        p.grad = g.clone()
        opt.step()


def _grads(n: int) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(64, 48) * 10 ** torch.randint(-3, 2, (64, 48)) for _ in range(n)]


def test_bf16_moments_are_the_fp32_update_with_each_moment_rounded_when_stored():
    torch.manual_seed(0)
    start, grads = torch.randn(64, 48), _grads(5)
    p = torch.nn.Parameter(start.clone())
    opt = TritonAdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, reference=True, moments_dtype=torch.bfloat16)
    _steps(opt, p, grads)
    want_p, want_m, want_v = _expected(start, grads, torch.bfloat16)
    state = opt.state[p]
    assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype, state["step"].dtype) == (
        torch.bfloat16, torch.bfloat16, torch.float32)
    assert torch.equal(p.detach(), want_p) and torch.equal(state["exp_avg"], want_m)
    assert torch.equal(state["exp_avg_sq"], want_v) and float(state["step"]) == 5.0
    # the rounding is real: fp32 moments give another trajectory
    assert not torch.equal(_expected(start, grads, torch.float32)[0], want_p)


def test_the_reference_with_the_parameters_moments_is_torchs_single_tensor_adamw_bitwise():
    torch.manual_seed(0)
    start, grads = torch.randn(64, 48), _grads(4)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    _steps(TritonAdamW([ours], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, reference=True), ours, grads)
    _steps(torch.optim.AdamW([theirs], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False), theirs, grads)
    assert torch.equal(ours.detach(), theirs.detach())


@pytest.mark.parametrize("params, moments", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_a_loaded_state_keeps_its_moments_in_the_moments_dtype_bitwise(params, moments):
    """torch's load_state_dict casts every floating state tensor to the parameter's dtype: bf16 moments beside
    fp32 parameters survive a cast back, fp32 moments beside bf16 parameters would not (taken again from the
    state dict)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 16, dtype=params))
    opt = TritonAdamW([p], reference=True, moments_dtype=moments)
    _steps(opt, p, [torch.randn(16, 16, dtype=params), torch.randn(16, 16, dtype=params)])
    saved = {k: v.clone() for k, v in opt.state[p].items()}
    if moments == torch.float32:  # bits a cast through the bf16 parameters' dtype would lose
        assert not torch.equal(saved["exp_avg_sq"].to(params).float(), saved["exp_avg_sq"])
    fresh = TritonAdamW([p], reference=True, moments_dtype=moments)
    fresh.load_state_dict(opt.state_dict())
    assert {k: v.dtype for k, v in fresh.state[p].items()} == {"step": torch.float32, "exp_avg": moments,
                                                               "exp_avg_sq": moments}
    assert all(torch.equal(fresh.state[p][k], v) for k, v in saved.items())


def _cfg(holder: str, run_dir: str, steps: int, *extra: str, moments: str = "bfloat16"):
    base = [o for o in HOLDERS[holder] if moments == "bfloat16" or not o.startswith("train.adamw_moments_dtype")]
    return load_config(TINY, [*base, f"train.steps={steps}", "train.progress=false", "train.seq_len=32",
                              "train.global_batch_size=2", "train.micro_batch_size=1", "train.grad_clip=0.05",
                              "train.peak_tflops=1.0", f"train.run_dir={run_dir}", *extra])


def _moment_dtypes(rank, world, run_dir: str, holder: str, moments: str) -> tuple[list[str], list[float]]:
    trainer = Trainer(_cfg(holder, run_dir, 3, moments=moments)).setup()
    losses = [trainer.step()["loss"] for _ in range(3)]
    dtypes = sorted({str((v.to_local() if isinstance(v, DTensor) else v).dtype)
                     for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"})
    kind = type(trainer.optimizer).__name__
    trainer.close()
    return [kind, *dtypes], losses


@pytest.mark.parametrize("holder", ["fsdp", "optimizer"])
def test_both_master_holders_train_with_bf16_moments(tmp_path, holder):
    ((kinds, losses),) = run_distributed(_moment_dtypes, 1, str(tmp_path / holder), holder, "bfloat16", timeout=300)
    ((_, fp32_losses),) = run_distributed(_moment_dtypes, 1, str(tmp_path / f"{holder}32"), holder, "float32",
                                          timeout=300)
    assert kinds == [{"fsdp": "TritonAdamW", "optimizer": "MasterAdamW"}[holder], "torch.bfloat16"]
    # the first update reads the fp32 moments it computed, before they are rounded: the third loss is the first
    # to see a rounded moment
    assert losses[:2] == fp32_losses[:2]
    assert losses[2] != fp32_losses[2] and abs(losses[2] - fp32_losses[2]) < 1e-2 * fp32_losses[2]


def _resume(rank, world, run_dir: str, holder: str, steps: int):
    result = train(_cfg(holder, run_dir, steps, "train.save_every=2"))
    return result.resumed_from, [r["loss"] for r in result.records]


@pytest.mark.parametrize(("holder", "world"), [("fsdp", 1), ("optimizer", 1), ("fsdp", 2)])
def test_a_saved_step_resumes_with_its_bf16_moments_as_if_never_stopped(tmp_path, holder, world):
    whole = run_distributed(_resume, world, str(tmp_path / "whole"), holder, 4, timeout=300)
    head = run_distributed(_resume, world, str(tmp_path / "split"), holder, 2, timeout=300)
    tail = run_distributed(_resume, world, str(tmp_path / "split"), holder, 4, timeout=300)
    for rank in range(world):  # FSDP2 shards the moments over both ranks; each resumes its own shard
        assert (whole[rank][0], head[rank][0], tail[rank][0]) == (None, None, 2)
        assert head[rank][1] + tail[rank][1] == whole[rank][1]


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.adamw_moments_dtype=bfloat16"],
     "train.adamw_moments_dtype = 'bfloat16' keeps AdamW's moments below fp32 masters, but model.master_dtype is "
     "None: the state is already in model.dtype ('float32'); set model.master_dtype = 'float32' or leave "
     "train.adamw_moments_dtype unset"),
    ([*MASTERS, "train.optimizer=muon"],
     "train.adamw_moments_dtype = 'bfloat16' needs train.optimizer = 'adamw' (got 'muon', whose state would "
     "ignore it)"),
    (["train.adamw_moments_dtype=float16"], "train.adamw_moments_dtype: Input should be 'bfloat16' (got 'float16')"),
])
def test_contradictory_moment_settings_are_errors_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert str(err.value) == f"invalid config: {message}"


def test_the_memory_model_counts_two_bytes_a_moment():
    cfg = load_config(TINY, MASTERS)
    dims = cfg.parallel.dims(1)
    fp32 = state_bytes_per_rank(cfg.model, dims, "adamw")
    bf16 = state_bytes_per_rank(cfg.model, dims, "adamw", moments_dtype="bfloat16")
    assert bf16["optimizer_state"] * 2 == fp32["optimizer_state"] > 0
    assert {k: bf16[k] for k in ("parameters", "gradients")} == {k: fp32[k] for k in ("parameters", "gradients")}


def _resume_from_fp32_moments(rank, world, run_dir: str) -> tuple[int, list[str]]:
    train(_cfg("fsdp", run_dir, 2, "train.save_every=2", moments="float32"))
    trainer = Trainer(_cfg("fsdp", run_dir, 3, "train.save_every=2")).setup()
    dtypes = sorted({str(v.to_local().dtype) for s in trainer.optimizer.state.values() for k, v in s.items()
                     if k != "step"})
    trainer.step()
    trainer.close()
    return trainer.resumed_from, dtypes


def test_a_step_saved_with_fp32_moments_resumes_into_bf16_moments_and_says_so(tmp_path):
    ((resumed, dtypes),) = run_distributed(_resume_from_fp32_moments, 1, str(tmp_path / "run"), timeout=300)
    assert (resumed, dtypes) == (2, ["torch.bfloat16"])  # rounded once, on load
    saved = state_config(_cfg("fsdp", str(tmp_path), 2, moments="float32"))
    now = state_config(_cfg("fsdp", str(tmp_path), 3))
    assert training_notes(saved, now, skip=SCHEDULE_KEYS) == [
        "spartron: note: train.adamw_moments_dtype changed on resume: the saved step trained with None, this run "
        "uses 'bfloat16'"]
