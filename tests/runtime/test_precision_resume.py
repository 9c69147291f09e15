"""fp32 masters save and resume: a run of 3 steps with model.master_dtype = "float32" (FSDP2 on one rank,
fp32 DTensor parameters and AdamW state) stopped after step 2 and resumed gives the uninterrupted run's
losses bitwise."""

from __future__ import annotations

from pathlib import Path

from spartron.runtime.config import load_config
from spartron.runtime.trainer import train
from spartron.testing import run_distributed

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def _losses(rank, world, run_dir: str, steps: int):
    cfg = load_config(TINY, ["model.dtype=bfloat16", "model.master_dtype=float32", f"train.steps={steps}",
                             "train.save_every=2", "train.seq_len=32", "train.global_batch_size=2",
                             "train.progress=false", "train.peak_tflops=1.0", f"train.run_dir={run_dir}"])
    result = train(cfg)
    return result.resumed_from, [r["loss"] for r in result.records]


def test_fp32_masters_resume_bitwise(tmp_path):
    (whole,) = run_distributed(_losses, 1, str(tmp_path / "whole"), 3, timeout=120)
    (first,) = run_distributed(_losses, 1, str(tmp_path / "split"), 2, timeout=120)
    (rest,) = run_distributed(_losses, 1, str(tmp_path / "split"), 3, timeout=120)
    assert whole[0] is None and first[0] is None and rest[0] == 2
    assert first[1] + rest[1] == whole[1]
