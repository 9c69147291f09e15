"""Rotary position embedding with optional YaRN frequency scaling (DeepSeek-V3 convention).

Tables are computed from the explicit global positions on every call (a few hundred flops), so a
layer holds no position cache and context-parallel ranks, whose local tokens are not contiguous,
need nothing special.

Pairing conventions (both are DeepSeek's reference choices, kept so released weights load as-is):
- MLA rotates *interleaved* pairs (x[2i], x[2i+1]) of q_pe / k_pe;
- the DSA lightning indexer rotates *half-split* pairs (x[i], x[i + d/2]) of its first
  qk_rope_head_dim dims (DeepSeek-V3.2 reference, `interleaved=False`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from spartron.layers.config import MLAConfig, YarnConfig


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN attention-temperature factor 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_inv_freq(rope_dim: int, theta: float, yarn: YarnConfig | None,
                  device: torch.device | str | None = None) -> Tensor:
    """Inverse frequencies [rope_dim/2] (float64) on `device`. YaRN keeps fast-rotating dims (they
    already resolve long contexts), divides slow ones by `factor`, and ramps linearly in between.
    Built where it is used: a host table copied to the GPU would sync the host on every layer."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float64, device=device) / rope_dim
    inv_freq = 1.0 / theta**exponents
    if yarn is None:
        return inv_freq
    low = max(math.floor(_correction_dim(yarn.beta_fast, rope_dim, theta,
                                         yarn.original_max_position_embeddings)), 0)
    high = min(math.ceil(_correction_dim(yarn.beta_slow, rope_dim, theta,
                                         yarn.original_max_position_embeddings)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (keep frequency), 0: interpolate (divide by factor)
    return inv_freq / yarn.factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(yarn: YarnConfig | None) -> float:
    """Multiplier on cos/sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim) (HF DeepSeek-V3)."""
    if yarn is None:
        return 1.0
    return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)


def mla_softmax_scale(mla: MLAConfig) -> float:
    """qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek-V3)."""
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    if mla.yarn is not None:
        scale *= yarn_mscale(mla.yarn.factor, mla.yarn.mscale_all_dim) ** 2
    return scale


def rope_cos_sin(positions: Tensor, mla: MLAConfig) -> tuple[Tensor, Tensor]:
    """cos, sin tables [S, qk_rope_head_dim/2] (float64; `apply_rope` casts) for int64 `positions` [S], or
    [B, S, qk_rope_head_dim/2] for per-row positions [B, S] (packed documents: attention.doc_mask)."""
    inv_freq = rope_inv_freq(mla.qk_rope_head_dim, mla.rope_theta, mla.yarn, device=positions.device)
    angles = positions.to(torch.float64)[..., None] * inv_freq
    factor = rope_attention_factor(mla.yarn)
    return angles.cos() * factor, angles.sin() * factor


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotate the last dim of x [B, S, *heads, d] by tables [S, d/2] or [B, S, d/2]; computed in >= float32."""
    compute = torch.promote_types(x.dtype, torch.float32)
    rows = cos.shape[0] if cos.dim() == 3 else 1  # per-row tables: packed documents
    view = (rows, cos.shape[-2]) + (1,) * (x.dim() - 3) + (cos.shape[-1],)
    c, s = cos.to(compute).view(view), sin.to(compute).view(view)
    xf = x.to(compute)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = xf.chunk(2, dim=-1)
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return out.to(x.dtype)
