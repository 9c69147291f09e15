"""ParallelGroups: the ProcessGroups and DeviceMeshes of one ParallelDims layout.

Every group is created here with ``new_group`` from the pure rank math of ``ParallelDims``, in one
deterministic order on every rank, and the DeviceMeshes are assembled from those groups with
``DeviceMesh.from_group``. Nothing goes through torch's mesh caches, so several ``ParallelGroups``
(different layouts, or the same layout twice) coexist in one process without sharing state.

Member order: torch sorts the ranks of a ``new_group``, so a group's local rank is the position of
the global rank in ascending order. Along every single mesh dimension this equals the mesh
coordinate (ranks grow with each coordinate). For the FSDP shard dimension, which flattens
(fsdp, cp), the FSDP meshes use the ascending order too, so a rank's shard index is its rank in
the shard ProcessGroup whatever the ``order`` string.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from spartron.parallel.dims import DENSE_DIMS, EXPERT_DIMS, GROUP_DIMS, ParallelDims

GROUP_NAMES: tuple[str, ...] = tuple(GROUP_DIMS)


class ParallelGroupsError(RuntimeError):
    """The process world does not match the requested layout (raised on every rank before any collective)."""


class _GroupFactory:
    """Creates each distinct rank set once per build (every rank calls new_group in the same order)."""

    def __init__(self, rank: int, world_size: int, timeout: timedelta | None) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.made: dict[tuple[int, ...], ProcessGroup | None] = {}

    def get(self, ranks: list[int], desc: str, nccl: Mapping[str, int] | None = None) -> ProcessGroup | None:
        """The group of exactly `ranks` (None on ranks outside it); identical rank sets share one group,
        except that a group with NCCL settings gets a communicator of its own (keyed by its name)."""
        members = tuple(sorted(ranks))
        key = members if nccl is None else (desc, members)
        if key not in self.made:
            if nccl is None and len(members) == self.world_size:
                pg = dist.group.WORLD
            else:
                kwargs: dict = {"timeout": self.timeout} if self.timeout is not None else {}
                if nccl is not None:
                    kwargs.update(backend="nccl", pg_options=_nccl_options(nccl, desc))
                pg = dist.new_group(ranks=list(members), group_desc=f"spartron_{desc}", **kwargs)
            self.made[key] = pg if self.rank in members else None
        return self.made[key]

    def mine(self, groups: list[list[int]], desc: str, required: bool = True,
             nccl: Mapping[str, int] | None = None) -> ProcessGroup | None:
        """Create every group of `groups`; return the one holding this rank (None allowed if not required)."""
        found = None
        for ranks in groups:
            pg = self.get(ranks, desc, nccl)
            if pg is not None:
                found = pg
        if found is None and required:
            raise ParallelGroupsError(f"rank {self.rank} is in no {desc} group (internal layout error)")
        return found


def _nccl_options(settings: Mapping[str, int], group: str) -> dist.ProcessGroupNCCL.Options:
    """ProcessGroupNCCL options carrying `settings` (ncclConfig_t fields such as max_ctas)."""
    options = dist.ProcessGroupNCCL.Options()
    for key, value in settings.items():
        if not hasattr(options.config, key):
            raise ParallelGroupsError(f"parallel.nccl.{group}.{key}: this torch's NCCL config has no such field")
        setattr(options.config, key, value)
    return options


def _slices(mesh: torch.Tensor, dim: int) -> list[list[int]]:
    """All 1-D slices of `mesh` along `dim`: the rank groups of that mesh dimension."""
    return mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim]).tolist()


def _mesh_from_tensor(factory: _GroupFactory, mesh: torch.Tensor, names: tuple[str, ...],
                      device_type: str, desc: str) -> DeviceMesh:
    """A DeviceMesh over `mesh` whose every dimension's groups come from `factory`."""
    pgs = [factory.mine(_slices(mesh, d), f"{desc}_{name}") for d, name in enumerate(names)]
    return DeviceMesh.from_group(pgs, device_type, mesh=mesh, mesh_dim_names=names)


def _fsdp_mesh(factory: _GroupFactory, replicas: list[list[int]],
               shard_name: str) -> tuple[list[list[int]], ProcessGroup | None, ProcessGroup | None]:
    """Rows of an FSDP mesh: one sorted shard group per replica; the columns are the replicate groups.

    The groups are None on ranks outside this mesh (the expert meshes: one per ep index).
    """
    rows = [sorted(r) for r in replicas]
    shard_pg = factory.mine(rows, shard_name, required=False)
    columns = [list(c) for c in zip(*rows, strict=True)]
    for col in columns:
        if col != sorted(col):
            raise ParallelGroupsError(f"{shard_name} replicas {rows} do not line up (internal layout error)")
    replicate_pg = factory.mine(columns, f"{shard_name}_replicate", required=False) if len(rows) > 1 else None
    return rows, shard_pg, replicate_pg


@dataclass(eq=False)
class ParallelGroups:
    """Named ProcessGroups and the DeviceMeshes of one layout; layers take the groups they need."""

    dims: ParallelDims
    device_type: str
    dense_mesh: DeviceMesh  # (dp_replicate, fsdp, cp)
    expert_mesh: DeviceMesh  # (dp_replicate, expert_fsdp, ep)
    fsdp_mesh: DeviceMesh  # dense params: 1-D (fsdp_cp,) or HSDP (dp_replicate, fsdp_cp)
    expert_fsdp_mesh: DeviceMesh  # expert params: 1-D (expert_fsdp,) or HSDP (dp_replicate, expert_fsdp)
    world: ProcessGroup
    cp: ProcessGroup
    fsdp: ProcessGroup
    dp_replicate: ProcessGroup
    dp: ProcessGroup
    fsdp_cp: ProcessGroup
    dp_cp: ProcessGroup
    ep: ProcessGroup
    expert_fsdp: ProcessGroup
    expert_dp: ProcessGroup
    _by_name: dict[str, ProcessGroup] = field(default_factory=dict, repr=False)
    _owned: list[ProcessGroup] = field(default_factory=list, repr=False)  # created here, this rank a member

    @classmethod
    def build(cls, dims: ParallelDims, device_type: str, timeout: timedelta | None = None,
              nccl: Mapping[str, Mapping[str, int]] | None = None) -> ParallelGroups:
        """Create every group and mesh of `dims`. Collective: all ranks call it with the same arguments.

        `nccl` maps group names to NCCL communicator settings (`ParallelConfig.nccl_settings()`); each
        such group gets its own communicator with them (CUDA only).
        """
        if not dist.is_available() or not dist.is_initialized():
            raise ParallelGroupsError("ParallelGroups.build needs torch.distributed initialized first "
                                      "(spartron.parallel.env.init_distributed)")
        world_size, rank = dist.get_world_size(), dist.get_rank()
        if world_size != dims.world_size:
            raise ParallelGroupsError(f"ParallelDims.world_size is {dims.world_size} but torch.distributed "
                                      f"has {world_size} ranks ({dims.describe()})")
        if device_type not in ("cpu", "cuda"):
            raise ParallelGroupsError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
        nccl = dict(nccl or {})
        unknown = sorted(set(nccl) - set(GROUP_NAMES))
        if unknown:
            raise ParallelGroupsError(f"parallel.nccl: unknown group {unknown[0]!r}; known: {', '.join(GROUP_NAMES)}")
        if nccl and (device_type != "cuda" or not dist.is_nccl_available()):
            raise ParallelGroupsError(f"parallel.nccl configures NCCL communicators, but this run's groups are "
                                      f"for {device_type!r} tensors" + ("" if dist.is_nccl_available() else
                                                                        " and this torch has no NCCL"))
        factory = _GroupFactory(rank, world_size, timeout)
        named = {name: factory.mine(dims.rank_groups(name), name, nccl=nccl.get(name)) for name in GROUP_NAMES}

        dense = torch.tensor(dims.mesh_ranks("dense"), dtype=torch.int)
        expert = torch.tensor(dims.mesh_ranks("expert"), dtype=torch.int)
        dense_mesh = _mesh_from_tensor(factory, dense, DENSE_DIMS, device_type, "dense")
        expert_mesh = _mesh_from_tensor(factory, expert, EXPERT_DIMS, device_type, "expert")

        # Dense params: shard over fsdp x cp (each replica), replicate over dp_replicate.
        rows, shard_pg, rep_pg = _fsdp_mesh(factory, dense.reshape(dims.dp_replicate, -1).tolist(),
                                            "fsdp_cp")
        fsdp_mesh = cls._fsdp_device_mesh(rows, shard_pg, rep_pg, device_type, "fsdp_cp")
        # Expert params: shard over expert_fsdp, replicate over dp_replicate; one mesh per ep index.
        expert_fsdp_mesh = None
        for e in range(dims.ep):
            rows, shard_pg, rep_pg = _fsdp_mesh(factory, expert[:, :, e].tolist(), "expert_fsdp")
            if shard_pg is not None:
                expert_fsdp_mesh = cls._fsdp_device_mesh(rows, shard_pg, rep_pg, device_type, "expert_fsdp")
        assert expert_fsdp_mesh is not None
        owned = [pg for pg in factory.made.values() if pg is not None and pg is not dist.group.WORLD]
        return cls(dims=dims, device_type=device_type, dense_mesh=dense_mesh, expert_mesh=expert_mesh,
                   fsdp_mesh=fsdp_mesh, expert_fsdp_mesh=expert_fsdp_mesh, _by_name=named, _owned=owned,
                   **named)

    @staticmethod
    def _fsdp_device_mesh(rows: list[list[int]], shard_pg: ProcessGroup, replicate_pg: ProcessGroup | None,
                          device_type: str, shard_name: str) -> DeviceMesh:
        if replicate_pg is None:
            return DeviceMesh.from_group(shard_pg, device_type, mesh=rows[0], mesh_dim_names=(shard_name,))
        mesh = torch.tensor(rows, dtype=torch.int)
        return DeviceMesh.from_group([replicate_pg, shard_pg], device_type, mesh=mesh,
                                     mesh_dim_names=("dp_replicate", shard_name))

    def destroy(self) -> None:
        """Destroy the groups this build created (not the default group); other builds keep working."""
        for pg in self._owned:
            dist.destroy_process_group(pg)
        self._owned.clear()

    # ---- lookups ---------------------------------------------------------------------------
    def group(self, name: str) -> ProcessGroup:
        if name not in self._by_name:
            raise KeyError(f"unknown group {name!r}; known: {', '.join(GROUP_NAMES)}")
        return self._by_name[name]

    def group_ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's `name` group, in group-rank order (ascending)."""
        return dist.get_process_group_ranks(self.group(name))

    def rank_in(self, name: str) -> int:
        return dist.get_rank(self.group(name))

    def size(self, name: str) -> int:
        return dist.get_world_size(self.group(name))
