"""SparseMoEModel: the reference sparse MoE model (embeddings, decoder stack, MTP, head, loss).

Every CP rank receives the full sequence; the model keeps its load-balanced causal shard (chunks r and
2cp-1-r). The loss on each rank is scaled so that the average over the gradient-averaging group (FSDP
averages over every data/context-parallel rank) is the exact global token mean: of the micro-batch, or,
given the step's `LossNorm` (the trainer's), the micro-batch's share of the whole step's token mean.

Initial weights depend only on `seed` and each parameter's name (and global expert index), never on
the RNG state or the layout (spartron.layers.init): every EP/CP/FSDP layout builds the 1-rank model.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from spartron.comm import labelled
from spartron.comm.transport import EPTransport
from spartron.layers.attention.context_parallel import cp_positions, cp_shard
from spartron.layers.attention.doc_mask import check_document_positions, document_shifted_labels
from spartron.layers.config import ModelConfig
from spartron.layers.decoder import DecoderLayer, run_decoder_stack, total_loss
from spartron.layers.init import init_parameters_
from spartron.layers.loss import IGNORE_INDEX, LossNorm, linear_cross_entropy_sum
from spartron.layers.mtp import MTP, shift_left
from spartron.layers.norms import RMSNorm
from spartron.layers.outputs import ModelOutput
from spartron.layers.overlap import merge_micro_batches, split_micro_batches
from spartron.layers.parallelize import Block


class SparseMoEModel(nn.Module):
    """`transport`: the EP group's communication buffers (None: one rank, buffers made here); every MoE
    layer of the model gets it when built, so all share one exchange / DeepEP buffer, released by
    `close()`. `micro_batches` / `micro_batch_scope` (train.intra_layer_micro_batches and its scope,
    validated with the run config): each decoder layer runs that many batch slices with their phases
    interleaved ("layer"), or each MoE layer that many chunks of its routed path ("experts")."""

    def __init__(self, cfg: ModelConfig, transport: EPTransport | None = None, cp_group=None, loss_group=None,
                 seed: int = 0, micro_batches: int = 1, micro_batch_scope: Literal["layer", "experts"] = "layer"):
        super().__init__()
        self.cfg = cfg
        self.cp_group = cp_group
        self.loss_group = loss_group
        self.transport = EPTransport(None, cfg.moe.copy_engine_sync) if transport is None else transport
        t = self.transport
        chunks = micro_batches if micro_batch_scope == "experts" else 1
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, t, cp_group, moe_micro_batches=chunks)
                                     for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.mtp = MTP(cfg, t, cp_group, moe_micro_batches=chunks) if cfg.mtp.depth > 0 else None
        self.intra_layer_micro_batches = micro_batches if micro_batch_scope == "layer" else 1
        self.init_weights(seed)

    def init_weights(self, seed: int = 0) -> None:
        """The layout-invariant rule of spartron.layers.init over this model's parameter names."""
        init_parameters_(self, seed, self.cfg.init_std)

    @property
    def head_weight(self) -> Tensor:
        return self.embed.weight if self.head is None else self.head.weight

    def _cp(self, x: Tensor) -> Tensor:
        return x if self.cp_group is None else cp_shard(x, self.cp_group, dim=1)

    def _token_mean(self, hidden: Tensor, labels: Tensor, targets: Tensor | None) -> Tensor:
        """Sum of CE over local tokens, scaled so the mean over the loss group is the global token mean: over
        `targets` labels (the step's, LossNorm), or over this micro-batch's (all-reduced here)."""
        loss_sum = linear_cross_entropy_sum(hidden.flatten(0, 1), self.head_weight, labels.flatten(),
                                            self.cfg.loss_chunk_size)
        ranks = 1
        if self.loss_group is not None and dist.get_world_size(self.loss_group) > 1:
            ranks = dist.get_world_size(self.loss_group)
        if targets is None:
            targets = (labels != IGNORE_INDEX).sum().to(torch.float32)
            if ranks > 1:
                with labelled("loss_norm", self.loss_group):
                    dist.all_reduce(targets, group=self.loss_group)
        return loss_sum * ranks / targets.clamp(min=1.0)

    def _loss_labels(self, labels: Tensor, rows: Tensor | None) -> list[Tensor]:
        """This rank's labels of the LM loss and of each MTP depth (`rows`: packed documents' positions, whose
        MTP targets stay inside their document)."""
        out = [self._cp(labels)]
        for k in range(1, (self.cfg.mtp.depth if self.mtp is not None else 0) + 1):
            out.append(self._cp(document_shifted_labels(labels, rows, k) if rows is not None
                                else shift_left(labels, k, IGNORE_INDEX)))
        return out

    def target_counts(self, labels: Tensor, positions: Tensor | None = None) -> Tensor:
        """This rank's label counts [1 + MTP depth] (float32) of one micro-batch: what `LossNorm.targets` sums
        over a step's micro-batches and all-reduces over the loss group."""
        return torch.stack([(y != IGNORE_INDEX).sum() for y in self._loss_labels(labels, positions)]).float()

    def _embed_tokens(self, tokens: Tensor) -> Tensor | list[Tensor]:
        h = self.embed(self._cp(tokens))
        if self.intra_layer_micro_batches > 1:
            return split_micro_batches(h, self.intra_layer_micro_batches)
        return h

    def forward(self, tokens: Tensor, labels: Tensor, positions: Tensor | None = None, *,
                loss_norm: LossNorm | None = None) -> ModelOutput:
        """`positions` [B, S] int64: packed documents (positions restart at 0 at each document start; RoPE
        per document, block-causal attention, MTP targets within the document: attention.doc_mask).
        `loss_norm`: the step's (LossNorm): `loss`, `lm_loss` and `mtp_losses` are then this micro-batch's
        shares of the step's (they sum over its micro-batches); `aux_loss` / `indexer_loss` stay its own."""
        seq = tokens.shape[1]
        rows = None
        if positions is not None:
            check_document_positions(positions, tokens.shape[0], seq)
            rows, positions = positions, self._cp(positions)  # whole rows (MTP targets); this rank's queries
        else:
            positions = (torch.arange(seq, device=tokens.device) if self.cp_group is None
                         else cp_positions(seq, self.cp_group, device=tokens.device))
        loss_labels = self._loss_labels(labels, rows)
        targets = [None] * len(loss_labels) if loss_norm is None else list(loss_norm.targets.unbind(0))
        # The embedding goes to the stack without a local here, so the first layer's input is freed
        # as soon as that layer is done with it (an offload window moves it to the host).
        stack = run_decoder_stack(list(self.layers.values()), self._embed_tokens(tokens), positions)
        stack.hidden_states = merge_micro_batches(stack.hidden_states)
        stack.dsa_topk_ids = merge_micro_batches(stack.dsa_topk_ids)
        lm_loss = self._token_mean(self.norm(stack.hidden_states), loss_labels[0], targets[0])

        aux, indexer, counts = stack.aux_losses, stack.indexer_losses, stack.tokens_per_expert
        mtp_losses: list[Tensor] = []
        if self.mtp is not None:
            mtp_out, layer_outs = self.mtp(
                stack.hidden_states,
                embed_at_depth=lambda k: self.embed(self._cp(shift_left(tokens, k, 0))),
                positions=positions, dsa_topk_ids=stack.dsa_topk_ids,
                loss_at_depth=lambda k, hn: self._token_mean(hn, loss_labels[k], targets[k]))
            mtp_losses = mtp_out["losses"]
            for out in layer_outs:
                aux += [out["aux_loss"]] if out["aux_loss"] is not None else []
                indexer += [out["indexer_loss"]] if out["indexer_loss"] is not None else []
                counts += [out["tokens_per_expert"]] if out["tokens_per_expert"] is not None else []
        aux_loss, indexer_loss = total_loss(aux), total_loss(indexer)
        loss = lm_loss + sum(mtp_losses, torch.zeros((), device=lm_loss.device))
        for extra in (aux_loss, indexer_loss):
            if extra is not None:
                loss = loss + (extra if loss_norm is None else extra / loss_norm.micro_batches)
        return ModelOutput(loss=loss, lm_loss=lm_loss, mtp_losses=mtp_losses, aux_loss=aux_loss,
                           indexer_loss=indexer_loss,
                           tokens_per_expert=torch.stack(counts) if counts else None)

    def moe_layers(self) -> list[nn.Module]:
        mods = [layer.ffn for layer in self.layers.values() if layer.is_moe]
        if self.mtp is not None:
            mods += [b.layer.ffn for b in self.mtp.blocks if b.layer.is_moe]
        return mods

    def blocks(self) -> list[Block]:
        """The decoder blocks in call order, main stack then MTP (spartron.layers.parallelize's units)."""
        out = [Block(name, layer, layer.ffn.experts if layer.is_moe else None, layer=layer.layer_idx)
               for name, layer in self.layers.items()]
        if self.mtp is not None:
            reused = self.mtp.depth > len(self.mtp.blocks)  # one weight-shared block runs every depth
            out += [Block(f"mtp {i}", b.layer, b.layer.ffn.experts if b.layer.is_moe else None, reused)
                    for i, b in enumerate(self.mtp.blocks)]
        return out

    def ep_sharded_parameters(self) -> list[nn.Parameter]:
        """The routed experts' parameters: each EP rank holds only its experts, under the same names."""
        return [p for block in self.blocks() if block.experts is not None for p in block.experts.parameters()]

    def update_expert_bias(self, group=None) -> None:
        """Once per optimizer step: every MoE layer updates its selection bias from the step's counts."""
        for moe in self.moe_layers():
            moe.update_expert_bias(group=group)

    def close(self) -> int:
        """Release the EP group's communication buffers (collective: every rank calls it, while all
        are alive); returns how many were live. A later forward creates them again."""
        return self.transport.destroy()


def build_model(cfg: ModelConfig, groups=None, seed: int = 0, transport: EPTransport | None = None,
                micro_batches: int = 1, micro_batch_scope: Literal["layer", "experts"] = "layer",
                device: torch.device | str | None = None) -> SparseMoEModel:
    """Build the reference model on the explicit groups (None: single rank), initialised from `seed`
    (the trainer passes train.seed) by the layout-invariant rule of spartron.layers.init; `transport`:
    the EP group's buffers (None: the model makes its own); intra-layer micro-batches as SparseMoEModel.

    `device` "meta": parameters without storage or values, to be parallelised there and given their
    shards by `spartron.layers.init.materialize_(model, device, seed, cfg.init_std)` (what the trainer
    does); None: the current default device, initialised here.

    Parameters are stored in `cfg.stored_dtype` (model.master_dtype, else model.dtype): drawn in
    float32 (spartron.layers.init) and cast once; `spartron.layers.parallelize` makes the compute run
    in model.dtype. Buffers such as the router's fp32 expert bias keep their own dtype.
    """
    ep_group = None if groups is None else groups.ep
    if transport is None:
        transport = EPTransport(ep_group, cfg.moe.copy_engine_sync)
    elif transport.group is not ep_group:
        raise ValueError("build_model: the transport's group is not the expert-parallel group (groups.ep)")
    kw = {"seed": seed, "transport": transport, "micro_batches": micro_batches, "micro_batch_scope": micro_batch_scope}
    with torch.device(device) if device is not None else contextlib.nullcontext():
        if groups is None:
            model = SparseMoEModel(cfg, **kw)
        else:
            # a 1-rank CP group is no CP: None keeps process-group queries out of the forward (dynamo in torch
            # 2.11 cannot trace dist.get_world_size on a Python group such as a rehearsal's mirror)
            cp_group = groups.cp if groups.size("cp") > 1 else None
            model = SparseMoEModel(cfg, cp_group=cp_group, loss_group=groups.dp_cp, **kw)
    dtype = getattr(torch, cfg.stored_dtype)
    for p in model.parameters():
        if p.dtype != dtype:  # torch's default-dtype modules (MoE layers make theirs in the stored dtype)
            p.data = p.data.to(dtype)
    return model
