"""Each subpackage's __init__ is its public face: every name it lists imports from the package."""

from __future__ import annotations

import importlib

import pytest

FACES = ["spartron.parallel", "spartron.comm", "spartron.checkpointing", "spartron.layers", "spartron.layers.attention",
         "spartron.layers.moe", "spartron.interop.megatron", "spartron.interop.hf"]


@pytest.mark.parametrize("name", FACES)
def test_face_lists_what_it_exports(name):
    package = importlib.import_module(name)
    assert package.__all__, name
    missing = [n for n in package.__all__ if not hasattr(package, n)]
    assert missing == [], name


def test_users_import_from_the_faces():
    from spartron.comm import EPTransport, all_to_all  # noqa: F401
    from spartron.layers import SparseMoEModel, build_model, parallelize  # noqa: F401
    from spartron.parallel import ParallelDims, ParallelGroups

    assert ParallelDims(8, fsdp=4, ep=2, dp_replicate=2).expert_fsdp == 2
    assert ParallelGroups.__module__ == "spartron.parallel.groups"
