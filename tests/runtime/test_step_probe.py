"""Trainer.step(probe): the one hook benchmarks use to vary the offload window per step and watch phases."""

from __future__ import annotations

from pathlib import Path

import torch

from spartron.checkpointing.offload import ActivationOffloader
from spartron.runtime.config import load_config
from spartron.runtime.trainer import StepProbe, Trainer
from spartron.testing import run_distributed

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def _cfg(run_dir: Path):
    return load_config(TINY, ["device=cpu", "train.seq_len=32", "train.micro_batch_size=1", "train.global_batch_size=2",
                              "model.dtype=float32", "train.steps=4", "train.save_every=0", "train.progress=false",
                              "train.peak_tflops=1.0", f"train.run_dir={run_dir}", "ac.mode=full",
                              "offload.enabled=true"])


def _probe_steps(rank, world, cfg):
    trainer = Trainer(cfg).setup()
    events: list[str] = []
    on_phase = events.append
    trainer.step(StepProbe(on_phase=on_phase))
    run_session = trainer.offload_session
    run_offloaded = run_session.summary()["session"]["offloaded_bytes"]
    after_run = list(events)
    events.clear()
    trainer.step(StepProbe(offloader=None, on_phase=on_phase))
    none_session = trainer.offload_session
    no_offload_phases = list(events)
    events.clear()
    empty = ActivationOffloader.for_model(trainer.model, cfg.offload.model_copy(update={"enabled": False}),
                                          trainer.device)
    trainer.step(StepProbe(offloader=empty, on_region_forward=lambda k: events.append(f"fwd {k}"),
                           on_region_backward=lambda k: events.append(f"bwd {k}")))
    empty_offloaded = trainer.offload_session.summary()["session"]["offloaded_bytes"]
    regions = len(trainer.offloader.regions)
    losses = [r["loss"] for r in trainer.records]
    trainer.close()
    return after_run, run_offloaded, none_session, no_offload_phases, list(events), empty_offloaded, regions, losses


def test_probe_phases_and_per_step_offloader(tmp_path):
    cfg = _cfg(tmp_path / "run")
    (got,) = run_distributed(_probe_steps, 1, cfg)
    phases, run_offloaded, none_session, no_offload_phases, region_events, empty_offloaded, regions, losses = got
    # two micro-batches: a forward, then per micro-batch its backward; the optimizer; the end
    assert phases == ["forward", "backward", "backward", "optimizer", "end"]
    assert no_offload_phases == phases
    assert run_offloaded > 0  # the run's window moved region inputs to the host
    assert none_session is None  # offloader=None: the step ran without a session
    assert empty_offloaded == 0  # an empty window observes the regions, offloads nothing
    assert regions >= 2
    # per micro-batch: every region's forward in order (the last region, the MTP block, is called once per
    # MTP depth), then their backwards in reverse
    half = len(region_events) // 2
    assert region_events[:half] == region_events[half:]
    fwd = [int(e.split()[1]) for e in region_events[:half] if e.startswith("fwd")]
    bwd = [int(e.split()[1]) for e in region_events[:half] if e.startswith("bwd")]
    assert region_events[:half] == [f"fwd {k}" for k in fwd] + [f"bwd {k}" for k in bwd]
    assert sorted(set(fwd)) == list(range(regions)) and fwd == sorted(fwd) and bwd == fwd[::-1]
    assert all(torch.isfinite(torch.tensor(losses)))
