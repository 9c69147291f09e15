"""[[train.stages]]: the rule (stage, lr, trainable set), the frozen backbone through the dense warm-up (bitwise,
1 and 2 gloo ranks, no optimizer state and no reduce-scatter for frozen parameters), resume across a boundary."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spartron.configbase import ConfigError
from spartron.runtime.config import config_from_dict
from spartron.runtime.optim import lr_at
from spartron.runtime.stages import lr_for_step, stage_at
from spartron.runtime.trainer import Trainer
from spartron.testing import run_distributed

PRESET = Path(__file__).parents[2] / "configs" / "deepseek-v3.2-staged.toml"


def staged(run_dir=None, **train) -> dict:
    """The preset, smaller: 2 warm-up steps (indexers only), 2 sparse steps (all)."""
    data = tomllib.loads(PRESET.read_text())
    data["model"].update(n_layers=2, max_seq_len=32)
    data["train"].update(steps=4, seq_len=16, progress=False, peak_tflops=1.0, **train)
    data["train"]["stages"][0]["steps"] = data["train"]["stages"][1]["steps"] = 2
    data["train"]["indexer_metrics"] = {"queries": 4, "every": 1}
    data["parallel"]["timeout_s"] = 30.0
    if run_dir is not None:
        data["train"]["run_dir"] = str(run_dir)
    return data


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    return str(err.value)


def test_stage_rule_and_learning_rate():
    t = config_from_dict(staged()).train
    assert [stage_at(s, t).name for s in range(1, 5)] == ["dense_warmup"] * 2 + ["sparse"] * 2
    first = t.model_copy(update={"lr": 1e-3, "steps": 2, "warmup_steps": 0, "stages": []})
    second = t.model_copy(update={"lr": 3e-4, "steps": 2, "warmup_steps": 0, "stages": []})
    assert [lr_for_step(s, t) for s in range(1, 5)] == [lr_at(1, first), lr_at(2, first), lr_at(1, second),
                                                        lr_at(2, second)]
    assert lr_for_step(3, t) == pytest.approx(1.65e-4)  # restarted: the middle of the stage's cosine from 3e-4
    assert lr_for_step(2, t) == pytest.approx(1e-4) and lr_for_step(4, t) == pytest.approx(3e-5)  # each to 0.1x


@pytest.mark.parametrize("change, message", [
    (lambda d: d["train"].update(steps=5), "train.stages: the stages' steps add up to 4 (2 + 2), but train.steps is 5"),
    (lambda d: d["train"]["stages"][1].update(colour="red"), "train.stages.1.colour: unknown key"),
    (lambda d: d["train"]["stages"][1].update(name="dense_warmup"),
     "train.stages.1.name: 'dense_warmup' names an earlier stage too"),
    (lambda d: d["train"]["stages"][0].update(warmup_steps=3), "train.stages.0.warmup_steps: 3 is more than the "
                                                               "stage's 2 steps"),
    (lambda d: d["train"]["stages"][0].update(trainable=[]),
     "train.stages.0.trainable: must name at least one parameter pattern"),
    (lambda d: d["train"]["stages"][0].update(dsa_mode="sparse"), "train.stages.0.dsa_mode: Input should be"),
    (lambda d: d["model"]["dsa"].update(indexer_mode="frozen", indexer_loss_coeff=0.0),
     "train.stages.0.dsa_mode = 'dense_warmup' trains the indexer by its KL loss, but model.dsa.indexer_loss_coeff "
     "is 0"),
    (lambda d: d["model"].pop("dsa"), "train.stages.0.dsa_mode = 'dense_warmup' needs DSA layers, but the model "
                                      "has no [model.dsa]"),
])
def test_bad_stages_are_one_line_naming_the_key(change, message):
    data = staged()
    change(data)
    text = _error(data)
    assert message in text and "\n" not in text


def _first_steps(rank, world, data, steps, spy):
    """Train `steps` steps of a fresh Trainer; returns what the boundary test checks."""
    sizes = []
    if spy:
        real = dist.reduce_scatter_single

        def counting(output, input, *args, **kwargs):  # noqa: A002 - torch's name
            sizes.append(input.numel())
            return real(output, input, *args, **kwargs)

        dist.reduce_scatter_single = counting
    trainer = Trainer(config_from_dict(data)).setup()
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in trainer.model.named_parameters()}
    full.update({n: b.clone() for n, b in trainer.model.named_buffers() if n.endswith("expert_bias")})
    records = [trainer.step() for _ in range(steps)]
    after = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
             for n, p in trainer.model.named_parameters()}
    after.update({n: b.clone() for n, b in trainer.model.named_buffers() if n.endswith("expert_bias")})
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    state = sorted(names[id(p)] for p in trainer.optimizer.state)
    grads = sorted(n for n, p in trainer.model.named_parameters() if p.grad is not None)
    indexer_numel = [p.numel() for n, p in trainer.model.named_parameters() if ".indexer." in n]
    trainer.close()
    return {"changed": sorted(n for n in full if not torch.equal(full[n], after[n])), "state": state,
            "params": sorted(n for n, _ in trainer.model.named_parameters()), "stages": [r["stage"] for r in records],
            "grads": grads, "sizes": sizes,
            "recall": [r["indexer_recall_per_layer"] for r in records], "indexer_numel": indexer_numel}


@pytest.mark.parametrize("world", [1, 2])
def test_backbone_is_bitwise_frozen_through_the_warmup(tmp_path, world):
    out = run_distributed(_first_steps, world, staged(tmp_path / "run"), 2, world > 1, timeout=240)[0]
    indexer = sorted(n for n in out["params"] if ".indexer." in n)
    assert out["stages"] == ["dense_warmup", "dense_warmup"]
    assert out["changed"] == indexer  # every indexer weight moved; nothing else (the expert bias included)
    assert out["state"] == indexer  # optimizer state only for the trainable parameters
    assert out["grads"] == []  # zeroed after the step (set_to_none)
    assert len(out["recall"][0]) == 2 and all(0 < r <= 1 for r in out["recall"][0])
    if world > 1:  # FSDP2 reduce-scattered exactly the indexers' gradients: one call per block holding one, per step
        assert out["sizes"] == [sum(out["indexer_numel"]) // 2] * 4  # 2 steps x 2 blocks, each half the indexers


def test_the_sparse_stage_trains_everything_and_creates_state_at_the_boundary(tmp_path):
    out = run_distributed(_first_steps, 1, staged(tmp_path / "run"), 3, False, timeout=240)[0]
    assert out["stages"] == ["dense_warmup", "dense_warmup", "sparse"]
    assert out["state"] == sorted(n for n in out["params"])  # every parameter after its first sparse step
    assert set(out["changed"]) >= set(out["params"])


def _run_to(rank, world, data, stop_at):
    """Train (or resume) until step `stop_at`; returns the parameters and the step records."""
    trainer = Trainer(config_from_dict(data)).setup()
    records = []
    while trainer.step_no < stop_at:
        records.append(trainer.step())
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy().tobytes()  # exact bits
              for n, p in trainer.model.named_parameters()}
    trainer.close()
    return params, [(r["step"], r["stage"], r["loss"], r["grad_norm"]) for r in records]


@pytest.mark.parametrize("saved", [2, 3])  # the last warm-up step (exactly at the boundary), the first sparse one
def test_resume_at_and_after_the_boundary_equals_the_uninterrupted_run_bitwise(tmp_path, saved):
    data = staged(tmp_path / "whole", save_every=1)
    whole, whole_records = run_distributed(_run_to, 1, data, 4, timeout=240)[0]
    part = staged(tmp_path / "part", save_every=1)
    run_distributed(_run_to, 1, part, saved, timeout=240)
    resumed, records = run_distributed(_run_to, 1, copy.deepcopy(part), 4, timeout=240)[0]
    assert records == whole_records[saved:]  # losses, grad norms and stages of the steps after the resume
    assert resumed == whole
