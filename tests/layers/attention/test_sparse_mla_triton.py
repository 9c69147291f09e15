"""The Triton sparse-MLA kernels behind `spartron::sparse_mla` on CUDA.

CPU: the dispatch (CUDA has its own kernel, CPU runs the reference) and the shape limits. GPU (lent
H200, `pytest -m gpu`): forward and backward against the float64 reference at several shapes, with
invalid ids, short rows and an empty query; norm-wise relative error <= 1e-2 and nothing non-finite.
"""

from __future__ import annotations

import pytest
import torch

from spartron.layers.attention import sparse_mla_triton
from spartron.layers.attention.sparse_mla import reference_backward, reference_forward, sparse_mla

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the Triton sparse-MLA kernels")


# --- CPU -----------------------------------------------------------------------------------------

def test_cuda_has_its_own_kernel_and_cpu_keeps_the_reference():
    for op in ("spartron::sparse_mla", "spartron::sparse_mla_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    # the kernels reject float64 and head dim 6; the CPU path takes both, so it is the reference
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 2, 6, dtype=torch.float64, generator=g)
    kv = torch.randn(1, 4, 6, dtype=torch.float64, generator=g)
    ids = torch.tensor([[[0, 1], [2, -1], [3, 0]]], dtype=torch.int32)
    out, lse = sparse_mla(q, kv, ids, 0.5, 4)
    ref_out, ref_lse = reference_forward(q, kv, ids, 0.5, 4, 2)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("d, d_v, dtype, message", [
    (320, 256, torch.bfloat16, "needs head dim 576 .kv_lora 512 \\+ rope 64. and d_v 512; got head dim 320, d_v 256"),
    (576, 448, torch.bfloat16, "got head dim 576, d_v 448"),
    (576, 512, torch.float32, "needs bfloat16 or float16 inputs; got torch.float32"),
])
def test_shape_limits_are_errors_naming_the_limit(d, d_v, dtype, message):
    q = torch.zeros(1, 2, 4, d, dtype=dtype)
    kv = torch.zeros(1, 2, d, dtype=dtype)
    with pytest.raises(ValueError, match=message):
        sparse_mla_triton.check_supported(q, kv, d_v)


def test_supported_shapes_pass_the_check():
    for dtype in (torch.bfloat16, torch.float16):
        sparse_mla_triton.check_supported(torch.zeros(1, 1, 3, 576, dtype=dtype),
                                          torch.zeros(1, 1, 576, dtype=dtype), 512)


def test_head_block_follows_the_head_count():
    assert [sparse_mla_triton.forward_config(h).block_h for h in (1, 4, 16, 32, 33, 64, 128)] == \
        [16, 16, 16, 16, 64, 64, 64]
    assert [sparse_mla_triton.backward_config(h).block_h for h in (16, 64, 128)] == [16, 64, 64]


# --- GPU -----------------------------------------------------------------------------------------

def _ids(b: int, s_q: int, s_kv: int, k: int, g: torch.Generator, shuffle: bool) -> torch.Tensor:
    """Causal random distinct ids padded with -1 at the end (early queries see fewer than k keys, as
    top-k leaves them), optionally shuffled along the row, then some scattered -1 / out-of-range ids
    and one query with none at all."""
    t = torch.arange(s_q, device="cuda")[:, None] + (s_kv - s_q)
    scores = torch.rand(b, s_q, s_kv, device="cuda", generator=g)
    scores = scores.masked_fill(torch.arange(s_kv, device="cuda")[None, None] > t, float("-inf"))
    kk = min(k, s_kv)
    vals, ids = scores.topk(kk, dim=-1)
    ids = torch.where(torch.isfinite(vals), ids, -1).to(torch.int32)
    if kk < k:
        ids = torch.cat([ids, ids.new_full((b, s_q, k - kk), -1)], -1)
    if shuffle:  # the kernels stop at the last valid slot; holes before it must still be skipped
        ids = ids[..., torch.randperm(k, device="cuda", generator=g)]
    holes = torch.rand(ids.shape, device="cuda", generator=g) < 0.05
    ids = torch.where(holes, -1, ids)
    ids[..., 0] = torch.where(torch.rand(b, s_q, device="cuda", generator=g) < 0.05, s_kv, ids[..., 0])
    ids[0, s_q // 2] = -1  # an empty query
    return ids


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


CASES = [  # (batch, s_q, s_kv, heads, top-k, shuffled ids)
    (1, 333, 333, 16, 100, True),  # lengths off every block size
    (1, 333, 333, 16, 100, False),
    (2, 257, 300, 64, 77, True),
    (2, 257, 300, 64, 77, False),
    (1, 190, 190, 128, 64, True),
    (1, 120, 120, 4, 40, True),  # fewer heads than a head block
    (2, 1000, 1000, 48, 256, False),
    (1, 16384, 16384, 16, 2048, False),
    (1, 16384, 16384, 64, 2048, False),
    (1, 4096, 4096, 128, 2048, True),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("b, s_q, s_kv, h, k, shuffle", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_kernels_match_float64_reference(b, s_q, s_kv, h, k, shuffle, dtype):
    g = torch.Generator(device="cuda").manual_seed(s_q * 131 + h)
    q = torch.randn(b, s_q, h, 576, device="cuda", generator=g).to(dtype)
    kv = torch.randn(b, s_kv, 576, device="cuda", generator=g).to(dtype)
    ids = _ids(b, s_q, s_kv, k, g, shuffle)
    scale = 192 ** -0.5
    go = torch.randn(b, s_q, h, 512, device="cuda", generator=g).to(dtype)
    gl = torch.randn(b, s_q, h, device="cuda", generator=g)

    qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = sparse_mla(qg, kvg, ids, scale, 512)
    ((out.float() * go.float()).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * gl).sum()).backward()

    chunk = 256
    ref_out, ref_lse = reference_forward(q.double(), kv.double(), ids, scale, 512, chunk)
    gl_ref = torch.where(torch.isfinite(ref_lse), gl.double(), 0.0)
    ref_dq, ref_dkv = reference_backward(go.double(), gl_ref, q.double(), kv.double(), ids, ref_lse, scale,
                                         512, chunk)
    empty = ~((ids >= 0) & (ids < s_kv)).any(-1)
    assert empty[0, s_q // 2]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), empty[..., None].expand_as(lse))
    assert torch.all(out[empty] == 0)
    fin = torch.isfinite(ref_lse)
    errors = dict(out=_rel(out, ref_out), lse=_rel(lse[fin], ref_lse[fin]), dq=_rel(qg.grad, ref_dq),
                  dkv=_rel(kvg.grad, ref_dkv))
    for name, t in dict(out=out, dq=qg.grad, dkv=kvg.grad).items():
        assert torch.isfinite(t).all(), f"{name} has non-finite values"
    print(f"rel errors b={b} s_q={s_q} s_kv={s_kv} h={h} k={k} shuffled={shuffle}:",
          " ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    assert all(e <= 1e-2 for e in errors.values()), errors


VARIANTS = [  # block configs other than the defaults, so a change of default stays tested
    ("fwd", sparse_mla_triton.KernelConfig(64, 32, 8, 2)),
    ("fwd", sparse_mla_triton.KernelConfig(16, 32, 4, 2)),
    ("bwd", sparse_mla_triton.KernelConfig(64, 32, 8, 1)),
    ("bwd", sparse_mla_triton.KernelConfig(16, 32, 4, 2)),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind, cfg", VARIANTS)
def test_kernel_block_configs_match_float64_reference(kind, cfg):
    b, s_q, s_kv, h, k = 2, 257, 300, 64 if cfg.block_h == 64 else 16, 200
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(b, s_q, h, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(b, s_kv, 576, device="cuda", generator=g).bfloat16()
    ids = _ids(b, s_q, s_kv, k, g, shuffle=False)
    scale = 192 ** -0.5
    ref_out, ref_lse = reference_forward(q.double(), kv.double(), ids, scale, 512, 64)
    if kind == "fwd":
        out, lse = sparse_mla_triton.forward(q, kv, ids, scale, 512, cfg)
        fin = torch.isfinite(ref_lse)
        errors = dict(out=_rel(out, ref_out), lse=_rel(lse[fin], ref_lse[fin]))
    else:
        out, lse = sparse_mla_triton.forward(q, kv, ids, scale, 512)
        go = torch.randn(b, s_q, h, 512, device="cuda", generator=g).bfloat16()
        gl = torch.zeros(b, s_q, h, device="cuda")
        dq, dkv = sparse_mla_triton.backward(go, gl, q, kv, ids, out, lse, scale, 512, cfg)
        ref_dq, ref_dkv = reference_backward(go.double(), gl.double(), q.double(), kv.double(), ids, ref_lse,
                                             scale, 512, 64)
        errors = dict(dq=_rel(dq, ref_dq), dkv=_rel(dkv, ref_dkv))
        assert torch.isfinite(dq).all() and torch.isfinite(dkv).all()
    print(f"rel errors {kind} {cfg}:", " ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    assert all(e <= 1e-2 for e in errors.values()), errors


@pytest.mark.gpu
@needs_cuda
def test_cuda_float32_is_an_error_not_a_fallback():
    q = torch.zeros(1, 2, 16, 576, device="cuda")
    kv = torch.zeros(1, 2, 576, device="cuda")
    ids = torch.zeros(1, 2, 2, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="needs bfloat16 or float16 inputs; got torch.float32"):
        sparse_mla(q, kv, ids, 0.1, 512)
