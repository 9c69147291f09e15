"""parallelize(model, groups, cfg): checkpoint regions INSIDE FSDP2, per block, then the root.

Order matters and is fixed here, in one place:
1. activation checkpointing wraps every `freq`-th decoder block's forward (a checkpoint region);
2. optional torch.compile per block (the region is inside the compiled module's forward);
3. FSDP2: the routed experts of each MoE block on the expert mesh (with the gradient divided by the
   full data x context world, since every rank's tokens reach an expert through all-to-all), then
   the block on the dense mesh — its hooks run OUTSIDE the region, so a replay never re-runs a block's
   all-gather — then embeddings/head/MTP and the root;
4. explicit backward prefetch: in reverse order each block prefetches the block before it, and the
   last block's experts are prefetched with it before backward replay starts.
"""

from __future__ import annotations

import torch
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
    if ac.mode == "none":
        return
    for i, (parent, name, block) in enumerate(checkpointed_blocks(model)):
        if i % ac.freq == 0:
            wrapped = apply_activation_checkpointing(block, ac)
            if wrapped is not block:
                setattr(parent, name, wrapped)


def apply_fsdp(model: nn.Module, groups, param_dtype: torch.dtype | None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kw = {"mp_policy": mp} if mp is not None else {}
    grad_world = groups.size("dp_cp")
    sharded_blocks = []
    for _, _, block in checkpointed_blocks(model):
        experts = getattr(getattr(block, "ffn", None), "experts", None)
        if experts is not None:
            fully_shard(experts, mesh=groups.expert_fsdp_mesh, reshard_after_forward=True, **kw)
            experts.set_gradient_divide_factor(float(grad_world))
        fully_shard(block, mesh=groups.fsdp_mesh, reshard_after_forward=True, **kw)
        sharded_blocks.append((block, experts))
    for name in ("embed", "head"):
        mod = getattr(model, name, None)
        if mod is not None:
            fully_shard(mod, mesh=groups.fsdp_mesh, **kw)
    fully_shard(model, mesh=groups.fsdp_mesh, **kw)
    # Backward prefetch: each block (and its experts) prefetches the previous one.
    for i in range(len(sharded_blocks) - 1, 0, -1):
        prev_block, prev_experts = sharded_blocks[i - 1]
        targets = [prev_block] + ([prev_experts] if prev_experts is not None else [])
        sharded_blocks[i][0].set_modules_to_backward_prefetch(targets)


def parallelize(model: nn.Module, groups, cfg) -> nn.Module:
    """Apply AC, compile and FSDP2 per the run config; returns the (same) model."""
    apply_ac(model, cfg.ac)
    wire_micro_batching(model, cfg)
    if cfg.train.compile:
        for _, _, block in checkpointed_blocks(model):
            block.compile(fullgraph=False)  # in place: parameter names and state_dict keys stay the same
    if groups is not None and groups.size("world") > 1:
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else None
        apply_fsdp(model, groups, dtype)
    return model


def wire_micro_batching(model: nn.Module, cfg) -> None:
    """[train] intra_layer_micro_batches -> the model (owned by checkpointing/microbatch.py). Offload
    windows need no wiring here: the trainer builds an ActivationOffloader over the model's regions."""
    from spartron.checkpointing.microbatch import set_intra_layer_micro_batches

    set_intra_layer_micro_batches(model, cfg)
