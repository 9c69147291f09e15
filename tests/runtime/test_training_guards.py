"""Divergence is not silent by default: train.loss_spike_factor stops a run whose loss passes 10x its first
(0 turns it off), the end-of-run summary says when the loss ended far above its start, and a resume that
changes the learning-rate schedule says so in one line."""

from __future__ import annotations

import json
import math

import pytest

from spartron.runtime.config import ConfigError, load_config
from spartron.runtime.metrics import loss_ended_high, print_summary
from spartron.runtime.optim import lr_at
from spartron.runtime.trainer import LossSpikeError, TrainingError, schedule_note, train
from spartron.testing import run_distributed

SMALL = ["model.n_layers=2", "model.mtp.depth=1", "train.seq_len=16", "train.global_batch_size=2",
         "train.progress=false", "train.peak_tflops=1.0", "ac.mode='none'"]


def tiny(run_dir, *overrides):
    return load_config("configs/tiny.toml", [*SMALL, f"train.run_dir={json.dumps(str(run_dir))}", *overrides])


def _train(rank, world, cfg):
    """(losses of the steps trained, the error's message or None)."""
    try:
        return [r["loss"] for r in train(cfg).records], None
    except TrainingError as err:
        return None, f"{type(err).__name__}: {err}"


def test_the_defaults_stop_a_diverging_run_and_zero_turns_the_guard_off(tmp_path):
    cfg = tiny(tmp_path / "a", "train.lr=100.0", "train.warmup_steps=0", "train.steps=4")
    assert (cfg.train.loss_spike_factor, cfg.train.max_loss) == (10.0, None)
    _, err = run_distributed(_train, 1, cfg, timeout=120)[0]
    assert err.startswith("LossSpikeError: loss ") and " at step 2 is " in err, err
    assert err.endswith(", above train.loss_spike_factor = 10 (lower train.lr, or set train.loss_spike_factor = 0 "
                        "to train on)")
    off = tiny(tmp_path / "b", "train.lr=100.0", "train.warmup_steps=0", "train.steps=4", "train.loss_spike_factor=0")
    losses, err = run_distributed(_train, 1, off, timeout=120)[0]
    assert err is None and len(losses) == 4 and max(losses) > 10 * losses[0]  # what the guard stopped


def test_a_normal_run_trains_through_the_default_guard(tmp_path):
    losses, err = run_distributed(_train, 1, tiny(tmp_path / "r", "train.steps=3", "train.lr=1e-2"), timeout=120)[0]
    assert err is None and len(losses) == 3


@pytest.mark.parametrize("value", ["0.5", "1", "1.0", "-2"])
def test_a_spike_factor_that_would_stop_a_healthy_run_is_refused(value):
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.toml", [f"train.loss_spike_factor={value}"])
    message = str(info.value)
    assert message.startswith("invalid config: train.loss_spike_factor: ")
    if not value.startswith("-"):
        assert message.endswith(f"must be 0 (off) or above 1 (times the first step's loss), got {float(value):g}")


def test_the_guard_error_class_is_the_spike_stop():
    from spartron.runtime.guards import check_loss_limits

    t = load_config("configs/tiny.toml").train
    with pytest.raises(LossSpikeError) as info:
        check_loss_limits(t, 4, 81.5, 8.0)
    assert str(info.value) == ("loss 81.5 at step 4 is 10.2x the first step's loss 8, above train.loss_spike_factor "
                               "= 10 (lower train.lr, or set train.loss_spike_factor = 0 to train on)")
    check_loss_limits(t, 4, 79.9, 8.0)  # below 10x: trains on


# ---- the end-of-run summary -------------------------------------------------------------------------------
def test_summary_line_when_the_loss_ended_far_above_its_first(capsys):
    records = [{"type": "step", "step": s, "loss": loss} for s, loss in ((1, 8.1), (2, 30.0), (3, 17.0))]
    line = ("spartron: warning: the loss ended at 17 (step 3), 2.1x the first step's 8.1: the run diverged (a lower "
            "train.lr may train; a lower train.loss_spike_factor stops such a run earlier)")
    assert loss_ended_high(records, None) == line
    assert loss_ended_high(records, 8.1) == line
    assert loss_ended_high(records, 9.0) is None  # a resumed run: the reference is the run's first loss (saved)
    assert loss_ended_high(records[:2] + [{"type": "step", "step": 3, "loss": 16.2}], 8.1) is None  # 2x: not above
    assert loss_ended_high([{"step": 1, "loss": 8.1}, {"step": 2, "loss": 2.0}], None) is None
    print_summary(records, 8.1)
    err = capsys.readouterr().err
    assert err.rstrip().splitlines()[-1] == line and "spartron: 3 steps" in err


# ---- a resume that changes the learning-rate schedule -------------------------------------------------------------
def test_schedule_note_names_the_step_the_values_and_the_keys():
    t = load_config("configs/tiny.toml", ["train.lr=1e-3", "train.warmup_steps=1", "train.steps=10"]).train
    saved = {"train.lr": 1e-3, "train.warmup_steps": 1, "train.min_lr_ratio": 0.1, "train.steps": 5}
    assert lr_at(6, t.model_copy(update={"steps": 5})) == pytest.approx(1e-4)
    assert schedule_note(saved, t, 5) == ("spartron: note: the learning-rate schedule changed on resume: lr at step 6 "
                                          "was to be 0.0001, is now 0.0004719 (train.steps 5 -> 10)")
    assert schedule_note({**saved, "train.steps": 10}, t, 5) is None  # the same schedule
    assert schedule_note({"train.lr": 1e-3}, t, 5) is None  # a step saved before the schedule was recorded
    constant = t.model_copy(update={"warmup_steps": 0, "min_lr_ratio": 1.0})
    flat = {**saved, "train.warmup_steps": 0, "train.min_lr_ratio": 1.0}
    assert schedule_note(flat, constant, 5) is None  # train.steps changed, the lr of every step did not
    later = schedule_note({**saved, "train.lr": 2e-3}, t.model_copy(update={"steps": 5}), 3)
    assert later == ("spartron: note: the learning-rate schedule changed on resume: lr at step 4 was to be "
                     f"{lr_at(4, t.model_copy(update={'steps': 5, 'lr': 2e-3})):.4g}, is now "
                     f"{lr_at(4, t.model_copy(update={'steps': 5})):.4g} (train.lr 0.002 -> 0.001)")


def test_resuming_with_more_steps_says_the_schedule_changed(tmp_path, capfd):
    over = ["train.lr=1e-3", "train.warmup_steps=1", "train.save_every=5"]
    losses, err = run_distributed(_train, 1, tiny(tmp_path / "r", "train.steps=5", *over), timeout=120)[0]
    assert err is None and len(losses) == 5
    meta = json.loads((tmp_path / "r" / "step-00000005" / "meta.json").read_text())
    assert {k: meta["config"][k] for k in ("train.lr", "train.warmup_steps", "train.min_lr_ratio", "train.steps",
                                           "train.eval_steps")} == {"train.lr": 1e-3, "train.warmup_steps": 1,
                                                                    "train.min_lr_ratio": 0.1, "train.steps": 5,
                                                                    "train.eval_steps": 1}
    capfd.readouterr()
    losses, err = run_distributed(_train, 1, tiny(tmp_path / "r", "train.steps=7", *over), timeout=120)[0]
    assert err is None and len(losses) == 2
    lines = capfd.readouterr().err.splitlines()
    new = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * 5 / 6))
    assert f"spartron: resumed from step 5 ({tmp_path / 'r' / 'step-00000005'})" in lines  # no schedule keys here
    assert ("spartron: note: the learning-rate schedule changed on resume: lr at step 6 was to be 0.0001, is now "
            f"{new:.4g} (train.steps 5 -> 7)") in lines
