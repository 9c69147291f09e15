"""Layout-free names for a saved state: expert-parallel parameters as slices of global tensors.

Each EP rank holds different routed experts under the same parameter name ([E_local, ...] stacked on
dim 0, local expert i being global expert ``ep_rank * E_local + i``), and FSDP2's DTensor of such a
parameter only describes its split over expert_fsdp. Saved as it is, DCP would see one tensor and keep
one EP rank's copy. So for the save and the load, every EP-sharded tensor (parameter and the optimizer
states of its shape) is wrapped in a DTensor over an (ep, expert_fsdp) mesh, placements
(Shard(0), FSDP2's own placement over expert_fsdp): its global shape is [n_routed_experts, ...] and its
offset the global expert index of its first expert. DCP then writes every expert once under the plain
name and reads back, on any other layout, the rows each rank now owns (resharding). The wrapper shares
the local tensor's storage, so what DCP loads lands in the model's shard.

Dense parameters need nothing: their FSDP2 DTensors are already global (sharded over fsdp x cp).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from spartron.runtime.rundir import StateLoadError


def expert_mesh(groups: Any) -> DeviceMesh | None:
    """The (ep, expert_fsdp) mesh of this rank's replica (groups: ParallelGroups); None without EP."""
    if groups.dims.ep == 1:
        return None
    mesh = groups.expert_mesh.mesh  # (dp_replicate, expert_fsdp, ep)
    replica = next(i for i in range(mesh.shape[0]) if (mesh[i] == dist.get_rank()).any())
    return DeviceMesh.from_group([groups.ep, groups.expert_fsdp], groups.device_type,
                                 mesh=mesh[replica].T.contiguous(), mesh_dim_names=("ep", "expert_fsdp"))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _wrap(t: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    per_rank = list(t.shape)  # an FSDP2 DTensor's shape is this EP rank's [E_local, ...]
    shape = torch.Size([per_rank[0] * mesh.size(0), *per_rank[1:]])
    # FSDP2's split over expert_fsdp is its DTensor's last placement: Shard(0), or Shard(1) when the local
    # experts do not split evenly (spartron.layers.parallelize.expert_shard_dim)
    inner = t.placements[-1] if isinstance(t, DTensor) else Replicate()
    return DTensor.from_local(_local(t), mesh, [Shard(0), inner], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def globalize(model_sd: dict, optim_sd: dict, ep_sharded: Collection[str], mesh: DeviceMesh | None) -> dict:
    """In place: EP-sharded entries become global DTensors over `mesh`; returns what `restore` puts back."""
    originals: dict = {}
    if mesh is None:
        if ep_sharded:  # each EP rank would write its own experts under one global name: a corrupt state
            raise ValueError("EP-sharded parameters need their expert mesh to be saved "
                             "(ep_mesh = spartron.runtime.state_layout.expert_mesh(groups))")
        return originals
    for fqn in ep_sharded:
        if fqn not in model_sd:
            raise StateLoadError(f"EP-sharded parameter {fqn!r} is not in the model's state dict")
        param = model_sd[fqn]
        originals[("model", fqn)] = param
        model_sd[fqn] = _wrap(param, mesh)
        for key, value in optim_sd["state"].get(fqn, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0:
                originals[("optim", fqn, key)] = value
                optim_sd["state"][fqn][key] = _wrap(value, mesh)
    return originals


def restore(model_sd: dict, optim_sd: dict, originals: dict) -> None:
    """Undo `globalize` (the loaded values are already in the original tensors: shared storage)."""
    for where, value in originals.items():
        if where[0] == "model":
            model_sd[where[1]] = value
        elif where[1] in optim_sd["state"]:
            optim_sd["state"][where[1]][where[2]] = value


def resplit_data_position(saved: dict, dp_rank: int, dp_size: int, where: str) -> dict:
    """A loader state (TokenLoader.state_dict) saved under another dp layout, for `dp_rank` of `dp_size`:
    the GLOBAL samples consumed (every dp rank reads the same count per step: position x saved dp_size)
    re-split over the new ranks; its other keys are kept. Dp rank r reads global samples r, r + dp, ...,
    so every step still reads the same global block of samples."""
    try:
        consumed = int(saved["position"]) * int(saved["dp_size"])
    except (KeyError, TypeError, ValueError) as err:
        raise StateLoadError(f"{where}: its data position does not fit this run ({err})") from None
    if consumed % dp_size:
        raise StateLoadError(f"{where}: {consumed} samples were consumed, which {dp_size} data-parallel ranks "
                             "cannot split evenly (train.global_batch_size must divide over the new layout)")
    return {**saved, "position": consumed // dp_size, "dp_rank": dp_rank, "dp_size": dp_size}
