"""The memory plan of a staged run (spartron.runtime.memory.stage_plans): each stage planned with its DSA mode and
its trainable parameters (frozen ones: no gradient, no optimizer state), the run's peak its worst stage's, and a
line per stage in `spartron plan`. configs/deepseek-v3.2-staged.toml: a dense warm-up training the indexers only,
then the sparse stage training everything."""

from __future__ import annotations

from pathlib import Path

from spartron.launch.plan import render_plan
from spartron.layers.model import build_model
from spartron.runtime.config import load_config
from spartron.runtime.memory import plan_memory, stage_plans

PRESET = Path(__file__).resolve().parents[2] / "configs" / "deepseek-v3.2-staged.toml"


def test_each_stage_is_planned_with_its_mode_and_trainable_parameters():
    cfg = load_config(PRESET, [])
    (warm_name, warm), (sparse_name, sparse) = stage_plans(cfg, 1)
    assert (warm_name, sparse_name) == ("dense_warmup", "sparse")
    params = dict(build_model(cfg.model, device="meta").named_parameters())
    total = sum(p.numel() for p in params.values())
    indexers = sum(p.numel() for n, p in params.items() if ".indexer." in n)
    assert (total, indexers) == (210_400, 10_080)
    # the warm-up: float32 gradients and two AdamW moments for the indexers only (2 micro-batches: the
    # gradients live through backward); dense attention (CPU: SDPA's [B, H, S, S] probabilities) and the
    # kl_dense chunk's temporaries at the backward peak (+ the [T, H, c + r] absorbed query kl_dense saves); the
    # loss's saved tensors are gone by then
    assert warm.parts == {"parameters": total * 4, "optimizer_state": 2 * indexers * 4, "communication_buffers": 0,
                          "gradients": indexers * 4, "activations": 752_384, "unsharded_parameters": 0,
                          "working": 1_005_056}
    # (one rank, no FSDP2: nothing gathered or reduce-scattered at the end of backward, the root's phase is the
    # optimizer's; the float32 loss's backward holds as much as its forward)
    assert (warm.phase, warm.phases) == ("backward", {"forward end": 2_157_568, "loss backward": 2_157_568,
                                                      "backward": 2_720_000, "root reduction": 962_560,
                                                      "optimizer": 962_560})
    # the sparse stage trains everything in kl_sparse: the plan of the same run without stages, its peak inside the
    # loss (4_536_064 planned, 4_557_696 tracked: tests/layers/test_memory_plan.py's tracker)
    assert sparse.phase == "forward end" and sparse.parts == {
        "parameters": total * 4, "optimizer_state": 2 * total * 4, "communication_buffers": 0, "gradients": total * 4,
        "activations": 907_520, "unsharded_parameters": 0, "working": 262_144}
    unstaged = load_config(PRESET, ["train.stages=[]", "train.indexer_metrics.every=0"])
    assert unstaged.model.dsa.indexer_mode == "kl_sparse" and plan_memory(unstaged, 1) == sparse
    assert plan_memory(cfg, 1) == sparse  # the run's peak: its worst stage's


def test_a_warmup_stage_that_is_the_worst_gives_the_peak_and_plan_prints_every_stage():
    # at 128 tokens the warm-up's dense attention (CPU: [B, H, S, S]) and kl_dense chunk outgrow the sparse stage's
    # optimizer state: the warm-up is the worst stage
    cfg = load_config(PRESET, ["train.seq_len=128"])
    (_, warm), (_, sparse) = stage_plans(cfg, 1)
    assert warm.peak > sparse.peak and plan_memory(cfg, 1) == warm
    text = render_plan(cfg, 1)
    mib = f"{warm.peak / 2**20:.2f} MiB"
    assert f"stage 1 'dense_warmup' predicted peak {mib} at backward: parameters 0.80 MiB, optimizer_state 0.08 MiB" \
        in text
    assert f"stage 2 'sparse' predicted peak {sparse.peak / 2**20:.2f} MiB at forward end" in text
    assert f"stage 'dense_warmup'): {mib} at backward" in text
