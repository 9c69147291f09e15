"""The two per-head products of absorbed MLA (DSA layers), laid out for `spartron::sparse_mla`.

absorbed_query: q_abs = (q_nope @ W_uk[h]) ++ q_pe, [B, S, H, kv_lora + rope], contiguous.
latent_values:  out = out_latent @ W_uv[h]^T, [B, S, H, v], contiguous (wo reads it as [B, S, H*v]).

Both are one bmm batched over heads, on [H, B*S, n] views that cost no copy. Written with einsum and
cat (the plain form, kept for compiled graphs), autograd moves more bytes than the math needs: the
query product lands in [H, B*S, kv_lora] and a cat copies it into q_abs; the latent gradient lands
there too and the sparse op's backward copies it into the [B, S, H, kv_lora] layout it reads (1 GiB
per DSA layer at 64k tokens x 16 heads in bf16); the values land in [H, B*S, v] and the reshape for
wo copies them. Here each bmm writes straight into a [B, S, H, *] buffer (`out=` a strided view),
forward and backward; every other product is the same bmm on the same operands, so values and
gradients equal the einsum form's bitwise (CPU float32). Under selective AC, which saves aten::bmm,
a saved `out=` bmm costs one copy of what it wrote (the region keeps it, the replay copies it back),
so there only the backward copy is saved. Dynamo takes no strided `out=`: under torch.compile both
functions are the einsum form.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _heads_first(t: Tensor) -> Tensor:
    """[B, S, H, n] -> [H, B*S, n] (a view for any tensor here: B and S merge; else a copy)."""
    b, s, h, n = t.shape
    return t.permute(2, 0, 1, 3).reshape(h, b * s, n)


def _heads_first_view(t: Tensor) -> Tensor:
    """The [H, B*S, n] view of a [B, S, H, *] buffer slice that a bmm writes into (never a copy)."""
    b, s, h, n = t.shape
    return t.permute(2, 0, 1, 3).view(h, b * s, n)


class _AbsorbedQuery(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_nope: Tensor, q_pe: Tensor, w_uk: Tensor) -> Tensor:
        b, s, h, _ = q_nope.shape
        c = w_uk.shape[-1]
        q_abs = q_nope.new_empty(b, s, h, c + q_pe.shape[-1])
        torch.bmm(_heads_first(q_nope), w_uk, out=_heads_first_view(q_abs[..., :c]))
        q_abs[..., c:].copy_(q_pe)
        ctx.save_for_backward(q_nope, w_uk)
        return q_abs

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        q_nope, w_uk = ctx.saved_tensors
        b, s, h, n = q_nope.shape
        c = w_uk.shape[-1]
        g = _heads_first(grad[..., :c])
        grad_nope = grad_pe = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_nope = torch.bmm(g, w_uk.transpose(1, 2)).view(h, b, s, n).permute(1, 2, 0, 3)
        if ctx.needs_input_grad[1]:
            grad_pe = grad[..., c:]
        if ctx.needs_input_grad[2]:
            grad_w = torch.bmm(_heads_first(q_nope).transpose(1, 2), g)
        return grad_nope, grad_pe, grad_w


class _LatentValues(torch.autograd.Function):
    @staticmethod
    def forward(ctx, latent: Tensor, w_uv: Tensor) -> Tensor:
        b, s, h, _ = latent.shape
        ctx.save_for_backward(latent, w_uv)
        out = latent.new_empty(b, s, h, w_uv.shape[1])
        torch.bmm(_heads_first(latent), w_uv.transpose(1, 2), out=_heads_first_view(out))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        latent, w_uv = ctx.saved_tensors
        g = _heads_first(grad)
        grad_latent = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_latent = torch.empty_like(latent, memory_format=torch.contiguous_format)
            torch.bmm(g, w_uv, out=_heads_first_view(grad_latent))
        if ctx.needs_input_grad[1]:
            grad_w = torch.bmm(_heads_first(latent).transpose(1, 2), g).transpose(1, 2)
        return grad_latent, grad_w


def absorbed_query(q_nope: Tensor, q_pe: Tensor, w_uk: Tensor) -> Tensor:
    """q_nope [B,S,H,n], q_pe [B,S,H,r], W_uk [H,n,c] -> contiguous q_abs [B,S,H,c+r]."""
    if torch.compiler.is_compiling():
        return torch.cat((torch.einsum("bshn,hnc->bshc", q_nope, w_uk), q_pe), dim=-1)
    return _AbsorbedQuery.apply(q_nope, q_pe, w_uk)


def latent_values(latent: Tensor, w_uv: Tensor) -> Tensor:
    """latent [B,S,H,c], W_uv [H,v,c] -> per-head values [B,S,H,v]."""
    if torch.compiler.is_compiling():
        return torch.einsum("bshc,hvc->bshv", latent, w_uv)
    return _LatentValues.apply(latent, w_uv)
