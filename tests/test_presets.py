"""Every shipped preset loads and validates; the V3.2 attention preset is what its header says and plans
inside one H200."""

from __future__ import annotations

from pathlib import Path

import pytest

from spartron.runtime.config import load_config
from spartron.runtime.memory import plan_memory

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
H200_BYTES = 139 * 2**30  # what torch reports as the H200's total memory, rounded down


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.stem)
def test_every_preset_loads(path: Path):
    assert load_config(path).name == path.stem


def test_the_v32_attention_preset_trains_v32s_indexer_and_fits_one_h200():
    cfg = load_config(CONFIGS / "dsa-v32-10l.toml")
    m = cfg.model
    assert (m.n_heads, m.n_layers, cfg.train.seq_len) == (128, 10, 32768)
    assert (m.dsa.n_index_heads, m.dsa.index_head_dim, m.dsa.index_topk, m.dsa.topk_freq) == (64, 128, 2048, 1)
    assert (m.dsa.indexer_mode, m.dsa.attention_chunk, m.mtp.depth) == ("kl_sparse", 8192, 1)
    peak = plan_memory(cfg, 1, 0).peak
    assert 0.8 * H200_BYTES < peak < 0.9 * H200_BYTES  # as many layers as fit, with the planner's margin
    eleven = plan_memory(load_config(CONFIGS / "dsa-v32-10l.toml", ["model.n_layers=11"]), 1, 0).peak
    assert eleven > 0.92 * H200_BYTES  # one more layer leaves no margin
