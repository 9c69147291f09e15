"""ProcessGroupCollection export: Megatron modules see the same ranks as megatron-core's own groups."""

from __future__ import annotations

import pytest

from spartron.interop.megatron.groups import (
    MEGATRON_FIELDS,
    from_process_group_collection,
    to_process_group_collection,
)
from spartron.parallel.dims import ParallelDims
from spartron.parallel.groups import ParallelGroups
from spartron.testing import run_distributed

# Imported in the parent so forked ranks do not each pay the seconds megatron's import costs.
parallel_state = pytest.importorskip("megatron.core.parallel_state")
ProcessGroupCollection = pytest.importorskip("megatron.core.process_groups_config").ProcessGroupCollection


def _compare(rank, world, kwargs):
    dims = ParallelDims(world_size=world, **kwargs)
    ours = from_process_group_collection(to_process_group_collection(ParallelGroups.build(dims, "cpu")))
    parallel_state.initialize_model_parallel(
        context_parallel_size=dims.cp, expert_model_parallel_size=dims.ep, order=dims.order,
        create_gloo_process_groups=False)
    theirs = from_process_group_collection(ProcessGroupCollection.use_mpu_process_groups())
    parallel_state.destroy_model_parallel()
    return ours, theirs


@pytest.mark.parametrize("world,kwargs", [
    (4, dict(fsdp=2, cp=2, ep=2)),
    (4, dict(fsdp=1, cp=2, ep=2, dp_replicate=2, order="tp-dp-cp-ep-pp")),
], ids=["fsdp2-cp2-ep2", "rep2-cp2-ep2-dp-first"])
def test_collection_ranks_equal_megatron(world, kwargs):
    for rank, (ours, theirs) in enumerate(run_distributed(_compare, world, kwargs)):
        assert set(ours) == set(MEGATRON_FIELDS), rank
        assert {k: sorted(v) for k, v in ours.items()} == {k: sorted(theirs[k]) for k in ours}, rank
        assert ours["tp"] == ours["pp"] == [rank]
        assert len(ours["cp"]) == kwargs["cp"] and len(ours["ep"]) == kwargs["ep"]
