"""[train.indexer_metrics] is opt-in: a DSA run that does not ask for the metric hooks nothing (a benchmark's speed
and memory are the model's alone); asked for, it hooks every DSA source layer."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from spartron.configbase import ConfigError
from spartron.layers.attention.mla import MLA
from spartron.layers.model import build_model
from spartron.runtime.config import config_from_dict
from spartron.runtime.indexer_metrics import IndexerProbe

PRESET = Path(__file__).parents[2] / "configs" / "deepseek-v3.2-staged.toml"


def _config(metrics: dict | None):
    data = tomllib.loads(PRESET.read_text())
    data["model"].update(n_layers=2, max_seq_len=32)
    data["train"].update(seq_len=16)
    data["train"].pop("indexer_metrics")
    if metrics is not None:
        data["train"]["indexer_metrics"] = metrics
    return config_from_dict(data)


def test_the_metric_is_off_unless_asked_and_hooks_the_sources_when_asked():
    off = _config(None)
    assert off.train.indexer_metrics.every == 0
    model = build_model(off.model)
    assert IndexerProbe.for_model(model, off.train, None) is None
    on = _config({"every": 2, "queries": 3})
    probe = IndexerProbe.for_model(model, on.train, None)
    sources = [m.layer_idx for m in model.modules() if isinstance(m, MLA) and m.indexer is not None]
    assert (probe.every, probe.queries, [m.layer_idx for m in probe.layers]) == (2, 3, sources)
    assert sources  # the preset has DSA sources: the None above is the default's doing
    assert tomllib.loads(PRESET.read_text())["train"]["indexer_metrics"]["every"] == 1  # the recipe measures


def test_the_metric_under_compile_is_an_error_naming_both_keys():
    data = tomllib.loads(PRESET.read_text())
    data["train"]["compile"] = True
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert ("train.indexer_metrics.every = 1 needs train.compile = false (the metric hooks the DSA layers, which a "
            "compiled block cannot run); set train.indexer_metrics.every = 0 to train compiled") in str(err.value)
    data["train"]["indexer_metrics"]["every"] = 0
    assert config_from_dict(data).train.compile  # off, compiled training is fine
