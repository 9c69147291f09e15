"""Token dispatch/combine between the router and the experts, as explicit phases.

    prepare       sort the (token, k) slots by global expert; count them (device work only, no sync);
                  (EP) replicate the tokens into their slots, the rows to send
    dispatch      (EP) exchange the counts and copy the split sizes to the host (`exchange_counts`),
                  then all-to-all the sorted rows to the ranks owning their experts
    post_dispatch (EP) regroup received rows by local expert, (one rank) replicate the tokens into their
                  slots -> rows ready for the grouped GEMM (`post_dispatch_gathered`: that last gather as
                  a `GatheredRows` plan, so FP8 experts quantise the rows through its index without
                  writing them in bf16)
    experts       (caller) GroupedExperts(rows, tokens_per_local_expert)
    pre_combine   (EP) undo the regrouping (DeepEP: also weight by the gates, sum per token)
    combine       (EP) reverse all-to-all back to the source rank
    finalize      unsort the slots, weight by the gates, sum the top-k contributions per token

`dispatch` and `combine` only communicate; every computation sits in the phases around them, so
under interleaving (layers/overlap.py) the communication streams carry communication
and the compute stream never waits for computation queued behind another micro-batch's exchange.

Chunks of one MoE call (`train.intra_layer_micro_batch_scope = "experts"`) exchange their counts
together (`exchange_counts_together`): the first dispatch among them does one count exchange and
one host copy for all, so the layer synchronises the host once, not once per chunk.

Every piece of data a later phase needs travels in a per-call `DispatchState`; dispatchers hold
only configuration, so two micro-batches can be in flight at once (layers/overlap.py
interleaves one micro-batch's communication with another's compute).

The one host synchronisation of the all-to-all path (the split sizes the token all-to-all needs on
the host) sits in `dispatch`, not in `prepare`: under interleaving `dispatch` runs on a
communication stream that waits only for its own micro-batch, so the blocking device->host copy
waits for that micro-batch's routing while the compute stream keeps running the other micro-batch's
queued attention. In `prepare` it would drain the compute stream before any all-to-all is issued.
Under torch.compile the same host copy (`splits_to_host`, whose list feeds the all-to-all's split
sizes) is a deliberate graph break: the compiled graphs end before it and start again after it.

Global expert e lives on EP rank e // E_local. Sorting slots by global expert therefore also makes
each destination rank's rows contiguous, which is what the all-to-all's split sizes describe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from spartron.comm.collectives import all_gather, all_to_all, splits_to_host
from spartron.comm.copy_engine import exchange, transpose_counts
from spartron.comm.deepep import DeepEPHandle, deepep_combine, deepep_dispatch
from spartron.comm.deepep_buffer import check_deepep_shape, load_deep_ep
from spartron.comm.transport import EPTransport
from spartron.layers.config import MoEConfig
from spartron.layers.moe.combine import combine_slots, moe_slot_sum


@dataclass
class DispatchState:
    """The hand-over between the phases of one dispatch/combine call."""

    topk_weights: Tensor  # [tokens, top_k] gate weights, applied in finalize
    slot_order: Tensor  # [tokens * top_k] flat slot indices sorted by global expert (stable)
    slot_inverse: Tensor  # inverse permutation of slot_order
    tokens_per_expert: Tensor  # [n_experts] int64 slots this rank routed to each global expert
    tokens_per_local_expert: Tensor | None = None  # [E_local] rows per local expert (post_dispatch)
    input_splits: list[int] | None = None  # EP: rows sent to each EP rank
    output_splits: list[int] | None = None  # EP: rows received from each EP rank
    recv_counts: Tensor | None = None  # EP: [ep, E_local] rows received per (source rank, local expert)
    recv_order: Tensor | None = None  # EP: received rows sorted by local expert (stable)
    recv_inverse: Tensor | None = None  # EP: the inverse permutation of recv_order
    counts: list[int] | None = None  # EP, copy engines: [ep, ep] rows rank s sends to rank r, row-major
    # EP: the states whose counts one exchange handles with this one (a cycle until that exchange clears it)
    exchanged_with: tuple[DispatchState, ...] = field(default=(), repr=False, compare=False)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def inverse_permutation(order: Tensor) -> Tensor:
    """`inverse` with `inverse[order[i]] = i` (one small integer scatter)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def permute_rows(x: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
    """`x[order]` for a permutation `order` of x's rows (`inverse`: its inverse permutation).

    Why not `x[order]`: its backward is index_put with accumulation, which sorts the indices (about
    1 ms per call for an MoE layer's rows on the H200). A permutation writes every row once, so both
    directions are plain gathers (the backward `grad[inverse]`): no sort, no scatter (`index_copy_` of
    bf16 rows ran at a third of the gather's speed at DeepSeek-V3's per-rank shape, H100), deterministic,
    the same values."""
    return _PermuteRows.apply(x, order, inverse)


class _ReplicateTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, slot_order: Tensor, slot_inverse: Tensor, top_k: int) -> Tensor:
        ctx.save_for_backward(slot_inverse)
        ctx.top_k = top_k
        return x.index_select(0, slot_order // top_k)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (slot_inverse,) = ctx.saved_tensors
        return moe_slot_sum(grad, slot_inverse, ctx.top_k), None, None, None


@dataclass
class GatheredRows:
    """`source[order // k]`, not yet written: the experts' input as the last regrouping before them leaves
    it. k = 1: the EP permutation of the received rows; k = top_k: the single-rank replication of each token
    into its top-k slots (`order` the slot order). `inverse` is the inverse permutation of `order`.
    `materialize()` writes the rows (`permute_rows` / `replicate_tokens`: the same values and gradient); FP8
    experts instead read `source` through the index in their quantisation kernels and send the gradient back
    through `inverse` (spartron.layers.fp8.expert_ops). k is a model constant (never read from a shape: the
    received row count is data-dependent under compile)."""

    source: Tensor
    order: Tensor
    inverse: Tensor
    k: int = 1

    def materialize(self) -> Tensor:
        if self.k == 1:
            return permute_rows(self.source, self.order, self.inverse)
        return replicate_tokens(self.source, self.order, self.inverse, self.k)


def replicate_tokens(x: Tensor, slot_order: Tensor, slot_inverse: Tensor, top_k: int) -> Tensor:
    """`x[slot_order // top_k]`: token rows [T, dim] -> one row per (token, k) slot in `slot_order`.

    Why not plain indexing: its backward is index_put with accumulation over the top_k copies of each
    token, which sorts the indices (the same ~1 ms a call on the H200 as `permute_rows` avoids).
    Here the backward sums each token's top_k slot rows, found through `slot_inverse` (spartron::moe_slot_sum: on
    CUDA one pass, elsewhere the gather into token-major order and a sum): no sort, deterministic, fp32
    accumulation, one rounding."""
    return _ReplicateTokens.apply(x, slot_order, slot_inverse, top_k)


class _GateWeightedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weights: Tensor, per_slot: Tensor) -> Tensor:
        ctx.save_for_backward(weights, per_slot)
        return torch.bmm(weights.unsqueeze(1), per_slot).squeeze(1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        weights, per_slot = ctx.saved_tensors
        grad_weights = torch.bmm(per_slot, grad.unsqueeze(-1)).squeeze(-1) if ctx.needs_input_grad[0] else None
        grad_slots = weights.unsqueeze(-1) * grad.unsqueeze(1) if ctx.needs_input_grad[1] else None
        return grad_weights, grad_slots


def gate_weighted_sum(weights: Tensor, per_slot: Tensor) -> Tensor:
    """`sum_k weights[t, k] * per_slot[t, k]`: weights [T, top_k], per_slot [T, top_k, dim] -> [T, dim].

    Why not plain `torch.bmm(weights[:, None], per_slot)`: its autograd computes the weights'
    gradient as a [T, 1, top_k] GEMM output whose rows are top_k elements wide; for top_k 6 (12
    bytes) cuBLAS falls back to an sm80 `wmma ... align2` kernel (1.3 ms per MoE layer on the H200).
    Here that gradient is `per_slot @ grad` ([T, top_k, 1]) and the per-slot gradient, a K = 1
    product, an elementwise outer product: the same values (one fp32 product rounded once)."""
    return _GateWeightedSum.apply(weights, per_slot)


class LocalDispatcher:
    """No expert parallelism: all experts are local, dispatch and combine move nothing."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts
        self.n_local_experts = n_experts

    def prepare(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> tuple[Tensor, DispatchState]:
        """Sort the (token, k) slots by expert and count them; x [tokens, dim] comes back as it is (one rank:
        post_dispatch replicates it into the slots)."""
        flat = topk_ids.reshape(-1)
        slot_order = torch.argsort(flat, stable=True)
        slot_inverse = inverse_permutation(slot_order)
        # scatter_add rather than bincount: no device sync to size the output on CUDA
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        state = DispatchState(topk_weights=topk_weights, slot_order=slot_order, slot_inverse=slot_inverse,
                              tokens_per_expert=counts)
        return x, state  # the tokens: post_dispatch replicates them into their slots (nothing travels)

    def dispatch(self, x: Tensor, state: DispatchState) -> Tensor:
        return x

    def post_dispatch(self, x: Tensor, state: DispatchState) -> tuple[Tensor, Tensor]:
        """x's rows ready for the grouped GEMM: here the tokens replicated into their slots, sorted by expert."""
        rows, counts = self.post_dispatch_gathered(x, state)
        return rows.materialize(), counts

    def post_dispatch_gathered(self, x: Tensor, state: DispatchState) -> tuple[GatheredRows, Tensor]:
        """post_dispatch, the last regrouping left as a GatheredRows plan (FP8 experts read it in place)."""
        state.tokens_per_local_expert = state.tokens_per_expert
        rows = GatheredRows(x, state.slot_order, state.slot_inverse, state.topk_weights.shape[1])
        return rows, state.tokens_per_local_expert

    def exchange_counts_together(self, states: list[DispatchState]) -> None:
        """Nothing to exchange without expert parallelism."""

    def pre_combine(self, y: Tensor, state: DispatchState) -> Tensor:
        return y

    def combine(self, y: Tensor, state: DispatchState) -> Tensor:
        return y

    def finalize(self, y: Tensor, state: DispatchState) -> Tensor:
        """Expert outputs in slot order -> [tokens, dim] gate-weighted sums over the top-k (one op: the slots'
        gather into token order and the weighted sum, spartron.layers.moe.combine)."""
        return combine_slots(y, state.topk_weights, state.slot_inverse, state.slot_order)


class AllToAllDispatcher(LocalDispatcher):
    """Expert parallelism over the transport's EP group with uneven all-to-alls (spartron_collectives ops).

    `wire`: a hook the dispatch rows are sent through, or None (rows sent as they are). It gets the rows and
    two functions: `send` (this dispatch's all-to-all of any [rows, ...] tensor) and `send_back` (the reverse,
    for the gradient). model.fp8.dispatch installs spartron.layers.fp8.wire.FP8Wire (apply_fp8)."""

    def __init__(self, n_experts: int, transport: EPTransport):
        super().__init__(n_experts)
        self.wire = None
        self.group = transport.group
        self.ep = dist.get_world_size(self.group)
        self.n_local_experts = n_experts // self.ep

    def prepare(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> tuple[Tensor, DispatchState]:
        """x [tokens, dim] -> one row per (token, k) slot, sorted by expert: the rows the all-to-all sends."""
        tokens, state = super().prepare(x, topk_ids, topk_weights)
        return replicate_tokens(tokens, state.slot_order, state.slot_inverse, topk_ids.shape[1]), state

    def exchange_counts(self, *states: DispatchState) -> None:
        """Exchange the per-expert counts of `states` and copy their split sizes to the host: one
        collective and one device->host copy (the sync point) for all of them.

        `dispatch` calls it when its state has no split sizes yet (with the states exchanged
        together with it); callers that time the token all-to-all alone call it once beforehand."""
        ep, n_local, n = self.ep, self.n_local_experts, len(states)
        counts = torch.stack([s.tokens_per_expert for s in states]).view(n, ep, n_local)
        # to rank r: the counts of r's local experts in every state; entry (src, i, e) of recv: rows
        # source rank src sends to my local expert e in state i
        send = counts.transpose(0, 1).reshape(-1)
        recv = all_to_all(send, [n * n_local] * ep, [n * n_local] * ep, self.group).view(ep, n, n_local)
        host = splits_to_host(torch.cat([counts.sum(dim=2).reshape(-1),  # [state, dst]
                                         recv.sum(dim=2).transpose(0, 1).reshape(-1)]))  # [state, src]
        for i, state in enumerate(states):
            state.input_splits = host[i * ep:(i + 1) * ep]
            state.output_splits = host[(n + i) * ep:(n + i + 1) * ep]
            state.recv_counts = recv[:, i]
            state.exchanged_with = ()  # no reference cycle keeps the states' tensors alive

    def exchange_counts_together(self, states: list[DispatchState]) -> None:
        """The first of `states` to dispatch exchanges the counts of all of them (one host sync)."""
        for state in states:
            state.exchanged_with = tuple(states)

    def dispatch(self, x: Tensor, state: DispatchState) -> Tensor:
        if state.input_splits is None:
            self.exchange_counts(*(state.exchanged_with or (state,)))
        if self.wire is not None:
            return self.wire.send(x, lambda rows: self._send(rows, state, reverse=False),
                                  lambda grad: self._send(grad, state, reverse=True))
        return self._send(x, state, reverse=False)

    def _send(self, x: Tensor, state: DispatchState, reverse: bool) -> Tensor:
        """The token exchange: rows to the ranks owning their experts, or (reverse) back to their source."""
        if reverse:
            return all_to_all(x, state.input_splits, state.output_splits, self.group)
        return all_to_all(x, state.output_splits, state.input_splits, self.group)

    def post_dispatch(self, x: Tensor, state: DispatchState) -> tuple[Tensor, Tensor]:
        rows, counts = self.post_dispatch_gathered(x, state)
        return rows.materialize(), counts

    def post_dispatch_gathered(self, x: Tensor, state: DispatchState) -> tuple[GatheredRows, Tensor]:
        local_expert = torch.arange(self.n_local_experts, device=x.device).repeat(self.ep)
        row_expert = torch.repeat_interleave(local_expert, state.recv_counts.reshape(-1),
                                             output_size=x.shape[0])
        state.recv_order = torch.argsort(row_expert, stable=True)
        state.recv_inverse = inverse_permutation(state.recv_order)
        state.tokens_per_local_expert = state.recv_counts.sum(dim=0)
        return GatheredRows(x, state.recv_order, state.recv_inverse), state.tokens_per_local_expert

    def pre_combine(self, y: Tensor, state: DispatchState) -> Tensor:
        return permute_rows(y, state.recv_inverse, state.recv_order)  # back to the received order

    def combine(self, y: Tensor, state: DispatchState) -> Tensor:
        return self._send(y, state, reverse=True)


class CopyEngineDispatcher(AllToAllDispatcher):
    """The all-to-all dispatcher with the token exchange done by the copy engines over symmetric
    memory (`spartron_symm::exchange`, comm/copy_engine.py): no SMs taken from the compute it
    overlaps with. Same rows in the same order as the NCCL path, so the same numerics.

    The counts: an all-gather of every rank's per-expert counts gives the whole [ep, ep] send matrix
    the exchange needs, and this rank's received counts per local expert, in one host copy.
    """

    def __init__(self, n_experts: int, transport: EPTransport):
        """`transport`: the EP group's (its exchange buffer is shared by every layer on the group)."""
        super().__init__(n_experts, transport)
        self.buffer = transport.exchange_buffer()

    def exchange_counts(self, *states: DispatchState) -> None:
        ep, n_local, n = self.ep, self.n_local_experts, len(states)
        me = dist.get_rank(self.group)
        counts = torch.stack([s.tokens_per_expert for s in states]).reshape(-1)
        every = all_gather(counts, self.group, purpose="ep_counts")
        every = every.view(ep, n, ep, n_local)  # [src, state, dst rank, expert]
        matrices = splits_to_host(every.sum(dim=3).transpose(0, 1).reshape(-1))  # [state, src, dst]: one copy
        for i, state in enumerate(states):
            matrix = matrices[i * ep * ep:(i + 1) * ep * ep]
            state.counts = matrix
            state.input_splits = matrix[me * ep:(me + 1) * ep]
            state.output_splits = matrix[me::ep]
            state.recv_counts = every[:, i, me]
            state.exchanged_with = ()

    def _send(self, x: Tensor, state: DispatchState, reverse: bool) -> Tensor:
        counts = transpose_counts(state.counts, self.ep) if reverse else state.counts
        return exchange(self.buffer, x, counts)


@dataclass
class DeepEPDispatchState:
    """The hand-over between DeepEPDispatcher's phases (one call, one micro-batch)."""

    topk_ids: Tensor  # [tokens, top_k] global expert ids
    topk_weights: Tensor  # [tokens, top_k] gate weights, sent with the tokens, applied expert-side
    tokens_per_expert: Tensor  # [n_experts] int64 slots this rank routed to each global expert
    recv_topk_ids: Tensor | None = None  # [R, top_k] local expert ids of the received tokens, -1 = other rank
    recv_topk_weights: Tensor | None = None  # [R, top_k] float32, 0 where the id is -1
    tokens_per_local_expert: Tensor | None = None  # [E_local] int64 on the host (from DeepEP's notify)
    handle: DeepEPHandle | None = None  # the layout of this exchange; combine and both backwards use it
    recv_order: Tensor | None = None  # valid (received token, k) slots sorted by local expert (stable)


class DeepEPDispatcher:
    """Expert parallelism over NVLink with DeepEP's intranode kernels (ops in comm/deepep.py).

    Unlike the all-to-all path, DeepEP sends each token once per destination rank (not once per
    (token, k) slot) together with its top-k ids and gate weights. The receiving rank expands the
    tokens into one row per local (token, k) slot for the experts, weights the expert outputs by
    the gates and sums them per received token, and DeepEP's combine sums the per-rank partial
    results on the source rank. So the gates are applied before combine, and their gradient comes
    back through the dispatch op's backward (a combine that also reduces the top-k weights).

    The buffer (`DeepEPBuffer`, created on the first dispatch) is the EP group's transport's: every
    layer on the group shares it.
    """

    def __init__(self, cfg: MoEConfig, transport: EPTransport, hidden: int | None):
        """`transport.deepep_library`: what provides `Buffer`/`Config` (None: `deep_ep`, imported now)."""
        if transport.deepep_library is None:
            load_deep_ep()  # a missing install fails when the model is built, not at the first step
        ep = 1 if transport.group is None else dist.get_world_size(transport.group)
        check_deepep_shape(cfg.n_routed_experts, cfg.top_k, ep, cfg.deepep_num_sms, hidden)
        self.n_experts = cfg.n_routed_experts
        self.ep = ep
        self.n_local_experts = cfg.n_routed_experts // ep
        self.buffer = transport.deepep_buffer(cfg.top_k, cfg.n_routed_experts, cfg.deepep_num_sms, hidden)
        self.wire = None  # model.fp8.dispatch: spartron.layers.fp8.wire.FP8Wire, whose rows() DeepEP sends as FP8

    def prepare(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> tuple[Tensor, DeepEPDispatchState]:
        """x [tokens, dim] -> the same tokens (DeepEP sends whole tokens); counts per global expert."""
        self.buffer.check_input(x, topk_ids)
        flat = topk_ids.reshape(-1)
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        return x, DeepEPDispatchState(topk_ids=topk_ids, topk_weights=topk_weights, tokens_per_expert=counts)

    def dispatch(self, x: Tensor, state: DeepEPDispatchState) -> Tensor:
        fp8 = None if self.wire is None else self.wire.rows(x)  # model.fp8.dispatch: DeepEP's FP8 dispatch
        recv_x, state.recv_topk_ids, state.recv_topk_weights, state.tokens_per_local_expert, state.handle = \
            deepep_dispatch(self.buffer, x, state.topk_ids, state.topk_weights, fp8)
        return recv_x

    def post_dispatch(self, x: Tensor, state: DeepEPDispatchState) -> tuple[Tensor, Tensor]:
        """Received tokens [R, dim] -> one row per local (token, k) slot, grouped by local expert."""
        top_k = state.recv_topk_ids.shape[1]
        flat = state.recv_topk_ids.reshape(-1)
        key = torch.where(flat >= 0, flat, self.n_local_experts)  # other ranks' slots sort last
        rows = int(state.tokens_per_local_expert.sum())  # a host tensor: no device sync
        state.recv_order = torch.argsort(key, stable=True)[:rows]
        return x[state.recv_order // top_k], state.tokens_per_local_expert

    def post_dispatch_gathered(self, x: Tensor, state: DeepEPDispatchState) -> tuple[Tensor, Tensor]:
        """post_dispatch: DeepEP's regrouping replicates rows (top-k slots of a token), no permutation plan."""
        return self.post_dispatch(x, state)

    def exchange_counts_together(self, states: list[DeepEPDispatchState]) -> None:
        """DeepEP's dispatch exchanges its counts itself (its notify step), per call."""

    def pre_combine(self, y: Tensor, state: DeepEPDispatchState) -> Tensor:
        """Expert rows -> gate-weighted sum per received token."""
        received, top_k = state.recv_topk_ids.shape
        slots = y.new_zeros(received * top_k, y.shape[-1]).index_copy_(0, state.recv_order, y)
        return gate_weighted_sum(state.recv_topk_weights.to(y.dtype), slots.view(received, top_k, -1))

    def combine(self, y: Tensor, state: DeepEPDispatchState) -> Tensor:
        """Per-token partial results -> summed on the source rank."""
        return deepep_combine(self.buffer, y, state.handle)

    def finalize(self, y: Tensor, state: DeepEPDispatchState) -> Tensor:
        return y  # gates applied and top-k summed before combine


Dispatcher = LocalDispatcher | AllToAllDispatcher | CopyEngineDispatcher | DeepEPDispatcher


def check_dispatcher(dispatcher: str, ep: int) -> None:
    """THE rule for the dispatcher against the EP size (the run config checks it at load, the
    dispatcher when it is built): 'local' moves no tokens, so it cannot serve more than one EP rank."""
    if dispatcher == "local" and ep > 1:
        raise ValueError(f"model.moe.dispatcher = 'local' cannot serve an EP group of {ep} ranks; "
                         "use 'all_to_all' or 'deepep'")


def build_dispatcher(cfg: MoEConfig, transport: EPTransport | None = None, hidden: int | None = None) -> Dispatcher:
    """The dispatcher `model.moe.dispatcher` names, over the EP group `transport` holds (None, or a
    transport of group None: single rank).

    With one EP rank there is nothing to exchange: "all_to_all" runs as the local dispatcher
    (the same arithmetic, no collective). "local" with more than one EP rank is an error.
    "deepep" needs DeepEP installed and an EP group of 2, 4 or 8 ranks; `hidden` (model.dim) sizes
    its buffer (None: taken from the first tokens). "all_to_all" exchanges tokens with NCCL, or with
    the copy engines when `model.moe.all_to_all_transport = "copy_engine"` (one host).
    `transport` also holds the EP group's buffers, shared by every layer of a model.
    """
    ep = 1 if transport is None or transport.group is None else dist.get_world_size(transport.group)
    check_dispatcher(cfg.dispatcher, ep)
    if cfg.dispatcher == "deepep":
        return DeepEPDispatcher(cfg, transport or EPTransport(None, cfg.copy_engine_sync), hidden)
    if ep == 1:
        return LocalDispatcher(cfg.n_routed_experts)
    if cfg.all_to_all_transport == "copy_engine":
        return CopyEngineDispatcher(cfg.n_routed_experts, transport)
    return AllToAllDispatcher(cfg.n_routed_experts, transport)
