"""The MoE layer: shared experts + routed experts behind a router and a dispatcher.

Expert placement: with an EP group of size ep, this rank holds E_local = E / ep routed experts,
global experts [rank * E_local, (rank + 1) * E_local). They live in the `experts` submodule (a
GroupedExperts); the router and the shared experts are replicated like any dense weight. Initial
values follow spartron.layers.init (seed and global identity, global expert index included): an EP
layer holds exactly its slice of the 1-rank layer's experts, however many ranks share them.

Routing telemetry: every forward adds its per-expert token counts into the non-persistent buffer
`step_tokens_per_expert` through the op `spartron::record_routing_stats`. That op is in the
checkpoint policy's mandatory set, so a replay under full or selective AC never adds twice. The
trainer reads the buffer after the step's last micro-batch and calls `update_expert_bias(group=
groups.dp_cp)`, which reduces it, updates the bias and zeroes it. `MoEOutput.tokens_per_expert` is
the count of the current forward alone (a fresh tensor, for metrics).
"""

from __future__ import annotations

from collections.abc import Generator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from spartron.comm.transport import EPTransport
from spartron.layers.config import ModelConfig
from spartron.layers.ffn import FeedForward
from spartron.layers.init import init_parameters_
from spartron.layers.moe.dispatch import build_dispatcher
from spartron.layers.moe.experts import GroupedExperts
from spartron.layers.moe.router import Router
from spartron.layers.moe.telemetry import record_routing_stats
from spartron.layers.outputs import MoEOutput
from spartron.layers.schedule import Phase, PhaseGen, drive, interleave


class MoELayer(nn.Module):
    def __init__(self, model_cfg: ModelConfig, ep_group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None, transport: EPTransport | None = None):
        """`transport`: the EP group's communication buffers, shared by a model's MoE layers (None: its own)."""
        super().__init__()
        cfg = model_cfg.moe
        self.cfg = cfg
        ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if cfg.n_routed_experts % ep:
            raise ValueError(f"model.moe.n_routed_experts {cfg.n_routed_experts} is not divisible by the "
                             f"expert-parallel size {ep} (parallel.ep)")
        self.ep_group = ep_group
        self.n_local_experts = cfg.n_routed_experts // ep
        self.first_local_expert = ep_rank * self.n_local_experts
        dtype = getattr(torch, model_cfg.dtype)
        common = {"dtype": dtype, "device": device, "init_std": model_cfg.init_std}
        self.dispatcher = build_dispatcher(cfg, ep_group, hidden=model_cfg.dim, transport=transport)
        self.router = Router(cfg, model_cfg.dim, **common)
        self.experts = GroupedExperts(self.n_local_experts, model_cfg.dim, cfg.moe_inter_dim,
                                      mode=cfg.grouped_mm, first_expert=self.first_local_expert, **common)
        self.shared_experts = (FeedForward(model_cfg.dim, cfg.n_shared_experts * cfg.moe_inter_dim, **common)
                               if cfg.n_shared_experts > 0 else None)
        # > 1: the routed token path runs in this many chunks, interleaved (train.intra_layer_micro_batch_scope
        # = "experts": set by the model that owns the layer, SparseMoEModel, when it is built)
        self.micro_batches = 1
        self.register_buffer("step_tokens_per_expert",
                             torch.zeros(cfg.n_routed_experts, dtype=torch.int64, device=device),
                             persistent=False)
        self.init_std = model_cfg.init_std
        self.reset_parameters()

    def reset_parameters(self, seed: int = 0, prefix: str = "") -> None:
        """The init rule over this layer's names (`prefix` + router.weight, experts.w1, ...)."""
        init_parameters_(self, seed, self.init_std, prefix)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The step's routing counts start at zero (also after materialising from the meta device)."""
        self.step_tokens_per_expert.zero_()

    def forward(self, x: Tensor) -> MoEOutput:
        """x [batch, seq, dim] (this rank's tokens) -> MoEOutput."""
        return drive(self.forward_phases(x))

    def forward_phases(self, x: Tensor) -> Generator[Phase, None, MoEOutput]:
        """The forward as phases (see spartron.layers.schedule): it yields before each step
        another micro-batch's work may overlap with; `forward` runs it straight through.

        With `micro_batches` > 1 it yields nothing: routing and the shared experts run once over all
        tokens, and only the routed token path runs per chunk of tokens, interleaved (`_chunked`)."""
        if x.dim() != 3:
            raise ValueError(f"MoELayer expects x [batch, seq, dim], got shape {tuple(x.shape)}")
        routing = self.router(x)
        topk_ids, topk_weights = routing["topk_ids"], routing["topk_weights"]
        record_routing_stats(topk_ids, self.step_tokens_per_expert)
        tokens = x.reshape(-1, x.shape[-1])
        if self.micro_batches > 1:
            out, counts = self._chunked(tokens, topk_ids, topk_weights)
        else:
            out, counts = yield from self._routed(*self.dispatcher.prepare(tokens, topk_ids, topk_weights))
            if self.shared_experts is not None:
                out = out + self.shared_experts(tokens)
        return MoEOutput(hidden_states=out.view_as(x), router_scores=routing["scores"], topk_ids=topk_ids,
                         topk_weights=topk_weights, tokens_per_expert=counts, aux_loss=routing["aux_loss"])

    def _routed(self, rows: Tensor, state) -> Generator[Phase, None, tuple[Tensor, Tensor]]:
        """Routed experts of prepared `rows` (dispatcher.prepare) -> ([T, dim] gate-weighted sums,
        counts per expert)."""
        d = self.dispatcher
        # Phase.reads: the `rows` handed across streams, which the next step drops (rebinding) while
        # the other stream may still read them. What `state` holds stays alive until this returns,
        # after the compute stream has joined the last comm step, so it needs no recording.
        yield Phase("dispatch", comm=True, reads=(rows,))  # (EP) count exchange, splits to host, all-to-all
        rows = d.dispatch(rows, state)
        yield Phase("experts", reads=(rows,))
        rows, tokens_per_local_expert = d.post_dispatch(rows, state)
        rows = d.pre_combine(self.experts(rows, tokens_per_local_expert), state)
        yield Phase("combine", comm=True, reads=(rows,))
        rows = d.combine(rows, state)
        yield Phase("finalize", reads=(rows,))
        return d.finalize(rows, state), state.tokens_per_expert

    def _chunked(self, tokens: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> tuple[Tensor, Tensor]:
        """The routed path over `micro_batches` chunks of tokens, interleaved, plus the shared experts.

        The host issues, for 2 chunks: prepare (sort by expert) 0 and 1; the shared experts over all
        tokens; dispatch 0 (one count exchange and host sync for both chunks) + experts 0; dispatch 1
        + experts 1; combine + finalize 0; combine + finalize 1. So the first dispatch runs under the
        shared experts, the one host sync waits while they run, each other dispatch or combine runs
        under a chunk's experts, and the last combine under the finalize of chunk 0.
        """
        n = self.micro_batches
        if tokens.shape[0] < n:
            raise ValueError(f"train.intra_layer_micro_batches = {n} (scope 'experts') needs at least {n} tokens "
                             f"per MoE layer call, got {tokens.shape[0]}")
        d = self.dispatcher
        sizes = even_split_sizes(tokens.shape[0], n)
        prepared = [d.prepare(t, i, w) for t, i, w in
                    zip(tokens.split(sizes), topk_ids.split(sizes), topk_weights.split(sizes), strict=True)]
        d.exchange_counts_together([state for _, state in prepared])
        gens: list = [self._routed(rows, state) for rows, state in prepared]
        if self.shared_experts is not None:
            gens.append(_at_first_turn(self.shared_experts, tokens))
        results = interleave(gens, device=tokens.device)
        out = torch.cat([r[0] for r in results[:n]])
        counts = torch.stack([r[1] for r in results[:n]]).sum(dim=0)
        if self.shared_experts is not None:
            out = out + results[n]
        return out, counts

    @torch.no_grad()
    def update_expert_bias(self, counts: Tensor | None = None,
                           group: dist.ProcessGroup | None = None) -> None:
        """Once per optimizer step. counts None = this layer's step accumulator, zeroed afterwards.

        `group`: the dp x cp group (`groups.dp_cp`); see Router.update_expert_bias for why.
        """
        if counts is None:
            self.router.update_expert_bias(self.step_tokens_per_expert, group)
            self.step_tokens_per_expert.zero_()
        else:
            self.router.update_expert_bias(counts, group)


def even_split_sizes(rows: int, n: int) -> list[int]:
    """`n` sizes summing to `rows` that differ by at most one, larger first (tensor_split's rule).

    For `Tensor.split`: its backward writes all pieces' gradients into one tensor (one cat), where
    tensor_split's pieces are separate slices, each backward a zero-filled full-size tensor plus a
    copy, then summed: two extra full-size passes per split tensor, measured on the H200 as part
    of micro-batch 2's extra copy time."""
    return [rows // n + (i < rows % n) for i in range(n)]


def _at_first_turn(fn, x: Tensor) -> PhaseGen:
    """`fn(x)` as a phase generator with no phase: `interleave` runs it whole in its first turn,
    after the other micro-batches' first steps (up to their first dispatch) and before any exchange."""
    return fn(x)
    yield  # unreachable: makes this a generator function
