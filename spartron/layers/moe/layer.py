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
from spartron.layers.schedule import Carry, Phase, Step, drive, interleave, then


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
        return drive(self.phases(), {"moe_in": x})["moe_out"]

    def phases(self) -> list[Step]:
        """The forward as steps (see spartron.layers.schedule) over a carry holding "moe_in" (x) that
        ends holding "moe_out" (the MoEOutput); `forward` runs them straight through.

        With `micro_batches` > 1 it is one step: routing and the shared experts run once over all
        tokens, and only the routed token path runs per chunk of tokens, interleaved (`_chunked`)."""
        if self.micro_batches > 1:
            return [Step(then(self._route, self._chunked_step))]
        routed = self._routed_steps()
        return [Step(then(self._route, self._prepare)), *routed[:-1],
                Step(then(routed[-1].run, self._output), routed[-1].phase)]

    def _route(self, c: Carry) -> None:
        x = c["moe_in"]
        if x.dim() != 3:
            raise ValueError(f"MoELayer expects x [batch, seq, dim], got shape {tuple(x.shape)}")
        c["routing"] = routing = self.router(x)
        record_routing_stats(routing["topk_ids"], self.step_tokens_per_expert)
        c["tokens"] = x.reshape(-1, x.shape[-1])

    def _prepare(self, c: Carry) -> None:
        c["rows"], c["state"] = self.dispatcher.prepare(c["tokens"], c["routing"]["topk_ids"],
                                                        c["routing"]["topk_weights"])

    def _chunked_step(self, c: Carry) -> None:
        c["routed"] = self._chunked(c["tokens"], c["routing"]["topk_ids"], c["routing"]["topk_weights"])
        self._output(c, shared_done=True)

    def _output(self, c: Carry, shared_done: bool = False) -> None:
        out, counts = c["routed"]
        if self.shared_experts is not None and not shared_done:
            out = out + self.shared_experts(c["tokens"])
        x, routing = c.pop("moe_in"), c.pop("routing")
        for key in ("tokens", "routed", "state"):  # not kept past the layer (an interleave holds every carry)
            c.pop(key, None)
        c["moe_out"] = MoEOutput(hidden_states=out.view_as(x), router_scores=routing["scores"],
                                 topk_ids=routing["topk_ids"], topk_weights=routing["topk_weights"],
                                 tokens_per_expert=counts, aux_loss=routing["aux_loss"])

    def _routed_steps(self) -> list[Step]:
        """Routed experts of prepared carry["rows"] / ["state"] (dispatcher.prepare) -> carry["routed"]
        = ([T, dim] gate-weighted sums, counts per expert). Phase.reads: the rows handed across
        streams, which the next step replaces while the other stream may still read them; what
        "state" holds stays alive until the layer ends, after the compute stream has joined the last
        comm step, so it needs no recording."""
        d = self.dispatcher

        def dispatch(c: Carry) -> None:  # (EP) count exchange, splits to host, all-to-all
            c["rows"] = d.dispatch(c["rows"], c["state"])

        def experts(c: Carry) -> None:
            rows, tokens_per_local_expert = d.post_dispatch(c["rows"], c["state"])
            c["rows"] = d.pre_combine(self.experts(rows, tokens_per_local_expert), c["state"])

        def combine(c: Carry) -> None:
            c["rows"] = d.combine(c["rows"], c["state"])

        def finalize(c: Carry) -> None:
            c["routed"] = (d.finalize(c.pop("rows"), c["state"]), c["state"].tokens_per_expert)

        return [Step(dispatch, Phase("dispatch", comm=True, reads=("rows",))),
                Step(experts, Phase("experts", reads=("rows",))),
                Step(combine, Phase("combine", comm=True, reads=("rows",))),
                Step(finalize, Phase("finalize", reads=("rows",)))]

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
        # Each chunk's first step is empty (its first point is the dispatch); the shared experts are
        # one step with no phase: `interleave` runs it whole in its first turn, after the chunks'
        # (empty) first steps and before any exchange.
        plans: list = [([Step(_nothing), *self._routed_steps()], {"rows": rows, "state": state})
                       for rows, state in prepared]
        if self.shared_experts is not None:
            plans.append(([Step(self._shared)], {"tokens": tokens}))
        results = interleave(plans, device=tokens.device)
        out = torch.cat([r["routed"][0] for r in results[:n]])
        counts = torch.stack([r["routed"][1] for r in results[:n]]).sum(dim=0)
        if self.shared_experts is not None:
            out = out + results[n]["shared"]
        return out, counts

    def _shared(self, c: Carry) -> None:
        c["shared"] = self.shared_experts(c["tokens"])

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


def _nothing(c: Carry) -> None:
    """The first step of a chunk whose work starts at its dispatch."""
