"""Save / resume of the REAL tiny preset (MLA + DSA sources/consumers, MoE with shared experts, MTP
depth 2 with shared weights) through the trainer's default model factory: resumed steps equal the
uninterrupted run's bitwise (CPU, fp32), on 1 rank after a kill -9 and on 4 gloo ranks (EP2 x CP2,
FSDP2 + EP-sharded experts + DCP) from a fresh process group.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spartron.runtime.config import load_config
from spartron.runtime.metrics import read_metrics
from spartron.runtime.state import COMPLETE, SafeFileSystemReader, complete_steps, step_dir
from spartron.runtime.trainer import train
from spartron.testing import run_distributed, sigkill_when_exists

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
STEPS = 4
SAVE_EVERY = 2


def overrides(run_dir: Path, *extra: str) -> list[str]:
    """The tiny preset, shortened: 4 steps of 4 sequences of 32 tokens, a save every 2 steps."""
    return [f"train.steps={STEPS}", f"train.save_every={SAVE_EVERY}", "train.seq_len=32",
            "train.global_batch_size=4", "train.progress=false", "train.peak_tflops=1.0",
            f"train.run_dir={run_dir}", *extra]


def trace(records: list[dict]) -> list[tuple]:
    """What must match bitwise: every loss term and the gradient norm, per step."""
    return [(r["step"], r["loss"], r["lm_loss"], r["mtp_losses"], r["aux_loss"], r["indexer_loss"],
             r["grad_norm"]) for r in records]


def last_segment(metrics_path: Path) -> tuple[dict, list[dict]]:
    """The header and the step records written by the LAST process that ran in this run directory."""
    header, records = None, []
    for line in metrics_path.read_text().splitlines():
        record = json.loads(line)
        if record.get("type") == "header":
            header, records = record, []
        elif record.get("type") == "step":
            records.append(record)
    return header, records


# ---- 1 rank: kill -9 after the step-2 save, resume with the same command ------------------------
def trainer_command(run_dir: Path, *extra: str) -> list[str]:
    command = [sys.executable, "-m", "spartron.launch.rank", str(TINY)]
    for item in overrides(run_dir, *extra):
        command += ["--set", item]
    return command


# One intra-op thread, as in run_distributed's ranks: on a shared 2-core machine, OpenMP threads that
# spin while another process holds a core make a step 10-50x slower. (Same count in every run.)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_to_end(command: list[str]) -> None:
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]


def run_and_kill_after_save(command: list[str], run_dir: Path) -> None:
    """Start the run, SIGKILL it as soon as step 2's save is committed (the COMPLETE marker exists)."""
    proc = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sigkill_when_exists(proc, step_dir(run_dir, SAVE_EVERY) / COMPLETE, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    pytest.param((), id="preset-selective-ac"),
    pytest.param(("ac.mode=full", "offload.enabled=true"), id="full-ac-offload"),
])
def test_one_rank_kill9_after_save_then_resume_matches_uninterrupted_bitwise(tmp_path, extra):
    reference, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    run_to_end(trainer_command(reference, *extra))
    _, expected = read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    assert complete_steps(reference) == [2, 4]

    command = trainer_command(killed, *extra)
    run_and_kill_after_save(command, killed)
    assert complete_steps(killed) == [2], "killed too late: step 4 was already saved"
    run_to_end(command)  # the same command resumes from the last complete save

    header, resumed = last_segment(killed / "metrics.jsonl")
    assert header["resumed_from_step"] == 2
    assert trace(resumed) == trace(expected[2:])  # bitwise: == on the floats written as JSON
    _, whole = read_metrics(killed / "metrics.jsonl")
    assert trace(whole) == trace(expected)  # steps 1-2 before the kill were the same too
    assert all(len(r["mtp_losses"]) == 2 for r in whole)  # the real preset (MTP depth 2) ran


# ---- 4 gloo ranks, EP2 x CP2: resume in a fresh process group --------------------------------------
def _train_ranks(rank, world, run_dir: str):
    cfg = load_config(TINY, overrides(Path(run_dir), "parallel.ep=2", "parallel.cp=2", "parallel.timeout_s=60"))
    result = train(cfg)
    return result.resumed_from, trace(result.records)


@pytest.mark.slow
def test_four_ranks_ep2_cp2_resume_in_a_fresh_process_group_matches_bitwise(tmp_path):
    reference, resumed_dir = tmp_path / "uninterrupted", tmp_path / "resumed"
    full = run_distributed(_train_ranks, 4, str(reference), timeout=180)
    assert all(r == full[0] for r in full)  # every rank reports the same all-reduced values
    assert full[0][0] is None and [r[0] for r in full[0][1]] == [1, 2, 3, 4]
    assert complete_steps(reference) == [2, 4]
    # Both EP ranks' experts (4 of 8 each) are in the checkpoint as one global tensor, not one rank's copy.
    saved = SafeFileSystemReader(step_dir(reference, 2)).read_metadata().state_dict_metadata
    expert_keys = sorted(k for k in saved if k.startswith("model.layers.1.ffn.experts.w1"))
    assert expert_keys == ["model.layers.1.ffn.experts.w1"] and saved[expert_keys[0]].size[0] == 8
    assert sorted(c.offsets[0] for c in saved[expert_keys[0]].chunks) == [0, 2, 4, 6]  # ep x expert_fsdp

    # A new run directory holding only the step-2 save: the state a crash after that save leaves.
    shutil.copytree(step_dir(reference, 2), step_dir(resumed_dir, 2))
    resumed = run_distributed(_train_ranks, 4, str(resumed_dir), timeout=180)
    assert all(r == resumed[0] for r in resumed)
    resumed_from, records = resumed[0]
    assert resumed_from == 2
    assert records == full[0][1][2:]  # bitwise: losses, MTP/aux/indexer losses, grad norms
