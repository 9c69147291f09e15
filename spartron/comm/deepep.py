"""DeepEP intranode dispatch/combine as `spartron_deepep` custom ops (GPU, NVLink).

Why ops: the checkpoint policy lists the whole `spartron_deepep` namespace as mandatory, so a
replay of an MoE block takes the dispatch and combine outputs from the saved-op cache: no second
layout computation, no second notify exchange, no second token exchange. torch.compile sees the
ops through their fake impls.

The handle. DeepEP's intranode handle is six tensors (rank and channel prefix matrices, the
received tokens' source indices, the token -> rank mask, the send heads). The dispatch op returns
them as ordinary outputs and the combine op takes them as inputs, so the handle crosses the op
boundary as tensors (no opaque object for it) and no store is keyed by ids. Autograd saves them on
the op's node (`setup_context`): their lifetime is the autograd graph's, freed by backward. On a
checkpoint replay the dispatch op's outputs, handle included, are the original pass's saved
outputs, so the backward of the replayed graph uses the very handle the original exchange produced.

    dispatch  = layout + notify + dispatch     backward: dispatch_backward (a combine with the
                                               handle, also reducing the top-k weight gradients)
    combine   = combine with the handle        backward: cached_dispatch (a dispatch with the handle)

The buffer. Each op takes the caller's DeepEPBuffer as its first argument, as the opaque reference
`DeepEPBuffer.ref` (spartron.comm.deepep_buffer), and `setup_context` keeps that ref on the autograd
node for backward (which may run on another thread). Under torch.compile the ref is an input of the
graph, forward and backward, so the compiled block calls the same ops on the same buffer with no
graph break (a ContextVar scope around the call, the earlier design, is a break dynamo cannot
trace). Nothing here imports `deep_ep`: the buffer object does, when a layer selects the backend.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from spartron.comm.deepep_buffer import DeepEPBuffer, DeepEPBufferRef
from spartron.comm.fp8_rows import dequantize_tiles

NAMESPACE = "spartron_deepep"
OPS: tuple[str, ...] = tuple(f"{NAMESPACE}::{n}" for n in
                             ("dispatch", "combine", "dispatch_backward", "cached_dispatch"))


@dataclass(frozen=True)
class DeepEPHandle:
    """DeepEP's intranode handle, field order as `deep_ep.Buffer.dispatch` returns it."""

    rank_prefix_matrix: Tensor  # [ep, ep] int32
    channel_prefix_matrix: Tensor  # [ep, channels] int32 (sender side)
    recv_channel_prefix_matrix: Tensor  # [ep, channels] int32 (receiver side)
    recv_src_idx: Tensor  # [received tokens] int32
    is_token_in_rank: Tensor  # [tokens, ep] bool
    send_head: Tensor  # [tokens, ep] int32

    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    @property
    def num_recv_tokens(self) -> int:
        return self.recv_src_idx.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.send_head.shape[0]


def _runtime(ref: DeepEPBufferRef, num_sms: int) -> tuple[DeepEPBuffer, Any]:
    if not isinstance(ref, DeepEPBufferRef):
        raise TypeError(f"spartron_deepep ops take a DeepEPBuffer's `ref` (DeepEPBufferRef), got {type(ref).__name__}")
    buffer = ref.buffer
    if buffer.num_sms != num_sms:
        raise RuntimeError(f"spartron_deepep: op called for {num_sms} SMs but its buffer uses "
                           f"{buffer.num_sms}")
    return buffer, buffer.runtime()


def _deep_ep_handle(handle: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    # Combine rewrites send_head in place (it encodes the skipped slots); the ops are declared pure,
    # and backward may combine with the same handle again, so hand DeepEP a private copy.
    return (*handle[:5], handle[5].clone())


# ---------------------------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::dispatch", mutates_args=())
def _dispatch(buffer: DeepEPBufferRef, x: Tensor, x_fp8: Tensor | None, x_scales: Tensor | None, topk_idx: Tensor,
              topk_weights: Tensor, num_experts: int, num_ranks: int, num_sms: int
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`x_fp8` / `x_scales`: x's rows as E4M3 with fp32 scales per 128 values (model.fp8.dispatch), sent in x's
    place by DeepEP's FP8 dispatch and dequantised to x's dtype on arrival; None: x is sent."""
    buffer, rt = _runtime(buffer, num_sms)
    if (buffer.ep, buffer.n_experts) != (num_ranks, num_experts):
        raise RuntimeError(f"spartron_deepep::dispatch for {num_ranks} ranks / {num_experts} experts, but the "
                           f"buffer serves {buffer.ep} / {buffer.n_experts}")
    per_rank, _, per_expert, in_rank, _ = rt.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = rt.dispatch(
        x if x_fp8 is None else (x_fp8, x_scales), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights, config=buffer.dispatch_config)
    if x_fp8 is not None:
        recv_x = dequantize_tiles(*recv_x, x.dtype)
    host_counts = torch.tensor(list(counts), dtype=torch.int64)
    return (recv_x, recv_idx, recv_w, host_counts, *handle)


@_dispatch.register_fake
def _(buffer, x, x_fp8, x_scales, topk_idx, topk_weights, num_experts, num_ranks, num_sms):
    received = torch.library.get_ctx().new_dynamic_size()
    tokens, top_k = topk_idx.shape
    channels = num_sms // 2
    i32 = {"dtype": torch.int32, "device": x.device}
    return (x.new_empty(received, x.shape[1]), topk_idx.new_empty(received, top_k),
            topk_weights.new_empty(received, top_k),
            torch.empty(num_experts // num_ranks, dtype=torch.int64, device="cpu"),
            torch.empty(num_ranks, num_ranks, **i32), torch.empty(num_ranks, channels, **i32),
            torch.empty(num_ranks, channels, **i32), torch.empty(received, **i32),
            torch.empty(tokens, num_ranks, dtype=torch.bool, device=x.device),
            torch.empty(tokens, num_ranks, **i32))


@torch.library.custom_op(f"{NAMESPACE}::combine", mutates_args=())
def _combine(buffer: DeepEPBufferRef, x: Tensor, rank_prefix_matrix: Tensor, channel_prefix_matrix: Tensor,
             recv_channel_prefix_matrix: Tensor, recv_src_idx: Tensor, is_token_in_rank: Tensor,
             send_head: Tensor, num_sms: int) -> Tensor:
    buffer, rt = _runtime(buffer, num_sms)
    handle = _deep_ep_handle((rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
                              recv_src_idx, is_token_in_rank, send_head))
    out, _, _ = rt.combine(x, handle, config=buffer.combine_config)
    return out


@_combine.register_fake
def _(buffer, x, rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
      is_token_in_rank, send_head, num_sms):
    return x.new_empty(send_head.shape[0], x.shape[1])


@torch.library.custom_op(f"{NAMESPACE}::dispatch_backward", mutates_args=())
def _dispatch_backward(buffer: DeepEPBufferRef, grad_recv_x: Tensor, grad_recv_topk_weights: Tensor,
                       rank_prefix_matrix: Tensor, channel_prefix_matrix: Tensor,
                       recv_channel_prefix_matrix: Tensor, recv_src_idx: Tensor, is_token_in_rank: Tensor,
                       send_head: Tensor, num_sms: int) -> tuple[Tensor, Tensor]:
    buffer, rt = _runtime(buffer, num_sms)
    handle = _deep_ep_handle((rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
                              recv_src_idx, is_token_in_rank, send_head))
    grad_x, grad_w, _ = rt.combine(grad_recv_x, handle, topk_weights=grad_recv_topk_weights,
                                   config=buffer.combine_config)
    return grad_x, grad_w


@_dispatch_backward.register_fake
def _(buffer, grad_recv_x, grad_recv_topk_weights, rank_prefix_matrix, channel_prefix_matrix,
      recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head, num_sms):
    tokens = send_head.shape[0]
    return (grad_recv_x.new_empty(tokens, grad_recv_x.shape[1]),
            grad_recv_topk_weights.new_empty(tokens, grad_recv_topk_weights.shape[1]))


@torch.library.custom_op(f"{NAMESPACE}::cached_dispatch", mutates_args=())
def _cached_dispatch(buffer: DeepEPBufferRef, x: Tensor, rank_prefix_matrix: Tensor, channel_prefix_matrix: Tensor,
                     recv_channel_prefix_matrix: Tensor, recv_src_idx: Tensor, is_token_in_rank: Tensor,
                     send_head: Tensor, num_sms: int) -> Tensor:
    buffer, rt = _runtime(buffer, num_sms)
    handle = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
              is_token_in_rank, send_head)
    recv_x, *_ = rt.dispatch(x, handle=handle, config=buffer.dispatch_config)
    return recv_x


@_cached_dispatch.register_fake
def _(buffer, x, rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
      is_token_in_rank, send_head, num_sms):
    return x.new_empty(recv_src_idx.shape[0], x.shape[1])


# ---------------------------------------------------------------------------------------------
# Autograd: dispatch <-> combine with the saved handle
# ---------------------------------------------------------------------------------------------

def _dispatch_setup(ctx, inputs, output):
    ctx.buffer, x, _, _, topk_idx, _, _, _, ctx.num_sms = inputs
    ctx.hidden, ctx.top_k, ctx.x_dtype = x.shape[1], topk_idx.shape[1], x.dtype
    ctx.save_for_backward(output[1], *output[4:])


def _dispatch_grad(ctx, grad_recv_x, _grad_idx, grad_recv_w, _grad_counts, *_grad_handle):
    recv_idx, *handle = ctx.saved_tensors
    received = recv_idx.shape[0]
    if grad_recv_x is None:
        grad_recv_x = torch.zeros(received, ctx.hidden, dtype=ctx.x_dtype, device=recv_idx.device)
    if grad_recv_w is None:
        grad_recv_w = torch.zeros(received, ctx.top_k, dtype=torch.float32, device=recv_idx.device)
    else:  # a received weight whose expert lives elsewhere is the constant 0, not w: no gradient
        grad_recv_w = grad_recv_w.float().masked_fill(recv_idx < 0, 0.0)
    grad_x, grad_w = _dispatch_backward(ctx.buffer, grad_recv_x.contiguous(), grad_recv_w.float().contiguous(),
                                        *handle, ctx.num_sms)
    return None, grad_x, None, None, None, grad_w, None, None, None  # FP8 rows: x's gradient, straight through


_dispatch.register_autograd(_dispatch_grad, setup_context=_dispatch_setup)


def _combine_setup(ctx, inputs, output):
    ctx.buffer, ctx.num_sms = inputs[0], inputs[8]
    ctx.save_for_backward(*inputs[2:8])


def _combine_grad(ctx, grad):
    grad_x = _cached_dispatch(ctx.buffer, grad.contiguous(), *ctx.saved_tensors, ctx.num_sms)
    return (None, grad_x) + (None,) * 7


_combine.register_autograd(_combine_grad, setup_context=_combine_setup)


# ---------------------------------------------------------------------------------------------
# Wrappers (the buffer is a spartron.comm.deepep_buffer.DeepEPBuffer; its ops get `buffer.ref`)
# ---------------------------------------------------------------------------------------------

def deepep_dispatch(buffer: DeepEPBuffer, x: Tensor, topk_idx: Tensor, topk_weights: Tensor,
                    fp8: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, DeepEPHandle]:
    """Send each token once to every EP rank holding one of its experts.

    Returns (recv_x [R, dim], recv_topk_idx [R, top_k] local expert ids or -1, recv_topk_weights
    [R, top_k] float32 (0 where -1), rows per local expert [E_local] int64 on the host, handle).
    Differentiable in x and topk_weights. `fp8`: x's rows as (E4M3 [tokens, dim], fp32 scales
    [tokens, dim / 128]), sent instead of x (model.fp8.dispatch); recv_x is then their dequantised values in
    x's dtype, and x's gradient comes back in that dtype as without them.
    """
    buffer.check_input(x, topk_idx)
    q, scales = (None, None) if fp8 is None else buffer.check_fp8(x, *fp8)
    out = _dispatch(buffer.ref, x.contiguous(), q, scales, topk_idx.contiguous(), topk_weights.float().contiguous(),
                    buffer.n_experts, buffer.ep, buffer.num_sms)
    return out[0], out[1], out[2], out[3], DeepEPHandle(*out[4:])


def deepep_combine(buffer: DeepEPBuffer, x: Tensor, handle: DeepEPHandle) -> Tensor:
    """Sum each received token's rows [R, dim] back on its source rank -> [tokens, dim]."""
    if x.dim() != 2 or x.shape[0] != handle.num_recv_tokens:
        raise ValueError(f"deepep_combine: x must be [{handle.num_recv_tokens}, dim] (one row per received "
                         f"token), got {tuple(x.shape)}")
    return _combine(buffer.ref, x.contiguous(), *handle.tensors(), buffer.num_sms)


def deepep_cached_dispatch(buffer: DeepEPBuffer, x: Tensor, handle: DeepEPHandle) -> Tensor:
    """Dispatch `x` along an existing handle (no layout, no notify). Not differentiable."""
    return _cached_dispatch(buffer.ref, x.contiguous(), *handle.tensors(), buffer.num_sms)
