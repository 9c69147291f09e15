"""configs/deepseek-v3.2-staged.toml through the public `spartron train` and `spartron plan`: the stage switch in
the metrics, the backbone frozen through the warm-up (the saved step after it: only the indexers moved)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from spartron.layers.model import build_model
from spartron.runtime.config import load_config

PRESET = Path(__file__).parents[2] / "configs" / "deepseek-v3.2-staged.toml"
SPARTRON = [str(Path(sys.executable).parent / "spartron")]


def _saved_model(step_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    reader = dcp.FileSystemReader(str(step_dir))
    meta = reader.read_metadata()
    state = {f"model.{n}": torch.empty(meta.state_dict_metadata[f"model.{n}"].size) for n in names}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def test_the_staged_preset_trains_its_two_stages(tmp_path):
    run = tmp_path / "run"
    done = subprocess.run([*SPARTRON, "train", str(PRESET), "--set", f"train.run_dir={run}", "--set",
                           "train.save_every=4", "--set", "train.seq_len=32"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stage 1/2 'dense_warmup': steps 1-4, DSA dense_warmup, lr 0.001" in done.stderr
    assert "stage 2/2 'sparse': steps 5-8, DSA kl_sparse, lr 0.0003" in done.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    assert [r["stage"] for r in steps] == ["dense_warmup"] * 4 + ["sparse"] * 4
    assert all(len(r["indexer_recall_per_layer"]) == 3 and 0 < r["indexer_recall"] <= 1 for r in steps)
    assert [r["indexer_metric_layers"] for r in steps] == [[0, 1, 2]] * 8
    assert all(r["grad_norm"] < 0.1 for r in steps[:4]) and all(r["grad_norm"] > 0.1 for r in steps[4:])
    # After the warm-up only the indexers differ from the initial weights (seeded, layout-invariant init)
    initial = build_model(load_config(PRESET).model, seed=0).state_dict()
    warm = _saved_model(run / "step-00000004", list(initial))
    moved = sorted(k for k, v in initial.items() if not torch.equal(warm[f"model.{k}"], v))
    assert moved == sorted(k for k in initial if ".indexer." in k)


def test_plan_lists_the_stages(tmp_path):
    done = subprocess.run([*SPARTRON, "plan", str(PRESET)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert ("stage 1 'dense_warmup': steps 1-4, DSA dense_warmup, lr 0.001 (warmup 0, cosine to 0.0001); trains "
            "10,080 of 210,400 parameters (0.04 MiB)") in done.stdout
    assert "stage 2 'sparse': steps 5-8, DSA kl_sparse" in done.stdout and "trains 210,400 of 210,400" in done.stdout
