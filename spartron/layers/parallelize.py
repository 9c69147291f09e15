"""parallelize(model, groups, ac): checkpoint regions INSIDE FSDP2, per block, then the root.

Order matters and is fixed here, in one place:
1. activation checkpointing wraps every `freq`-th block's forward (a checkpoint region);
2. optional torch.compile per block, fullgraph (`compile_block`): a checkpointed block compiles its
   region, with the operator policy as torch's selective-checkpoint policy (non-reentrant regions
   only: the config rejects compile with reentrant ones), any other block its forward; under FSDP2
   the experts' forward hooks then move to their block (`_hoist_experts_hooks`), outside the graph;
3. FSDP2 with the precision policy (compute and reduction dtypes): the routed experts of each
   block on the expert mesh (with the gradient divided by the full data x context world, since
   every rank's tokens reach an expert through all-to-all), then the block on the dense mesh — its
   hooks run OUTSIDE the region, so a replay never re-runs a block's all-gather — then the root
   (embeddings, final norm, head);
4. explicit backward prefetch: the root prefetches the last block and its experts before backward
   replay starts, then each block prefetches the block before it.

What it needs from a model is the `ParallelizableModel` protocol: its blocks in call order, each with
its routed experts and whether it runs several times per step. It never looks inside the model.

The AC class swap (apply_activation_checkpointing) is the one outside hook on the blocks: the way
FSDP2's fully_shard swaps classes, it keeps parameter names and state_dict keys and leaves FSDP's
hooks outside the region, which a wrapper module could not do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from spartron.checkpointing import apply_ac_to_blocks, compile_block
from spartron.checkpointing.config import ACConfig
from spartron.comm.mirror import is_mirrored
from spartron.layers.config import FP8Config
from spartron.layers.fp8 import apply_fp8
from spartron.layers.fp8.apply import check_param_gather
from spartron.layers.fp8.param_gather import install as install_param_gather
from spartron.parallel.groups import ParallelGroups


@dataclass(frozen=True)
class Block:
    """One block of a model as parallelize sees it: a checkpoint region, compile and FSDP unit."""

    name: str
    module: nn.Module
    experts: nn.Module | None = None  # its routed experts (EP-sharded: FSDP over the expert mesh)
    reused: bool = False  # runs several times per step (a weight-shared MTP block)
    layer: int | None = None  # its index in the main decoder stack (None: an MTP module)


@runtime_checkable
class ParallelizableModel(Protocol):
    """What parallelize relies on (the reference SparseMoEModel implements it)."""

    def blocks(self) -> list[Block]:
        """Every block in call order (main stack, then MTP)."""


def apply_ac(model: ParallelizableModel, ac: ACConfig) -> list[str]:
    """Wrap every `freq`-th block in a checkpoint region; returns the wrapped blocks' names.

    A block that runs several times per step (the weight-shared MTP block) gets a non-reentrant
    region: with a reentrant region, FSDP2 (torch 2.13) leaves the block's separately sharded experts
    unsharded after backward, with the gradient of one of the calls never reduce-scattered (see
    tests/layers/test_model.py parity tests, which caught it).
    """
    blocks = model.blocks()
    return apply_ac_to_blocks({b.name: b.module for b in blocks}, ac,
                              non_reentrant=[b.module for b in blocks if b.reused])


def expert_shard_dim(shape: tuple[int, ...] | torch.Size, shards: int) -> int:
    """The dim FSDP2 shards a routed-expert weight [local experts, out, in] on over `shards` expert_fsdp
    ranks: 0 (whole experts per rank) when the local experts split evenly, else dim 1 when it does (4
    experts over 16 ranks would leave 12 ranks without a shard and the other 4 padded), else 0."""
    if shape[0] % shards and len(shape) > 1 and shape[1] % shards == 0:
        return 1
    return 0


def apply_fsdp(model: nn.Module, blocks: list[Block], groups: ParallelGroups, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2 over the dense and expert meshes. `param_dtype`: the dtype parameters are all-gathered and
    computed in (None: their stored dtype); gradients are reduce-scattered in `reduce_dtype` and kept
    in the stored dtype (fp32 masters get fp32 gradients)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    grad_world = groups.size("dp_cp")
    # gloo has no PREMUL_SUM, and the mirrored group of a rehearsal cannot read its factor on torch 2.11
    sum_only = dist.get_backend(groups.world) == "gloo" or is_mirrored(groups.world)
    shards = groups.size("expert_fsdp")
    for block in blocks:
        if block.experts is not None:
            fully_shard(block.experts, mesh=groups.expert_fsdp_mesh, reshard_after_forward=True,
                        shard_placement_fn=lambda p: Shard(expert_shard_dim(p.shape, shards)), **kw)
            block.experts.set_gradient_divide_factor(float(grad_world))
            # Without PREMUL_SUM: reduce with SUM, then divide by the factor. Not with a 1-rank shard
            # group: there FSDP2 (torch 2.13) already divides while copying and would divide twice.
            if sum_only and groups.size("expert_fsdp") > 1:
                block.experts.set_force_sum_reduction_for_comms(True)
            _range_fsdp_pre_forward(block.experts)
        fully_shard(block.module, mesh=groups.fsdp_mesh, reshard_after_forward=True, **kw)
    # Embeddings, final norm and head stay with the root: the loss reads the head weight directly
    # (chunked cross-entropy, tied embeddings), so it must be unsharded for the whole forward.
    fully_shard(model, mesh=groups.fsdp_mesh, **kw)
    # Backward prefetch: the root prefetches the last block and its experts before backward replay
    # starts; each block then prefetches the block before it. (Prefetching a previous block's experts
    # from a block that runs several times per step, the shared MTP block, corrupted its expert
    # gradients in torch 2.13's FSDP2, so experts are only prefetched from the root.)
    if blocks:
        last = blocks[-1]
        model.set_modules_to_backward_prefetch([last.module] + ([last.experts] if last.experts is not None else []))
    for later, earlier in zip(blocks[:0:-1], blocks[-2::-1], strict=True):
        later.module.set_modules_to_backward_prefetch([earlier.module])


def _hoist_experts_hooks(block: Block) -> None:
    """A compiled MoE block: FSDP2's forward hooks of its separately sharded experts move from the
    experts to the block, outside the compiled graph (dynamo cannot trace them: FSDP2 marks them
    dynamo-disabled, a graph break, and a compiled checkpoint region cannot hold one). The experts are
    then unsharded before the block runs and resharded after it, their pre-backward unshard fires on
    the block's output gradients and their post-backward reduce-scatter after the block's backward:
    the block's compiled backward is one autograd node, so the experts' own hooks could not run
    inside it anyway."""
    _move_fsdp_forward_hooks(block.experts, block.module)


def _move_fsdp_forward_hooks(sharded: nn.Module, onto: nn.Module) -> None:
    """Move the forward pre/post hooks that `fully_shard(sharded)` registered onto module `onto`.

    FSDP2's private state, on purpose: no public FSDP2 API does this. `FSDPModule.unshard()` /
    `reshard()` all-gather and free, but the pre-forward hook also registers the pre- and
    post-backward hooks (the backward unshard, the gradient reduce-scatter), which have no public
    entry; `register_fsdp_forward_method` hooks another method of the same module, not another
    module; and the hook handles exist only on the state. The names used here are the same in
    torch 2.11 and 2.13; a torch that lays them out otherwise fails here, naming the setting."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(sharded)
    try:
        handles = state._pre_forward_hook_handle, state._post_forward_hook_handle
        pre_forward, post_forward = state._pre_forward, state._post_forward
    except AttributeError as err:
        raise RuntimeError(f"train.compile under FSDP2 with separately sharded experts moves FSDP2's forward hooks "
                           f"of the experts to their block, but torch {torch.__version__}'s FSDP2 state has no "
                           f"{err.name!r}: set train.compile = false") from err
    for handle in handles:
        handle.remove()
    onto.register_forward_pre_hook(pre_forward, with_kwargs=True)
    onto.register_forward_hook(post_forward)


def _range_fsdp_pre_forward(module: nn.Module) -> None:
    """FSDP2's pre-forward hook of a module inside a checkpoint region, in one "FSDP::" profiler range:
    the region's replay check leaves FSDP's ops out of the op sequence by those ranges, and FSDP2's
    unshard on a 1-rank shard group (the copy into the unsharded parameter, in backward) has none."""
    open_ranges = []

    def enter(m: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():  # no eager replay check inside a compiled region
            return
        r = torch.profiler.record_function("FSDP::pre_forward (inside a checkpoint region)")
        r.__enter__()
        open_ranges.append(r)

    def leave(m: nn.Module, args: tuple) -> None:
        if not torch.compiler.is_compiling():
            open_ranges.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter, prepend=True)  # before FSDP2's own (prepended) hook
    module.register_forward_pre_hook(leave)


def fp8_blocks(blocks: list[Block], fp8: FP8Config) -> list[nn.Module]:
    """The blocks model.fp8 converts: the MTP modules and every decoder layer but the first / last it keeps in
    bf16 (FP8Config.runs_fp8)."""
    n_layers = sum(b.layer is not None for b in blocks)
    return [b.module for b in blocks if b.layer is None or fp8.runs_fp8(b.layer, n_layers)]


def parallelize(model: nn.Module, groups: ParallelGroups | None, ac: ACConfig,
                compile_backend: str | None = None, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype = torch.float32, fp8: FP8Config | None = None) -> nn.Module:
    """Apply FP8 compute (model.fp8: spartron.layers.fp8.apply_fp8), AC, compile (when `compile_backend`
    is given: train.compile) and FSDP2 to a ParallelizableModel; returns the same model. FSDP2 runs when
    `groups` span more than one rank, or
    when `param_dtype` (the compute dtype, model.dtype under model.master_dtype with model.master_weights =
    "fsdp") is given: the cast of the sharded masters to it is FSDP's, so it applies on one rank too. Under
    model.master_weights = "optimizer" no param_dtype is given: one rank runs without FSDP2 and the
    optimizer holds the masters (spartron.runtime.master_weights). Works on a model built on the
    meta device (spartron.layers.init.materialize_ gives it storage afterwards). With model.fp8.param_gather the
    FP8-run weights are all-gathered as E4M3 (spartron.layers.fp8.param_gather): the caller runs
    spartron.layers.fp8.invalidate_weight_caches(model) once the weights have their values, before the first
    forward, as after every optimizer step and load."""
    if not isinstance(model, ParallelizableModel):
        raise TypeError(f"parallelize needs a model with blocks() (ParallelizableModel); "
                        f"{type(model).__name__} has none")
    if fp8 is not None and fp8.param_gather:
        check_param_gather(compile_backend is not None, groups.fsdp_mesh.shape[-1] if groups is not None else 1)
    if fp8 is not None:
        apply_fp8(fp8_blocks(model.blocks(), fp8), fp8, compiled=compile_backend is not None,
                  expert_shards=groups.size("expert_fsdp") if groups is not None else 1)
    apply_ac(model, ac)
    blocks = model.blocks()
    if compile_backend is not None:
        shared: dict = {}  # the blocks share compiled callables: one dynamo cache, not one per layer
        for block in blocks:  # in place: parameter names and state_dict keys stay the same
            compile_block(block.module, compile_backend, fullgraph=True, shared=shared)
    if param_dtype is not None and groups is None:
        raise ValueError("parallelize: a compute dtype (param_dtype) needs FSDP2, so it needs the groups "
                         "(ParallelGroups of the world, one rank included)")
    if groups is not None and (groups.size("world") > 1 or param_dtype is not None):
        apply_fsdp(model, blocks, groups, param_dtype, reduce_dtype)
        if fp8 is not None and fp8.param_gather:  # FP8 all-gathers: the first refresh comes before the first forward
            install_param_gather(model)
        if compile_backend is not None:
            for block in blocks:
                if block.experts is not None:
                    _hoist_experts_hooks(block)
    return model
