"""Spartron's activation checkpointing on Megatron TransformerLayers built from Spartron specs.

    ckpt = apply_spartron_checkpointing(model, ACConfig(mode="selective"), OffloadConfig(enabled=True))
    with ckpt.session():                       # one training step (all its micro-batches)
        side.reset(); loss = lm_loss(model(...)) + side.loss(); loss.backward()

Each checkpointed TransformerLayer runs as ONE Spartron checkpoint region (the operator-level policy
of spartron.checkpointing: "full" keeps the mandatory ops, "selective" also the matmuls, attention and
communication; reentrant or not by `ac.reentrant`; every `ac.freq`-th layer), the same region
Spartron's own DecoderLayers run in. The layer keeps its names, state and call signature (its class
is swapped for a subclass, as apply_activation_checkpointing does), so Megatron's DDP, optimizer and
dist_checkpointing see the same module.

The side outputs go through the region (side_channel.py, "Replay safety"): the DSA consumer's ids
are read from the SideChannel BEFORE the region and enter it as an input; the layer's writes inside
are captured and come out as region outputs, so aux and indexer losses keep their gradients in the
reentrant mode too (whose original pass runs without grad), and are recorded once; the recompute's
capture is checked against the original's decisions and dropped.

Megatron's own `recompute_granularity` stays refused (config.py): Megatron's "full" recompute wraps
chunks of layers in its own reentrant checkpoint inside TransformerBlock.forward and "selective"
recomputes Megatron submodules (core attention, MLA up-projections, layernorms, MoE activations) that
Spartron's adapters do not have. Neither can be mapped without patching TransformerBlock, and the
Spartron policy already covers both: ac.mode = "full" is layer recompute, "selective" keeps the
expensive operators of every layer. Megatron's cpu_offloading is refused the same way; offload
windows (`offload`) move the saved inputs of the regions to host memory instead.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes

from spartron.checkpointing import (
    ACConfig,
    CheckpointRegion,
    CheckpointReplayError,
    OffloadConfig,
    checkpoint_region_of,
    checkpointed_positions,
    region_options,
)
from spartron.checkpointing.offload import ActivationOffloader, OffloadSession
from spartron.interop.megatron.side_channel import SideChannel, decisions
from spartron.interop.megatron.spec import SpartronMLAAttention
from spartron.layers.ops import load_ops

_ATTR = "_spartron_megatron_checkpoint"


@dataclass(frozen=True)
class MegatronCheckpointing:
    """What apply_spartron_checkpointing did: the checkpointed layers (module names), their regions in
    call order and the offloader of the offload window (None without offload)."""

    layers: tuple[str, ...]
    regions: tuple[CheckpointRegion, ...]
    offloader: ActivationOffloader | None

    def session(self) -> contextlib.AbstractContextManager[OffloadSession | None]:
        """Enter around one training step's forwards and backwards (a no-op without offload)."""
        return self.offloader.session() if self.offloader is not None else contextlib.nullcontext()


class _Decisions:
    """One region call's decisions (DSA ids, expert ids, token counts): the first pass keeps them,
    a recompute must reproduce them exactly."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.original: dict[str, Tensor] | None = None

    def check(self, outputs: dict[str, Any]) -> None:
        found = decisions(outputs)
        if self.original is None:
            self.original = found
            return
        with _disable_current_modes():  # the check is not one of the region's ops (policy, replay order)
            differ = [k for k in sorted(set(found) | set(self.original)) if k not in found
                      or k not in self.original or not torch.equal(found[k], self.original[k])]
        if differ:
            raise CheckpointReplayError(f"{self.name}: the recompute produced a different {', '.join(differ)} "
                                        "than the forward (the layer is not deterministic given its inputs)")


class _LayerCheckpoint:
    """A checkpointed layer's region and its SideChannel hand-over."""

    def __init__(self, region: CheckpointRegion, side: SideChannel, layer_idx: int, consumer: bool,
                 name: str) -> None:
        self.region = region
        self.side = side
        self.layer_idx = layer_idx
        self.consumer = consumer
        self.name = name

    def __call__(self, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        ids = self.side.dsa_topk_ids if self.consumer else None
        body = functools.partial(self._body, forward, _Decisions(self.name))
        out, side_outputs = self.region(body, ids, *args, **kwargs)
        self.side.record_layer(self.layer_idx, side_outputs)
        return out

    def _body(self, forward: Callable[..., Any], seen: _Decisions, ids: Tensor | None, /,
              *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        with self.side.capturing(self.layer_idx, ids) as capture:
            out = forward(*args, **kwargs)
        side_outputs = capture.outputs()
        seen.check(side_outputs)
        return out, side_outputs


def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, _ATTR)(super(subclass, self).forward, *args, **kwargs)

    subclass = type(f"SpartronCheckpointed{cls.__name__}", (cls,), {"forward": forward,
                                                                    "__module__": cls.__module__})
    return subclass


def _transformer_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, TransformerLayer)]
    if not layers:
        raise ValueError(f"apply_spartron_checkpointing: {type(model).__name__} has no Megatron TransformerLayer")
    for name, layer in layers:
        if not isinstance(getattr(layer, "self_attention", None), SpartronMLAAttention):
            raise ValueError(f"apply_spartron_checkpointing: layer {name!r} was not built from Spartron specs "
                             f"(its self_attention is {type(getattr(layer, 'self_attention', None)).__name__}, "
                             "not SpartronMLAAttention)")
        if getattr(layer.config, "recompute_granularity", None) is not None:
            raise ValueError(f"apply_spartron_checkpointing: layer {name!r} has Megatron recompute_granularity="
                             f"{layer.config.recompute_granularity!r}; set it to None (one recompute, Spartron's)")
        if hasattr(layer, _ATTR) or checkpoint_region_of(layer) is not None:
            raise ValueError(f"apply_spartron_checkpointing: layer {name!r} is already checkpointed")
    return layers


def apply_spartron_checkpointing(model: nn.Module, ac: ACConfig | Mapping[str, Any],
                                 offload: OffloadConfig | Mapping[str, Any] | None = None) -> MegatronCheckpointing:
    """Make every `ac.freq`-th Megatron TransformerLayer of `model` (GPTModel, TransformerBlock, ...) one
    Spartron checkpoint region; `offload` (enabled) moves the regions' saved inputs to host memory.

    `ac` / `offload` are the `[ac]` / `[offload]` sections of a Spartron run config (or their dicts).
    Apply it to the bare model, before Megatron's DDP / Float16Module wrap it (the layers keep their
    parameters and names). ac.mode = "none" wraps nothing. Errors: a model without TransformerLayers,
    a layer not built from Spartron specs, already checkpointed, or with Megatron recompute set.
    """
    load_ops()  # ac.targets may name Spartron's operators: registered before the config checks them
    ac = ac if isinstance(ac, ACConfig) else ACConfig.model_validate(dict(ac))
    if offload is not None and not isinstance(offload, OffloadConfig):
        offload = OffloadConfig.model_validate(dict(offload))
    if offload is not None and offload.enabled and ac.mode == "none":
        raise ValueError("offload.enabled needs checkpoint regions: set ac.mode to 'full' or 'selective'")
    layers = _transformer_layers(model)
    derived: dict[type, type] = {}  # one subclass per layer class of this model
    names, regions = [], []
    for position in checkpointed_positions(len(layers), ac):
        name, layer = layers[position]
        region = CheckpointRegion(region_options(ac, name))
        attention = layer.self_attention
        object.__setattr__(layer, _ATTR, _LayerCheckpoint(region, attention.side_channel, attention.layer_idx,
                                                          attention.dsa_role == "consumer", name))
        cls = type(layer)
        if cls not in derived:
            derived[cls] = _checkpointed_class(cls)
        layer.__class__ = derived[cls]
        names.append(name)
        regions.append(region)
    offloader = None
    if offload is not None and offload.enabled:
        offloader = ActivationOffloader(regions, offload, next(model.parameters()).device)
    return MegatronCheckpointing(tuple(names), tuple(regions), offloader)


def megatron_checkpoint_region_of(layer: nn.Module) -> CheckpointRegion | None:
    """The region a layer checkpointed by apply_spartron_checkpointing runs in (its `last_stats`)."""
    wrapped = getattr(layer, _ATTR, None)
    return None if wrapped is None else wrapped.region
