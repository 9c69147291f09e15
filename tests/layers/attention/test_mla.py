"""MLA against a literal re-statement of DeepSeek-V3 attention, RoPE / YaRN, RMSNorm."""

from __future__ import annotations

import math

import pytest
import torch

from spartron.layers.attention.mla import MLA
from spartron.layers.attention.rope import mla_softmax_scale, rope_inv_freq
from spartron.layers.config import ModelConfig
from spartron.layers.norms import RMSNorm

MLA_SHAPES = dict(q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)


def make_cfg(dsa=None, yarn=None, n_layers=3, first_k_dense=1, **mla):
    mla_cfg = {**MLA_SHAPES, **mla}
    if yarn is not None:
        mla_cfg["yarn"] = yarn
    return ModelConfig.model_validate(dict(dim=16, n_heads=3, n_layers=n_layers, first_k_dense=first_k_dense,
                                           mla=mla_cfg, dsa=dsa))


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3 + (1.0 if p.dim() == 1 else 0.0))


def literal_rope(x, positions, inv_freq):
    """DeepSeek reference style: consecutive pairs as complex numbers times e^{i * pos * freq}."""
    angles = positions.double()[:, None] * inv_freq[None]
    rot = torch.polar(torch.ones_like(angles), angles)  # [S, d/2]
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 3) + (rot.shape[-1],)
    return torch.view_as_real(xc * rot.view(shape)).flatten(-2).to(x.dtype)


def literal_mla(m: MLA, x, positions, allowed):
    """Per-head loops; allowed[b, t, s] says which keys query t sees."""
    cfg = m.cfg.mla
    b, s, _ = x.shape
    h, dn, dr, dv = m.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    inv_freq = rope_inv_freq(dr, cfg.rope_theta, cfg.yarn)
    q = m.wq_b(m.q_norm(m.wq_a(x))).view(b, s, h, dn + dr)
    kv_a = m.wkv_a(x)
    latent = m.kv_norm(kv_a[..., : cfg.kv_lora_rank])
    k_pe = literal_rope(kv_a[..., cfg.kv_lora_rank :], positions, inv_freq)
    kv = m.wkv_b(latent).view(b, s, h, dn + dv)
    outs = []
    for head in range(h):
        qh = torch.cat([q[:, :, head, :dn], literal_rope(q[:, :, head, dn:], positions, inv_freq)], -1)
        kh = torch.cat([kv[:, :, head, :dn], k_pe], -1)
        scores = qh @ kh.transpose(1, 2) * mla_softmax_scale(cfg)
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.softmax(scores, -1) @ kv[:, :, head, dn:])
    return m.wo(torch.cat(outs, -1))


def test_dense_mla_matches_literal_reference():
    cfg = make_cfg()
    m = MLA(cfg, 0).double()
    randomize(m)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    positions = torch.arange(7)
    out = m(x, positions)
    assert out["dsa_topk_ids"] is None and out["indexer_loss"] is None
    causal = torch.ones(7, 7, dtype=torch.bool).tril().expand(2, 7, 7)
    expected = literal_mla(m, x, positions, causal)
    torch.testing.assert_close(out["hidden_states"], expected, rtol=1e-10, atol=1e-10)


def test_dense_mla_with_yarn_matches_literal_reference():
    cfg = make_cfg(yarn=dict(factor=8.0, original_max_position_embeddings=4, mscale=0.7, mscale_all_dim=0.7))
    m = MLA(cfg, 0).double()
    randomize(m)
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None]
    out = m(x, torch.arange(6))["hidden_states"]
    torch.testing.assert_close(out, literal_mla(m, x, torch.arange(6), causal), rtol=1e-10, atol=1e-10)


def test_query_without_lora_uses_wq():
    cfg = make_cfg(q_lora_rank=0)
    m = MLA(cfg, 0)
    assert not hasattr(m, "wq_a") and m.wq.weight.shape == (3 * 10, 16)
    assert m(torch.randn(1, 5, 16), torch.arange(5))["hidden_states"].shape == (1, 5, 16)


def test_sparse_mla_layer_matches_literal_reference_with_its_ids():
    dsa = dict(n_index_heads=2, index_head_dim=8, index_topk=3, topk_freq=2)
    cfg = make_cfg(dsa=dsa)
    source = MLA(cfg, 1).double()
    randomize(source)
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    out = source(x, torch.arange(8))
    ids = out["dsa_topk_ids"]
    assert ids.shape == (2, 8, 3) and ids.dtype == torch.int32
    allowed = torch.zeros(2, 8, 9, dtype=torch.bool).scatter_(-1, torch.where(ids < 0, 8, ids).long(), True)
    allowed = allowed[..., :8]
    assert torch.all(allowed <= torch.ones(8, 8, dtype=torch.bool).tril())  # ids are causal
    expected = literal_mla(source, x, torch.arange(8), allowed)
    torch.testing.assert_close(out["hidden_states"], expected, rtol=1e-10, atol=1e-10)


def test_sparse_with_all_keys_equals_dense_mla():
    """The absorbed (DSA) path with top-k >= seq is dense MLA with the same weights."""
    dense_layer = MLA(make_cfg(), 0).double()
    sparse_layer = MLA(make_cfg(dsa=dict(n_index_heads=2, index_head_dim=8, index_topk=64)), 1).double()
    randomize(dense_layer)
    sparse_layer.load_state_dict(dense_layer.state_dict(), strict=False)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    a, b = dense_layer(x, torch.arange(6)), sparse_layer(x, torch.arange(6))
    torch.testing.assert_close(a["hidden_states"], b["hidden_states"], rtol=1e-10, atol=1e-10)


def test_positions_offset_shifts_rope_not_causality():
    m = MLA(make_cfg(), 0).double()
    randomize(m)
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    out = m(x, torch.arange(5) + 100)["hidden_states"]
    torch.testing.assert_close(out, literal_mla(m, x, torch.arange(5) + 100, causal), rtol=1e-10, atol=1e-10)


def test_yarn_frequencies_and_softmax_scale():
    from spartron.layers.config import YarnConfig

    yarn = YarnConfig(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                      mscale=1.0, mscale_all_dim=1.0)
    inv = rope_inv_freq(64, 10000.0, yarn)
    base = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    # correction range for V3 shapes: dims below low keep their frequency, above high are divided by 40
    low = math.floor(64 * math.log(4096 / (32 * 2 * math.pi)) / (2 * math.log(10000.0)))
    high = math.ceil(64 * math.log(4096 / (1 * 2 * math.pi)) / (2 * math.log(10000.0)))
    assert (low, high) == (10, 23)
    torch.testing.assert_close(inv[:low], base[:low])
    torch.testing.assert_close(inv[high:], base[high:] / 40.0)
    mla = make_cfg(yarn=dict(factor=40.0, mscale_all_dim=1.0), qk_nope_head_dim=128, qk_rope_head_dim=64).mla
    assert mla_softmax_scale(mla) == pytest.approx(192**-0.5 * (0.1 * math.log(40.0) + 1) ** 2)


def test_rmsnorm_matches_formula():
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(8.0))
    x = torch.randn(3, 8)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * torch.arange(8.0)
    torch.testing.assert_close(norm(x), expected)
    assert norm(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("layer_idx, ids, message", [
    (0, torch.zeros(1, 5, 2, dtype=torch.int32), "dense-attention layer and takes no dsa_topk_ids"),
    (1, torch.zeros(1, 5, 2, dtype=torch.int32), "DSA source layer and takes no dsa_topk_ids"),
    (2, None, "is a DSA consumer: pass the source layer's"),
    (2, torch.zeros(1, 5, 2, dtype=torch.int64), "dsa_topk_ids must be int32"),
])
def test_ids_argument_checked_against_role(layer_idx, ids, message):
    cfg = make_cfg(dsa=dict(n_index_heads=2, index_head_dim=8, index_topk=2, topk_freq=2))
    with pytest.raises(ValueError, match=message):
        MLA(cfg, layer_idx)(torch.randn(1, 5, 16), torch.arange(5), ids)


def test_bad_positions_and_layer_index():
    m = MLA(make_cfg(), 0)
    with pytest.raises(ValueError, match="positions int64"):
        m(torch.randn(1, 5, 16), torch.arange(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="layer_idx 3 outside 0..2"):
        MLA(make_cfg(), 3)
