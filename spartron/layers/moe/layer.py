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

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from spartron.comm.transport import EPTransport
from spartron.layers.config import ModelConfig
from spartron.layers.ffn import FeedForward
from spartron.layers.init import init_parameters_
from spartron.layers.moe.dispatch import DispatchState, GatheredRows, build_dispatcher
from spartron.layers.moe.experts import GroupedExperts
from spartron.layers.moe.router import Router, Routing
from spartron.layers.moe.telemetry import record_routing_stats
from spartron.layers.outputs import MoEOutput
from spartron.layers.overlap import Phase, interleave


@dataclass
class RoutedRows:
    """The routed token path of one MoE call (or of one chunk of it) between its phases."""

    rows: Tensor  # the slots in flight: sorted by expert, received, expert outputs, returned, per token
    dispatch: DispatchState  # what the dispatcher's later phases need (orders, splits, counts)

    def in_flight(self) -> tuple[Tensor]:
        """The rows (spartron.layers.overlap.InFlight): each phase replaces them while another stream
        may still read them. What `dispatch` holds stays alive until the layer ends, after the
        compute stream has joined the last comm phase, so it needs no recording."""
        return (self.rows,)


@dataclass
class MoEState(RoutedRows):
    """One MoE call between its phases: the routed path and what its last phase needs."""

    x: Tensor  # the input [batch, seq, dim]
    tokens: Tensor  # x as [tokens, dim]: the shared experts' input
    routing: Routing


class MoELayer(nn.Module):
    """Shared experts plus routed experts: route -> dispatch -> experts -> combine -> finalize.

    `transport`: the EP group's communication buffers, shared by a model's MoE layers (None: one
    rank; a DeepEP layer then makes its own). `micro_batches` > 1: the routed path runs in that many
    chunks of tokens, interleaved (train.intra_layer_micro_batch_scope = "experts").
    """

    def __init__(self, model_cfg: ModelConfig, transport: EPTransport | None = None, *, micro_batches: int = 1,
                 device: torch.device | str | None = None):
        super().__init__()
        cfg = model_cfg.moe
        self.cfg = cfg
        ep_group = None if transport is None else transport.group
        ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if cfg.n_routed_experts % ep:
            raise ValueError(f"model.moe.n_routed_experts {cfg.n_routed_experts} is not divisible by the "
                             f"expert-parallel size {ep} (parallel.ep)")
        if micro_batches < 1:
            raise ValueError(f"train.intra_layer_micro_batches must be at least 1, got {micro_batches}")
        self.micro_batches = micro_batches
        self.n_local_experts = cfg.n_routed_experts // ep
        self.first_local_expert = ep_rank * self.n_local_experts
        dtype = getattr(torch, model_cfg.stored_dtype)  # model.master_dtype, else model.dtype
        common = {"dtype": dtype, "device": device, "init_std": model_cfg.init_std}
        self.dispatcher = build_dispatcher(cfg, transport, hidden=model_cfg.dim)
        self.router = Router(cfg, model_cfg.dim, **common)
        self.experts = GroupedExperts(self.n_local_experts, model_cfg.dim, cfg.moe_inter_dim,
                                      mode=cfg.grouped_mm, first_expert=self.first_local_expert, **common)
        self.shared_experts = (FeedForward(model_cfg.dim, cfg.n_shared_experts * cfg.moe_inter_dim, **common)
                               if cfg.n_shared_experts > 0 else None)
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
        if self.micro_batches > 1:
            return self._chunked(x)
        s = self.route(x)
        s = self.dispatch(s)
        s = self.run_experts(s)
        s = self.combine(s)
        return self.finalize(s)

    def phases(self) -> list[Phase]:
        """`forward` cut where it communicates (spartron.layers.overlap.Phased); with `micro_batches`
        > 1 one phase, which interleaves its own chunks."""
        if self.micro_batches > 1:
            return [Phase(self._chunked)]
        return [Phase(self.route), Phase(self.dispatch, comm=True), Phase(self.run_experts),
                Phase(self.combine, comm=True), Phase(self.finalize)]

    # ---- the phases ----------------------------------------------------------------------------
    def route(self, x: Tensor) -> MoEState:
        """Pick each token's experts (counted into the step's telemetry), sort its slots by expert."""
        routing, tokens = self._pick(x)
        rows, state = self.dispatcher.prepare(tokens, routing["topk_ids"], routing["topk_weights"])
        return MoEState(rows, state, x, tokens, routing)

    def dispatch(self, s: RoutedRows) -> RoutedRows:
        """(EP) exchange the counts, copy the split sizes to the host, send the rows to their experts."""
        s.rows = self.dispatcher.dispatch(s.rows, s.dispatch)
        return s

    def run_experts(self, s: RoutedRows) -> RoutedRows:
        """The local experts over the rows they received, in the order the rows arrived."""
        rows, tokens_per_local_expert = self.dispatcher.post_dispatch_gathered(s.rows, s.dispatch)
        if isinstance(rows, GatheredRows):  # as tensors: FSDP2 looks for the input needing a gradient among them
            out = self.experts(rows.source, tokens_per_local_expert, rows.order, rows.inverse, rows.k)
        else:
            out = self.experts(rows, tokens_per_local_expert)
        s.rows = self.dispatcher.pre_combine(out, s.dispatch)
        return s

    def combine(self, s: RoutedRows) -> RoutedRows:
        """(EP) send the expert outputs back to the ranks their tokens came from."""
        s.rows = self.dispatcher.combine(s.rows, s.dispatch)
        return s

    def finalize(self, s: MoEState) -> MoEOutput:
        """Gate-weighted sum of each token's expert outputs, plus the shared experts."""
        s.rows = self.dispatcher.finalize(s.rows, s.dispatch)
        out = s.rows if self.shared_experts is None else s.rows + self.shared_experts(s.tokens)
        return self._output(s.x, out, s.dispatch.tokens_per_expert, s.routing)

    # ---- helpers -------------------------------------------------------------------------------
    def _pick(self, x: Tensor) -> tuple[Routing, Tensor]:
        if x.dim() != 3:
            raise ValueError(f"MoELayer expects x [batch, seq, dim], got shape {tuple(x.shape)}")
        routing = self.router(x)
        record_routing_stats(routing["topk_ids"], self.step_tokens_per_expert)
        return routing, x.reshape(-1, x.shape[-1])

    def _output(self, x: Tensor, out: Tensor, counts: Tensor, routing: Routing) -> MoEOutput:
        return MoEOutput(hidden_states=out.view_as(x), router_scores=routing["scores"],
                         topk_ids=routing["topk_ids"], topk_weights=routing["topk_weights"],
                         tokens_per_expert=counts, aux_loss=routing["aux_loss"])

    def _finalize_chunk(self, s: RoutedRows) -> RoutedRows:
        s.rows = self.dispatcher.finalize(s.rows, s.dispatch)
        return s

    def _chunked(self, x: Tensor) -> MoEOutput:
        """Routing over all tokens at once, the routed path over `micro_batches` chunks, interleaved.

        The host issues, for 2 chunks: prepare (sort by expert) 0 and 1; the shared experts over all
        tokens; dispatch 0 (one count exchange and host sync for both chunks) + experts 0; dispatch 1
        + experts 1; combine + finalize 0; combine + finalize 1. So the first dispatch runs under the
        shared experts, the one host sync waits while they run, each other dispatch or combine runs
        under a chunk's experts, and the last combine under the finalize of chunk 0.
        """
        routing, tokens = self._pick(x)
        n = self.micro_batches
        if tokens.shape[0] < n:
            raise ValueError(f"train.intra_layer_micro_batches = {n} (scope 'experts') needs at least {n} tokens "
                             f"per MoE layer call, got {tokens.shape[0]}")
        d = self.dispatcher
        sizes = even_split_sizes(tokens.shape[0], n)
        chunks = [RoutedRows(*d.prepare(t, i, w)) for t, i, w in zip(
            tokens.split(sizes), routing["topk_ids"].split(sizes), routing["topk_weights"].split(sizes), strict=True)]
        d.exchange_counts_together([c.dispatch for c in chunks])
        path = [Phase(self.dispatch, comm=True), Phase(self.run_experts), Phase(self.combine, comm=True),
                Phase(self._finalize_chunk)]
        # The shared experts are one compute phase, first: `interleave` issues them before any exchange,
        # and each chunk's dispatch waits only for what was queued before them (the prepares).
        shared = [([Phase(self.shared_experts)], tokens)] if self.shared_experts is not None else []
        results = interleave([*shared, *((path, c) for c in chunks)], device=tokens.device)
        routed = results[len(shared):]
        out = torch.cat([r.rows for r in routed])
        counts = torch.stack([r.dispatch.tokens_per_expert for r in routed]).sum(dim=0)
        if shared:
            out = out + results[0]
        return self._output(x, out, counts, routing)

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

