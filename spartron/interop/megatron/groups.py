"""Interop with megatron-core: hand Spartron's groups to Megatron modules as a ProcessGroupCollection.

With tp = pp = 1 (Spartron has neither), Megatron's tensor/pipeline groups are this rank alone, and its
combined groups collapse onto Spartron's: tp_cp = cp, tp_ep = tp_ep_pp = ep, tp_dp_cp = dp_cp, and
with one distributed-optimizer instance the "intra" groups are the full data-parallel groups.
megatron is imported inside the functions: importing it costs seconds.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

import torch.distributed as dist

from spartron.parallel.groups import GROUP_NAMES, ParallelGroups

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

# Megatron field -> the Spartron group it is (None: this rank alone; tp = pp = 1).
MEGATRON_FIELDS: dict[str, str | None] = {
    "tp": None, "pp": None, "mp": None, "embd": None, "pos_embd": None, "expt_tp": None,
    "cp": "cp", "tp_cp": "cp",
    "ep": "ep", "tp_ep": "ep", "tp_ep_pp": "ep",
    "dp": "dp", "dp_cp": "dp_cp", "tp_dp_cp": "dp_cp", "intra_dp_cp": "dp_cp",
    "expt_dp": "expert_dp", "intra_expt_dp": "expert_dp",
    "intra_dist_opt": "world",
}
# Fields Megatron leaves None unless hierarchical CP / partial distributed optimizer are on.
MEGATRON_UNSET_FIELDS = ("hcp", "inter_dist_opt")


def _single_rank_group(groups: ParallelGroups) -> dist.ProcessGroup:
    """A group of this rank alone: an existing size-1 group, else one new group per rank (collective)."""
    for name in GROUP_NAMES:
        if groups.dims.group_size(name) == 1:  # same answer on every rank: no one skips the loop below
            return groups.group(name)
    mine = None
    for rank in range(groups.dims.world_size):
        pg = dist.new_group(ranks=[rank], group_desc="spartron_single_rank")
        if rank == dist.get_rank():
            mine = pg
    return mine


def to_process_group_collection(groups: ParallelGroups) -> ProcessGroupCollection:
    """Megatron's ProcessGroupCollection over Spartron's groups. Collective: call it on every rank."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    known = {f.name for f in fields(ProcessGroupCollection)}
    unknown = sorted(set(MEGATRON_FIELDS) - known)
    if unknown:
        raise RuntimeError(f"this megatron-core has no ProcessGroupCollection fields {unknown}; "
                           "spartron.interop.megatron.groups targets megatron-core 0.16")
    single = _single_rank_group(groups)
    values = {name: single if ours is None else groups.group(ours) for name, ours in MEGATRON_FIELDS.items()}
    values.update({name: None for name in MEGATRON_UNSET_FIELDS if name in known})
    return ProcessGroupCollection(**values)


def from_process_group_collection(pgc: ProcessGroupCollection) -> dict[str, list[int]]:
    """This rank's global ranks in every set, non-None group of `pgc` (for comparing layouts)."""
    out = {}
    for f in fields(pgc):
        pg = getattr(pgc, f.name, None)
        if isinstance(pg, dist.ProcessGroup):
            out[f.name] = dist.get_process_group_ranks(pg)
    return out
