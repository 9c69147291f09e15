"""Expert-load statistic, memory, measured peak FLOP/s and the JSONL log (FLOPs: tests/layers/test_costs.py)."""

from __future__ import annotations

import json

import torch

from spartron.runtime.metrics import (
    MetricsLog,
    expert_load_max_violation,
    measure_peak_flops,
    peak_memory,
    read_metrics,
)


def test_expert_load_violation():
    assert expert_load_max_violation(torch.tensor([[2, 2, 2, 2]])) == 0.0
    assert expert_load_max_violation(torch.tensor([[4, 2, 1, 1], [2, 2, 2, 2]])) == 1.0
    assert expert_load_max_violation(None) is None


def test_peak_memory_and_measured_peak_leave_rng_alone():
    alloc, reserved = peak_memory(torch.device("cpu"))
    assert alloc == reserved > 10 * 2**20  # the RSS of a process that imported torch
    state = torch.get_rng_state()
    assert measure_peak_flops(torch.device("cpu"), torch.float32) > 1e6
    assert torch.equal(state, torch.get_rng_state())


def test_log_appends_jsonl_and_reader_keeps_last_record_per_step(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    rec = {"type": "step", "loss": 1.0, "grad_norm": 0.5, "tokens_per_s": 10.0}
    log = MetricsLog(path, 3, enabled=True, progress=False)
    log.write({"type": "header", "n": 1})
    log.write({**rec, "step": 1})
    log.write({**rec, "step": 2})
    log.close(summary=False)
    with path.open("a") as f:
        f.write('{"type": "step", "step": 3, "lo')  # a process killed mid-write
    log = MetricsLog(path, 3, enabled=True, progress=False)  # resumed after step 1
    log.write({"type": "header", "n": 2})
    log.write({**rec, "step": 2, "loss": 2.0})
    log.close(summary=False)
    lines = path.read_text().splitlines()
    assert [json.loads(x)["type"] for x in lines] == ["header", "step", "step", "header", "step"]
    headers, steps = read_metrics(path)
    assert [h["n"] for h in headers] == [1, 2]
    assert [(s["step"], s["loss"]) for s in steps] == [(1, 1.0), (2, 2.0)]


def test_disabled_log_writes_nothing(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl", 1, enabled=False)
    log.write({"type": "step", "step": 1})
    log.close()
    assert not (tmp_path / "m.jsonl").exists()


def test_git_commit_prefers_the_snapshot_marker_over_an_enclosing_checkout(tmp_path):
    import subprocess

    from spartron.runtime.metrics import git_commit

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x")
    head = git("rev-parse", "HEAD").strip()
    snap = tmp_path / "snap"
    snap.mkdir()
    assert git_commit(snap) == head  # no marker: the enclosing checkout's HEAD
    (snap / "BUILD_COMMIT").write_text("abc123\n")
    assert git_commit(snap) == "abc123"
    (snap / "BUILD_COMMIT").write_text("  \n")
    assert git_commit(snap) == head  # an empty marker is no marker


def test_git_commit_marks_a_checkout_with_modified_tracked_files_dirty(tmp_path):
    """A rehearsal of a tree with one modified tracked file recorded the clean HEAD (audit F8)."""
    import subprocess

    from spartron.runtime.metrics import git_commit

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    head = git("rev-parse", "HEAD").strip()
    (tmp_path / "new.py").write_text("untracked\n")
    assert git_commit(tmp_path) == head  # untracked files do not count
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == f"{head}-dirty"
    (tmp_path / "BUILD_COMMIT").write_text("abc123\n")
    assert git_commit(tmp_path) == "abc123"  # a snapshot's marker is taken as written
