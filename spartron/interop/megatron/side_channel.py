"""The SideChannel: per-forward outputs of Spartron's Megatron adapters that Megatron has no slot for.

DSA source layers store their top-k ids here and consumer layers read them (the hand-over
`run_decoder_stack` does); attention layers store their AttentionOutput and MoE layers their
MoEOutput (aux loss, tokens per expert, routing). Call `side.reset()` before every forward
(micro-batch) and add `side.loss()` to the LM loss before backward. A layer that writes twice
without a reset raises: that catches a missing reset and any recompute the channel would
otherwise see twice.

Replay safety (activation checkpointing, spartron.interop.megatron.checkpointing): a checkpointed
layer runs its forward inside `side.capturing(layer, ids)`, which the layer's checkpoint region
itself enters, so it holds in the original pass AND in the recompute during backward. While it
holds, the layer's writes go to a per-call `LayerCapture` instead of the channel, and reads of
`dsa_topk_ids` see the ids handed in (the consumer's ids are a region input, saved like any input:
a recompute never reads whatever the channel holds by the time backward runs). The capture is
returned from the region as part of its outputs, so aux and indexer losses carry their gradients
out of a reentrant region (whose original pass runs without grad), and the region's caller records
the capture into the channel once. A recompute's capture is compared with the original's integer
fields (DSA ids, expert ids, token counts: they must be equal) and then dropped: nothing is counted
twice and no id is overwritten. A write inside a Spartron checkpoint region that did not open a
capture (the generic apply_activation_checkpointing on a Megatron layer) is refused, because its
losses would reach the channel without gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from spartron.checkpointing.replay import current_frame
from spartron.layers.outputs import AttentionOutput, MoEOutput

_USE_OURS = ("use spartron.interop.megatron.apply_spartron_checkpointing(model, ac) for activation "
             "checkpointing of Megatron layers")


@dataclass
class LayerCapture:
    """What one call of one checkpointed layer wrote. `outputs()` is a PyTree (dicts of tensors) that
    the checkpoint region returns; the layers' hidden states are left out (None): a checkpointed
    layer keeps none of its activations, and its output already carries them."""

    layer_idx: int
    dsa_topk_ids: Tensor | None
    attention: AttentionOutput | None = None
    moe: MoEOutput | None = None

    def outputs(self) -> dict[str, Any]:
        return {"attention": _without_hidden(self.attention), "moe": _without_hidden(self.moe)}


def _without_hidden(out: dict | None) -> dict | None:
    return None if out is None else {**out, "hidden_states": None}


@dataclass
class SideChannel:
    """Per-forward outputs of the adapters, keyed by Spartron layer index (Megatron layer_number - 1)."""

    attention: dict[int, AttentionOutput] = field(default_factory=dict)
    moe: dict[int, MoEOutput] = field(default_factory=dict)
    dsa_topk_ids: Tensor | None = None  # ids of the latest DSA source layer [B, S_local, K]
    _capture: LayerCapture | None = field(default=None, repr=False, compare=False)

    def reset(self) -> None:
        self.attention.clear()
        self.moe.clear()
        self.dsa_topk_ids = None

    def record_attention(self, layer_idx: int, out: AttentionOutput) -> None:
        if self._captured(layer_idx, "attention", out):
            return
        _check_fresh(self.attention, layer_idx)
        self.attention[layer_idx] = _without_hidden(out)  # the layer's output goes on through Megatron
        if out["dsa_topk_ids"] is not None:
            self.dsa_topk_ids = out["dsa_topk_ids"]

    def record_moe(self, layer_idx: int, out: MoEOutput) -> None:
        if self._captured(layer_idx, "moe", out):
            return
        _check_fresh(self.moe, layer_idx)
        self.moe[layer_idx] = _without_hidden(out)

    # ---- replay-safe writes (spartron.interop.megatron.checkpointing) ------------------------------
    @contextlib.contextmanager
    def capturing(self, layer_idx: int, dsa_topk_ids: Tensor | None) -> Iterator[LayerCapture]:
        """Inside: layer `layer_idx`'s writes go to the yielded capture and `dsa_topk_ids` reads
        `dsa_topk_ids`; the channel's own contents are untouched and restored readable after."""
        if self._capture is not None:
            raise RuntimeError(f"SideChannel: layer {layer_idx} starts a capture while layer "
                               f"{self._capture.layer_idx}'s is open (checkpoint regions do not nest)")
        capture = LayerCapture(layer_idx, dsa_topk_ids)
        outer_ids, self.dsa_topk_ids, self._capture = self.dsa_topk_ids, dsa_topk_ids, capture
        try:
            yield capture
        finally:
            self.dsa_topk_ids, self._capture = outer_ids, None

    def record_layer(self, layer_idx: int, outputs: dict[str, Any]) -> None:
        """Record the `LayerCapture.outputs()` a checkpoint region returned (once per forward)."""
        if outputs["attention"] is not None:
            self.record_attention(layer_idx, outputs["attention"])
        if outputs["moe"] is not None:
            self.record_moe(layer_idx, outputs["moe"])

    def _captured(self, layer_idx: int, kind: str, out: dict) -> bool:
        capture = self._capture
        if capture is None:
            frame = current_frame()
            if frame is not None:
                raise RuntimeError(f"SideChannel: layer {layer_idx} wrote its {kind} output inside checkpoint "
                                   f"region {frame.region_name!r}, which does not capture the layer's side "
                                   f"outputs (its losses would have no gradient): {_USE_OURS}")
            return False
        if layer_idx != capture.layer_idx or getattr(capture, kind) is not None:
            raise RuntimeError(f"SideChannel: layer {layer_idx} wrote its {kind} output while layer "
                               f"{capture.layer_idx}'s capture is open (one layer per checkpoint region, "
                               "one write per kind)")
        setattr(capture, kind, out)
        return True

    # ---- what the forward produced ------------------------------------------------------------------
    def aux_loss(self) -> Tensor | None:
        losses = [o["aux_loss"].float() for _, o in sorted(self.moe.items()) if o["aux_loss"] is not None]
        return torch.stack(losses).sum() if losses else None

    def indexer_loss(self) -> Tensor | None:
        losses = [o["indexer_loss"].float() for _, o in sorted(self.attention.items())
                  if o["indexer_loss"] is not None]
        return torch.stack(losses).sum() if losses else None

    def loss(self) -> Tensor | float:
        """Aux + indexer losses of this forward: add it to the LM loss (0.0 when there are none)."""
        terms = [t for t in (self.aux_loss(), self.indexer_loss()) if t is not None]
        return torch.stack(terms).sum() if terms else 0.0

    def tokens_per_expert(self) -> Tensor | None:
        """[n_moe_layers, n_routed_experts] counts of this forward, in layer order."""
        counts = [o["tokens_per_expert"] for _, o in sorted(self.moe.items())]
        return torch.stack(counts) if counts else None


# Integer fields a recompute must reproduce exactly (the decisions the layer made in forward).
REPLAYED_DECISIONS = (("attention", "dsa_topk_ids"), ("moe", "topk_ids"), ("moe", "tokens_per_expert"))


def decisions(outputs: dict[str, Any]) -> dict[str, Tensor]:
    """The `REPLAYED_DECISIONS` present in a capture's outputs, named 'attention.dsa_topk_ids' etc."""
    found = {}
    for kind, key in REPLAYED_DECISIONS:
        part = outputs[kind]
        if part is not None and part[key] is not None:
            found[f"{kind}.{key}"] = part[key]
    return found


def _check_fresh(store: dict, layer_idx: int) -> None:
    if layer_idx in store:
        raise RuntimeError(f"SideChannel already holds layer {layer_idx}'s output: call side.reset() before "
                           f"each forward (a recompute outside Spartron's checkpointing writes twice: "
                           f"Megatron recompute is refused; {_USE_OURS})")
