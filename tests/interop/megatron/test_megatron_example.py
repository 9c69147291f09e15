"""examples/megatron_gpt.py runs as the README prints it, and its dist_checkpointing save resumes and reshards.

The save and the resume run the example as a program (`--nproc N`: it spawns its own gloo ranks over a file
store, no port), as the README prints it, and because megatron-core's dist_checkpointing forks writer
processes when it saves, which spartron.testing's daemonic ranks may not. One run (2 ranks, EP 2, 4 steps,
saved after step 2) serves every test of this module:
- the save reloads bit-exactly into a freshly initialised model on every rank (each rank its own experts);
- a resume from it (model, optimizer, data position) gives the uninterrupted run's losses exactly;
- its weights load under EP 1 (2 ranks) and EP 4 (4 ranks) and give the saved model's loss. A load forks
  nothing: the example's own `run` (what `--load CKPT --model-only --steps 0` runs on each rank) runs in
  this test's gloo ranks, which have megatron-core imported already (a program's 2 or 4 fresh ranks spend
  most of their time importing it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from spartron.testing import run_distributed

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


def _model_only_load(rank, world, ckpt: str, ep: int) -> dict:
    """One rank of `examples/megatron_gpt.py --ep EP --steps 0 --load CKPT --model-only` (its `run`)."""
    spec = importlib.util.spec_from_file_location("megatron_gpt_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = argparse.Namespace(ep=ep, steps=0, schedule_steps=8, micro_batches=2, save=None, save_at=None,
                              load=Path(ckpt), model_only=True, out=None)
    return example.run(args)


@pytest.mark.parametrize(("world", "ep"), [(2, 1), (4, 4)])
def test_example_weights_load_under_another_ep_size(saved, world, ep):
    tmp, ranks = saved
    loaded = run_distributed(_model_only_load, world, str(tmp / "ckpt"), ep, timeout=300)
    assert [(r["world"], r["ep"], r["losses"]) for r in loaded] == [(world, ep, {})] * world
    assert max(abs(r["loaded_eval_loss"] - ranks[0]["saved_eval_loss"]) for r in loaded) < 1e-6, loaded
