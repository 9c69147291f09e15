"""model.master_weights = "optimizer" (spartron.runtime.master_weights): bf16 parameters, fp32 masters, main
gradients and AdamW state in the optimizer, against today's FSDP2 fp32-master path on one gloo rank.

Both paths compute in bf16 on the CPU with the same bf16 weights (round(master)) and the same bf16 gradients, cast
to fp32 (FSDP2's copy, or the update's read) and summed in fp32 over micro-batches; the CPU runs MasterAdamW's torch
reference, which follows torch's single-tensor AdamW operation by operation. So the losses, gradient norms, fp32
masters and AdamW moments are compared to 1e-6 (they agree bitwise here), with clipping active at every step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from spartron.layers.config import master_layout_refusal
from spartron.runtime.config import ConfigError, TrainConfig, load_config
from spartron.runtime.master_weights import MasterAdamW, attach_master_weights
from spartron.runtime.optim import build_optimizer, global_grad_norm
from spartron.runtime.trainer import StepProbe, Trainer, train
from spartron.testing import run_distributed

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
MASTERS = ["model.dtype=bfloat16", "model.master_dtype=float32"]
PATHS = {"fsdp": MASTERS, "optimizer": [*MASTERS, "model.master_weights=optimizer"]}
STEPS = 3


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _cfg(path: str, run_dir: str, micro: int, *extra: str):
    return load_config(TINY, [*PATHS[path], f"train.steps={STEPS}", "train.progress=false", "train.peak_tflops=1.0",
                              "train.seq_len=32", f"train.global_batch_size={micro}", "train.micro_batch_size=1",
                              "train.grad_clip=0.05", f"train.run_dir={run_dir}", *extra])


def _run(path: str, run_dir: str, micro: int) -> dict:
    trainer = Trainer(_cfg(path, run_dir, micro)).setup()
    grads, rounded, records = [], [], []
    model = trainer.model

    def on_phase(name: str) -> None:
        if name == "optimizer" and path == "optimizer":
            grads.append(sorted({str(p.main_grad.dtype) for p in model.parameters() if p.main_grad is not None}))

    for _ in range(STEPS):
        records.append(trainer.step(StepProbe(on_phase=on_phase)))
        if path == "optimizer":
            rounded.append(all(torch.equal(p.detach(), p.main_param.to(torch.bfloat16)) for p in model.parameters()))
    masters = {n: _full(p.main_param if path == "optimizer" else p).float() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {(names[id(p)], k): _full(v) for p, s in trainer.optimizer.state.items() for k, v in s.items()
               if k != "step"}
    out = dict(losses=[r["loss"] for r in records], norms=[r["grad_norm"] for r in records], masters=masters,
               moments=moments, grads=grads, rounded=rounded,
               param_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
               state_dtypes=sorted({str(v.dtype) for v in moments.values()}),
               optimizer=type(trainer.optimizer).__name__)
    trainer.close()
    return out


def _both(rank, world, root, micro):
    """Both runs and the largest differences of their masters and moments (tensors do not cross the pipe)."""
    old, new = (_run(path, f"{root}/{path}", micro) for path in PATHS)
    assert old["masters"].keys() == new["masters"].keys() and old["moments"].keys() == new["moments"].keys()
    diffs = {**{n: float((v - new["masters"][n]).abs().max()) for n, v in old["masters"].items()},
             **{k: float((v - new["moments"][k]).abs().max()) for k, v in old["moments"].items()}}
    moved = sum(int((v != _bf16(v)).sum()) for v in old["masters"].values())
    for run in (old, new):
        del run["masters"], run["moments"]
    return old, new, diffs, moved


@pytest.mark.parametrize("micro", [1, 2])
def test_optimizer_masters_train_as_the_fsdp_path_on_one_rank(tmp_path, micro):
    ((old, new, diffs, moved),) = run_distributed(_both, 1, str(tmp_path), micro, timeout=300)
    assert (old["optimizer"], new["optimizer"]) == ("AdamW", "MasterAdamW")
    assert (old["param_dtypes"], new["param_dtypes"]) == (["torch.float32"], ["torch.bfloat16"])
    assert new["state_dtypes"] == old["state_dtypes"] == ["torch.float32"]
    # one micro-batch: autograd's bf16 gradient as it is; two: an fp32 sum
    assert new["grads"] == [["torch.bfloat16" if micro == 1 else "torch.float32"]] * STEPS
    assert new["rounded"] == [True] * STEPS  # the bf16 weight is the rounded master after every step
    assert min(old["norms"]) > 0.05  # clipped at every step
    for a, b in zip(old["losses"] + old["norms"], new["losses"] + new["norms"], strict=True):
        assert abs(a - b) <= 1e-6
    assert len(diffs) > 100 and max(diffs.values()) <= 1e-6  # every master, exp_avg and exp_avg_sq
    assert moved > 0  # the masters hold what bf16 cannot


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _resume_run(rank, world, run_dir: str, path: str, steps: int):
    cfg = _cfg(path, run_dir, 2, f"train.steps={steps}", "train.save_every=2")
    result = train(cfg)
    return result.resumed_from, [r["loss"] for r in result.records]


@pytest.mark.parametrize(("first", "then"), [("optimizer", "optimizer"), ("optimizer", "fsdp"),
                                             ("fsdp", "optimizer")])
def test_a_saved_step_resumes_on_either_path(tmp_path, first, then):
    (whole,) = run_distributed(_resume_run, 1, str(tmp_path / "whole"), "optimizer", STEPS, timeout=300)
    (head,) = run_distributed(_resume_run, 1, str(tmp_path / "split"), first, 2, timeout=300)
    (tail,) = run_distributed(_resume_run, 1, str(tmp_path / "split"), then, STEPS, timeout=300)
    assert (whole[0], head[0], tail[0]) == (None, None, 2)
    assert head[1] + tail[1] == whole[1]


def _tiny_linear() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4, bias=False))
    attach_master_weights(model, torch.bfloat16)
    return model


def _backward(model: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(5, 8, dtype=torch.bfloat16)).square().sum().backward()


def test_gradients_move_into_main_grad_and_sum_in_fp32_from_the_second_micro_batch():
    model = _tiny_linear()
    w = model[0].weight
    _backward(model, 1)
    first = w.main_grad
    assert w.grad is None and first.dtype == torch.bfloat16
    _backward(model, 2)
    reference = _tiny_linear()
    _backward(reference, 2)
    assert w.main_grad.dtype == torch.float32 and w.grad is None
    assert torch.equal(w.main_grad, first.float() + reference[0].weight.main_grad.float())
    norm = global_grad_norm(list(model.parameters()))
    assert torch.equal(norm, torch.stack([torch.linalg.vector_norm(p.main_grad, dtype=torch.float32).square()
                                          for p in model.parameters()]).sum().sqrt())
    opt = build_optimizer(model, TrainConfig())
    kept = w.main_grad
    opt.zero_grad(set_to_none=False)  # train.keep_grad_buffers: the fp32 buffer stays, zeroed
    assert w.main_grad is kept and not kept.any()
    opt.zero_grad()
    assert all(p.main_grad is None for p in model.parameters())


def test_the_state_dict_holds_the_masters_and_loading_rounds_them_into_the_parameters():
    model = _tiny_linear()
    sd = model.state_dict()
    assert sd["0.weight"] is model[0].weight.main_param and sd["0.weight"].dtype == torch.float32
    new = {k: v + 1e-3 for k, v in sd.items()}
    model.load_state_dict(new)
    for name, p in model.named_parameters():
        assert torch.equal(p.main_param, new[name]) and torch.equal(p.detach(), new[name].to(torch.bfloat16))


def test_master_adamw_keeps_fp32_moments_through_load_state_dict():
    model = _tiny_linear()
    opt = build_optimizer(model, TrainConfig())
    assert type(opt) is MasterAdamW and opt.reference  # CPU parameters: the torch reference
    _backward(model, 3)
    opt.step()
    saved = opt.state_dict()
    again = build_optimizer(model, TrainConfig())
    again.load_state_dict(saved)
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert again.state[p][key].dtype == torch.float32 and torch.equal(again.state[p][key], opt.state[p][key])
        assert torch.equal(p.detach(), p.main_param.to(torch.bfloat16))


def test_attach_refuses_twice_and_non_fp32_parameters():
    model = _tiny_linear()
    with pytest.raises(ValueError, match="^attach_master_weights: the model's parameters already have fp32 masters$"):
        attach_master_weights(model, torch.bfloat16)
    with pytest.raises(ValueError, match=r"^attach_master_weights: parameter weight is torch.bfloat16; the masters"):
        attach_master_weights(nn.Linear(2, 2, dtype=torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.dtype=bfloat16", "model.master_weights=optimizer"],
     "model.master_weights = 'optimizer' keeps fp32 masters in the optimizer: it needs model.master_dtype = "
     "'float32' (with model.dtype = 'bfloat16')"),
    ([*PATHS["optimizer"], "train.optimizer=muon"],
     "model.master_weights = 'optimizer' is AdamW over fp32 masters; train.optimizer = 'muon' keeps its own state: "
     "set model.master_weights = 'fsdp'"),
    (["model.master_weights=megatron"], "model.master_weights: Input should be 'fsdp' or 'optimizer' (got 'megatron')"),
])
def test_contradictory_master_weight_settings_are_errors_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert str(err.value) == f"invalid config: {message}"


def test_more_than_one_rank_is_refused_naming_the_key():
    assert master_layout_refusal("optimizer", 1) is None and master_layout_refusal("fsdp", 8) is None
    assert master_layout_refusal("optimizer", 2) == ("model.master_weights = 'optimizer' runs on one rank (its "
                                                     "parameters are not sharded); this layout has 2 ranks: set "
                                                     "model.master_weights = 'fsdp'")


def test_the_optimizer_builder_refuses_muon_over_masters_with_the_config_rule():
    """One rule, one text: the builder (a caller that skips RunConfig) says what the config says."""
    with pytest.raises(ConfigError) as config_err:
        load_config(TINY, [*PATHS["optimizer"], "train.optimizer=muon"])
    model = _tiny_linear()
    with pytest.raises(ValueError) as builder_err:
        build_optimizer(model, TrainConfig(optimizer="muon"))
    assert str(config_err.value) == f"invalid config: {builder_err.value}"
