"""The memory model of model.master_weights = "optimizer" (spartron.layers.costs / step_memory): exact state bytes,
no FSDP2 buffers, and the predicted peak of a tiny CPU step within 10% of the live bytes a tracker counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from live_bytes import LiveStorageBytes  # tests/live_bytes.py (tests/ is on sys.path through its conftest)

from spartron.layers.costs import count_parameters, state_bytes_per_rank
from spartron.layers.step_memory import StepShape, memory_plan
from spartron.runtime.config import load_config
from spartron.runtime.memory import plan_memory
from spartron.runtime.trainer import Trainer
from spartron.testing import run_distributed

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
FSDP = ["model.dtype=bfloat16", "model.master_dtype=float32"]
OPTIMIZER = [*FSDP, "model.master_weights=optimizer"]
FROZEN_INDEXER = 6624  # tiny's DSA indexer parameters: model.dsa.indexer_mode = "frozen" gives them no gradient


def test_state_bytes_add_the_bf16_weights_to_the_fp32_masters():
    cfg = load_config(TINY, OPTIMIZER)
    n = count_parameters(cfg.model).total
    t = n - FROZEN_INDEXER  # what gets a gradient, hence main gradients and moments
    assert state_bytes_per_rank(cfg.model, cfg.parallel.dims(1), "adamw") == {
        "parameters": 6 * n, "gradients": 4 * t, "optimizer_state": 8 * t, "total": 6 * n + 12 * t}


@pytest.mark.parametrize("micro", [1, 2])
def test_the_plan_drops_fsdp_buffers_and_keeps_bf16_gradients_of_one_micro_batch(micro):
    old, new = (load_config(TINY, o).model for o in (FSDP, OPTIMIZER))
    dims = load_config(TINY).parallel.dims(1)
    step = StepShape(seq_len=64, micro_batch_size=1, micro_steps=micro)
    a, b = memory_plan(old, dims, step), memory_plan(new, dims, step)
    n = count_parameters(new).total
    assert b.parts["parameters"] - a.parts["parameters"] == 2 * n
    assert b.phases["optimizer"] - b.parts["parameters"] - b.parts["optimizer_state"] \
        - b.parts["communication_buffers"] == (2 if micro == 1 else 4) * (n - FROZEN_INDEXER)
    assert b.parts["unsharded_parameters"] == 0 < a.parts["unsharded_parameters"]  # no all-gathered bf16 copies


def _measured_and_planned(rank, world, run_dir: str, mode: str, micro: int):
    cfg = load_config(TINY, [*OPTIMIZER, f"ac.mode={mode}", "train.steps=2", "train.progress=false",
                             "train.peak_tflops=1", f"train.global_batch_size={micro}", f"train.run_dir={run_dir}"])
    trainer = Trainer(cfg).setup()
    trainer.step()  # the optimizer state exists from here on
    model = trainer.model
    live = [*model.state_dict().values(), *model.parameters(),  # masters and buffers; bf16 weights
            *(v for st in trainer.optimizer.state.values() for v in st.values())]
    with LiveStorageBytes([t for t in live if isinstance(t, torch.Tensor)]) as tracker:
        trainer.step()
    trainer.close()
    return tracker.peak, plan_memory(cfg, world).peak


@pytest.mark.parametrize(("mode", "micro"), [("none", 1), ("selective", 2), ("full", 4)])
def test_predicted_peak_is_within_10_percent_of_the_tracked_peak(tmp_path, mode, micro):
    measured, planned = run_distributed(_measured_and_planned, 1, str(tmp_path), mode, micro, timeout=120)[0]
    assert abs(planned / measured - 1) < 0.10, (planned, measured)


def test_a_plan_of_more_than_one_rank_is_refused_naming_the_key():
    cfg = load_config(TINY, OPTIMIZER)
    with pytest.raises(ValueError) as err:
        memory_plan(cfg.model, cfg.parallel.dims(2), StepShape(seq_len=64, micro_batch_size=1))
    assert str(err.value) == ("model.master_weights = 'optimizer' runs on one rank (its parameters are not sharded); "
                              "this layout has 2 ranks: set model.master_weights = 'fsdp'")
