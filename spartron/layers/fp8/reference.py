"""The "reference" backend: quantise, dequantise to fp32, multiply in fp32, round to the compute dtype.

An exact model of the blockwise recipe's quantisation error (the GPU kernels differ from it only by
the order of fp32 accumulation), on any device. Slow by design: it is the CPU path and the yardstick
the GPU kernels are tested against. Reads the expert counts on the host.

Every GEMM is a grouped one: a dense linear is one group of all rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spartron.layers.fp8.quant import (
    dequantize_blocks,
    dequantize_cols_grouped,
    dequantize_rows,
    quantize_blocks,
    quantize_cols_grouped,
    quantize_rows,
)


def _segments(counts: Tensor) -> list[tuple[int, int]]:
    out, start = [], 0
    for count in counts.tolist():
        out.append((start, start + count))
        start += count
    return out


def grouped_forward(x: Tensor, w: Tensor, counts: Tensor, pow2: bool) -> Tensor:
    """out[rows of e] = x[rows of e] @ w[e]^T; x [M, K] (1x128), w [E, N, K] (128x128)."""
    xd = dequantize_rows(*quantize_rows(x, pow2))
    wd = dequantize_blocks(*quantize_blocks(w, pow2))
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    for e, (lo, hi) in enumerate(_segments(counts)):
        out[lo:hi] = xd[lo:hi] @ wd[e].t()
    return out.to(x.dtype)


def grouped_backward(grad: Tensor, x: Tensor, w: Tensor, counts: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    """dgrad: grad (1x128 along N) @ w (the same 128x128 blocks); wgrad: grad^T @ x, both 128x1 along
    the tokens of each expert."""
    gd = dequantize_rows(*quantize_rows(grad, pow2))
    wd = dequantize_blocks(*quantize_blocks(w, pow2))
    gt = dequantize_cols_grouped(*quantize_cols_grouped(grad, counts, pow2), counts)  # [N, M]
    xt = dequantize_cols_grouped(*quantize_cols_grouped(x, counts, pow2), counts)  # [K, M]
    dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    dw = torch.zeros(w.shape, dtype=torch.float32, device=x.device)
    for e, (lo, hi) in enumerate(_segments(counts)):
        dx[lo:hi] = gd[lo:hi] @ wd[e]
        dw[e] = gt[:, lo:hi] @ xt[:, lo:hi].t()
    return dx.to(x.dtype), dw.to(w.dtype)
