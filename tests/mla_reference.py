"""The literal per-head MLA attention scores (non-absorbed: every head's own keys from wkv_b), the reference the
DSA tests compare the absorbed kernels, the indexer KL and the indexer-recall metric with."""

from __future__ import annotations

import torch

from spartron.layers.attention.mla import MLA
from spartron.layers.attention.rope import apply_rope, mla_softmax_scale, rope_cos_sin


def per_head_scores(m: MLA, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale * q . k per head [B, H, S_q, S_k], unmasked; cos; sin) of one MLA layer on x [B, S, D]."""
    cfg = m.cfg.mla
    b, n, _ = x.shape
    h, dn = m.n_heads, cfg.qk_nope_head_dim
    cos, sin = rope_cos_sin(pos, cfg)
    q = m.wq_b(m.q_norm(m.wq_a(x))).view(b, n, h, -1)
    q = torch.cat([q[..., :dn], apply_rope(q[..., dn:], cos, sin, True)], -1)
    kv_a = m.wkv_a(x)
    k_pe = apply_rope(kv_a[..., cfg.kv_lora_rank:], cos, sin, True)
    k_nope = m.wkv_b(m.kv_norm(kv_a[..., :cfg.kv_lora_rank])).view(b, n, h, -1)[..., :dn]
    k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, h, -1)], -1)
    return torch.einsum("bthd,bshd->bhts", q, k) * mla_softmax_scale(cfg), cos, sin
