"""ParallelDims: parallel sizes, their validation, and pure rank-group math.

No torch.distributed here: a layout for thousands of ranks can be checked on a laptop.

Dense ranks are laid out ``dp_replicate x fsdp x cp``; expert ranks ``dp_replicate x expert_fsdp x ep``
where EP borrows from the ``fsdp x cp`` ranks (``expert_fsdp = fsdp * cp / ep``). With tp = pp = 1 the
groups are exactly megatron-core's for the same sizes and order string: the rank of a coordinate is
computed the way megatron's ``RankGenerator`` does it (the first name of ``order`` varies fastest),
Megatron's ``dp`` being ``dp_replicate x fsdp`` with ``fsdp`` the inner (faster) part.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

MEGATRON_ORDER_NAMES = ("tp", "cp", "ep", "dp", "pp")

# Group name -> (mesh, the mesh dims that vary inside one group).
DENSE_DIMS = ("dp_replicate", "fsdp", "cp")
EXPERT_DIMS = ("dp_replicate", "expert_fsdp", "ep")
GROUP_DIMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "world": ("dense", DENSE_DIMS),
    "cp": ("dense", ("cp",)),
    "fsdp": ("dense", ("fsdp",)),
    "dp_replicate": ("dense", ("dp_replicate",)),
    "dp": ("dense", ("dp_replicate", "fsdp")),
    "fsdp_cp": ("dense", ("fsdp", "cp")),
    "dp_cp": ("dense", DENSE_DIMS),
    "ep": ("expert", ("ep",)),
    "expert_fsdp": ("expert", ("expert_fsdp",)),
    "expert_dp": ("expert", ("dp_replicate", "expert_fsdp")),
}


class ParallelDimsError(ValueError):
    """A parallel layout that cannot work; the message says which product failed and why."""


def check_order(order: object, key: str = "order") -> None:
    """THE rule for a rank order (ParallelDims and the run config's `parallel.order` both use it)."""
    tokens = order.split("-") if isinstance(order, str) else None
    if tokens is None or sorted(tokens) != sorted(MEGATRON_ORDER_NAMES):
        raise ParallelDimsError(f"{key} must be a '-'-joined permutation of {'-'.join(MEGATRON_ORDER_NAMES)} "
                                f"(megatron-core's names), got {order!r}")


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    fsdp: int
    cp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    order: str = "tp-cp-ep-dp-pp"

    def __post_init__(self) -> None:
        for name in ("world_size", "fsdp", "cp", "ep", "dp_replicate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ParallelDimsError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ParallelDimsError(f"{name} must be >= 1, got {value}")
        check_order(self.order)
        dense = self.dp_replicate * self.fsdp * self.cp
        if dense != self.world_size:
            raise ParallelDimsError(
                f"dp_replicate * fsdp * cp = {self.dp_replicate} * {self.fsdp} * {self.cp} = {dense} "
                f"must equal world_size {self.world_size}"
            )
        if (self.fsdp * self.cp) % self.ep != 0:
            raise ParallelDimsError(
                f"ep {self.ep} must divide fsdp * cp = {self.fsdp} * {self.cp} = {self.fsdp * self.cp} "
                "(expert parallelism borrows ranks from the fsdp x cp ranks)"
            )

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Megatron's data-parallel size: replicas times shards."""
        return self.dp_replicate * self.fsdp

    @property
    def expert_fsdp(self) -> int:
        return self.fsdp * self.cp // self.ep

    @property
    def expert_dp(self) -> int:
        return self.dp_replicate * self.expert_fsdp

    def sizes(self, mesh: str) -> dict[str, int]:
        names = DENSE_DIMS if mesh == "dense" else EXPERT_DIMS
        return {name: getattr(self, name) for name in names}

    # ---- rank math ----------------------------------------------------------------------
    def _rank_of(self, mesh: str, coord: dict[str, int]) -> int:
        """Global rank of a mesh coordinate, laid out like megatron's RankGenerator."""
        if mesh == "dense":
            megatron = {"tp": (0, 1), "pp": (0, 1), "ep": (0, 1), "cp": (coord["cp"], self.cp),
                        "dp": (coord["dp_replicate"] * self.fsdp + coord["fsdp"], self.dp)}
        else:
            megatron = {"tp": (0, 1), "pp": (0, 1), "cp": (0, 1), "ep": (coord["ep"], self.ep),
                        "dp": (coord["dp_replicate"] * self.expert_fsdp + coord["expert_fsdp"],
                               self.expert_dp)}
        rank, stride = 0, 1
        for name in self.order.split("-"):
            index, size = megatron[name]
            rank += index * stride
            stride *= size
        return rank

    def mesh_ranks(self, mesh: str) -> list:
        """Nested lists of global ranks shaped like the mesh (dense or expert), for DeviceMesh."""
        if mesh not in ("dense", "expert"):
            raise ParallelDimsError(f"mesh must be 'dense' or 'expert', got {mesh!r}")
        sizes = self.sizes(mesh)
        names = list(sizes)

        def build(prefix: dict[str, int], depth: int):
            if depth == len(names):
                return self._rank_of(mesh, prefix)
            return [build({**prefix, names[depth]: i}, depth + 1) for i in range(sizes[names[depth]])]

        return build({}, 0)

    def rank_groups(self, name: str) -> list[list[int]]:
        """The rank groups of one named dimension (sorted by their first rank, ranks in group order)."""
        if name not in GROUP_DIMS:
            raise ParallelDimsError(f"unknown group {name!r}; known: {', '.join(GROUP_DIMS)}")
        mesh, inner = GROUP_DIMS[name]
        sizes = self.sizes(mesh)
        outer = [n for n in sizes if n not in inner]
        groups = []
        for outer_idx in itertools.product(*(range(sizes[n]) for n in outer)):
            fixed = dict(zip(outer, outer_idx, strict=True))
            group = []
            # The group's ranks ordered with the LAST inner name fastest, like a flattened mesh.
            for inner_idx in itertools.product(*(range(sizes[n]) for n in inner)):
                group.append(self._rank_of(mesh, {**fixed, **dict(zip(inner, inner_idx, strict=True))}))
            groups.append(group)
        return sorted(groups, key=lambda g: g[0])

    def group_size(self, name: str) -> int:
        mesh, inner = GROUP_DIMS[name]
        return math.prod(self.sizes(mesh)[n] for n in inner)

    def describe(self) -> str:
        return (f"world {self.world_size} = dp_replicate {self.dp_replicate} x fsdp {self.fsdp} "
                f"x cp {self.cp}; "
                f"ep {self.ep} (expert_fsdp {self.expert_fsdp}); order {self.order}")
