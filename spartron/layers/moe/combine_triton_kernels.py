"""The MoE combine (spartron.layers.moe.combine) as two Triton passes, one program per token, and its unweighted
form (the gradient of the tokens' replication into their top-k slots).

Forward: the token's k slot rows (through slot_inverse) weighted and summed in fp32, in slot order j = 0..k-1,
rounded once. Backward: the output gradient row read once; each slot row's gradient (weight x gradient, one
product rounded once: bitwise torch's) stored where the row lies, and the weights' gradient (the slot row . the
gradient row) summed in fp32 over the columns in BLOCK-wide chunks, rounded once. The k rows are one [K_PAD,
BLOCK] tile (k padded to a power of two, masked); the model constants (k, dim) are compile-time, the token
count is not. Imported only on CUDA (Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 512


@triton.jit
def _combine_forward_kernel(y_ptr, w_ptr, inv_ptr, out_ptr, N_COLS: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                            BLOCK: tl.constexpr, WEIGHTED: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, K_PAD)
    jmask = j < K
    rows = tl.load(inv_ptr + token * K + j, mask=jmask, other=0).to(tl.int64)
    mask = jmask[:, None] & (cols[None, :] < N_COLS)
    y = tl.load(y_ptr + rows[:, None] * N_COLS + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if WEIGHTED:
        w = tl.load(w_ptr + token * K + j, mask=jmask, other=0.0).to(tl.float32)
        y = w[:, None] * y
    out = tl.sum(y, axis=0)
    tl.store(out_ptr + token * N_COLS + cols, out.to(out_ptr.dtype.element_ty), mask=cols < N_COLS)


@triton.jit
def _combine_backward_kernel(grad_ptr, y_ptr, w_ptr, inv_ptr, dy_ptr, dw_ptr, N_COLS: tl.constexpr, K: tl.constexpr,
                             K_PAD: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_PAD)
    jmask = j < K
    rows = tl.load(inv_ptr + token * K + j, mask=jmask, other=0).to(tl.int64)
    w = tl.load(w_ptr + token * K + j, mask=jmask, other=0.0).to(tl.float32)
    dw = tl.zeros((K_PAD,), dtype=tl.float32)
    for start in range(0, N_COLS, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        cmask = cols < N_COLS
        g = tl.load(grad_ptr + token * N_COLS + cols, mask=cmask, other=0.0).to(tl.float32)
        mask = jmask[:, None] & cmask[None, :]
        y = tl.load(y_ptr + rows[:, None] * N_COLS + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dw += tl.sum(y * g[None, :], axis=1)
        tl.store(dy_ptr + rows[:, None] * N_COLS + cols[None, :], (w[:, None] * g[None, :]).to(
            dy_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + token * K + j, dw.to(dw_ptr.dtype.element_ty), mask=jmask)


def _check(y: Tensor, weights: Tensor, slot_inverse: Tensor) -> tuple[int, int, int]:
    tokens, top_k = weights.shape
    if not (y.is_contiguous() and weights.is_contiguous() and slot_inverse.is_contiguous()):
        raise ValueError("moe_combine kernels: y, weights and slot_inverse must be contiguous")
    if y.shape[0] != tokens * top_k or slot_inverse.numel() != tokens * top_k:
        raise ValueError(f"moe_combine kernels: {tokens} tokens x top-{top_k} slots, y has {y.shape[0]} rows and "
                         f"slot_inverse {slot_inverse.numel()}")
    return tokens, top_k, y.shape[1]


def combine_forward(y: Tensor, weights: Tensor, slot_inverse: Tensor) -> Tensor:
    tokens, top_k, _ = _check(y, weights, slot_inverse)
    return _sum_slots(y, weights, slot_inverse, tokens, top_k)


def slot_sum(rows: Tensor, slot_inverse: Tensor, top_k: int) -> Tensor:
    """out[t] = sum_j rows[slot_inverse[t * k + j]] (the combine with unit weights: no weights read)."""
    if not (rows.is_contiguous() and slot_inverse.is_contiguous()) or rows.shape[0] != slot_inverse.numel():
        raise ValueError(f"moe_slot_sum kernels: contiguous rows [{slot_inverse.numel()}, dim] and slot_inverse, got "
                         f"{tuple(rows.shape)}")
    return _sum_slots(rows, None, slot_inverse, slot_inverse.numel() // top_k, top_k)


def _sum_slots(y: Tensor, weights: Tensor | None, slot_inverse: Tensor, tokens: int, top_k: int) -> Tensor:
    cols = y.shape[1]
    out = y.new_empty(tokens, cols)
    if tokens and cols:
        grid = (tokens, triton.cdiv(cols, BLOCK))
        _combine_forward_kernel[grid](y, y if weights is None else weights, slot_inverse, out, N_COLS=cols, K=top_k,
                                      K_PAD=triton.next_power_of_2(top_k), BLOCK=BLOCK, WEIGHTED=weights is not None)
    return out


def combine_backward(grad: Tensor, y: Tensor, weights: Tensor, slot_inverse: Tensor) -> tuple[Tensor, Tensor]:
    tokens, top_k, cols = _check(y, weights, slot_inverse)
    if tuple(grad.shape) != (tokens, cols) or not grad.is_contiguous():
        raise ValueError(f"moe_combine kernels: the gradient must be contiguous [{tokens}, {cols}], got "
                         f"{tuple(grad.shape)}")
    d_y, d_weights = torch.empty_like(y), torch.empty_like(weights)
    if tokens and cols:
        _combine_backward_kernel[(tokens,)](grad, y, weights, slot_inverse, d_y, d_weights, N_COLS=cols, K=top_k,
                                            K_PAD=triton.next_power_of_2(top_k), BLOCK=BLOCK)
    elif tokens:
        d_weights.zero_()
    return d_y, d_weights
