"""`spartron eval RUN.toml --step DIR` evaluates the data the saved step records (train.data.*, seed, seq_len,
global_batch_size, eval_steps), not the data the config names: a differing config is reported one line per
key, `--set` chooses other data (and says it is not the step's), and a step trained on all of its data is
refused in one line, since nothing of it is held out."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spartron.launch.cli import main
from spartron.runtime.config import ConfigError, dump_config, load_config
from spartron.runtime.evaluate import describe_eval_data, eval_data_origin, step_eval_config
from spartron.runtime.metrics import read_metrics
from spartron.runtime.trainer import train
from spartron.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.n_layers=2", "model.mtp.depth=1", "train.seq_len=16", "train.global_batch_size=2",
         "train.progress=false", "train.peak_tflops=1.0", "train.warmup_steps=1", "train.lr=1e-2",
         "ac.mode='none'"]


def token_file(path, offset):
    (np.arange(4096) * 7 % 509 + offset).astype(np.uint16).tofile(path)
    return str(path)


def data(path, val_fraction=0.25):
    return ["train.data.kind='mmap'", f"train.data.path={json.dumps(path)}", f"train.data.val_fraction={val_fraction}"]


def _train(rank, world, cfg):
    train(cfg)


def _cli(rank, world, argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


def sets(items):
    return [arg for item in items for arg in ("--set", item)]


@pytest.fixture
def trained_on_a(tmp_path):
    """A 2-step run on token file A (eval_steps 2, evaluated and saved at step 2) and a config file naming
    token file B with eval_steps 1 and another seed."""
    a, b = token_file(tmp_path / "a.bin", 0), token_file(tmp_path / "b.bin", 3)
    run = tmp_path / "r"
    common = [*SMALL, f"train.run_dir={json.dumps(str(run))}"]
    cfg = load_config("configs/tiny.toml", [*common, *data(a), "train.steps=2", "train.save_every=2",
                                            "train.eval_every=2", "train.eval_steps=2"])
    run_distributed(_train, 1, cfg, timeout=120)
    logged = read_metrics(run / "metrics.jsonl")[1][-1]
    toml = tmp_path / "other.toml"
    other = load_config("configs/tiny.toml", [*data(b, 0.5), "train.eval_steps=1", "train.seed=5"])
    toml.write_text(dump_config(other))
    return a, b, run, logged, toml, common


def test_eval_evaluates_the_steps_data_and_reports_the_config_differences(trained_on_a):
    a, b, run, logged, toml, common = trained_on_a
    status, out, err = run_distributed(_cli, 1, ["eval", str(toml), *sets(common), "--step", str(run)], timeout=120)[0]
    assert status == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["val_loss"] == logged["val_loss"] and result["step"] == logged["step"] == 2  # the logged value
    assert result["val_tokens"] == logged["val_tokens"] == 2 * 2 * 16
    step = run / "step-00000002"
    assert err.splitlines() == [
        f"spartron: note: train.data.path: evaluating the step's {a!r}, not the config's {b!r}",
        "spartron: note: train.data.val_fraction: evaluating the step's 0.25, not the config's 0.5",
        "spartron: note: train.seed: evaluating with the step's 0, not the config's 5",
        "spartron: note: train.eval_steps: evaluating with the step's 2, not the config's 1",
        f"spartron: {step} (step 2): validation loss {result['val_loss']:.6g} (perplexity {result['val_ppl']:.6g}) "
        f"over 64 tokens of the last 0.25 of the samples of token file {a!r}, held out: never trained on"]
    assert "notes" not in result  # said once, on stderr


def test_set_chooses_other_data_and_says_it_is_not_the_steps(trained_on_a):
    a, b, run, logged, toml, common = trained_on_a
    argv = ["eval", "configs/tiny.toml", *sets([*common, *data(b)]), "--step", str(run)]
    status, out, err = run_distributed(_cli, 1, argv, timeout=120)[0]
    assert status == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["val_loss"] != logged["val_loss"]
    lines = err.splitlines()
    assert lines[0] == ("spartron: note: train.data is given with --set: evaluating it, not the data the step was "
                        f"trained on (token file {a!r})")
    assert lines[-1].endswith(f"over 64 tokens of the last 0.25 of the samples of token file {b!r}, given with --set: "
                              "not the step's data; it may hold tokens the step was trained on")
    assert "train.seed" not in err  # tiny.toml's seed is the step's


def test_a_step_trained_on_all_of_its_data_is_refused_in_one_line(tmp_path):
    a = token_file(tmp_path / "a.bin", 0)
    run = tmp_path / "r"
    common = [*SMALL, f"train.run_dir={json.dumps(str(run))}", *data(a, 0.0)]
    run_distributed(_train, 1, load_config("configs/tiny.toml", [*common, "train.steps=1", "train.save_every=1"]),
                    timeout=120)
    done = subprocess.run([sys.executable, "-m", "spartron.launch.cli", "eval", "configs/tiny.toml", *sets(common),
                           "--step", str(run)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"spartron: error: {run / 'step-00000001'} was trained on all of token file {a!r} "
                   "(train.data.val_fraction = 0): none of it is held out; evaluate other data with --set "
                   "train.data.path=... (a --set train.data.val_fraction=... would measure tokens it was trained on)\n")


# ---- step_eval_config alone ------------------------------------------------------------------------------------
def test_step_eval_config_rules():
    cfg = load_config("configs/tiny.toml")
    saved = {"train.data.kind": "synthetic", "train.data.path": None, "train.seed": 3, "train.seq_len": 32,
             "train.global_batch_size": 4, "model.dim": 64}
    out, notes = step_eval_config(cfg, saved, [], "m.json")
    assert (out.train.seed, out.train.seq_len) == (3, 32) and out.train.eval_steps == cfg.train.eval_steps
    assert notes == ["spartron: note: train.seed: evaluating with the step's 3, not the config's 0",
                     "spartron: note: train.seq_len: evaluating with the step's 32, not the config's 64"]
    assert eval_data_origin(out, saved) == "step"
    assert describe_eval_data(out, "step") == ("the held-out stream of synthetic data (train.seed 3), held out: "
                                               "never trained on")
    out, notes = step_eval_config(cfg, saved, ["train.seed", "train.seq_len"], "m.json")
    assert (out.train.seed, out.train.seq_len) == (0, 64)
    assert notes == ["spartron: note: train.seed = 0 is given with --set (the step recorded 3)",
                     "spartron: note: train.seq_len = 64 is given with --set (the step recorded 32)"]
    assert step_eval_config(cfg, None, [], "m.json") == (
        cfg, ["spartron: note: m.json records no data settings: evaluating the config's train.data"])
    assert describe_eval_data(cfg, "config").endswith(", the config's data (the step records none)")
    with pytest.raises(ConfigError) as info:
        step_eval_config(cfg, {**saved, "train.data.future_key": 1}, [], "m.json")
    assert str(info.value) == "m.json records train.data.future_key, which this Spartron does not know"
    with pytest.raises(ConfigError) as info:
        step_eval_config(cfg, {**saved, "train.data.kind": "mmap"}, [], "m.json")
    assert str(info.value).startswith("the settings m.json records do not form a valid config with this one: ")


# ---- the model settings: the config's, named where they differ from the step's --------------------------------
FP8_DIMS = ["model.dim=128", "model.moe.moe_inter_dim=128", "model.dense_inter_dim=256", "model.mla.q_lora_rank=128",
            "model.mla.kv_lora_rank=128"]


def test_eval_in_other_precision_than_the_steps_says_so_in_one_note():
    """A step trained in FP8 with fp32 masters, evaluated with a config in fp32 (FP8 may not run where eval does):
    the config's model settings are evaluated, and one note names each that differs (a section set on one side,
    off on the other, as one entry)."""
    from spartron.runtime.saved_config import state_config

    trained = load_config("configs/tiny.toml", [*FP8_DIMS, 'model.dtype="bfloat16"', 'model.master_dtype="float32"',
                                                'model.fp8.backend="reference"'])
    cfg = load_config("configs/tiny.toml", FP8_DIMS)
    out, notes = step_eval_config(cfg, state_config(trained), [], "m.json")
    assert out.model == cfg.model
    fp8 = trained.model.fp8.model_dump(mode="json")
    assert notes == [
        "spartron: note: evaluating with model settings other than the step was trained with (its tensors fit): "
        f"model.dtype (saved 'bfloat16', this run 'float32'), model.fp8 (saved {fp8!r}, this run None), "
        "model.master_dtype (saved 'float32', this run None)"]
    assert step_eval_config(trained, state_config(trained), [], "m.json")[1] == []


def test_a_setting_the_step_never_recorded_is_no_change():
    """A step written before a key was recorded (or by `convert --from-hf`: no train.eval_steps) says nothing of
    it: neither a resume nor an eval names it as changed; a recorded one still is."""
    from spartron.runtime.saved_config import recorded_changes, resume_notes, state_config

    now = {**state_config(load_config("configs/tiny.toml")), "train.eval_steps": 1}
    older = {k: v for k, v in now.items() if k not in ("train.eval_steps", "model.dsa.indexer_fp8")}
    assert resume_notes(older, {**now, "model.dsa.indexer_fp8": True}) == []
    assert recorded_changes(older, now, "model.") == []
    assert resume_notes({**older, "train.eval_steps": 2}, now) == ["train.eval_steps (saved 2, this run 1)"]
