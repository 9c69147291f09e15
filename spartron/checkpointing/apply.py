"""Wrapping blocks in checkpoint regions without changing their names, state or call signature.

``apply_activation_checkpointing(block, ac)`` swaps the block's class for a subclass whose
``forward`` runs the original forward inside a CheckpointRegion (the way FSDP2's ``fully_shard``
swaps classes). No wrapper submodule is inserted, so parameter names and ``state_dict`` keys stay
exactly the same, and forward hooks (FSDP2's unshard / reshard) stay OUTSIDE the region: apply
checkpointing first, then ``fully_shard``, and a replay never re-runs an FSDP forward.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn

from spartron.checkpointing.boundary import CheckpointOptions, CheckpointRegion, compile_own
from spartron.checkpointing.config import ACConfig
from spartron.checkpointing.policy import build_policy

_REGION_ATTR = "_spartron_ac_region"
_COMPILED_ATTR = "_spartron_compiled_forward"
_DERIVED_ATTR = "_spartron_derived_classes"


def region_options(config: ACConfig, name: str | None = None) -> CheckpointOptions:
    """The CheckpointOptions a config describes (mode must be 'full' or 'selective')."""
    return CheckpointOptions(policy=build_policy(config.mode, config.targets), reentrant=config.reentrant,
                             preserve_rng_state=config.preserve_rng_state,
                             debug_summary=config.debug_summary, name=name)


def _derived_class(cls: type[nn.Module], kind: str,
                   make: Callable[[type[nn.Module]], type[nn.Module]]) -> type[nn.Module]:
    """One ``kind`` subclass per class, kept on the class (as FSDP2 keeps its own): every block of a
    model then has the same type, so a compiled block's graph (whose guards check the type) serves
    all its layers instead of recompiling per layer."""
    derived = cls.__dict__.get(_DERIVED_ATTR)
    if derived is None:
        derived = {}
        setattr(cls, _DERIVED_ATTR, derived)
    if kind not in derived:
        derived[kind] = make(cls)
    return derived[kind]


def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        original = super(subclass, self).forward  # bound: the region finds the block's parameters
        return getattr(self, _REGION_ATTR)(original, *args, **kwargs)

    subclass = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward, "__module__": cls.__module__})
    return subclass


def is_checkpointed(module: nn.Module) -> bool:
    return hasattr(module, _REGION_ATTR)


def checkpoint_region_of(module: nn.Module) -> CheckpointRegion | None:
    """The region a wrapped block runs in (its ``last_stats`` is the latest call's RegionStats)."""
    return getattr(module, _REGION_ATTR, None)


def apply_activation_checkpointing(module: nn.Module, config: ACConfig, name: str | None = None) -> nn.Module:
    """Make every call of ``module`` one checkpoint region; returns the same object.

    ``config.mode == "none"`` leaves it untouched. Raises if the module is already FSDP-sharded
    (the region must be inside FSDP's hooks) or already checkpointed.
    """
    if config.mode == "none":
        return module
    from torch.distributed.fsdp import FSDPModule

    label = name or type(module).__name__
    if isinstance(module, FSDPModule):
        raise ValueError(f"{label}: apply activation checkpointing before fully_shard, so FSDP's "
                         "all-gather hooks wrap the checkpoint region instead of being replayed inside it")
    if is_checkpointed(module):
        raise ValueError(f"{label} is already wrapped in a checkpoint region")
    object.__setattr__(module, _REGION_ATTR, CheckpointRegion(region_options(config, label)))
    module.__class__ = _derived_class(type(module), "checkpointed", _checkpointed_class)
    return module


def _compiled_class(cls: type[nn.Module]) -> type[nn.Module]:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(capture_scalar_outputs=True):  # host split sizes: unbacked SymInts
            return getattr(self, _COMPILED_ATTR)(super(subclass, self).forward, *args, **kwargs)

    subclass = type(f"Compiled{cls.__name__}", (cls,), {"forward": forward, "__module__": cls.__module__})
    return subclass


def _call(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def compile_block(module: nn.Module, backend: str | Callable[..., Any] = "inductor",
                  fullgraph: bool = True, shared: dict | None = None) -> nn.Module:
    """Compile one block's forward in place (names, state and call signature unchanged).

    A checkpointed block compiles its region (CheckpointRegion.compile: torch's checkpoint with the
    policy table as its selective-checkpoint policy); any other block compiles its forward. Either
    way the compiled graph is the forward alone: hooks on the module (FSDP2's) and the region's
    offload scope run outside it, in eager code. Unlike nn.Module.compile, data-dependent host values
    (MoE split sizes) trace as unbacked SymInts, so ``fullgraph`` holds on the real model.

    ``shared``: one dict for all blocks of a model, so blocks with the same options share one
    compiled callable and with it dynamo's cache (same guards: no recompile per layer, no hitting the
    recompile limit with many layers)."""
    shared = {} if shared is None else shared
    region = checkpoint_region_of(module)
    if region is not None:
        region.compile(backend, fullgraph=fullgraph, shared=shared)
        return module
    if hasattr(module, _COMPILED_ATTR):
        raise ValueError(f"{type(module).__name__} is already compiled")
    key = ("forward", backend, fullgraph)
    if key not in shared:
        shared[key] = compile_own(_call, backend, fullgraph)
    object.__setattr__(module, _COMPILED_ATTR, shared[key])
    module.__class__ = _derived_class(type(module), "compiled", _compiled_class)
    return module


def checkpointed_positions(n_blocks: int, config: ACConfig) -> list[int]:
    """THE `ac.freq` rule: the positions (0, freq, 2*freq, ...) of the blocks that become regions."""
    return [] if config.mode == "none" else list(range(0, n_blocks, config.freq))


def apply_ac_to_blocks(blocks: nn.ModuleList | nn.ModuleDict | Mapping[str, nn.Module],
                       config: ACConfig, non_reentrant: Collection[nn.Module] = ()) -> list[str]:
    """Checkpoint every ``config.freq``-th block (indices 0, freq, 2*freq, ...); returns their names.

    Blocks in ``non_reentrant`` get a non-reentrant region whatever ``config.reentrant`` says (a
    block that runs several times per step: see spartron.layers.parallelize.apply_ac)."""
    items = list(blocks.items()) if isinstance(blocks, (nn.ModuleDict, Mapping)) else \
        [(str(i), b) for i, b in enumerate(blocks)]
    wrapped = []
    for position in checkpointed_positions(len(items), config):
        key, block = items[position]
        cfg = config.model_copy(update={"reentrant": False}) if block in non_reentrant else config
        apply_activation_checkpointing(block, cfg, name=f"block {key}")
        wrapped.append(key)
    return wrapped
