"""What a rehearsal report says about what it compares and leaves out (audit F4, F7, F11)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spartron.launch.rehearse import rehearsal_config, run_rehearsal
from spartron.launch.rehearse_report import build_report, render
from spartron.runtime.config import ConfigError, load_config
from spartron.runtime.linktable import ClusterConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "tiny.toml"


def test_parameter_shards_compare_the_models_parameters_under_optimizer_held_masters():
    """model.master_weights = "optimizer": the planned side was weights + fp32 masters (6 B a parameter), the held
    side the model's bf16 parameters (2 B): 2,452,416 vs 817,472. Both are the model's own parameters now."""
    cfg = load_config(TINY, ["model.dtype=bfloat16", "model.master_dtype=float32", "model.master_weights=optimizer"])
    report = build_report(run_rehearsal(cfg, 1, 0, 1, balanced=True), ClusterConfig())
    planner = report["planner"]
    assert planner["parameter_bytes"] == planner["measured_parameter_bytes"] == 817472
    assert "model parameter shards 0.00 GB planned, 0.00 GB held (the model's own parameters: optimizer-held " \
           "masters are in neither)" in " ".join(render(report).split())


def test_a_staged_config_is_refused_naming_steps_and_the_total_it_needs(tmp_path):
    cfg = load_config(CONFIGS / "deepseek-v3.2-staged.toml")
    with pytest.raises(ConfigError, match=r"^--steps 3: the config is staged \(train.stages\) and a "
                                          r"rehearsal runs every stage's steps, 8 \(4 \+ 4\) in all: rehearse with "
                                          r"--steps 8$"):
        rehearsal_config(cfg, 2, 3, str(tmp_path))
    rcfg, _, _ = rehearsal_config(cfg, 2, 8, str(tmp_path))
    assert rcfg.train.steps == 8


def test_evaluation_and_saves_left_out_are_noted(tmp_path):
    cfg = load_config(TINY, ["train.eval_every=2", "train.save_every=3", "train.async_save=true"])
    _, _, notes = rehearsal_config(cfg, 1, 1, str(tmp_path))
    assert notes == ["train.eval_every = 2 is not rehearsed: the steps and tokens/s leave out evaluation",
                     "train.save_every = 3 is not rehearsed: the steps and tokens/s leave out saves (async_save "
                     "included)"]
    assert rehearsal_config(load_config(TINY), 1, 1, str(tmp_path))[2] == []


def test_allocator_retries_during_the_rehearsed_steps_are_noted_with_the_steps_they_came_in():
    """CUDA's num_alloc_retries is cumulative over the process: the note names the steps whose count rose and the
    reserved against allocated peak; a CPU rehearsal (None) and a run without retries say nothing."""
    measured = run_rehearsal(load_config(TINY, ["train.seq_len=32"]), 1, 0, 3, balanced=True)
    assert [s["record"]["alloc_retries"] for s in measured["steps"]] == [None] * 3  # CPU
    assert not [n for n in build_report(measured, ClusterConfig())["notes"] if "caching allocator" in n]
    for s, retries in zip(measured["steps"], (0, 0, 0), strict=True):
        s["record"]["alloc_retries"] = retries
    assert not [n for n in build_report(measured, ClusterConfig())["notes"] if "caching allocator" in n]
    for s, retries, reserved in zip(measured["steps"], (0, 2, 5), (10e9, 60e9, 75e9), strict=True):
        s["record"]["alloc_retries"], s["record"]["peak_memory_reserved_bytes"] = retries, reserved
        s["record"]["peak_memory_allocated_bytes"] = 17e9
    report = build_report(measured, ClusterConfig())
    assert [s["alloc_retries"] for s in report["steps"]] == [0, 2, 5]
    (note,) = [n for n in report["notes"] if "caching allocator" in n]
    assert note == ("the CUDA caching allocator freed its cache and retried 5 allocations (at steps 2, 3; peak "
                    "reserved 75.00 GB against 17.00 GB allocated): the rank runs near its memory and such steps "
                    "stall; expandable segments usually avoid it (launch.env = {PYTORCH_CUDA_ALLOC_CONF = "
                    "\"expandable_segments:True\"})")


def test_a_cpu_rehearsal_does_not_compare_the_planner_with_the_process_rss():
    """On CPU the measured peak is the interpreter's lifetime RSS: the planner line said -98% (read as a planner
    error, outside audit F6); it is named for what it is and not compared."""
    report = build_report(run_rehearsal(load_config(TINY, ["train.seq_len=32"]), 1, 0, 1, balanced=True),
                          ClusterConfig())
    assert report["planner"]["difference_percent"] is None and report["planner"]["measured_peak_bytes"] > 0
    assert "(the process's peak RSS on CPU, not the step's allocation: not compared)" in " ".join(
        render(report).split())
