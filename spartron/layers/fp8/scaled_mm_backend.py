"""Dense FP8 GEMMs through torch's blockwise `scaled_mm` (cuBLASLt's DeepSeek-style scaling, sm90),
with Spartron's Triton quantisation.

`F.scaled_mm` (torch's `_scaled_mm_v2`) checks its scale layouts, and they are not Spartron's:
- 1x128 scales of an [R, K] operand: [R, K/128] with strides (1, R) (outer-dim-major). Spartron's
  row scales [K/128, R] are that buffer (a `.t()` view), its column scales [C, T] are stored
  slot-major (strides (1, C)): their first `tiles` slots are it as they are.
- 128x128 scales of the right operand [K, N] (contraction first): [L4, N/128] with strides (1, L4),
  L4 = K/128 rounded up to a multiple of 4 (cuBLASLt's padding): a copy when K/128 % 4 != 0.
The layout functions are pure torch, tested against torch's own shape checks on the meta device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rows_scale(s: Tensor) -> Tensor:
    """Spartron's 1x128 scales [K/128, R] -> torch's [R, K/128], strides (1, R) (a view)."""
    return s.t()


def cols_scale(s: Tensor, tiles: int) -> Tensor:
    """Spartron's one-group 128x1 column scales [C, T] (C rows of the transposed operand, T slots)
    -> torch's 1x128 scales [C, tiles] of that operand, strides (1, C) (a view when `s` is slot-major,
    as quantize_cols_grouped stores it)."""
    return s[:, :tiles].t().contiguous().t()


def block_scale(s: Tensor) -> Tensor:
    """128x128 scales [K/128, N/128] of the right operand [K, N] (K the contraction; any strides)
    -> torch's [L4, N/128] with strides (1, L4), rows past K/128 zero (cuBLASLt reads none of them)."""
    kb, nb = s.shape
    l4 = -(-kb // 4) * 4
    out = torch.zeros(nb, l4, dtype=s.dtype, device=s.device)
    out[:, :kb] = s.t()
    return out.t()


def fprop(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, dtype: torch.dtype) -> Tensor:
    """x [M, K] (1x128, scales [K/128, M]) @ w [N, K]^T (128x128, scales [N/128, K/128])."""
    return F.scaled_mm(xq, wq.t(), rows_scale(xs), F.ScalingType.BlockWise1x128, block_scale(ws.t()),
                       F.ScalingType.BlockWise128x128, output_dtype=dtype)


def dgrad(gq: Tensor, gs: Tensor, wtq: Tensor, wts: Tensor, dtype: torch.dtype) -> Tensor:
    """grad [M, N] (1x128 along N) @ w [N, K]: w given as quantize_blocks_t's w^T [K, N] (scales
    [K/128, N/128]), whose `.t()` is the column-major right operand cuBLASLt takes (no copy)."""
    return F.scaled_mm(gq, wtq.t(), rows_scale(gs), F.ScalingType.BlockWise1x128, block_scale(wts.t()),
                       F.ScalingType.BlockWise128x128, output_dtype=dtype)


def wgrad(gt: Tensor, gts: Tensor, xt: Tensor, xts: Tensor, dtype: torch.dtype) -> Tensor:
    """grad^T [N, M] @ x [M, K]: both 128x1 along the M tokens, in the slot-aligned column layout of one
    group (M a multiple of 128: T = M/128 + 1 slots, the last unused): the first M columns, as views."""
    tiles = gts.shape[1] - 1
    cols = tiles * 128
    return F.scaled_mm(gt[:, :cols], xt[:, :cols].t(), cols_scale(gts, tiles), F.ScalingType.BlockWise1x128,
                       cols_scale(xts, tiles), F.ScalingType.BlockWise1x128, output_dtype=dtype)


def linear_forward(x: Tensor, w: Tensor, pow2: bool) -> Tensor:
    from spartron.layers.fp8 import triton_backend as tb

    return fprop(*tb.quantize_rows(x, pow2), *tb.quantize_blocks(w, pow2), x.dtype)


def linear_backward(g: Tensor, x: Tensor, w: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    from spartron.layers.fp8 import triton_backend as tb

    m = x.shape[0]
    if m % 128:
        raise ValueError(f"model.fp8.backend = 'torch_scaled_mm': the wgrad GEMM contracts over the tokens, "
                         f"{m} rows is not a multiple of 128 (use backend 'triton')")
    dx = dgrad(*tb.quantize_rows(g, pow2), *tb.quantize_blocks_t(w, pow2), x.dtype)
    one = torch.tensor([m], dtype=torch.int32, device=x.device)
    dw = wgrad(*tb.quantize_cols_grouped(g, one, pow2), *tb.quantize_cols_grouped(x, one, pow2), w.dtype)
    return dx, dw
