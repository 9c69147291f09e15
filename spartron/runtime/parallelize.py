"""parallelize(model, groups, cfg): checkpoint regions INSIDE FSDP2, per block, then the root.

Order matters and is fixed here, in one place:
1. activation checkpointing wraps every `freq`-th decoder block's forward (a checkpoint region);
2. optional torch.compile per block, only without checkpoint regions (the config rejects compile
   with ac.mode != 'none': the operator policy is a TorchDispatchMode that dynamo cannot trace, so
   regions stay eager, as seed 000 keeps dense checkpoint boundaries outside compiled graphs);
3. FSDP2: the routed experts of each MoE block on the expert mesh (with the gradient divided by the
   full data x context world, since every rank's tokens reach an expert through all-to-all), then
   the block on the dense mesh — its hooks run OUTSIDE the region, so a replay never re-runs a block's
   all-gather — then the root (embeddings, final norm, head);
4. explicit backward prefetch: the root prefetches the last block and its experts before backward
   replay starts, then each block prefetches the block before it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from spartron.checkpointing import apply_activation_checkpointing
from spartron.checkpointing.config import ACConfig


def checkpointed_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, block) for every decoder block, main stack then MTP, in call order."""
    blocks = [(model.layers, name, layer) for name, layer in model.layers.items()]
    if getattr(model, "mtp", None) is not None:
        blocks += [(block, "layer", block.layer) for block in model.mtp.blocks]
    return blocks


def apply_ac(model: nn.Module, ac: ACConfig) -> None:
    """Wrap every `freq`-th block (main stack, then MTP) in a checkpoint region.

    A weight-shared MTP block runs `depth` times per step. Its region is non-reentrant: with a
    reentrant region, FSDP2 (torch 2.13) leaves the block's separately sharded experts unsharded
    after backward, with the gradient of one of the calls never reduce-scattered (see
    tests/layers/test_model.py parity tests, which caught it).
    """
    if ac.mode == "none":
        return
    reused = shared_mtp_block(model)
    for i, (parent, name, block) in enumerate(checkpointed_blocks(model)):
        if i % ac.freq == 0:
            cfg = ac.model_copy(update={"reentrant": False}) if parent is reused else ac
            wrapped = apply_activation_checkpointing(block, cfg)
            if wrapped is not block:
                setattr(parent, name, wrapped)


def shared_mtp_block(model: nn.Module) -> nn.Module | None:
    """The MTP block that serves several depths (share_weights), else None."""
    mtp = getattr(model, "mtp", None)
    return mtp.blocks[0] if mtp is not None and mtp.depth > len(mtp.blocks) else None


def apply_fsdp(model: nn.Module, groups) -> None:
    """FSDP2 over the dense and expert meshes; gradients are reduced in float32 whatever the param dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float32)}
    grad_world = groups.size("dp_cp")
    sum_only = dist.get_backend(groups.world) == "gloo"
    sharded_blocks = []
    for _, _, block in checkpointed_blocks(model):
        experts = getattr(getattr(block, "ffn", None), "experts", None)
        if experts is not None:
            fully_shard(experts, mesh=groups.expert_fsdp_mesh, reshard_after_forward=True, **kw)
            experts.set_gradient_divide_factor(float(grad_world))
            # gloo has no PREMUL_SUM: reduce with SUM, then divide by the factor. Not with a 1-rank shard
            # group: there FSDP2 (torch 2.13) already divides while copying and would divide twice.
            if sum_only and groups.size("expert_fsdp") > 1:
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=groups.fsdp_mesh, reshard_after_forward=True, **kw)
        sharded_blocks.append((block, experts))
    # Embeddings, final norm and head stay with the root: the loss reads the head weight directly
    # (chunked cross-entropy, tied embeddings), so it must be unsharded for the whole forward.
    fully_shard(model, mesh=groups.fsdp_mesh, **kw)
    # Backward prefetch: the root prefetches the last block and its experts before backward replay
    # starts; each block then prefetches the block before it. (Prefetching a previous block's experts
    # from a block that runs several times per step, the shared MTP block, corrupted its expert
    # gradients in torch 2.13's FSDP2, so experts are only prefetched from the root.)
    if sharded_blocks:
        last_block, last_experts = sharded_blocks[-1]
        model.set_modules_to_backward_prefetch([last_block] + ([last_experts] if last_experts is not None else []))
    for i in range(len(sharded_blocks) - 1, 0, -1):
        sharded_blocks[i][0].set_modules_to_backward_prefetch([sharded_blocks[i - 1][0]])


def parallelize(model: nn.Module, groups, cfg) -> nn.Module:
    """Apply AC, compile and FSDP2 per the run config; returns the (same) model."""
    apply_ac(model, cfg.ac)
    wire_micro_batching(model, cfg)
    if cfg.train.compile:
        for _, _, block in checkpointed_blocks(model):
            # In place: parameter names and state_dict keys stay the same. Not fullgraph: the MoE
            # dispatcher's host-side split sizes break the graph by design (documented in moe/dispatch.py).
            block.compile(fullgraph=False, backend=cfg.train.compile_backend)
    if groups is not None and groups.size("world") > 1:
        apply_fsdp(model, groups)
    return model


def wire_micro_batching(model: nn.Module, cfg) -> None:
    """[train] intra_layer_micro_batches -> the model (owned by checkpointing/microbatch.py). Offload
    windows need no wiring here: the trainer builds an ActivationOffloader over the model's regions."""
    from spartron.checkpointing.microbatch import set_intra_layer_micro_batches

    set_intra_layer_micro_batches(model, cfg)
