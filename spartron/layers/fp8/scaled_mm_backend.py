"""Dense FP8 GEMMs through torch's blockwise `scaled_mm` (cuBLASLt's DeepSeek-style scaling, sm90),
with Spartron's Triton quantisation. Scale layouts are cuBLAS's: 1x128 scales outer-dim-major,
128x128 scales of the column-major right operand as the transpose of the row-major [N/128, K/128].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from spartron.layers.fp8 import triton_backend as tb


def linear_forward(x: Tensor, w: Tensor, pow2: bool) -> Tensor:
    xq, xs = tb.quantize_rows(x, pow2)  # xs [K/128, M]
    wq, ws = tb.quantize_blocks(w, pow2)  # ws [N/128, K/128]
    return F.scaled_mm(xq, wq.t(), xs.t(), F.ScalingType.BlockWise1x128, ws.t(), F.ScalingType.BlockWise128x128,
                       output_dtype=x.dtype)


def linear_backward(g: Tensor, x: Tensor, w: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    m = x.shape[0]
    if m % 128:
        raise ValueError(f"model.fp8.backend = 'torch_scaled_mm': the wgrad GEMM contracts over the tokens, "
                         f"{m} rows is not a multiple of 128 (use backend 'triton')")
    gq, gs = tb.quantize_rows(g, pow2)
    wq, ws = tb.quantize_blocks(w, pow2)
    dx = F.scaled_mm(gq, wq.t().contiguous().t(), gs.t(), F.ScalingType.BlockWise1x128,
                     ws.t().contiguous().t(), F.ScalingType.BlockWise128x128, output_dtype=x.dtype)
    one = torch.tensor([m], dtype=torch.int32, device=x.device)
    gt, gts = tb.quantize_cols_grouped(g, one, pow2)  # [N, M], scales [N, M/128 + 1]
    xt, xts = tb.quantize_cols_grouped(x, one, pow2)  # [K, M]
    tiles = m // 128
    dw = F.scaled_mm(gt, xt.t(), gts[:, :tiles].t().contiguous().t(), F.ScalingType.BlockWise1x128,
                     xts[:, :tiles].t().contiguous(), F.ScalingType.BlockWise1x128, output_dtype=w.dtype)
    return dx, dw
