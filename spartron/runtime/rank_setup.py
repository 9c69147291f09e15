"""What a rank sets up before it trains or evaluates: its place in the launch (device, layout, groups) and
its model with the optimizer and the EP keywords of the saved state. The Trainer and `spartron eval`
(spartron.runtime.saved_eval) build both the same way, here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from spartron.layers.config import master_layout_refusal
from spartron.parallel.dims import ParallelDims
from spartron.parallel.groups import ParallelGroups
from spartron.runtime.config import ConfigError, RunConfig
from spartron.runtime.master_weights import attach_master_weights
from spartron.runtime.optim import build_optimizer
from spartron.runtime.state_layout import expert_mesh

ModelFactory = Callable[[RunConfig, ParallelGroups], nn.Module]


@runtime_checkable
class ExpertParallelModel(Protocol):
    def ep_sharded_parameters(self) -> Iterable[nn.Parameter]:
        """Parameters whose tensors hold only this EP rank's experts without saying so in a DTensor
        placement (their squared norms are summed over the EP group for clipping; they are saved as
        global tensors over the expert mesh, spartron.runtime.state_layout). Required with parallel.ep > 1."""


@runtime_checkable
class ClosableModel(Protocol):
    def close(self) -> object:
        """Release communication buffers: a collective, called on every rank when a run ends well."""


def default_model_factory(cfg: RunConfig, groups: ParallelGroups) -> nn.Module:
    """The reference model of spartron.layers.model, built on the meta device, parallelised there (AC,
    compile, FSDP2 with model.dtype as compute dtype over model.master_dtype masters, gradients reduced
    in model.reduce_dtype) and materialised shard by shard on the current default device: no rank
    holds more than its shards and one parameter's temporary. Under model.master_weights = "optimizer" no
    FSDP2 on one rank: fp32 parameters, which RankModel.build turns into bf16 ones with fp32 masters."""
    from spartron.layers.init import materialize_
    from spartron.layers.model import build_model
    from spartron.layers.parallelize import parallelize

    t, m = cfg.train, cfg.model
    model = build_model(m, groups, seed=t.seed, micro_batches=t.intra_layer_micro_batches,
                        micro_batch_scope=t.intra_layer_micro_batch_scope, device="meta")
    model = parallelize(model, groups, cfg.ac, compile_backend=t.compile_backend if t.compile else None,
                        param_dtype=getattr(torch, m.dtype) if m.master_dtype and m.master_weights == "fsdp" else None,
                        reduce_dtype=getattr(torch, m.reduce_dtype), fp8=m.fp8)
    return materialize_(model, torch.get_default_device(), t.seed, m.init_std)


def resolve_device(cfg: RunConfig) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' requested but torch.cuda.is_available() is False "
                          "(install a CUDA build of torch, or set device = 'cpu')")
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def init_process_group(cfg: RunConfig) -> bool:
    """Initialise torch.distributed from the launcher's environment unless already done; True if we did."""
    if dist.is_initialized():
        return False
    from spartron.parallel.env import discover, init_distributed

    init_distributed(discover(), cfg.parallel.backend, cfg.parallel.timeout_s)
    return True


@dataclass(frozen=True)
class RankPlace:
    """This rank in the launch: its device, rank and world, the layout, micro-batches per step, groups."""

    device: torch.device
    rank: int
    world: int
    dims: ParallelDims
    n_micro: int
    groups: ParallelGroups

    @classmethod
    def of(cls, cfg: RunConfig) -> RankPlace:
        """The layout and the batch split are checked (ConfigError) before the groups, the first collective."""
        device, rank, world = resolve_device(cfg), dist.get_rank(), dist.get_world_size()
        p = cfg.parallel
        dims = p.dims(world)
        n_micro = cfg.train.micro_steps(dims.dp)
        groups = ParallelGroups.build(dims, device.type, timeout=timedelta(seconds=p.timeout_s),
                                      nccl=p.nccl_settings())
        return cls(device, rank, world, dims, n_micro, groups)


@dataclass
class RankModel:
    """The model on this rank, its optimizer, and what the EP-sharded parameters add (clip norm groups;
    save_state / load_state's EP keywords)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    ep_extra: dict[int, tuple]
    ep_state: dict

    @classmethod
    def build(cls, cfg: RunConfig, place: RankPlace, factory: ModelFactory) -> RankModel:
        # The reference model's init depends on train.seed and names only (spartron.layers.init); this is
        # for custom factories that draw from the global RNG: the same state on every rank.
        torch.manual_seed(cfg.train.seed)
        refusal = master_layout_refusal(cfg.model.master_weights, place.world)
        if refusal:
            raise ConfigError(refusal)
        with place.device:
            model = factory(cfg, place.groups)
        if cfg.model.master_weights == "optimizer":  # fp32 parameters become bf16 with fp32 masters
            attach_master_weights(model, getattr(torch, cfg.model.dtype))
        ep_extra, ep_state = _ep_state(model, place)
        return cls(model, build_optimizer(model, cfg.train), ep_extra, ep_state)


def _ep_state(model: nn.Module, place: RankPlace) -> tuple[dict, dict]:
    groups = place.groups
    if groups.size("ep") == 1:
        ep_extra = {}
    elif not isinstance(model, ExpertParallelModel):
        raise ConfigError(f"parallel.ep = {groups.size('ep')}: {type(model).__name__} has no "
                          "ep_sharded_parameters() saying which parameters hold only this rank's experts")
    else:
        ep_extra = {id(p): (groups.ep,) for p in model.ep_sharded_parameters()}
    # Every EP rank holds different experts under the same names: saved as global tensors over ep_mesh.
    ep_state = {"ep_sharded": [n for n, q in model.named_parameters() if id(q) in ep_extra],
                "ep_rank": groups.rank_in("ep"), "layout": place.dims.describe(), "ep_mesh": expert_mesh(groups)}
    return ep_extra, ep_state
