"""The "reference" backend's primitives: quantise (spartron.layers.fp8.quant), then dequantise to
fp32, multiply in fp32 and round to the output dtype.

An exact model of the blockwise recipe's quantisation error (the GPU kernels differ from it only by
the order of fp32 accumulation), on any device. Slow by design: it is the CPU path and the yardstick
the GPU kernels are tested against. Reads the expert counts on the host. The GEMM sequences over
these primitives are spartron.layers.fp8.gemms'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from spartron.layers.fp8 import quant
from spartron.layers.fp8.quant import (
    dequantize_blocks,
    dequantize_cols_grouped,
    dequantize_rows,
    gemm_rows,
    group_counts,
    one_group,
    quantize_blocks,
    quantize_blocks_t,
    rows_in_order,
    slot_layout,
)

__all__ = ["dgrad", "fprop", "gemm_rows", "group_counts", "one_group",
           "quantize_blocks", "quantize_blocks_both", "quantize_blocks_cat", "quantize_blocks_t",
           "quantize_cols_grouped", "quantize_rows", "slot_layout", "swiglu_quantize_rows", "wgrad"]


def quantize_rows(x: Tensor, pow2: bool, index: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """quant.quantize_rows of x, or of x[index] (the rows in a gathered order)."""
    return quant.quantize_rows(x if index is None else x.index_select(0, index), pow2)


def quantize_cols_grouped(x: Tensor, counts: Tensor, pow2: bool, index: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """quant.quantize_cols_grouped of x, or of x[index]."""
    return quant.quantize_cols_grouped(x if index is None else x.index_select(0, index), counts, pow2)


def _segments(counts: Tensor, rows: int) -> list[tuple[int, int]]:
    out, start = [], 0
    for count in counts.tolist():
        out.append((start, start + count))
        start += count
    if start != rows:
        raise ValueError(f"fp8 blockwise: tokens_per_expert sums to {start}, x has {rows} rows")
    return out


def fprop(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, counts: Tensor, dtype: torch.dtype) -> Tensor:
    """out[rows of e] = x[rows of e] @ w[e]^T: x [M, K] 1x128 (scales [K/128, M]), w [E, N, K] 128x128."""
    xd, wd = dequantize_rows(xq, xs), dequantize_blocks(wq, ws)
    out = torch.zeros(xq.shape[0], wq.shape[1], dtype=torch.float32, device=xq.device)
    for e, (lo, hi) in enumerate(_segments(counts, xq.shape[0])):
        out[lo:hi] = xd[lo:hi] @ wd[e].t()
    return out.to(dtype)


def dgrad(gq: Tensor, gs: Tensor, wtq: Tensor, wts: Tensor, counts: Tensor, dtype: torch.dtype,
          rows: Tensor | None = None, k: int = 1) -> Tensor:
    """dx[rows of e] = grad[rows of e] @ w[e]: grad [M, N] 1x128 along N, w^T [E, K, N] the forward's
    blocks transposed (quantize_blocks_t). `rows`, `k`: quant.rows_in_order (every backend's dgrad takes them:
    "deep_gemm" folds them into its own gather from the slot layout)."""
    gd, wd = dequantize_rows(gq, gs), dequantize_blocks(wtq, wts).transpose(-2, -1).contiguous()
    out = torch.zeros(gq.shape[0], wtq.shape[1], dtype=torch.float32, device=gq.device)
    for e, (lo, hi) in enumerate(_segments(counts, gq.shape[0])):
        out[lo:hi] = gd[lo:hi] @ wd[e]
    return rows_in_order(out.to(dtype), rows, k)


def wgrad(gt: Tensor, gts: Tensor, xt: Tensor, xts: Tensor, counts: Tensor, dtype: torch.dtype) -> Tensor:
    """dw[e] = grad^T[:, rows of e] @ x[rows of e]: grad^T and x^T in the slot-aligned column layout
    ([N, T*128] and [K, T*128], 128x1 along the tokens of each expert) -> [E, N, K]."""
    gd, xd = dequantize_cols_grouped(gt, gts, counts), dequantize_cols_grouped(xt, xts, counts)  # token order
    out = torch.zeros(len(counts), gt.shape[0], xt.shape[0], dtype=torch.float32, device=gt.device)
    for e, (lo, hi) in enumerate(_segments(counts, gd.shape[1])):
        out[e] = gd[:, lo:hi] @ xd[:, lo:hi].t()
    return out.to(dtype)


def swiglu_quantize_rows(gate: Tensor, up: Tensor, pow2: bool, index: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """1x128 quantisation of silu(gate) * up (of their rows `index`), computed as spartron.layers.ffn.swiglu
    computes it (the value the unfused path quantises); h is a temporary, never kept."""
    return quantize_rows(F.silu(gate) * up, pow2, index)


def quantize_blocks_cat(weights: tuple[Tensor, ...], pow2: bool, transpose: bool = False) -> tuple[Tensor, Tensor]:
    """The 128x128 blocks (or transposed blocks) of the weights concatenated along N (the experts'
    [w1; w3]): every N is a multiple of 128, so no block mixes two weights."""
    w = torch.cat(weights, dim=-2)
    return quantize_blocks_t(w, pow2) if transpose else quantize_blocks(w, pow2)


def quantize_blocks_both(weights: tuple[Tensor, ...], pow2: bool) -> list[Tensor]:
    """[q, s, q^T, s^T] of the weights concatenated along N (quantize_blocks_cat both ways)."""
    return [*quantize_blocks_cat(weights, pow2), *quantize_blocks_cat(weights, pow2, transpose=True)]
