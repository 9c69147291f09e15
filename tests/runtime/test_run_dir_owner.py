"""A run directory belongs to one run: its lock lives as long as the run (a second run, an overwrite and an
eval are refused while it trains; exit, crash and kill -9 release it), and nothing inside it is followed
through a symbolic link or opened when it is not a regular file (the target's bytes stay unchanged).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.nn.functional as F
from torch import nn

from spartron.launch.command import USAGE_ERROR
from spartron.launch.local import launch_local
from spartron.layers.outputs import ModelOutput
from spartron.runtime.config import config_from_dict
from spartron.runtime.metrics import MetricsFileError, MetricsLog
from spartron.runtime.rundir import RunDirLock, StateLoadError, check_not_in_use, lock_for_reading
from spartron.runtime.safe_open import UnsafeEntryError, make_dir, open_file
from spartron.runtime.state import COMPLETE, remove_step, step_dir
from spartron.runtime.tensorboard import MetricSinks
from spartron.runtime.trainer import Trainer, TrainingError, train
from spartron.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
PRECIOUS = b"precious bytes of another owner\n"
HINT = "a run reads and writes only regular files and folders inside its run directory; remove it"


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)

    def forward(self, tokens, labels) -> ModelOutput:
        loss = F.cross_entropy(self.head(self.embed(tokens)).flatten(0, 1), labels.flatten())
        return ModelOutput(loss=loss, lm_loss=loss, mtp_losses=[], aux_loss=None, indexer_loss=None,
                           tokens_per_expert=None)


def tiny(cfg, groups):
    return TinyLM(cfg.model.vocab_size, cfg.model.dim)


def cfg_for(run_dir: Path, observe: dict | None = None, **train_opts):
    base = {"steps": 2, "seq_len": 16, "global_batch_size": 2, "micro_batch_size": 1, "lr": 1e-2,
            "warmup_steps": 1, "progress": False, "run_dir": str(run_dir), "peak_tflops": 1.0}
    base.update(train_opts)
    return config_from_dict({"name": "t", "device": "cpu", "model": {"vocab_size": 64, "dim": 16},
                             "parallel": {"timeout_s": 20.0}, "observe": observe or {}, "train": base})


def _run(rank, world, cfg, hook=None):
    try:
        return [r["step"] for r in train(cfg, tiny, before_commit=hook).records]
    except (StateLoadError, UnsafeEntryError, MetricsFileError) as err:
        return f"{type(err).__name__}: {err}"
    except TrainingError as err:
        return f"TrainingError: {err.__cause__}"


def run1(cfg, world: int = 1):
    return run_distributed(_run, world, cfg, timeout=60)[0]


def outside_file(tmp_path: Path) -> Path:
    target = tmp_path / "outside" / "precious.txt"
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(PRECIOUS)
    return target


# ---- the lock lives as long as the run ----------------------------------------------------------------
def _probe_while_saving(tmp_dir: Path) -> None:
    """before_commit on every rank, mid-run: a second run must find the directory in use."""
    try:
        check_not_in_use(tmp_dir.parent)
    except StateLoadError as err:
        (tmp_dir.parent / f"probe-{os.getpid()}-{tmp_dir.name}.txt").write_text(str(err))


def test_rank_0_holds_the_lock_for_the_whole_run_on_every_rank_and_releases_it_at_the_end(tmp_path):
    run = tmp_path / "run"
    assert run_distributed(_run, 2, cfg_for(run, steps=4, save_every=2), _probe_while_saving,
                           timeout=90) == [[1, 2, 3, 4]] * 2
    probes = sorted(run.glob("probe-*.txt"))
    assert len(probes) == 4  # 2 saves x 2 ranks, long after setup returned
    for probe in probes:
        assert probe.read_text().startswith(f"{run} is in use by another run (pid ")
        assert probe.read_text().endswith(f"lock {run}/.lock): wait for it to end or stop it, or give this run "
                                          "another directory")
    check_not_in_use(run)  # released at the end: no exception
    assert (run / ".lock").read_bytes() == b""  # and the holder line is cleared


def _close_then_probe(rank, world, cfg):
    """A Trainer driven by hand (a notebook, a benchmark): the moment close() returns on a rank, that rank may
    start the next run in the directory, though rank 0's trainer (its lock object) is still alive."""
    trainer = Trainer(cfg, tiny).setup()
    while not trainer.done:
        trainer.step()
    trainer.close()
    try:
        check_not_in_use(cfg.train.run_dir)
        probe = "free"
    except StateLoadError as err:
        probe = str(err)
    resumed = Trainer(cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 3})}), tiny).setup()
    step = resumed.step()["step"]
    resumed.close()
    return probe, trainer.step_no, step


def test_close_frees_the_run_dir_on_every_rank_before_it_returns(tmp_path):
    run = tmp_path / "run"
    assert run_distributed(_close_then_probe, 2, cfg_for(run, save_every=2), timeout=90) == [("free", 2, 3)] * 2
    check_not_in_use(run)


def _steps_out_of_turn(rank, world, cfg):
    """step() where the run has no step: before setup, once train.steps is reached, after close()."""
    def refusal(trainer):
        try:
            trainer.step()
        except RuntimeError as err:
            return str(err)
        return "stepped"

    trainer = Trainer(cfg, tiny)
    early = refusal(trainer)
    trainer.setup()
    while not trainer.done:
        trainer.step()
    done = refusal(trainer)
    trainer.close()
    saved = sorted(p.name for p in Path(cfg.train.run_dir).glob("step-*"))
    return early, done, refusal(trainer), trainer.step_no, saved


def test_step_is_refused_before_setup_once_done_and_after_close(tmp_path):
    """A hand-driven loop that overshoots trained past the schedule (at the floor lr) and saved a step beyond
    train.steps; after close() it failed inside the step with an unrelated TypeError."""
    run = tmp_path / "run"
    assert run_distributed(_steps_out_of_turn, 2, cfg_for(run, save_every=1), timeout=90) == [(
        "Trainer.step() before setup()",
        "Trainer.step(): the run is done (train.steps = 2 reached); raise train.steps and resume to train on",
        "Trainer.step() after close(): build a new Trainer to go on (resume = true)",
        2, ["step-00000001", "step-00000002"])] * 2


def test_a_run_that_fails_releases_the_lock(tmp_path):
    run = tmp_path / "run"
    cfg = cfg_for(run, steps=3).model_copy(update={"debug": cfg_for(run).debug.model_copy(
        update={"fail_step": 2, "fail_mode": "raise"})})
    assert run1(cfg) == "TrainingError: debug.fail_mode = 'raise' at step 2 on rank 0"
    check_not_in_use(run)


def test_a_reader_and_a_run_exclude_each_other(tmp_path):
    run = tmp_path / "run"
    trainer_lock = RunDirLock(run)
    assert trainer_lock.acquire() is None
    with pytest.raises(StateLoadError) as err:
        lock_for_reading(step_dir(run, 2))
    assert str(err.value) == (f"{run} is being trained by another run (pid {os.getpid()} on {socket.gethostname()}, "
                              f"lock {run}/.lock): reading its steps now could race a save or train.keep_last; "
                              "wait for the run to end, or copy the step elsewhere and evaluate the copy")
    trainer_lock.release()
    reader = lock_for_reading(run)
    assert run1(cfg_for(run)) == (f"StateLoadError: {run} is in use by another run (holder unknown: a spartron "
                                  f"eval reading it?, lock {run}/.lock): wait for it to end or stop it, or give "
                                  "this run another directory")
    reader.release()
    assert run1(cfg_for(run)) == [1, 2]


def test_a_reader_creates_no_file_and_refuses_a_linked_step_before_opening_it(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    (run / "step-00000002").mkdir(parents=True)
    (outside / "step").mkdir(parents=True)
    (outside / "step" / "COMPLETE").write_text("{}")
    (run / "linked").symlink_to(outside / "step")
    lock_for_reading(step_dir(run, 2)).release()
    lock_for_reading(run).release()
    assert not (run / ".lock").exists()  # no lock file: nothing to wait for, nothing written
    with pytest.raises(StateLoadError) as err:
        lock_for_reading(run / "linked")
    assert str(err.value) == (f"{run / 'linked'} is a symbolic link (to {outside / 'step'}): a saved step must be a "
                              "directory inside the run directory; copy it there instead")
    assert sorted(p.name for p in (outside / "step").iterdir()) == ["COMPLETE"]


def _cli(args: list[str], cwd: Path, **kwargs) -> subprocess.Popen | subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "spartron.launch.cli", *args]
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    if kwargs.pop("background", False):
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def _tiny_args(run: Path, *more: str) -> list[str]:
    sets = [f"train.run_dir={json.dumps(str(run))}", "train.progress=false", "train.peak_tflops=1.0",
            "train.seq_len=32", *more]
    return [str(ROOT / "configs" / "tiny.toml"), *[x for s in sets for x in ("--set", s)]]


def _wait_stopped(proc: subprocess.Popen, marker: Path, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if marker.is_file() and state == "T":
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError("the first run did not reach its stop")


@pytest.mark.slow
def test_cli_a_second_train_an_overwrite_and_an_eval_of_a_live_run_are_refused_until_it_is_killed(tmp_path):
    run = tmp_path / "run"
    # The first run saves step 1, then stops itself (SIGSTOP) at step 2 holding the directory: a slow run.
    first = _cli(["train", *_tiny_args(run, "train.steps=3", "train.save_every=1", "debug.fail_step=2",
                                       "debug.fail_mode='stop'")], tmp_path, background=True)
    try:
        _wait_stopped(first, step_dir(run, 1) / COMPLETE)
        saved = sorted(p.name for p in step_dir(run, 1).iterdir())
        in_use = (f"spartron: error: {run} is in use by another run (pid {first.pid} on {socket.gethostname()}, "
                  f"lock {run}/.lock): wait for it to end or stop it, or give this run another directory\n")
        for extra in ([], ["train.resume=false", "train.overwrite=true"]):
            done = _cli(["train", *_tiny_args(run, "train.steps=3", *extra)], tmp_path)
            assert (done.returncode, done.stderr) == (USAGE_ERROR, in_use)
            assert sorted(p.name for p in step_dir(run, 1).iterdir()) == saved  # the live run's step is intact
        done = _cli(["eval", *_tiny_args(run), "--step", str(run)], tmp_path)
        assert done.returncode == USAGE_ERROR
        assert done.stderr.endswith(f"spartron: error: {run} is being trained by another run (pid {first.pid} on "
                                    f"{socket.gethostname()}, lock {run}/.lock): reading its steps now could race "
                                    "a save or train.keep_last; wait for the run to end, or copy the step elsewhere "
                                    "and evaluate the copy\n"), done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    finally:
        first.kill()  # kill -9: the kernel drops the flock
        first.wait(30)
    assert first.returncode == -signal.SIGKILL
    check_not_in_use(run)
    assert RunDirLock(run).acquire() is None


# ---- nothing is followed through a link, nothing but a regular file is opened ------------------------------
@pytest.mark.parametrize("entry", [".lock", "metrics.jsonl", "logs/rank1.log"])
def test_a_linked_file_entry_stops_the_run_and_the_target_is_untouched(tmp_path, entry):
    run, target = tmp_path / "run", outside_file(tmp_path)
    (run / entry).parent.mkdir(parents=True)
    (run / entry).symlink_to(target)
    result = run1(cfg_for(run))
    if entry == "metrics.jsonl":  # plan_run's own wording for the metrics file
        assert result == (f"StateLoadError: {run / entry} is a symbolic link (to {target}): a run's metrics must be "
                          "a file inside its run directory; remove the link")
    else:
        assert result == f"StateLoadError: {run / entry} is a symbolic link (to {target}): {HINT}"
    assert target.read_bytes() == PRECIOUS and (run / entry).is_symlink()


@pytest.mark.parametrize("entry", ["logs", "tensorboard", ".tmp-step-00000002"])
def test_a_linked_folder_entry_stops_the_run_and_the_target_is_untouched(tmp_path, entry):
    run, target = tmp_path / "run", outside_file(tmp_path)
    run.mkdir()
    (run / entry).symlink_to(target.parent)
    result = run1(cfg_for(run, save_every=2, observe={"tensorboard": True}))
    assert result == f"StateLoadError: {run / entry} is a symbolic link (to {target.parent}): {HINT}"
    assert sorted(os.listdir(target.parent)) == ["precious.txt"] and target.read_bytes() == PRECIOUS


@pytest.mark.parametrize("entry", ["metrics.jsonl", ".lock"])
def test_a_fifo_entry_is_refused_without_hanging(tmp_path, entry):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / entry)
    started = time.monotonic()
    assert run1(cfg_for(run)) == f"StateLoadError: {run / entry} is a FIFO: {HINT}"  # run_distributed: 60 s limit
    assert time.monotonic() - started < 30
    if entry == "metrics.jsonl":  # the writer itself, without plan_run in front of it
        with pytest.raises(MetricsFileError, match=f"^{run / entry} is a FIFO: "):
            MetricsLog(run / entry, 1, enabled=True, progress=False)
    else:
        with pytest.raises(StateLoadError, match=f"^{run / entry} is a FIFO: "):
            RunDirLock(run).acquire()


def test_a_hard_linked_lock_is_refused_and_its_other_name_is_untouched(tmp_path):
    run, target = tmp_path / "run", outside_file(tmp_path)
    run.mkdir()
    os.link(target, run / ".lock")
    assert run1(cfg_for(run)) == (f"StateLoadError: {run / '.lock'} is a hard link (one of 2 names of one file): "
                                  f"{HINT}")
    assert target.read_bytes() == PRECIOUS


def test_an_event_file_linked_elsewhere_is_never_opened(tmp_path):
    run, target = tmp_path / "run", outside_file(tmp_path)
    (run / "tensorboard").mkdir(parents=True)
    (run / "tensorboard" / "events.out.tfevents.0.old").symlink_to(target)
    assert run1(cfg_for(run, observe={"tensorboard": True})) == [1, 2]
    assert target.read_bytes() == PRECIOUS
    assert len([p for p in (run / "tensorboard").iterdir() if not p.is_symlink()]) == 1  # the run's own


def test_metric_sinks_refuse_a_linked_tensorboard_folder(tmp_path):
    run, target = tmp_path / "run", outside_file(tmp_path)
    run.mkdir()
    (run / "tensorboard").symlink_to(target.parent)
    observe = cfg_for(run, observe={"tensorboard": True}).observe
    with pytest.raises(UnsafeEntryError, match=f"^{run / 'tensorboard'} is a symbolic link "):
        MetricSinks(observe, run, {})
    assert os.listdir(target.parent) == ["precious.txt"]


def _steps_only(rank, world, cfg):
    return [r["step"] for r in train(cfg, tiny).records]


def test_keep_last_never_removes_a_step_linked_into_another_run(tmp_path, capfd):
    other, run = tmp_path / "other", tmp_path / "run"
    assert run1(cfg_for(other, steps=1, save_every=1)) == [1]
    assert run1(cfg_for(run, steps=2, save_every=2)) == [1, 2]
    step_dir(run, 1).symlink_to(step_dir(other, 1))  # older than the run's own step 2
    capfd.readouterr()
    assert run1(cfg_for(run, steps=4, save_every=1, keep_last=1)) == [3, 4]
    assert (step_dir(other, 1) / COMPLETE).is_file() and step_dir(run, 1).is_symlink()
    assert sorted(p.name for p in run.glob("step-*")) == ["step-00000001", "step-00000004"]
    assert (f"spartron: warning: train.keep_last did not remove {step_dir(run, 1)} is a symbolic link (to "
            f"{step_dir(other, 1)}): a run reads and writes only regular files") in capfd.readouterr().err


def test_removing_a_step_never_follows_a_link(tmp_path):
    other = tmp_path / "other" / "step-00000001"
    other.mkdir(parents=True)
    (other / COMPLETE).write_text("{}")
    (tmp_path / "step-00000001").symlink_to(other)
    with pytest.raises(UnsafeEntryError, match=r"step-00000001 is a symbolic link \(to "):
        remove_step(tmp_path / "step-00000001")
    assert (other / COMPLETE).read_text() == "{}"


def test_overwrite_removes_links_and_files_of_a_step_but_never_their_targets(tmp_path):
    run, target = tmp_path / "run", outside_file(tmp_path)
    assert run1(cfg_for(run, steps=1, save_every=1)) == [1]
    (step_dir(run, 1) / "extra.json").symlink_to(target)  # a file inside a step, linked elsewhere
    step_dir(run, 5).symlink_to(target.parent)  # a step that is a link (with no COMPLETE there)
    assert run1(cfg_for(run, steps=1, save_every=1, resume=False, overwrite=True)) == [1]
    assert not step_dir(run, 5).exists() and not (step_dir(run, 1) / "extra.json").exists()
    assert target.read_bytes() == PRECIOUS and os.listdir(target.parent) == ["precious.txt"]


def test_a_save_onto_a_step_link_is_refused_and_the_target_keeps_its_files(tmp_path):
    run, target = tmp_path / "run", outside_file(tmp_path)
    run.mkdir()
    step_dir(run, 1).symlink_to(target.parent)  # no COMPLETE there: a resume ignores it, the save meets it
    result = run1(cfg_for(run, steps=1, save_every=1))
    assert result.startswith(f"TrainingError: saving step 1 failed: rank 0: {step_dir(run, 1)} is a symbolic "
                             f"link (to {target.parent}): {HINT}; the state needs about "), result
    assert os.listdir(target.parent) == ["precious.txt"] and target.read_bytes() == PRECIOUS


# ---- the helper itself, and the launcher's rank logs ----------------------------------------------------
def test_open_file_walks_every_component_without_following_links(tmp_path):
    target = outside_file(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "sub").symlink_to(target.parent)
    with pytest.raises(UnsafeEntryError, match=f"^{run / 'sub'} is a symbolic link "):
        open_file(run, "sub/precious.txt", os.O_WRONLY | os.O_TRUNC)
    with pytest.raises(UnsafeEntryError, match=f"^{run / 'sub'} is a symbolic link "):
        make_dir(run, "sub/deeper")
    assert target.read_bytes() == PRECIOUS and os.listdir(target.parent) == ["precious.txt"]
    (run / "dir").mkdir()
    with pytest.raises(UnsafeEntryError, match=f"^{run / 'dir'} is a directory: "):
        open_file(run, "dir", os.O_RDONLY)
    with pytest.raises(ValueError, match="not a plain relative path"):
        open_file(run, "../outside/precious.txt", os.O_RDONLY)
    fd = open_file(run, "a/b/new.txt", os.O_WRONLY | os.O_CREAT)
    os.close(fd)
    assert (run / "a" / "b" / "new.txt").is_file()
    # the run directory itself may be a link (a user's choice of disk)
    (tmp_path / "alias").symlink_to(run)
    os.close(open_file(tmp_path / "alias", "a/b/new.txt", os.O_RDONLY))


@pytest.mark.parametrize("entry", ["logs", "logs/rank1.log"])
def test_launch_local_refuses_a_linked_rank_log_before_starting_any_rank(tmp_path, entry):
    run, target = tmp_path / "run", outside_file(tmp_path)
    (run / entry).parent.mkdir(parents=True, exist_ok=True)
    (run / entry).symlink_to(target if entry.endswith(".log") else target.parent)
    marker = tmp_path / "started"
    with pytest.raises(UnsafeEntryError, match=f"^{run / entry} is a symbolic link "):
        launch_local([sys.executable, "-c", f"open({str(marker)!r}, 'w')"], 2, {"PATH": "/usr/bin:/bin"},
                     run / "logs", root=run)
    assert not marker.exists() and target.read_bytes() == PRECIOUS


def test_cli_train_into_a_run_dir_with_a_linked_rank_log_is_one_line_exit_2(tmp_path):
    run, target = tmp_path / "run", outside_file(tmp_path)
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank1.log").symlink_to(target)
    done = _cli(["train", *_tiny_args(run, "launch.nproc=2")], tmp_path)
    assert (done.returncode, done.stderr) == (
        USAGE_ERROR, f"spartron: error: {run / 'logs' / 'rank1.log'} is a symbolic link (to {target}): {HINT}\n")
    assert target.read_bytes() == PRECIOUS


# ---- step markers and files are looked at with lstat: a linked or FIFO COMPLETE is no complete step --------
def _tamper(path: Path, kind: str, target: Path) -> str:
    """Replace the regular file at `path` with a `kind` entry; returns how the refusal describes it."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        return "is a FIFO"
    if kind == "folder":
        path.mkdir()
        return "is a directory"
    link = {"file": target, "dir": target.parent, "dangling": target.parent / "gone"}[kind]
    path.symlink_to(link)
    return f"is a symbolic link (to {link})"


@pytest.mark.parametrize("kind", ["file", "dir", "dangling", "fifo", "folder"])
def test_a_newest_step_whose_complete_is_not_a_regular_file_stops_the_resume(tmp_path, kind, capfd):
    from spartron.runtime.rundir import complete_steps, incomplete_steps, read_manifest

    run, target = tmp_path / "run", outside_file(tmp_path)
    assert run1(cfg_for(run, steps=2, save_every=1)) == [1, 2]
    marker = step_dir(run, 2) / COMPLETE
    what = _tamper(marker, kind, target)
    assert complete_steps(run) == [1] and incomplete_steps(run) == ["step-00000002"]
    assert run1(cfg_for(run, steps=4, save_every=1)) == (
        f"StateLoadError: {marker} {what}: a save writes a regular file there, so step-00000002 (the newest step) "
        "is not a complete saved step; restore the marker, or remove step-00000002 to use step-00000001")
    with pytest.raises(StateLoadError) as err:
        read_manifest(step_dir(run, 2))
    assert str(err.value) == (f"{marker} {what}: a save writes a regular file there, so step-00000002 is not a "
                              "complete saved step (the run directory was changed)")
    capfd.readouterr()
    assert run1(cfg_for(run, steps=1, save_every=1, resume=False, overwrite=True)) == [1]
    assert f"spartron: train.overwrite: removed step-00000001, step-00000002, metrics.jsonl from {run}" in \
        capfd.readouterr().err
    assert sorted(p.name for p in run.glob("step-*")) == ["step-00000001"]
    assert target.read_bytes() == PRECIOUS and os.listdir(target.parent) == ["precious.txt"]


def test_an_older_step_with_a_linked_complete_is_skipped_with_a_note(tmp_path, capfd):
    run, target = tmp_path / "run", outside_file(tmp_path)
    assert run1(cfg_for(run, steps=2, save_every=1)) == [1, 2]
    _tamper(step_dir(run, 1) / COMPLETE, "file", target)
    capfd.readouterr()
    assert run1(cfg_for(run, steps=3, save_every=1, keep_last=1)) == [3]
    assert (f"spartron: resumed from step 2 ({step_dir(run, 2)}); skipped incomplete step directories: "
            f"step-00000001 ({COMPLETE} is not a regular file)") in capfd.readouterr().err.splitlines()
    assert (step_dir(run, 1) / COMPLETE).is_symlink() and target.read_bytes() == PRECIOUS  # never pruned through


def test_a_step_file_that_is_a_fifo_is_named_without_hanging(tmp_path):
    run = tmp_path / "run"
    assert run1(cfg_for(run, steps=2, save_every=1)) == [1, 2]
    fifo = step_dir(run, 2) / "rank-00000.json"
    fifo.unlink()
    os.mkfifo(fifo)
    assert run1(cfg_for(run, steps=3, save_every=1)) == (
        f"StateLoadError: {fifo} is a FIFO: a saved step holds only regular files; the newest intact step is "
        f"step-00000001: move step-00000002 out of {run} to resume from it")


def test_an_empty_step_folder_is_skipped_on_resume_refused_on_a_new_run_and_replaced_by_the_save(tmp_path, capfd):
    run = tmp_path / "run"
    assert run1(cfg_for(run, steps=2, save_every=1)) == [1, 2]
    step_dir(run, 3).mkdir()  # what a deletion cut short leaves (COMPLETE goes first), or a user's mkdir
    assert run1(cfg_for(run, steps=4, save_every=1, resume=False)).startswith(
        f"StateLoadError: {run} already holds saved steps [1, 2] (step-00000001, step-00000002, step-00000003, "
        "metrics.jsonl); train.resume = false will not mix a new run into it")
    capfd.readouterr()
    assert run1(cfg_for(run, steps=4, save_every=1)) == [3, 4]
    assert (f"spartron: resumed from step 2 ({step_dir(run, 2)}); skipped incomplete step directories: "
            "step-00000003") in capfd.readouterr().err.splitlines()
    assert (step_dir(run, 3) / COMPLETE).is_file() and (step_dir(run, 3) / "meta.json").is_file()
    assert run1(cfg_for(run, steps=5, save_every=1)) == [5]  # step 3 is a complete step now


def test_eval_and_export_of_a_run_dir_whose_newest_marker_is_linked_are_one_line(tmp_path, capsys):
    from spartron.launch.cli import main
    from spartron.runtime.trainer import evaluate_saved

    run, target = tmp_path / "run", outside_file(tmp_path)
    assert run1(cfg_for(run, steps=2, save_every=1)) == [1, 2]
    marker = step_dir(run, 2) / COMPLETE
    what = _tamper(marker, "file", target)
    why = (f"{marker} {what}: a save writes a regular file there, so step-00000002 (the newest step) is not a "
           "complete saved step; restore the marker, or remove step-00000002 to use step-00000001")
    with pytest.raises(StateLoadError) as err:
        evaluate_saved(cfg_for(run), run)
    assert str(err.value) == why
    capsys.readouterr()
    assert main(["convert", "--from", str(run), "--to-hf", str(tmp_path / "hf")]) == USAGE_ERROR
    assert capsys.readouterr().err.splitlines() == [f"spartron: error: {why}"]
    assert not (tmp_path / "hf").exists() and target.read_bytes() == PRECIOUS
