"""The trainer and the CLI with saved state: new runs never mix into old ones, resumes say what they did,
mismatched states are one-line errors (exit 2 from `spartron train`), exploding losses can stop a run,
keep_last, one run per metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.nn.functional as F
from torch import nn

from spartron.launch.cli import main
from spartron.launch.command import USAGE_ERROR
from spartron.layers.outputs import ModelOutput
from spartron.runtime.config import config_from_dict, load_config
from spartron.runtime.metrics import MetricsFileError, MetricsLog, MetricsWriteError, read_metrics
from spartron.runtime.state import COMPLETE, RunDirLock, StateLoadError, complete_steps, step_dir
from spartron.runtime.trainer import TrainingError, train
from spartron.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


class SmallLM(nn.Module):
    """Embedding -> head; from step `scale_at` on, the loss is multiplied by `scale` (an exploding run)."""

    def __init__(self, vocab: int, dim: int, scale_at: int | None, scale: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)
        self.scale_at, self.scale, self.steps_done = scale_at, scale, 0

    def forward(self, tokens, labels) -> ModelOutput:
        loss = F.cross_entropy(self.head(self.embed(tokens)).flatten(0, 1), labels.flatten())
        if self.scale_at is not None and self.steps_done + 1 >= self.scale_at:
            loss = loss * self.scale
        return ModelOutput(loss=loss, lm_loss=loss, mtp_losses=[], aux_loss=None, indexer_loss=None,
                           tokens_per_expert=None)

    def update_expert_bias(self, group) -> None:  # once per optimizer step: counts steps (not restored)
        self.steps_done += 1


@dataclass
class SmallFactory:
    scale_at: int | None = None
    scale: float = 1.0

    def __call__(self, cfg, groups):
        return SmallLM(cfg.model.vocab_size, cfg.model.dim, self.scale_at, self.scale)


def cfg_for(run_dir: Path, dim: int = 16, **train):
    base = {"steps": 4, "seq_len": 16, "global_batch_size": 2, "micro_batch_size": 1, "lr": 1e-2,
            "warmup_steps": 1, "progress": False, "run_dir": str(run_dir), "peak_tflops": 1.0}
    base.update(train)
    return config_from_dict({"name": "t", "device": "cpu", "model": {"vocab_size": 64, "dim": dim},
                             "parallel": {"timeout_s": 20.0}, "train": base})


def _run(rank, world, cfg, factory=None):
    """The steps this call trained, or the error's message (StateLoadError / TrainingError)."""
    try:
        result = train(cfg, factory or SmallFactory())
    except (StateLoadError, TrainingError) as err:
        return f"{type(err).__name__}: {err}"
    return [r["step"] for r in result.records]


def run1(cfg, factory=None):
    return run_distributed(_run, 1, cfg, factory)[0]


def headers(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["type"] == "header"]


# ---- new runs never mix into old ones -------------------------------------------------------------------
def test_a_new_run_into_a_run_dir_with_saved_steps_is_refused_then_overwritten_on_request(tmp_path):
    run = tmp_path / "run"
    assert run1(cfg_for(run, save_every=2)) == [1, 2, 3, 4]
    old_id = headers(run)[0]["run_id"]
    refused = run1(cfg_for(run, save_every=2, resume=False, steps=2))
    assert refused == (
        f"StateLoadError: {run} already holds saved steps [2, 4] (step-00000002, step-00000004, metrics.jsonl); "
        "train.resume = false will not mix a new run into it: give this run another directory (name or "
        "train.run_dir), delete that one, or set train.overwrite = true to replace its saved steps and metrics")
    assert complete_steps(run) == [2, 4]  # untouched

    assert run1(cfg_for(run, save_every=1, resume=False, overwrite=True, steps=2)) == [1, 2]
    assert complete_steps(run) == [1, 2]  # the old, higher-numbered step 4 cannot be picked up by a resume
    (header,) = headers(run)
    assert header["run_id"] != old_id and header["resumed_from_step"] is None
    assert json.loads((step_dir(run, 2) / "meta.json").read_text())["run_id"] == header["run_id"]


def test_overwrite_with_resume_is_a_config_error():
    from spartron.runtime.config import ConfigError

    with pytest.raises(ConfigError, match=r"^invalid config: train\.overwrite = true replaces the saved steps of an "
                                          r"earlier run with a new run; it needs train\.resume = false$"):
        cfg_for(Path("unused"), overwrite=True)


def test_resume_with_nothing_left_to_train_is_an_error(tmp_path):
    run = tmp_path / "run"
    run1(cfg_for(run, save_every=2))
    assert run1(cfg_for(run, save_every=2)) == (
        f"StateLoadError: {step_dir(run, 4)}: this run already reached step 4 and train.steps = 4, so nothing is "
        "left to train: raise train.steps to continue it, or start a new run (another run directory)")


def test_a_new_run_with_resume_moves_an_earlier_runs_metrics_aside(tmp_path, capfd):
    run = tmp_path / "run"
    run1(cfg_for(run, steps=2))  # no save: nothing to resume
    first = (run / "metrics.jsonl").read_text()
    capfd.readouterr()
    assert run1(cfg_for(run, steps=3)) == [1, 2, 3]
    assert (f"spartron: {run} holds no complete saved step: starting a new run; the earlier run's "
            "metrics.jsonl was moved to metrics.1.jsonl") in capfd.readouterr().err
    assert (run / "metrics.1.jsonl").read_text() == first
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")[1]] == [1, 2, 3]
    assert len(headers(run)) == 1


def test_a_run_dir_another_run_is_training_in_is_refused(tmp_path):
    run = tmp_path / "run"
    other = RunDirLock(run)  # as the rank 0 of a run in progress holds it
    assert other.acquire() is None
    expected = (f"StateLoadError: {run} is in use by another run (pid {os.getpid()} on {socket.gethostname()}, "
                f"lock {run}/.lock): wait for it to end or stop it, or give this run another directory")
    assert run1(cfg_for(run)) == expected
    assert run1(cfg_for(run, resume=False, overwrite=True)) == expected  # overwrite does not override a live run
    other.release()
    assert run1(cfg_for(run, steps=2)) == [1, 2]


def _metrics_past_limit(rank, world, path):
    log = MetricsLog(path, 1, enabled=True, progress=False)
    log.write({"type": "header", "n": 1})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.RLIM_INFINITY))
    try:
        log.write({"type": "step", "pad": "x" * 200})
    except MetricsWriteError as err:
        return str(err), path.read_bytes()
    finally:
        log.close(summary=False)  # nothing left queued: closing does not retry the failed write


def test_a_metrics_write_error_names_the_file_and_the_resume_cuts_the_partial_line(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    [(message, content)] = run_distributed(_metrics_past_limit, 1, path)
    assert message == (f"{path}: cannot write a metrics record (File too large): free space on its disk, "
                       "then resume the run")
    assert content == b'{"type": "header", "n": 1}\n{"type": "step", "pad": "' + b"x" * 48  # cut at 100 bytes
    MetricsLog(path, 1, enabled=True, progress=False).close(summary=False)
    assert path.read_bytes() == b'{"type": "header", "n": 1}\n'


def test_cli_a_metrics_file_past_the_size_limit_is_one_line_exit_2(tmp_path):
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (3000, resource.RLIM_INFINITY))

    proc = subprocess.run([sys.executable, "-m", "spartron.launch.cli", "train", str(ROOT / "configs" / "tiny.toml"),
                           "--set", "train.steps=1", "--set", "train.progress=false", "--set", "name=k",
                           "--set", "train.peak_tflops=1.0"], cwd=tmp_path, capture_output=True, text=True,
                          preexec_fn=limit, timeout=240)
    assert proc.returncode == USAGE_ERROR
    assert proc.stderr.splitlines() == [
        "spartron: error: runs/k/metrics.jsonl: cannot write a metrics record (File too large): free space on its "
        "disk, then resume the run"]


# ---- resume says what it did ------------------------------------------------------------------------
def _crash_saving_step_4(tmp_dir: Path) -> None:
    if tmp_dir.name.endswith("step-00000004"):
        raise OSError("injected crash while saving step 4")


def _train_with_hook(rank, world, cfg):
    try:
        train(cfg, SmallFactory(), before_commit=_crash_saving_step_4)
    except TrainingError as err:
        return str(err)


def test_resume_prints_the_step_and_the_incomplete_steps_it_skipped(tmp_path, capfd):
    run = tmp_path / "run"
    assert "injected crash" in run_distributed(_train_with_hook, 1, cfg_for(run, save_every=2, steps=6))[0]
    (run / "step-00000006").mkdir()  # a step directory without its COMPLETE marker
    capfd.readouterr()
    assert run1(cfg_for(run, save_every=2, steps=6)) == [3, 4, 5, 6]
    assert (f"spartron: resumed from step 2 ({run}/step-00000002); skipped incomplete step directories: "
            ".tmp-step-00000004, step-00000006") in capfd.readouterr().err
    first, resumed = headers(run)
    assert resumed["resumed_from_step"] == 2 and resumed["run_id"] == first["run_id"]
    assert resumed["skipped_incomplete_steps"] == [".tmp-step-00000004", "step-00000006"]
    assert complete_steps(run) == [2, 4, 6]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")[1]] == [1, 2, 3, 4, 5, 6]


def test_resume_reports_changed_data_and_model_settings_that_still_fit(tmp_path, capfd):
    run = tmp_path / "run"
    run1(cfg_for(run, save_every=2, steps=2))
    capfd.readouterr()
    assert run1(cfg_for(run, steps=3, seed=1)) == [3]
    assert (f"spartron: resumed from step 2 ({run}/step-00000002); settings changed since that step (its tensors "
            "fit): train.seed (saved 0, this run 1)") in capfd.readouterr().err


def test_resume_with_another_seq_len_says_which_tokens_of_the_stream_it_skips_or_rereads(tmp_path, capfd):
    """The data position is a count of samples: after 2 steps x 2 samples of 16 tokens (64 tokens of the stream
    read), a resume at seq_len 32 starts at token 128 (64-127 never trained on), one at 8 at token 32 (32-63 read
    again); the same seq_len, or synthetic data, says nothing."""
    import numpy as np

    data = tmp_path / "tokens.bin"
    (np.arange(8192) % 61).astype(np.uint16).tofile(data)
    for name, seq, line in (
            ("long", 32, "this run reads from token 128 of the stream, where the saved run stopped at 64: tokens "
                         "64-127 are skipped"),
            ("short", 8, "this run reads from token 32 of the stream, where the saved run stopped at 64: tokens "
                         "32-63 are read again"),
            ("same", 16, None)):
        run = tmp_path / name
        mmap = {"kind": "mmap", "path": str(data)}
        assert run1(cfg_for(run, save_every=2, steps=2, data=mmap)) == [1, 2]
        capfd.readouterr()
        assert run1(cfg_for(run, steps=3, seq_len=seq, data=mmap)) == [3]
        notes = [n for n in capfd.readouterr().err.splitlines() if "train.seq_len changed on resume" in n]
        assert notes == ([] if line is None else [
            f"spartron: note: train.seq_len changed on resume (16 -> {seq}) and the data position is a count of "
            f"samples (4 read): {line}"])
    run, shuffled = tmp_path / "shuffled", {"kind": "mmap", "path": str(data), "shuffle": True}
    run1(cfg_for(run, save_every=2, steps=2, data=shuffled))
    capfd.readouterr()
    assert run1(cfg_for(run, steps=3, seq_len=32, data=shuffled)) == [3]
    assert ("spartron: note: train.seq_len changed on resume (16 -> 32) and the data position is a count of samples "
            "(4 read): the epoch's remaining samples are windows of the new length in their own shuffled order, not "
            "the data the saved run had left unread") in capfd.readouterr().err
    run = tmp_path / "synthetic"
    run1(cfg_for(run, save_every=2, steps=2))
    capfd.readouterr()
    assert run1(cfg_for(run, steps=3, seq_len=32)) == [3]
    assert "train.seq_len changed on resume" not in capfd.readouterr().err


def test_resume_names_each_changed_training_option_in_one_note(tmp_path, capfd):
    run = tmp_path / "run"
    run1(cfg_for(run, save_every=2, steps=2, warmup_steps=2))
    capfd.readouterr()
    # lr 1e-2 -> 1e-1 with min_lr_ratio 0.1: step 3's lr is 1e-2 either way (no schedule line), still said
    assert run1(cfg_for(run, steps=3, warmup_steps=2, lr=1e-1, grad_clip=0.5, loss_spike_factor=0.0)) == [3]
    notes = [line for line in capfd.readouterr().err.splitlines() if line.startswith("spartron: note:")]
    assert notes == [
        "spartron: note: train.lr changed on resume: the saved step trained with 0.01, this run uses 0.1",
        "spartron: note: train.steps changed on resume: the saved step trained with 2, this run uses 3",
        "spartron: note: train.grad_clip changed on resume: the saved step trained with 1.0, this run uses 0.5",
        "spartron: note: train.loss_spike_factor changed on resume: the saved step trained with 10.0, this run "
        "uses 0.0"]


# ---- mismatched states ----------------------------------------------------------------------------------
def test_resuming_a_model_of_another_shape_names_the_differing_keys(tmp_path):
    run = tmp_path / "run"
    run1(cfg_for(run, save_every=2, steps=2))
    err = run1(cfg_for(run, dim=32, steps=4))
    assert err.startswith(f"StateLoadError: {step_dir(run, 2)} holds a model of another shape: differing config: "
                          "model.dim (saved 16, this run 32); tensors: model.embed.weight saved [64, 16], this run "
                          "[64, 32]; model.head.weight saved [64, 16], this run [64, 32]")
    assert "\n" not in err


def test_resuming_with_other_optimizer_settings_is_an_error(tmp_path):
    run = tmp_path / "run"
    run1(cfg_for(run, save_every=2, steps=2))
    assert run1(cfg_for(run, steps=4, weight_decay=0.2, beta2=0.9)) == (
        f"StateLoadError: {step_dir(run, 2)} holds optimizer state for other settings: train.beta2 (saved 0.95, "
        "this run 0.9), train.weight_decay (saved 0.1, this run 0.2); resume with the saved values, or start a "
        "new run")


def test_resuming_with_another_held_out_split_is_an_error(tmp_path):
    """val_fraction decides which samples are training data: a resume under another one trained on samples the
    run had evaluated as held out (and eval called them never trained on), with only a note."""
    import numpy as np

    data = tmp_path / "tokens.bin"
    (np.arange(8192) % 61).astype(np.uint16).tofile(data)
    run = tmp_path / "run"

    def cfg(fraction, steps):
        return cfg_for(run, save_every=2, steps=steps, data={"kind": "mmap", "path": str(data),
                                                            "val_fraction": fraction})

    assert run1(cfg(0.1, 2)) == [1, 2]
    assert run1(cfg(0.5, 4)) == (
        f"StateLoadError: {step_dir(run, 2)} was trained with train.data.val_fraction = 0.1, this run has 0.5: that "
        "moves the boundary between training and held-out samples (the run would train on samples it evaluated as "
        "held out, or evaluate samples it trained on); resume with 0.1, or start a new run")
    assert run1(cfg(0.1, 4)) == [3, 4]


def test_two_ranks_resume_a_one_rank_state_and_still_refuse_other_optimizer_settings(tmp_path):
    run = tmp_path / "run"
    run1(cfg_for(run, save_every=2, steps=2))
    other = tmp_path / "other"
    shutil.copytree(run, other)
    assert run_distributed(_run, 2, cfg_for(run, steps=4)) == [[3, 4]] * 2  # another world size resumes
    errors = run_distributed(_run, 2, cfg_for(other, steps=4, beta1=0.8))
    assert errors == [f"StateLoadError: {step_dir(other, 2)} holds optimizer state for other settings: train.beta1 "
                      "(saved 0.9, this run 0.8); resume with the saved values, or start a new run"] * 2


def test_a_step_of_another_run_copied_next_to_this_runs_metrics_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    run1(cfg_for(a, save_every=2, steps=2))
    run1(cfg_for(b, steps=1))  # run b: metrics, no saved step
    shutil.copytree(step_dir(a, 2), step_dir(b, 2))
    id_a, id_b = headers(a)[0]["run_id"], headers(b)[0]["run_id"]
    assert run1(cfg_for(b, steps=4)) == (
        f"StateLoadError: {b}/metrics.jsonl belongs to run {id_b}, but {step_dir(b, 2)}/meta.json records run_id "
        f"{id_a}: resuming would mix two runs in one directory; move metrics.jsonl away, or resume in a directory "
        "holding only that step")
    (b / "metrics.jsonl").unlink()
    assert run1(cfg_for(b, steps=4)) == [3, 4]  # the copied step alone: a fork of run a
    assert headers(b)[0]["run_id"] == id_a


# ---- exploding losses --------------------------------------------------------------------------------
def test_max_loss_stops_the_run_at_the_step(tmp_path):
    err = run1(cfg_for(tmp_path / "run", max_loss=1.0))
    assert err.startswith("LossSpikeError: loss 4.") and err.endswith(" at step 1 is above train.max_loss = 1")


def test_loss_spike_factor_can_be_turned_off_and_survives_a_resume(tmp_path):
    exploding = SmallFactory(scale_at=3, scale=1e6)  # finite, 1e6x the first loss from step 3 on
    assert run1(cfg_for(tmp_path / "off", save_every=1, loss_spike_factor=0), exploding) == [1, 2, 3, 4]

    run = tmp_path / "run"
    assert run1(cfg_for(run, save_every=2, steps=2), exploding) == [1, 2]  # the first loss is saved with step 2
    first_loss = json.loads((step_dir(run, 2) / "meta.json").read_text())["counters"]["first_loss"]
    resumed = SmallFactory(scale_at=1, scale=1e6)  # the resumed process's first step (3) explodes
    err = run1(cfg_for(run, save_every=1, loss_spike_factor=100.0), resumed)
    assert err.startswith("LossSpikeError: loss ") and " at step 3 is " in err
    assert f"the first step's loss {first_loss:.6g}, above train.loss_spike_factor = 100" in err
    assert complete_steps(run) == [2]  # step 3 was neither applied nor saved


# ---- keep_last --------------------------------------------------------------------------------------------
def test_keep_last_keeps_the_newest_complete_steps(tmp_path):
    run = tmp_path / "run"
    assert run1(cfg_for(run, save_every=1, steps=5, keep_last=2)) == [1, 2, 3, 4, 5]
    assert complete_steps(run) == [4, 5]
    assert sorted(p.name for p in run.iterdir()) == [".lock", "metrics.jsonl", "step-00000004", "step-00000005"]


# ---- metrics.jsonl holds one run ----------------------------------------------------------------------
def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


STEP = {"type": "step", "step": 1, "loss": 1.0, "grad_norm": 0.5, "tokens_per_s": 10.0}


def test_a_metrics_file_holding_two_runs_is_refused_by_regress_compare(tmp_path, capsys):
    piled = _write_jsonl(tmp_path / "a" / "metrics.jsonl", [
        {"type": "header", "run_id": "r1", "resumed_from_step": None}, STEP,
        {"type": "header", "run_id": "r2", "resumed_from_step": None}, STEP])
    with pytest.raises(MetricsFileError, match=r"holds 2 runs \(run ids \['r1', 'r2'\]\)"):
        read_metrics(piled)
    base = _write_jsonl(tmp_path / "b" / "metrics.jsonl", [{"type": "header", "run_id": "r3"}, STEP])
    assert main(["regress", "compare", str(piled), str(base)]) == USAGE_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"spartron: error: {piled} holds 2 runs") and err.count("\n") == 1
    resumed = _write_jsonl(tmp_path / "c" / "metrics.jsonl", [  # a resume of the same run is one run
        {"type": "header", "run_id": "r1", "resumed_from_step": None}, STEP,
        {"type": "header", "run_id": "r1", "resumed_from_step": 1}, {**STEP, "step": 2}])
    assert [s["step"] for s in read_metrics(resumed)[1]] == [1, 2]


# ---- the CLI: exit 2, before ranks are spawned where it can be checked ---------------------------------
def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spartron.launch.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


def test_cli_refuses_a_new_run_into_old_steps_before_spawning_ranks(tmp_path):
    run = tmp_path / "run"
    (run / "step-00000002").mkdir(parents=True)
    (run / "step-00000002" / COMPLETE).write_text("{}")
    done = _cli(["train", str(ROOT / "configs" / "tiny.toml"), "--set", "launch.nproc=2", "--set",
                 f"train.run_dir={json.dumps(str(run))}", "--set", "train.resume=false"], tmp_path)
    assert done.returncode == USAGE_ERROR, done.stderr
    assert done.stderr == (f"spartron: error: {run} already holds saved steps [2] (step-00000002); train.resume "
                           "= false will not mix a new run into it: give this run another directory (name or "
                           "train.run_dir), delete that one, or set train.overwrite = true to replace its saved "
                           "steps and metrics\n")
    assert not (run / "logs").exists()  # no rank was started


def test_cli_refuses_a_run_dir_in_use_before_spawning_ranks(tmp_path):
    run = tmp_path / "run"
    other = RunDirLock(run)
    other.acquire()
    done = _cli(["train", str(ROOT / "configs" / "tiny.toml"), "--set", "launch.nproc=2", "--set",
                 f"train.run_dir={json.dumps(str(run))}"], tmp_path)
    other.release()
    assert done.returncode == USAGE_ERROR, done.stderr
    assert done.stderr.startswith(f"spartron: error: {run} is in use by another run (pid {os.getpid()} on ")
    assert done.stderr.count("\n") == 1 and not (run / "logs").exists()


def _train_preset(rank, world, cfg):
    return [r["step"] for r in train(cfg).records]


def test_cli_resume_of_another_model_shape_is_exit_2_with_one_line(tmp_path):
    run = tmp_path / "run"
    sets = [f"train.run_dir={json.dumps(str(run))}", "train.save_every=1", "train.progress=false",
            "train.peak_tflops=1.0", "train.seq_len=32"]
    # the saved step comes from the Trainer in a forked rank (what the CLI's rank runs); the refusal is the CLI's
    assert run_distributed(_train_preset, 1, load_config(ROOT / "configs" / "tiny.toml", [*sets, "train.steps=1"]),
                           timeout=120) == [[1]]
    done = _cli(["train", str(ROOT / "configs" / "tiny.toml"), *[x for s in sets for x in ("--set", s)],
                 "--set", "train.steps=2", "--set", "model.vocab_size=2048"], tmp_path)
    assert done.returncode == USAGE_ERROR, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"spartron: error: {step_dir(run, 1)} holds a model of another shape: differing "
                           "config: model.vocab_size (saved 512, this run 2048); tensors: ")
    assert "Traceback" not in done.stderr


def test_a_linked_metrics_file_is_refused_and_nothing_is_appended_through_it(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside.jsonl"
    run.mkdir()
    outside.write_text("untouched\n")
    (run / "metrics.jsonl").symlink_to(outside)
    assert run1(cfg_for(run)) == (f"StateLoadError: {run / 'metrics.jsonl'} is a symbolic link (to {outside}): "
                                  "a run's metrics must be a file inside its run directory; remove the link")
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl is a symbolic link \(to .*outside.jsonl\): a run "
                       "reads and writes only regular files and folders inside its run directory; remove it$"):
        MetricsLog(run / "metrics.jsonl", 1, enabled=True, progress=False)  # the writer itself never follows it
    assert outside.read_text() == "untouched\n"


def test_cli_a_save_that_cannot_write_is_exit_2_with_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "step-00000001").write_text("a file where the step directory goes\n")
    done = _cli(["train", str(ROOT / "configs" / "tiny.toml"), "--set", f"train.run_dir={json.dumps(str(run))}",
                 "--set", "train.steps=1", "--set", "train.save_every=1", "--set", "train.progress=false",
                 "--set", "train.peak_tflops=1.0", "--set", "train.seq_len=32"], tmp_path)
    assert done.returncode == USAGE_ERROR, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("spartron: error: rank 0 failed at step 1: StateSaveError: saving step 1 failed: "), last
    assert (run / "step-00000001").read_text() == "a file where the step directory goes\n"
