"""FP8 operands of the lightning indexer: float8 e4m3 with one amax scale per row.

ReLU commutes with a positive scale, so the scores of quantised operands are exact rescalings:
I[t,s] = k_scale[s] * sum_h (w[t,h] * q_scale[t,h]) ReLU(q8[t,h] . k8[s]). The reference and the
kernel quantise through this one function, so they differ only in summation order.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0  # largest finite float8 e4m3fn


def quantize_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """(float8 e4m3 x / scale, float32 scale [...]) with one scale per last-dim row (amax / 448)."""
    # times the fp32 reciprocal, not / 448: CUDA divides by a scalar that way and CPU does not (the Triton
    # quantisation of indexer_triton does the same multiply, so all three agree bitwise)
    scale = (x.float().abs().amax(-1) * (1.0 / FP8_MAX)).clamp_min(torch.finfo(torch.float32).tiny)
    return (x.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def fp8_operands(q: Tensor, weights: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q8, weights * q scale, k8, k scale): ReLU commutes with the positive scales, so the query
    scales fold into the head weights and the key scale multiplies each score column once."""
    q8, q_scale = quantize_fp8(q)
    k8, k_scale = quantize_fp8(k)
    return q8, weights.float() * q_scale, k8, k_scale
