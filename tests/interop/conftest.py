"""Fixtures of the Hugging Face conversion tests (builders in hf_fixtures.py): each test module gets its own
tiny checkpoint and its own run directory imported from it, built once per module. The builders are imported
when a fixture is first used, so the Megatron tests below this folder do not load transformers for them."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Hugging Face DeepSeek-V3 checkpoint (hf_fixtures.TINY_HF, seed 0)."""
    from hf_fixtures import save_tiny_hf

    return save_tiny_hf(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def run_dir(hf_dir, tmp_path_factory):
    """A step-0 run directory converted from `hf_dir`."""
    from hf_fixtures import import_run

    return import_run(hf_dir, tmp_path_factory.mktemp("runs") / "run")
