"""Decoder layer and THE decoder-stack loop.

`DecoderLayer.forward` is the block. Its `phases()` are the same computation cut where the MoE layer
communicates, for spartron.layers.overlap to interleave intra-layer micro-batches (a list input).

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
from typing import NamedTuple

import torch
from torch import Tensor, nn

from spartron.comm.transport import EPTransport
from spartron.layers.attention.dsa import ids_for_layer
from spartron.layers.attention.mla import MLA
from spartron.layers.config import ModelConfig
from spartron.layers.ffn import FeedForward
from spartron.layers.moe import MoELayer
from spartron.layers.moe.layer import MoEState
from spartron.layers.norms import RMSNorm
from spartron.layers.outputs import DecoderLayerOutput, MoEOutput
from spartron.layers.overlap import Phase, mean_or_none, run_interleaved, sum_or_none


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(attn_norm(x)); out = h + ffn(ffn_norm(h)), a dense SwiGLU or MoE FFN.

    `transport`: the EP group's buffers for the MoE FFN (None: one rank); `moe_micro_batches`: the
    chunks of the MoE layer's routed path (train.intra_layer_micro_batch_scope = "experts").
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, transport: EPTransport | None = None, cp_group=None,
                 *, moe_micro_batches: int = 1):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = MLA(cfg, layer_idx, cp_group=cp_group)
        self.ffn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.is_moe = layer_idx >= cfg.first_k_dense
        if self.is_moe:
            self.ffn = MoELayer(cfg, transport, micro_batches=moe_micro_batches)
        else:
            self.ffn = FeedForward(cfg.dim, cfg.dense_inter_dim)

    def forward(self, x: Tensor | list[Tensor], positions: Tensor,
                dsa_topk_ids: Tensor | list[Tensor] | None = None) -> DecoderLayerOutput:
        """x: [B, S, D], or a list of intra-layer micro-batches run interleaved (fields become lists)."""
        if isinstance(x, (list, tuple)):
            return self._micro_batched(list(x), positions, dsa_topk_ids)
        h, ids, indexer_loss = self._attend(x, positions, dsa_topk_ids)
        if not self.is_moe:
            return _output(h + self.ffn(self.ffn_norm(h)), ids, indexer_loss)
        moe = self.ffn(self.ffn_norm(h))
        return _output(h + moe["hidden_states"], ids, indexer_loss, moe)

    def _attend(self, x: Tensor, positions: Tensor, dsa_topk_ids: Tensor | None):
        """h = x + attn(attn_norm(x)) with the attention's DSA ids and indexer loss (its output is not
        kept past the residual add)."""
        attn = self.attn(self.attn_norm(x), positions, dsa_topk_ids=dsa_topk_ids)
        return x + attn["hidden_states"], attn["dsa_topk_ids"], attn["indexer_loss"]

    # ---- the same forward in phases, for spartron.layers.overlap ----------------------------------
    def phases(self) -> list[Phase]:
        """`forward` cut where the MoE layer communicates (spartron.layers.overlap.Phased): the first
        phase takes a LayerInput, the last returns the DecoderLayerOutput. A dense block, or one whose
        MoE layer interleaves its own chunks, is one phase."""
        if not self.is_moe or self.ffn.micro_batches > 1:
            # the plain forward itself, not a checkpoint region's override: the region is already open
            return [Phase(lambda inp: DecoderLayer.forward(self, *inp))]
        return [Phase(self._attend_and_route), Phase(self._dispatch, comm=True), Phase(self._run_experts),
                Phase(self._combine, comm=True), Phase(self._finalize)]

    def _attend_and_route(self, inp: LayerInput) -> BlockState:
        h, ids, indexer_loss = self._attend(*inp)
        return BlockState(h, ids, indexer_loss, self.ffn.route(self.ffn_norm(h)))

    def _dispatch(self, s: BlockState) -> BlockState:
        s.moe = self.ffn.dispatch(s.moe)
        return s

    def _run_experts(self, s: BlockState) -> BlockState:
        s.moe = self.ffn.run_experts(s.moe)
        return s

    def _combine(self, s: BlockState) -> BlockState:
        s.moe = self.ffn.combine(s.moe)
        return s

    def _finalize(self, s: BlockState) -> DecoderLayerOutput:
        moe = self.ffn.finalize(s.moe)
        return _output(s.h + moe["hidden_states"], s.dsa_topk_ids, s.indexer_loss, moe)

    def _micro_batched(self, xs: list[Tensor], positions: Tensor,
                       dsa_topk_ids: Tensor | list[Tensor] | None) -> DecoderLayerOutput:
        """The block over N micro-batches, phases interleaved; list fields, mean losses, summed counts."""
        if isinstance(dsa_topk_ids, Tensor):
            dsa_topk_ids = list(dsa_topk_ids.chunk(len(xs), dim=0))
        ids = dsa_topk_ids if dsa_topk_ids is not None else [None] * len(xs)
        if len(ids) != len(xs):
            raise ValueError(f"{len(xs)} micro-batches but {len(ids)} dsa_topk_ids entries")
        # packed-document positions [B, S] are per row: each micro-batch takes its rows' (1-D ones are shared)
        rows = list(positions.chunk(len(xs), dim=0)) if positions.dim() == 2 else [positions] * len(xs)
        outs = run_interleaved(self, [LayerInput(*a) for a in zip(xs, rows, ids, strict=True)], device=xs[0].device)
        out_ids = [o["dsa_topk_ids"] for o in outs]
        return DecoderLayerOutput(hidden_states=[o["hidden_states"] for o in outs],
                                  dsa_topk_ids=None if out_ids[0] is None else out_ids,
                                  indexer_loss=mean_or_none([o["indexer_loss"] for o in outs]),
                                  aux_loss=mean_or_none([o["aux_loss"] for o in outs]),
                                  tokens_per_expert=sum_or_none([o["tokens_per_expert"] for o in outs]))


class LayerInput(NamedTuple):
    """One micro-batch's input to a block's first phase."""

    x: Tensor
    positions: Tensor
    dsa_topk_ids: Tensor | None


@dataclass
class BlockState:
    """A MoE block between its phases: the residual after attention, what attention gives the output,
    and the MoE layer's state."""

    h: Tensor
    dsa_topk_ids: Tensor | None
    indexer_loss: Tensor | None
    moe: MoEState

    def in_flight(self) -> tuple[Tensor, ...]:
        """The MoE rows handed across streams (spartron.layers.overlap.InFlight)."""
        return self.moe.in_flight()


def _output(hidden: Tensor, ids: Tensor | None, indexer_loss: Tensor | None,
            moe: MoEOutput | None = None) -> DecoderLayerOutput:
    return DecoderLayerOutput(hidden_states=hidden, dsa_topk_ids=ids, indexer_loss=indexer_loss,
                              aux_loss=None if moe is None else moe["aux_loss"],
                              tokens_per_expert=None if moe is None else moe["tokens_per_expert"])


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
