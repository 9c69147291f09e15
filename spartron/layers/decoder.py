"""Decoder layer and THE decoder-stack loop.

The loop lives in one function, `run_decoder_stack`: it passes each layer's explicit outputs (DSA
top-k ids from source layers) to the next layers and collects aux losses, indexer losses and router
counts. MTP (spartron.layers.mtp) has a loop of its own because it is not a stack: each depth takes
the previous depth's hidden state together with a new embedding and is scored by the head.
Activation checkpointing and offload are applied to the layer modules (apply_activation_checkpointing),
so this loop reads the same with or without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from spartron.comm.transport import EPTransport
from spartron.layers.attention.dsa import ids_for_layer
from spartron.layers.attention.mla import MLA
from spartron.layers.config import ModelConfig
from spartron.layers.ffn import FeedForward
from spartron.layers.moe import MoELayer
from spartron.layers.norms import RMSNorm
from spartron.layers.outputs import DecoderLayerOutput
from spartron.layers.schedule import Carry, Step, drive, interleave, mean_or_none, sum_or_none, then


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(.)); dense SwiGLU or MoE FFN."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ep_group=None, cp_group=None,
                 transport: EPTransport | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = MLA(cfg, layer_idx, cp_group=cp_group)
        self.ffn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.is_moe = layer_idx >= cfg.first_k_dense
        if self.is_moe:
            self.ffn = MoELayer(cfg, ep_group=ep_group, transport=transport)
        else:
            self.ffn = FeedForward(cfg.dim, cfg.dense_inter_dim)

    def forward(self, x: Tensor | list[Tensor], positions: Tensor,
                dsa_topk_ids: Tensor | list[Tensor] | None = None) -> DecoderLayerOutput:
        """x: [B, S, D], or a list of intra-layer micro-batches run interleaved (fields become lists)."""
        if isinstance(x, (list, tuple)):
            return run_micro_batches(self, list(x), positions, dsa_topk_ids)
        return drive(self.phases(), _carry(x, positions, dsa_topk_ids))["out"]

    def phases(self) -> list[Step]:
        """The forward as steps over a carry of "x", "positions", "dsa_topk_ids" that ends holding
        "out" (the DecoderLayerOutput): attention opens the MoE layer's first step and the output
        closes its last, so a MoE block has the MoE layer's phases and a dense block one step."""
        if not self.is_moe:
            return [Step(then(self._attention, self._dense_ffn))]
        steps = self.ffn.phases()
        steps[0] = Step(then(self._attention, self._ffn_input, steps[0].run), steps[0].phase)
        steps[-1] = Step(then(steps[-1].run, self._moe_output), steps[-1].phase)
        return steps

    def _attention(self, c: Carry) -> None:
        x = c.pop("x")
        attn = self.attn(self.attn_norm(x), c.pop("positions"), dsa_topk_ids=c.pop("dsa_topk_ids"))
        c["h"] = x + attn["hidden_states"]
        c["ids"], c["indexer_loss"] = attn["dsa_topk_ids"], attn["indexer_loss"]

    def _ffn_input(self, c: Carry) -> None:
        c["moe_in"] = self.ffn_norm(c["h"])

    def _dense_ffn(self, c: Carry) -> None:
        h = c.pop("h")
        c["out"] = DecoderLayerOutput(hidden_states=h + self.ffn(self.ffn_norm(h)), dsa_topk_ids=c.pop("ids"),
                                      indexer_loss=c.pop("indexer_loss"), aux_loss=None, tokens_per_expert=None)

    def _moe_output(self, c: Carry) -> None:
        moe = c.pop("moe_out")
        c["out"] = DecoderLayerOutput(hidden_states=c.pop("h") + moe["hidden_states"], dsa_topk_ids=c.pop("ids"),
                                      indexer_loss=c.pop("indexer_loss"), aux_loss=moe["aux_loss"],
                                      tokens_per_expert=moe["tokens_per_expert"])


def _carry(x: Tensor, positions: Tensor, dsa_topk_ids: Tensor | None) -> Carry:
    return {"x": x, "positions": positions, "dsa_topk_ids": dsa_topk_ids}


def run_micro_batches(layer: DecoderLayer, xs: list[Tensor], positions: Tensor,
                      dsa_topk_ids: Tensor | list[Tensor] | None) -> DecoderLayerOutput:
    """One layer over N micro-batches, phases interleaved; list fields, mean losses, summed counts."""
    if isinstance(dsa_topk_ids, Tensor):
        dsa_topk_ids = list(dsa_topk_ids.chunk(len(xs), dim=0))
    ids = dsa_topk_ids if dsa_topk_ids is not None else [None] * len(xs)
    if len(ids) != len(xs):
        raise ValueError(f"{len(xs)} micro-batches but {len(ids)} dsa_topk_ids entries")
    # packed-document positions [B, S] are per row: each micro-batch takes its rows' (1-D ones are shared)
    rows = list(positions.chunk(len(xs), dim=0)) if positions.dim() == 2 else [positions] * len(xs)
    carries = interleave([(layer.phases(), _carry(x, p, i)) for x, p, i in zip(xs, rows, ids, strict=True)],
                         device=xs[0].device)
    outs = [c["out"] for c in carries]
    out_ids = [o["dsa_topk_ids"] for o in outs]
    return DecoderLayerOutput(hidden_states=[o["hidden_states"] for o in outs],
                              dsa_topk_ids=None if out_ids[0] is None else out_ids,
                              indexer_loss=mean_or_none([o["indexer_loss"] for o in outs]),
                              aux_loss=mean_or_none([o["aux_loss"] for o in outs]),
                              tokens_per_expert=sum_or_none([o["tokens_per_expert"] for o in outs]))


@dataclass
class StackOutput:
    """What the stack loop gathered: final hidden states, the last ids, the losses and the counts."""

    hidden_states: Tensor
    dsa_topk_ids: Tensor | None
    aux_losses: list[Tensor] = field(default_factory=list)
    indexer_losses: list[Tensor] = field(default_factory=list)
    tokens_per_expert: list[Tensor] = field(default_factory=list)


def run_decoder_stack(layers: Sequence[nn.Module], h: Tensor, positions: Tensor,
                      dsa_topk_ids: Tensor | None = None) -> StackOutput:
    """Run the layers in order. A layer that returns ids (a DSA source) hands them to the next layers."""
    out = StackOutput(hidden_states=h, dsa_topk_ids=dsa_topk_ids)
    del h  # no second reference to the first layer's input: it is freed once that layer is done
    for layer in layers:
        ids = ids_for_layer(layer.attn.dsa_role, out.dsa_topk_ids)  # only DSA consumers take ids
        result = layer(out.hidden_states, positions, dsa_topk_ids=ids)
        out.hidden_states = result["hidden_states"]
        if result["dsa_topk_ids"] is not None:
            out.dsa_topk_ids = result["dsa_topk_ids"]
        if result["aux_loss"] is not None:
            out.aux_losses.append(result["aux_loss"])
        if result["indexer_loss"] is not None:
            out.indexer_losses.append(result["indexer_loss"])
        if result["tokens_per_expert"] is not None:
            out.tokens_per_expert.append(result["tokens_per_expert"])
    return out


def total_loss(values: list[Tensor]) -> Tensor | None:
    """The float32 sum of the losses the stack collected, None when it collected none."""
    return torch.stack([v.float() for v in values]).sum() if values else None
