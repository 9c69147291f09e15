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


def test_gluon_forward_takes_only_its_block_shape():
    q = torch.zeros(1, 2, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 576, dtype=torch.bfloat16)
    ids = torch.zeros(1, 2, 2, dtype=torch.int32)
    for bad in [(16, 64, 4, 1), (16, 64, 4, 3), (64, 64, 4, 2), (64, 128, 8, 2), (64, 64, 8, 4)]:
        cfg = sparse_mla_triton.KernelConfig(*bad, gluon=True)
        with pytest.raises(ValueError, match="Gluon forward: needs block_h 64, 8 warps, block_k 32 or 64, 2 or 3 "
                                             "stages; got KernelConfig.block_h={}, block_k={}, num_warps={}, "
                                             "num_stages={}".format(*bad)):
            sparse_mla_triton.forward(q, kv, ids, 0.1, 512, cfg)
    with pytest.raises(ValueError, match="Gluon forward: needs an sm90 .Hopper. GPU for its warpgroup MMA; got cpu"):
        sparse_mla_triton.forward(q, kv, ids, 0.1, 512, sparse_mla_triton.forward_config(64))


def test_head_block_follows_the_head_count():
    assert [sparse_mla_triton.forward_config(h).block_h for h in (1, 4, 16, 32, 33, 64, 128)] == \
        [16, 16, 16, 16, 64, 64, 64]
    assert [sparse_mla_triton.backward_config(h).block_h for h in (16, 64, 128)] == [16, 64, 64]
    # 64-row blocks: the Gluon forward and the three-walk backward; 16 rows: the Triton kernels, one walk
    assert [sparse_mla_triton.forward_config(h).gluon for h in (1, 16, 32, 33, 128)] == \
        [False, False, False, True, True]
    assert not sparse_mla_triton.forward_config(64, hopper=False).gluon  # its wgmma is sm90 only
    assert not sparse_mla_triton.is_hopper(torch.device("cpu"))
    assert [sparse_mla_triton.backward_config(h).walks for h in (16, 32, 33, 128)] == [1, 1, 3, 3]
    # 16 rows: [keys, columns] dkv tiles (no shared-memory layout change before the atomics)
    assert [sparse_mla_triton.backward_config(h).dkv_key_rows for h in (16, 32, 33, 128)] == \
        [True, True, False, False]
    # 16 rows: the gathers pipelined (3 stages) while the float32 dkv stays in L2, else one stage
    assert [sparse_mla_triton.backward_config(16, fits).num_stages for fits in (True, False)] == [3, 1]
    assert sparse_mla_triton.backward_config(64, False) == sparse_mla_triton.backward_config(64, True)
    assert sparse_mla_triton.dkv_in_l2(torch.zeros(1, 65536, 576))  # CPU tensors: no L2 to ask


def test_backward_walks_other_than_1_or_3_are_an_error():
    q = torch.zeros(1, 2, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 576, dtype=torch.bfloat16)
    ids = torch.zeros(1, 2, 2, dtype=torch.int32)
    lse = torch.zeros(1, 2, 16)
    cfg = sparse_mla_triton.KernelConfig(16, 32, 4, 1, walks=2)
    with pytest.raises(ValueError, match="sparse_mla backward kernel: walks must be 1 or 3; got 2"):
        sparse_mla_triton.backward(q[..., :512], lse, q, kv, ids, q[..., :512], lse, 0.1, 512, cfg)


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
    (1, 16384, 16384, 128, 2048, False),
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
    ("fwd", sparse_mla_triton.KernelConfig(64, 64, 8, 2)),
    ("fwd", sparse_mla_triton.KernelConfig(16, 32, 4, 2)),
    ("fwd", sparse_mla_triton.KernelConfig(16, 64, 4, 2)),  # the Triton 16-row forward: Hopper's default before
    ("fwd", sparse_mla_triton.KernelConfig(64, 64, 8, 2, gluon=True)),
    ("fwd", sparse_mla_triton.KernelConfig(64, 64, 8, 2, gluon=True, gather_early=False)),
    ("fwd", sparse_mla_triton.KernelConfig(64, 32, 8, 3, gluon=True)),
    ("bwd", sparse_mla_triton.KernelConfig(64, 32, 8, 1)),
    ("bwd", sparse_mla_triton.KernelConfig(64, 64, 8, 1)),
    ("bwd", sparse_mla_triton.KernelConfig(16, 32, 4, 2)),
    ("bwd", sparse_mla_triton.KernelConfig(64, 32, 8, 2, walks=3, stages2=2)),
    ("bwd", sparse_mla_triton.KernelConfig(16, 32, 4, 2, walks=3, stages2=2)),
    ("bwd", sparse_mla_triton.KernelConfig(16, 32, 4, 3, dkv_key_rows=True)),
    ("bwd", sparse_mla_triton.KernelConfig(16, 16, 4, 2, dkv_key_rows=True)),
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


def _case(b, s, h, k, seed, shuffle=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, s, h, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(b, s, 576, device="cuda", generator=g).bfloat16()
    ids = _ids(b, s, s, k, g, shuffle)
    go = torch.randn(b, s, h, 512, device="cuda", generator=g).bfloat16()
    return q, kv, ids, go


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("h", [16, 64])
def test_deterministic_dkv_is_bitwise_reproducible_and_accurate(h):
    b, s, k = 1, 4096, 2048
    q, kv, ids, go = _case(b, s, h, k, seed=11)
    scale = 192 ** -0.5
    gl = torch.zeros(b, s, h, device="cuda")
    out, lse = sparse_mla_triton.forward(q, kv, ids, scale, 512)
    runs = [sparse_mla_triton.backward(go, gl, q, kv, ids, out, lse, scale, 512, deterministic=True)
            for _ in range(3)]
    assert all(torch.equal(r[1], runs[0][1]) and torch.equal(r[0], runs[0][0]) for r in runs[1:])
    ref_out, ref_lse = reference_forward(q.double(), kv.double(), ids, scale, 512, 256)
    ref_dq, ref_dkv = reference_backward(go.double(), gl.double(), q.double(), kv.double(), ids, ref_lse, scale,
                                         512, 256)
    dq, dkv = runs[0]
    atomic_dkv = sparse_mla_triton.backward(go, gl, q, kv, ids, out, lse, scale, 512)[1]
    errors = dict(dq=_rel(dq, ref_dq), dkv=_rel(dkv, ref_dkv), atomic_dkv=_rel(atomic_dkv, ref_dkv))
    print(f"deterministic h={h}:", " ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    assert all(e <= 1e-2 for e in errors.values()), errors


@pytest.mark.gpu
@needs_cuda
def test_deterministic_flag_reaches_the_kernel_through_autograd():
    q, kv, ids, go = _case(1, 1024, 16, 256, seed=12)
    grads = []
    for _ in range(2):
        qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out, _ = sparse_mla(qg, kvg, ids, 0.1, 512, deterministic=True)
        out.backward(go)
        grads.append(kvg.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("h", [16, 128])
def test_kernels_under_cp2_equal_cp1(h):
    """CP layout: each rank's local queries (load-balanced shard) with their global-position ids attend
    over the all-gathered kv; out, lse and dq equal the CP=1 rows bitwise, and the ranks' dkv sum (what
    the all-gather's backward reduce-scatters) matches CP=1 and the float64 reference."""
    from spartron.layers.attention.context_parallel import shard_sequence

    b, s, k = 1, 4096, 2048
    q, kv, ids, go = _case(b, s, h, k, seed=13)
    scale = 192 ** -0.5
    gl = torch.zeros(b, s, h, device="cuda")
    out, lse = sparse_mla_triton.forward(q, kv, ids, scale, 512)
    dq, dkv = sparse_mla_triton.backward(go, gl, q, kv, ids, out, lse, scale, 512)
    dkv_sum = torch.zeros_like(kv, dtype=torch.float32)
    for rank in range(2):
        q_r, ids_r, go_r = (shard_sequence(t, 2, rank) for t in (q, ids, go))
        out_r, lse_r = sparse_mla_triton.forward(q_r.contiguous(), kv, ids_r.contiguous(), scale, 512)
        assert torch.equal(out_r, shard_sequence(out, 2, rank)) and torch.equal(lse_r, shard_sequence(lse, 2, rank))
        dq_r, dkv_r = sparse_mla_triton.backward(go_r.contiguous(), shard_sequence(gl, 2, rank).contiguous(),
                                                 q_r.contiguous(), kv, ids_r.contiguous(), out_r, lse_r, scale, 512)
        assert torch.equal(dq_r, shard_sequence(dq, 2, rank))
        dkv_sum += dkv_r.float()
    ref_out, ref_lse = reference_forward(q.double(), kv.double(), ids, scale, 512, 256)
    _, ref_dkv = reference_backward(go.double(), gl.double(), q.double(), kv.double(), ids, ref_lse, scale, 512, 256)
    errors = dict(cp_vs_cp1=_rel(dkv_sum, dkv.double()), cp_vs_float64=_rel(dkv_sum, ref_dkv))
    print(f"cp2 h={h}:", " ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    assert all(e <= 1e-2 for e in errors.values()), errors


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("h", [16, 64])
def test_kernels_at_64k_match_float64_on_sampled_queries(h):
    """64k tokens x top-k 2048: the kernels run over every query; out, lse and dq are checked on 256
    sampled queries, and dkv with the output gradient zero elsewhere (so the sampled queries' float64
    backward is the whole dkv)."""
    b, s, k = 1, 65536, 2048
    g = torch.Generator(device="cuda").manual_seed(14)
    q = torch.randn(b, s, h, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(b, s, 576, device="cuda", generator=g).bfloat16()
    ids = _ids(b, s, s, k, g, shuffle=False)
    rows = torch.randperm(s, device="cuda", generator=g)[:256].sort().values
    go = torch.zeros(b, s, h, 512, device="cuda", dtype=torch.bfloat16)
    go[:, rows] = torch.randn(b, rows.numel(), h, 512, device="cuda", generator=g).bfloat16()
    scale = 192 ** -0.5
    qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = sparse_mla(qg, kvg, ids, scale, 512)
    out.backward(go)
    qs, ids_s = q[:, rows].double(), ids[:, rows]
    ref_out, ref_lse = reference_forward(qs, kv.double(), ids_s, scale, 512, 64)
    ref_dq, ref_dkv = reference_backward(go[:, rows].double(), torch.zeros_like(ref_lse), qs, kv.double(), ids_s,
                                         ref_lse, scale, 512, 64)
    fin = torch.isfinite(ref_lse)
    errors = dict(out=_rel(out[:, rows], ref_out), lse=_rel(lse[:, rows][fin], ref_lse[fin]),
                  dq=_rel(qg.grad[:, rows], ref_dq), dkv=_rel(kvg.grad, ref_dkv))
    for name, t in dict(out=out, dq=qg.grad, dkv=kvg.grad).items():
        assert torch.isfinite(t).all(), f"{name} has non-finite values"
    print(f"64k h={h}:", " ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    assert all(e <= 1e-2 for e in errors.values()), errors
