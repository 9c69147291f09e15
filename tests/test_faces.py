"""Each subpackage's __init__ is its public face: every name it lists imports from the package."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FACES = ["spartron.parallel", "spartron.comm", "spartron.checkpointing", "spartron.layers", "spartron.layers.attention",
         "spartron.layers.moe", "spartron.layers.fp8", "spartron.data", "spartron.interop", "spartron.interop.megatron",
         "spartron.interop.hf", "spartron.runtime", "spartron.launch"]


def test_every_subpackage_has_a_face():
    packages = sorted(".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "spartron").rglob("__init__.py"))
    assert [p for p in packages if p != "spartron"] == sorted(FACES)


@pytest.mark.parametrize("name", FACES)
def test_face_lists_what_it_exports(name):
    package = importlib.import_module(name)
    assert package.__all__, name
    missing = [n for n in package.__all__ if not hasattr(package, n)]
    assert missing == [], name


def test_users_import_from_the_faces():
    from spartron.comm import EPTransport, all_to_all  # noqa: F401
    from spartron.interop import import_hf, spartron_block_spec  # noqa: F401
    from spartron.launch import main, render_plan  # noqa: F401
    from spartron.layers import SparseMoEModel, build_model, parallelize  # noqa: F401
    from spartron.parallel import ParallelDims, ParallelGroups
    from spartron.runtime import ConfigError, RunConfig, Trainer, load_config, train  # noqa: F401

    assert ParallelDims(8, fsdp=4, ep=2, dp_replicate=2).expert_fsdp == 2
    assert ParallelGroups.__module__ == "spartron.parallel.groups"
    assert (Trainer.__module__, ConfigError.__module__) == ("spartron.runtime.trainer", "spartron.configbase")
    assert "Trainer" in dir(importlib.import_module("spartron.runtime"))
    with pytest.raises(AttributeError, match="module 'spartron.runtime' has no attribute 'Trainr'"):
        importlib.import_module("spartron.runtime").Trainr  # noqa: B018


def test_a_lazy_face_imports_only_what_is_used():
    """`spartron.runtime.config` (the CLI's config check) does not import the Trainer or Slurm."""
    code = ("import sys, spartron.runtime.config, spartron.launch.process; "
            "print(sorted(m for m in ('spartron.runtime.trainer', 'spartron.launch.slurm', "
            "'spartron.interop.megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout == "[]\n"
