"""spartron.parallel: who talks to whom (the lowest floor).

`ParallelDims` (sizes, validation, pure rank-group math equal to megatron-core's for tp = pp = 1),
`ParallelGroups` (DeviceMeshes and named ProcessGroups built from the dims), and the launcher
environment (`discover`, `init_distributed`, `destroy_distributed`: torchrun and Slurm).
"""

from spartron.parallel.dims import GROUP_DIMS, MEGATRON_ORDER_NAMES, ParallelDims, ParallelDimsError, check_order
from spartron.parallel.env import DistEnv, DistEnvError, destroy_distributed, discover, init_distributed
from spartron.parallel.groups import GROUP_NAMES, ParallelGroups, ParallelGroupsError

__all__ = [
    "GROUP_DIMS", "GROUP_NAMES", "MEGATRON_ORDER_NAMES", "DistEnv", "DistEnvError", "ParallelDims",
    "ParallelDimsError", "ParallelGroups", "ParallelGroupsError", "check_order", "destroy_distributed", "discover",
    "init_distributed",
]
