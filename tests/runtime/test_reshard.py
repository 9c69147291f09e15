"""Resharding resume: a state saved under one layout continues under another (EP, CP, FSDP, world size)
with the losses of an uninterrupted run (fp32 tiny preset, gloo ranks); format-2 states (experts keyed
per EP rank) load under their own layout and are one line under another."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from spartron.runtime.config import load_config
from spartron.runtime.state import COMPLETE, SafeFileSystemReader, StateLoadError, step_dir
from spartron.runtime.state_layout import globalize, resplit_data_position
from spartron.runtime.trainer import train
from spartron.testing import run_distributed

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def _overrides(run_dir: str, steps: int, extra: tuple[str, ...]) -> list[str]:
    return [f"train.steps={steps}", "train.save_every=1", "train.seq_len=32", "train.global_batch_size=4",
            "train.progress=false", "train.peak_tflops=1.0", f"train.run_dir={run_dir}", "train.resume=true",
            "parallel.timeout_s=60", *extra]


def _train(rank, world, run_dir: str, steps: int, extra: tuple[str, ...]):
    result = train(load_config(TINY, _overrides(run_dir, steps, extra)))
    return result.resumed_from, [(r["step"], r["loss"], r["lm_loss"], r["grad_norm"]) for r in result.records]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Three steps on one rank: the losses every layout must continue with."""
    run = tmp_path_factory.mktemp("reference") / "run"
    return run_distributed(_train, 1, str(run), 3, (), timeout=120)[0][1]


CASES = [
    pytest.param(2, ("parallel.ep=2",), 1, (), id="ep2-to-ep1"),
    pytest.param(1, (), 4, ("parallel.ep=4",), id="ep1-to-ep4"),
    pytest.param(4, (), 2, (), id="fsdp4-to-fsdp2"),
    pytest.param(4, ("parallel.ep=2", "parallel.cp=2"), 4, ("parallel.ep=4",), id="ep2xcp2-to-ep4"),
    pytest.param(4, ("parallel.dp_replicate=2", "parallel.ep=2"), 2, ("parallel.ep=2",), id="hsdp2xep2-to-ep2"),
]


# Another layout sums the same float32 terms in another order (expert outputs over EP ranks, gradients over
# FSDP shards): a few ulps (~1e-6 of a loss near 8; ep1-to-ep4 differs by 2 ulps at step 3). A state
# mapped to the wrong parameters or optimizer slots is off by orders of magnitude more.
LAYOUT_REL = 1e-6


@pytest.mark.parametrize(("saved_world", "saved_extra", "world", "extra"), CASES)
def test_resume_under_another_layout_continues_the_uninterrupted_losses(tmp_path, uninterrupted, saved_world,
                                                                      saved_extra, world, extra):
    run = tmp_path / "run"
    first = run_distributed(_train, saved_world, str(run), 1, saved_extra, timeout=120)[0]
    assert first[0] is None and first[1][0][1:] == pytest.approx(uninterrupted[0][1:], rel=LAYOUT_REL)
    saved = SafeFileSystemReader(step_dir(run, 1)).read_metadata().state_dict_metadata
    experts = sorted(k for k in saved if k.startswith("model.layers.1.ffn.experts.w1"))
    assert experts == ["model.layers.1.ffn.experts.w1"] and list(saved[experts[0]].size) == [8, 32, 64]
    assert list(saved["optim.state.layers.1.ffn.experts.w1.exp_avg"].size) == [8, 32, 64]

    results = run_distributed(_train, world, str(run), 3, extra, timeout=120)
    assert all(r == results[0] for r in results)
    resumed_from, records = results[0]
    assert resumed_from == 1 and [r[0] for r in records] == [2, 3]
    for got, want in zip(records, uninterrupted[1:], strict=True):
        assert got[1:] == pytest.approx(want[1:], rel=LAYOUT_REL), (got, want)


def test_experts_sharded_on_their_inner_dim_reshard_too(tmp_path):
    """6 experts over EP 2 x expert_fsdp 2: 3 per EP rank do not split over 2, so FSDP2 shards dim 1
    (spartron.layers.parallelize.expert_shard_dim); resumed on 2 ranks (6 experts over 2: dim 0)."""
    six = ("model.moe.n_routed_experts=6",)
    reference = run_distributed(_train, 1, str(tmp_path / "reference"), 3, six, timeout=120)[0][1]
    run = tmp_path / "run"
    run_distributed(_train, 4, str(run), 1, ("parallel.ep=2", *six), timeout=120)
    saved = SafeFileSystemReader(step_dir(run, 1)).read_metadata().state_dict_metadata
    chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in saved["model.layers.1.ffn.experts.w1"].chunks)
    assert chunks == [((0, 0, 0), (3, 16, 64)), ((0, 16, 0), (3, 16, 64)), ((3, 0, 0), (3, 16, 64)),
                      ((3, 16, 0), (3, 16, 64))]
    resumed_from, records = run_distributed(_train, 2, str(run), 3, six, timeout=120)[0]
    assert resumed_from == 1
    for got, want in zip(records, reference[1:], strict=True):
        assert got[1:] == pytest.approx(want[1:], abs=1e-6), (got, want)


def test_the_data_position_is_the_global_sample_count_re_split():
    saved = {"position": 6, "dp_rank": 1, "dp_size": 2, "source": "synthetic"}
    assert resplit_data_position(saved, 0, 4, "x") == {"position": 3, "dp_rank": 0, "dp_size": 4,
                                                       "source": "synthetic"}
    assert resplit_data_position(saved, 0, 1, "x")["position"] == 12
    with pytest.raises(StateLoadError, match=r"^x: 12 samples were consumed, which 5 data-parallel ranks cannot "
                                             r"split evenly"):
        resplit_data_position(saved, 0, 5, "x")


def _as_format_2(path: Path) -> None:
    """Rewrite a saved step's format fields to 2 (a state of the previous Spartron; no EP: same tensors)."""
    meta = json.loads((path / "meta.json").read_text())
    meta["format_version"] = 2
    data = json.dumps(meta).encode()
    (path / "meta.json").write_bytes(data)
    marker = json.loads((path / COMPLETE).read_text())
    marker["format_version"] = 2
    for entry in marker["files"]:
        if entry["path"] == "meta.json":
            entry.update(size=len(data), crc32=zlib.crc32(data))
    (path / COMPLETE).write_text(json.dumps(marker))


def _train_error(rank, world, run_dir: str, steps: int, extra: tuple[str, ...]):
    try:
        return _train(rank, world, run_dir, steps, extra)
    except StateLoadError as err:
        return f"StateLoadError: {err}"


def test_a_format_2_state_loads_on_its_layout_and_is_one_line_on_another(tmp_path, uninterrupted):
    run = tmp_path / "run"
    run_distributed(_train, 1, str(run), 1, (), timeout=120)
    _as_format_2(step_dir(run, 1))
    other = tmp_path / "other"
    shutil.copytree(run, other)
    errors = run_distributed(_train_error, 2, str(other), 3, (), timeout=120)
    layout = "world 1 = dp_replicate 1 x fsdp 1 x cp 1; ep 1 (expert_fsdp 1); order tp-cp-ep-dp-pp"
    now = "world 2 = dp_replicate 1 x fsdp 2 x cp 1; ep 1 (expert_fsdp 2); order tp-cp-ep-dp-pp"
    assert errors == [f"StateLoadError: {step_dir(other, 1)} is a saved-state format 2 state (experts keyed per EP "
                      f"rank), which resumes only on the layout that saved it (world size 1, parallel layout "
                      f"[{layout}]); this run has world size 2, parallel layout [{now}]"] * 2
    resumed_from, records = run_distributed(_train, 1, str(run), 3, (), timeout=120)[0]
    assert resumed_from == 1 and records == uninterrupted[1:]  # its own layout: bitwise


def test_ep_sharded_names_without_their_mesh_are_refused():
    """Without the expert mesh every EP rank would write its own experts under one global name."""
    weight = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"EP-sharded parameters need their expert mesh to be saved "
                                         r"\(ep_mesh = spartron.runtime.state_layout.expert_mesh\(groups\)\)"):
        globalize({"layers.1.ffn.experts.w1": weight}, {"state": {}}, ["layers.1.ffn.experts.w1"], None)
    assert globalize({"embed.weight": weight}, {"state": {}}, [], None) == {}  # nothing EP-sharded: nothing to do
