"""train.stages relies on torch's private FSDP2 `FSDPParamGroup._init_mp_dtypes` (spartron.runtime.stages): pinned
here on this torch (a unit lazily initialised while frozen has no reduce dtype until it is re-derived), and a torch
without it is one clear error when a staged run starts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spartron.configbase import ConfigError
from spartron.runtime.stages import fsdp_dtype_refresher, refresh_fsdp_reduce_dtypes
from spartron.testing import run_distributed


def _frozen_then_trained(rank: int, world: int, refresh: bool) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)), mp_policy=policy)
    group = model._get_fsdp_state()._fsdp_param_group
    for p in model.parameters():
        p.requires_grad_(False)
    model(torch.randn(3, 4))  # lazy init while frozen (a warm-up stage): FSDP fixes the gradient dtypes now
    model.reshard()  # as after a step's backward: the stage change sees the sharded parameters
    for p in model.parameters():
        p.requires_grad_(True)
    seen = [(group._orig_dtype, group._reduce_dtype)]  # still the frozen unit's: torch never looks again
    if refresh:
        refresh_fsdp_reduce_dtypes(model)
    seen.append((group._orig_dtype, group._reduce_dtype))
    try:
        model(torch.randn(3, 4)).sum().backward()
        seen.append(tuple(p.grad.dtype for p in model.parameters()))
    except RuntimeError as err:
        seen.append(str(err).split(".")[0])
    return seen


def test_a_unit_frozen_at_lazy_init_gets_its_reduce_dtype_at_the_stage_change():
    assert run_distributed(_frozen_then_trained, 2, True)[0] == [(None, None), (torch.float32, torch.float32),
                                                                 (torch.float32,) * 4]
    # without the refresh this torch refuses the unit's gradients (why stages.py calls it)
    assert run_distributed(_frozen_then_trained, 2, False)[0] == [
        (None, None), (None, None),
        "attempting to assign a gradient with dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'"]


def test_a_torch_without_the_private_initialiser_is_one_clear_error(monkeypatch):
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    assert callable(fsdp_dtype_refresher())
    monkeypatch.delattr(FSDPParamGroup, "_init_mp_dtypes")
    with pytest.raises(ConfigError) as err:
        fsdp_dtype_refresher()
    assert str(err.value) == (  # the CLI prefixes `spartron: error: ` once
        f"train.stages: torch {torch.__version__}'s FSDP2 FSDPParamGroup has no _init_mp_dtypes, which the stages "
        "need to re-derive gradient dtypes at a stage change; run them on a torch that has it (2.13 is tested) or "
        "drop train.stages")
