"""train.grad_sync: with several micro-batches per step, FSDP2 reduce-scatters the gradients after the last
micro-batch only (unsharded gradients live until then) or after every one (only sharded gradients live, as
large models need). On 2 gloo ranks with 2 micro-batches: after the first micro-batch's backward the
parameters hold reduced, sharded (DTensor) gradients only under every_micro_batch; both modes train the
same losses."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.tensor import DTensor

from spartron.runtime.config import ConfigError, load_config
from spartron.runtime.trainer import default_model_factory, train
from spartron.testing import run_distributed

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def _run(rank, world, run_dir: str, mode: str):
    cfg = load_config(TINY, ["train.steps=2", "train.seq_len=32", "train.global_batch_size=4", "train.progress=false",
                             "train.peak_tflops=1.0", f"train.run_dir={run_dir}", f"train.grad_sync={mode}"])
    seen = []

    def factory(cfg, groups):
        model = default_model_factory(cfg, groups)
        # before each micro-batch's forward: does any parameter hold a reduced (sharded) gradient yet?
        model.register_forward_pre_hook(lambda m, args: seen.append(any(isinstance(p.grad, DTensor)
                                                                        for p in m.parameters())))
        return model

    records = train(cfg, model_factory=factory).records
    return {"seen": seen, "losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {mode: run_distributed(_run, 2, str(tmp_path_factory.mktemp(mode)), mode, timeout=180)[0]
            for mode in ("last_micro_batch", "every_micro_batch")}


def test_every_micro_batch_reduces_after_each_backward_and_last_only_after_the_last(runs):
    # 2 steps x 2 micro-batches; gradients are freed after each optimizer step
    assert runs["every_micro_batch"]["seen"] == [False, True, False, True]
    assert runs["last_micro_batch"]["seen"] == [False, False, False, False]


def test_both_modes_train_the_same_losses(runs):
    a, b = runs["last_micro_batch"], runs["every_micro_batch"]
    assert a["losses"][0] == b["losses"][0]  # the same start
    assert b["losses"] == pytest.approx(a["losses"], rel=1e-6, abs=0)  # the sums differ only in order
    assert b["norms"] == pytest.approx(a["norms"], rel=1e-5, abs=0)


def test_an_unknown_mode_is_an_error_naming_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["train.grad_sync=always"])
    assert str(err.value) == ("invalid config: train.grad_sync: Input should be 'last_micro_batch' or "
                              "'every_micro_batch' (got 'always')")


def test_the_planner_counts_unsharded_gradients_only_when_they_accumulate():
    from spartron.launch.plan import plan_memory
    from spartron.layers.costs import state_bytes_per_rank

    plans = {mode: plan_memory(load_config(TINY, ["train.global_batch_size=4", f"train.grad_sync={mode}"]), 2)
             for mode in ("last_micro_batch", "every_micro_batch")}
    cfg = load_config(TINY, [])
    sharded = state_bytes_per_rank(cfg.model, cfg.parallel.dims(2), "adamw")["gradients"]
    assert plans["every_micro_batch"].parts["gradients"] == sharded
    assert plans["last_micro_batch"].parts["gradients"] > 1.9 * sharded  # the whole (unsharded) local model's
