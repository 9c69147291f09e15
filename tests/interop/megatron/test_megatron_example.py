"""examples/megatron_gpt.py runs as the README prints it, and its dist_checkpointing save resumes and reshards.

The example is run as a program (`--nproc N`: it spawns its own gloo ranks over a file store, no port),
because megatron-core's dist_checkpointing forks writer processes, which spartron.testing's daemonic ranks
may not. One run (2 ranks, EP 2, 4 steps, saved after step 2) serves every test of this module:
- the save reloads bit-exactly into a freshly initialised model on every rank (each rank its own experts);
- a resume from it (model, optimizer, data position) gives the uninterrupted run's losses exactly;
- its weights load under EP 1 (2 ranks) and EP 4 (4 ranks) and give the saved model's loss.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core==0.16.1)")

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "megatron_gpt.py"


def run_example(out: Path, *args: str) -> list[dict]:
    """Every rank's results of one example run (its --out JSON); the run must succeed."""
    done = subprocess.run([sys.executable, str(EXAMPLE), *args, "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stderr[-4000:]}"
    return json.loads(out.read_text())["ranks"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron_example")
    ranks = run_example(tmp / "save.json", "--nproc", "2", "--ep", "2", "--steps", "4", "--save", str(tmp / "ckpt"),
                        "--save-at", "2")
    return tmp, ranks


def test_example_trains_saves_and_reloads_every_rank_bit_exact(saved):
    _, ranks = saved
    assert [(r["world"], r["ep"], r["micro_batches"]) for r in ranks] == [(2, 2, 2)] * 2
    assert list(ranks[0]["losses"]) == ["1", "2", "3", "4"] and ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["losses"]["4"] < ranks[0]["losses"]["1"]
    for r in ranks:
        assert r["reload_differing"] == [], r["reload_differing"]  # experts included: each rank its own
        assert r["reload_eval_loss"] == r["saved_eval_loss"]


def test_example_resume_continues_the_uninterrupted_run_exactly(saved):
    tmp, ranks = saved
    resumed = run_example(tmp / "resumed.json", "--nproc", "2", "--steps", "4", "--load", str(tmp / "ckpt"))[0]
    assert resumed["loaded_eval_loss"] == ranks[0]["saved_eval_loss"]
    whole = ranks[0]["losses"]
    assert resumed["losses"] == {"3": whole["3"], "4": whole["4"]}
    assert resumed["eval_loss"] == ranks[0]["eval_loss"]


@pytest.mark.parametrize(("world", "ep"), [(2, 1), pytest.param(4, 4, marks=pytest.mark.slow)])
def test_example_weights_load_under_another_ep_size(saved, world, ep):
    tmp, ranks = saved
    loaded = run_example(tmp / f"ep{ep}.json", "--nproc", str(world), "--ep", str(ep), "--steps", "0",
                         "--load", str(tmp / "ckpt"), "--model-only")
    assert [(r["world"], r["ep"]) for r in loaded] == [(world, ep)] * world
    assert max(abs(r["loaded_eval_loss"] - ranks[0]["saved_eval_loss"]) for r in loaded) < 1e-6, loaded
