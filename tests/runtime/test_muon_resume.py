"""Muon's state saved and resharded by DCP like AdamW's: the momentum buffers (DTensors with their
parameter's placement, experts as global tensors) saved by FSDP2 on 2 ranks (and EP2) continue on 1 rank with
the losses of an uninterrupted one-rank run (tiny preset, fp32, gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spartron.runtime.config import load_config
from spartron.runtime.state import SafeFileSystemReader, step_dir
from spartron.runtime.trainer import train
from spartron.testing import run_distributed

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
# Another layout sums the same float32 terms in another order (as in test_reshard): losses within 1e-6. The
# gradient norm after Muon steps within 1e-5: Newton-Schulz (5 quintic steps) amplifies those ulps in a
# gradient's near-null directions (measured 1.1e-6 at step 3); shards orthogonalised alone were off by 3e-2.
LAYOUT_REL, NORM_REL = 1e-6, 1e-5


def _train(rank, world, run_dir: str, steps: int, extra: tuple[str, ...]):
    overrides = [f"train.steps={steps}", "train.save_every=1", "train.seq_len=32", "train.global_batch_size=4",
                 "train.progress=false", "train.peak_tflops=1.0", f"train.run_dir={run_dir}", "train.resume=true",
                 "parallel.timeout_s=60", 'train.optimizer="muon"', "train.lr=0.01",
                 "train.warmup_steps=0", "train.min_lr_ratio=1.0", *extra]  # one lr: 2 saved steps of 4 take it too
    result = train(load_config(TINY, overrides))
    return result.resumed_from, [(r["step"], r["loss"], r["lm_loss"], r["grad_norm"]) for r in result.records]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("muon-reference") / "run"
    return run_distributed(_train, 1, str(run), 4, (), timeout=180)[0][1]


@pytest.mark.parametrize("saved_extra", [pytest.param((), id="fsdp2-to-1"),
                                         pytest.param(("parallel.ep=2",), id="ep2-to-1")])
def test_muon_state_saved_on_two_ranks_continues_on_one(tmp_path, uninterrupted, saved_extra):
    run = tmp_path / "run"
    first = run_distributed(_train, 2, str(run), 2, saved_extra, timeout=180)[0]
    assert first[0] is None
    saved = SafeFileSystemReader(step_dir(run, 2)).read_metadata().state_dict_metadata
    # the experts' momentum is one global tensor (every expert once), the head (AdamW) keeps Adam's moments
    assert list(saved["optim.state.layers.1.ffn.experts.w1.momentum_buffer"].size) == [8, 32, 64]
    assert list(saved["optim.state.layers.1.attn.wo.weight.momentum_buffer"].size) == [64, 64]
    assert "optim.state.head.weight.exp_avg" in saved and "optim.state.head.weight.momentum_buffer" not in saved
    assert not any(k.startswith("optim.state.layers.1.ffn.experts.w1.exp_avg") for k in saved)

    resumed_from, records = run_distributed(_train, 1, str(run), 4, (), timeout=180)[0]
    assert resumed_from == 2 and [r[0] for r in records] == [3, 4]
    for got, want in zip(records, uninterrupted[2:], strict=True):
        assert got[1:3] == pytest.approx(want[1:3], rel=LAYOUT_REL), (got, want)
        assert got[3] == pytest.approx(want[3], rel=NORM_REL), (got, want)
