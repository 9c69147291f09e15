"""Interop with megatron-core: hand Spartron's groups to Megatron modules as a ProcessGroupCollection.

With tp = pp = 1 (Spartron has neither), Megatron's tensor/pipeline groups are this rank alone, and its
combined groups collapse onto Spartron's: tp_cp = cp, tp_ep = tp_ep_pp = ep, tp_dp_cp = dp_cp, and
with one distributed-optimizer instance the "intra" groups are the full data-parallel groups.
megatron is imported inside the functions: importing it costs seconds.

`resolve_group` is where every adapter gets its groups: the spec's `groups` / `pg_collection`, else
megatron.core.parallel_state when it is initialised (Megatron's own default), else this rank alone
-- and a Megatron config whose expert_model_parallel_size / context_parallel_size disagrees with the
group found (or asks for > 1 with none found) is an error: a missing group would silently give every
rank all the experts, and Megatron's own code sizes expert parameters by the config.
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
# Adapter group (Megatron field name) -> (ParallelGroups attribute, parallel_state getter, config size field).
ADAPTER_GROUPS: dict[str, tuple[str, str, str | None]] = {
    "cp": ("cp", "get_context_parallel_group", "context_parallel_size"),
    "ep": ("ep", "get_expert_model_parallel_group", "expert_model_parallel_size"),
    "expt_dp": ("expert_dp", "get_expert_data_parallel_group", None),
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


def _ranks(pg: dist.ProcessGroup | None) -> list[int]:
    return [dist.get_rank()] if pg is None else dist.get_process_group_ranks(pg)


def _parallel_state_group(getter: str) -> dist.ProcessGroup | None:
    from megatron.core import parallel_state

    return getattr(parallel_state, getter)() if parallel_state.model_parallel_is_initialized() else None


def source_group(name: str, pg_collection: ProcessGroupCollection | None, groups: ParallelGroups | None,
                 config=None) -> dist.ProcessGroup | None:
    """The adapters' `name` group ("cp", "ep" or "expt_dp"), size 1 included; None: no source has one.

    Sources: `groups` and/or `pg_collection` (their ranks must agree), else megatron.core.parallel_state
    when initialised. `config` (Megatron's): its size field for `name` must equal the group's size
    (1 when there is no source).
    """
    ours, getter, size_field = ADAPTER_GROUPS[name]
    from_pgc = getattr(pg_collection, name, None) if pg_collection is not None else None
    from_groups = getattr(groups, ours) if groups is not None else None
    if pg_collection is not None and groups is not None and _ranks(from_pgc) != _ranks(from_groups):
        raise ValueError(f"the {name} group of pg_collection has ranks {_ranks(from_pgc)} but "
                         f"ParallelGroups.{ours} has {_ranks(from_groups)}: build pg_collection with "
                         "spartron.interop.megatron.groups.to_process_group_collection(groups)")
    if groups is not None:
        pg = from_groups
    elif pg_collection is not None:
        pg = from_pgc
    else:
        pg = _parallel_state_group(getter)
    wanted = getattr(config, size_field, 1) if config is not None and size_field else None
    size = 1 if pg is None else dist.get_world_size(pg)
    if wanted is not None and wanted != size:
        if pg is None:
            raise ValueError(f"Megatron config {size_field}={wanted} but the spec has no pg_collection / groups "
                             "and megatron.core.parallel_state is not initialised: pass pg_collection= (or "
                             "groups=) to spartron_block_spec, or initialise parallel_state")
        raise ValueError(f"Megatron config {size_field}={wanted} but the {name} group has {size} rank(s): "
                         f"set {size_field}={size} in the Megatron config")
    return pg


def resolve_group(name: str, pg_collection: ProcessGroupCollection | None, groups: ParallelGroups | None,
                  config=None) -> dist.ProcessGroup | None:
    """`source_group`, None when it is this rank alone (Spartron layers take None for one rank)."""
    pg = source_group(name, pg_collection, groups, config)
    return pg if pg is not None and dist.get_world_size(pg) > 1 else None
