"""The top-k combine of MoE finalize as one op: out[t] = sum_j w[t, j] * y[slot_inverse[t * k + j]].

`y` holds one expert output row per (token, k) slot in the slots' sorted order; `slot_inverse` (the inverse
permutation of the dispatcher's slot order) says which row is token t's j-th. Written as separate torch ops this
was a gather of all M = T x k rows into token order, then a batched [1, k] x [k, dim] product per token, and in
backward an outer product over [T, k, dim] gathered back into slot order plus a [k, dim] x [dim, 1] product: at
DeepSeek-V3's per-rank shape (32k rows of 7168) about 2 ms of memory-bound kernels a layer on the H100 (cuBLAS
runs the per-token products as gemv, the outer product is a broadcast kernel: the fp8_moe layer profile at
802d705). On CUDA the op is two Triton passes (combine_triton_kernels.py): forward reads each slot row once and
writes the token rows; backward reads the output gradient and the slot rows once and writes each slot row's
gradient where it lies (slot_inverse is a permutation: every row written once, no atomics) and the gate weights'
gradient. Elsewhere (the CPU) it runs the torch ops above, so the CPU numerics are those of the separate ops
bitwise. Both accumulate in fp32 and round once; on the GPU the sums' order is the kernel's, not cuBLAS's, so
the forward and the weights' gradient may differ from the separate ops in the last bit (y's gradient is one
product: bitwise).

An op of its own (`spartron::moe_combine`): selective AC keeps its output as it kept the product's
(spartron.checkpointing.policy), and torch.compile treats it as one opaque call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spartron.optional import require


def _kernels(y: Tensor):
    """The Triton kernels when y is a CUDA tensor (an error naming triton where it is missing), else None."""
    if not y.is_cuda:
        return None
    return require("spartron.layers.moe.combine_triton_kernels", "the MoE combine on CUDA",
                   "pip install triton (it ships with torch's CUDA wheels)")


def _per_token(rows: Tensor, slot_inverse: Tensor, top_k: int) -> Tensor:
    """rows [T * k, dim] in slot order -> [T, k, dim] in token order (the torch form: a gather)."""
    return rows.index_select(0, slot_inverse).view(-1, top_k, rows.shape[-1])


@torch.library.custom_op("spartron::moe_combine", mutates_args=())
def moe_combine(y: Tensor, weights: Tensor, slot_inverse: Tensor, slot_order: Tensor) -> Tensor:
    """y [T * k, dim] in slot order, weights [T, k] (y's dtype), slot_inverse / slot_order [T * k] (each the
    other's inverse) -> [T, dim]. slot_order is for the backward (each slot row's token and weight)."""
    kernels = _kernels(y)
    if kernels is not None:
        return kernels.combine_forward(y, weights, slot_inverse)
    return torch.bmm(weights.unsqueeze(1), _per_token(y, slot_inverse, weights.shape[1])).squeeze(1)


@moe_combine.register_fake
def _(y, weights, slot_inverse, slot_order):
    return y.new_empty(weights.shape[0], y.shape[-1])


@torch.library.custom_op("spartron::moe_combine_backward", mutates_args=())
def moe_combine_backward(grad: Tensor, y: Tensor, weights: Tensor, slot_inverse: Tensor,
                         slot_order: Tensor) -> tuple[Tensor, Tensor]:
    """-> (d y [T * k, dim] in slot order, d weights [T, k])."""
    kernels = _kernels(y)
    if kernels is not None:
        return kernels.combine_backward(grad, y, weights, slot_inverse)
    top_k = weights.shape[1]
    d_weights = torch.bmm(_per_token(y, slot_inverse, top_k), grad.unsqueeze(-1)).squeeze(-1)
    # slot s is token slot_order[s] // k's (slot_order[s] % k)-th: its gradient is that weight times the token's
    d_y = weights.reshape(-1).index_select(0, slot_order).unsqueeze(-1) * grad.index_select(0, slot_order // top_k)
    return d_y, d_weights


@moe_combine_backward.register_fake
def _(grad, y, weights, slot_inverse, slot_order):
    return torch.empty_like(y), torch.empty_like(weights)


def _setup(ctx, inputs, output):
    y, weights, slot_inverse, slot_order = inputs
    ctx.save_for_backward(y, weights, slot_inverse, slot_order)


def _backward(ctx, grad):
    y, weights, slot_inverse, slot_order = ctx.saved_tensors
    d_y, d_weights = moe_combine_backward(grad.contiguous(), y, weights, slot_inverse, slot_order)
    return d_y, d_weights, None, None


moe_combine.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("spartron::moe_slot_sum", mutates_args=())
def moe_slot_sum(rows: Tensor, slot_inverse: Tensor, top_k: int) -> Tensor:
    """rows [T * k, dim] in slot order -> [T, dim]: out[t] = sum_j rows[slot_inverse[t * k + j]], each token's k
    rows summed (fp32, one rounding): the backward of the tokens' replication into their top-k slots
    (spartron.layers.moe.dispatch.replicate_tokens). CUDA: the combine's forward kernel without weights (one pass
    over the rows instead of a gather writing them and a sum reading them again); elsewhere the torch ops it
    replaces, bitwise."""
    kernels = _kernels(rows)
    if kernels is not None:
        return kernels.slot_sum(rows.contiguous(), slot_inverse, top_k)
    return _per_token(rows, slot_inverse, top_k).sum(dim=1)


@moe_slot_sum.register_fake
def _(rows, slot_inverse, top_k):
    return rows.new_empty(slot_inverse.shape[0] // top_k, rows.shape[-1])


def combine_slots(y: Tensor, weights: Tensor, slot_inverse: Tensor, slot_order: Tensor) -> Tensor:
    """sum_j weights[t, j] * y[slot_inverse[t * k + j]] -> [T, dim] (weights cast to y's dtype)."""
    tokens, top_k = weights.shape
    if torch.compiler.is_compiling():  # the rows are an unbacked SymInt under EP (the all-to-all's): a runtime assert
        torch._check(y.shape[0] == tokens * top_k, lambda: "moe_combine: y must have tokens * top_k rows")
    elif y.dim() != 2 or y.shape[0] != tokens * top_k:
        raise ValueError(f"moe_combine: y must be [tokens * top_k = {tokens * top_k}, dim], got {tuple(y.shape)}")
    return moe_combine(y.contiguous(), weights.to(y.dtype).contiguous(), slot_inverse, slot_order)
