"""The absorbed MLA projections of DSA layers as ops that write their outputs in the layout used next.

`absorb_query` is cat(q_nope @ W_uk, q_pe) per head; `absorb_output` is out_latent @ W_uv^T per head,
flattened to [B, S, H * v] for wo. As einsum + cat / reshape these cost an extra pass over the
[B, S, H, 576] query (a batched product leaves its result heads-first, and the cat or reshape copies
it back), once in forward and again in a selective-AC replay. Here each product runs as one batched
matmul whose output is a strided view of the final tensor, so nothing is copied; the backward does
the same for the input gradients. Both are custom ops: opaque to compile and AC alike (the AC policy
keeps them as matrix products), with FLOP formulas so FlopCounterMode still counts them.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula


def _heads_first(x: Tensor) -> Tensor:
    """[B, S, H, d] -> [H, B*S, d], a view whenever B and S merge (always for a fresh tensor)."""
    return x.flatten(0, 1).transpose(0, 1)


@torch.library.custom_op("spartron::absorb_query", mutates_args=())
def absorb_query(q_nope: Tensor, q_pe: Tensor, w_uk: Tensor) -> Tensor:
    """q_nope [B, S, H, n], q_pe [B, S, H, r], w_uk [H, n, c] -> [B, S, H, c + r] = cat(q_nope W_uk, q_pe)."""
    b, s, h, _ = q_nope.shape
    c = w_uk.shape[-1]
    out = q_nope.new_empty(b, s, h, c + q_pe.shape[-1])
    torch.bmm(_heads_first(q_nope), w_uk, out=_heads_first(out[..., :c]))
    out[..., c:].copy_(q_pe)
    return out


@absorb_query.register_fake
def _(q_nope: Tensor, q_pe: Tensor, w_uk: Tensor) -> Tensor:
    b, s, h, _ = q_nope.shape
    return q_nope.new_empty(b, s, h, w_uk.shape[-1] + q_pe.shape[-1])


def _query_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    q_nope, _, w_uk = inputs
    ctx.save_for_backward(q_nope, w_uk)


def query_grads(grad: Tensor, q_nope: Tensor, w_uk: Tensor, need_nope: bool = True,
                need_w: bool = True) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """absorb_query's backward: (d q_nope, d q_pe (a view of grad), d w_uk) for grad [B, S, H, c + r]; shared
    with the query-chunked sparse attention (sparse_mla_absorbed), which runs it chunk by chunk."""
    c = w_uk.shape[-1]
    g_lat = _heads_first(grad[..., :c])  # [H, B*S, c]
    d_nope = d_w = None
    if need_nope:
        d_nope = q_nope.new_empty(q_nope.shape)
        torch.bmm(g_lat, w_uk.transpose(1, 2), out=_heads_first(d_nope))
    if need_w:
        d_w = torch.bmm(_heads_first(q_nope).transpose(1, 2), g_lat)
    return d_nope, grad[..., c:], d_w


def _query_backward(ctx, grad: Tensor):  # noqa: ANN001, ANN202
    q_nope, w_uk = ctx.saved_tensors
    d_nope, d_pe, d_w = query_grads(grad, q_nope, w_uk, ctx.needs_input_grad[0], ctx.needs_input_grad[2])
    return d_nope, d_pe if ctx.needs_input_grad[1] else None, d_w


absorb_query.register_autograd(_query_backward, setup_context=_query_setup)


@torch.library.custom_op("spartron::absorb_output", mutates_args=())
def absorb_output(out_latent: Tensor, w_uv: Tensor) -> Tensor:
    """out_latent [B, S, H, c], w_uv [H, v, c] -> [B, S, H * v]: per head out_latent W_uv^T."""
    b, s, h, _ = out_latent.shape
    out = out_latent.new_empty(b, s, h, w_uv.shape[1])
    torch.bmm(_heads_first(out_latent), w_uv.transpose(1, 2), out=_heads_first(out))
    return out.view(b, s, -1)


@absorb_output.register_fake
def _(out_latent: Tensor, w_uv: Tensor) -> Tensor:
    b, s, h, _ = out_latent.shape
    return out_latent.new_empty(b, s, h * w_uv.shape[1])


def _output_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    ctx.save_for_backward(*inputs)


def output_grads(grad: Tensor, out_latent: Tensor, w_uv: Tensor, need_lat: bool = True,
                 need_w: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """absorb_output's backward: (d out_latent, d w_uv) for grad [B, S, H * v]; shared like query_grads."""
    g = _heads_first(grad.unflatten(-1, (w_uv.shape[0], w_uv.shape[1])))  # [H, B*S, v]
    d_lat = d_w = None
    if need_lat:
        d_lat = out_latent.new_empty(out_latent.shape)
        torch.bmm(g, w_uv, out=_heads_first(d_lat))
    if need_w:
        d_w = torch.bmm(g.transpose(1, 2), _heads_first(out_latent))
    return d_lat, d_w


def _output_backward(ctx, grad: Tensor):  # noqa: ANN001, ANN202
    out_latent, w_uv = ctx.saved_tensors
    return output_grads(grad, out_latent, w_uv, ctx.needs_input_grad[0], ctx.needs_input_grad[1])


absorb_output.register_autograd(_output_backward, setup_context=_output_setup)


@register_flop_formula(torch.ops.spartron.absorb_query)
def _absorb_query_flops(q_nope_shape, q_pe_shape, w_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
    b, s, h, n = q_nope_shape
    return 2 * b * s * h * n * w_shape[-1]


@register_flop_formula(torch.ops.spartron.absorb_output)
def _absorb_output_flops(lat_shape, w_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
    b, s, h, c = lat_shape
    return 2 * b * s * h * c * w_shape[1]
