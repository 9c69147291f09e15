"""DSA's query-chunked absorbed attention (model.dsa.attention_chunk, attention.sparse_mla_absorbed; issue 39):
one chunk covering every row is the unchunked path bitwise; several chunks give the unchunked output and query
gradients bitwise and the summed (weight, latent-row) gradients to rounding; selective AC keeps the op's
[S, H * v] output instead of the [S, H, kv_lora] latent, and replaying it changes no bit; the planner puts
chunked DSA below dense attention from 64k to 128k at 128 heads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spartron.layers.attention.absorb import absorb_output, absorb_query
from spartron.layers.attention.sparse_mla import sparse_mla
from spartron.layers.attention.sparse_mla_absorbed import sparse_mla_absorbed

sys.path.insert(0, str(Path(__file__).parent))
from test_dsa_memory import DIM, LORA, ROPE, H, K, V, make_layer, region_call  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
B, S, N, R, C, VD, KK = 2, 40, 8, 8, 16, 8, 6


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, 4, N + R, dtype=dtype, generator=g).requires_grad_()
    kv = torch.randn(B, S, C + R, dtype=dtype, generator=g).requires_grad_()
    w = torch.randn(4, N + VD, C, dtype=dtype, generator=g).requires_grad_()
    rows = []
    for t in range(S):  # causal ids, -1 past a row's visible keys
        picked = torch.randperm(t + 1, generator=g)[:KK]
        rows.append(torch.cat([picked, -torch.ones(KK - len(picked), dtype=torch.long)]))
    ids = torch.stack(rows)[None].expand(B, -1, -1).int().contiguous()
    return q, kv, w, ids, torch.randn(B, S, 4 * VD, dtype=dtype, generator=g)


def _run(dtype: torch.dtype, chunk: int | None) -> list[torch.Tensor]:
    q, kv, w, ids, grad = _inputs(dtype)
    q_nope, q_pe = q.split([N, R], -1)
    w_uk, w_uv = w[:, :N], w[:, N:]
    if chunk is None:  # the unchunked path, as mla.MLA._sparse runs it
        out = absorb_output(sparse_mla(absorb_query(q_nope, q_pe, w_uk), kv, ids, 0.3, C)[0], w_uv)
    else:
        out = sparse_mla_absorbed(q_nope, q_pe, kv, ids, w_uk, w_uv, 0.3, chunk)
    out.backward(grad)
    return [out.detach(), q.grad, kv.grad, w.grad]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("chunk", [S, 1000])
def test_one_chunk_is_the_unchunked_path_bitwise(dtype, chunk):
    for a, b in zip(_run(dtype, None), _run(dtype, chunk), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype, row_tol, tol", [(torch.float64, 1e-14, 1e-12), (torch.bfloat16, 1e-2, 2e-2)])
def test_chunks_keep_the_output_and_query_gradient_per_row_and_sums_to_rounding(dtype, row_tol, tol):
    """Each query row's output and gradient are computed from that row alone: chunked they equal the unchunked
    path up to the BLAS's rounding (bitwise where its per-row results do not depend on how many rows a call has;
    not so on an AVX512 EPYC's CPU BLAS, 5e-16 relative in float64); kv's and the weights' gradients sum over the
    chunks, to rounding."""
    ref = _run(dtype, None)
    out, dq, dkv, dw = _run(dtype, 7)
    for got, want in ((out, ref[0]), (dq, ref[1])):
        assert (got.double() - want.double()).abs().max() <= row_tol * want.double().abs().max()
    for got, want in ((dkv, ref[2]), (dw, ref[3])):
        assert (got.double() - want.double()).abs().max() <= tol * want.double().abs().max()


def test_a_chunk_below_one_row_is_refused():
    q, kv, w, ids, _ = _inputs(torch.float64)
    with pytest.raises(ValueError, match="sparse_mla_absorbed: chunk must be >= 1 query row, got 0"):
        sparse_mla_absorbed(q[..., :N], q[..., N:], kv, ids, w[:, :N], w[:, N:], 0.3, 0)


def _backward_calls(chunk: int, q_grad: bool, kv_grad: bool, uk_grad: bool, uv_grad: bool):
    """(the gradients, aten::bmm and spartron::sparse_mla_backward calls of the op's backward) with the inputs
    that need a gradient as given (a frozen weight, or a frozen layer's inputs, need none)."""
    q, kv, w, ids, grad = _inputs(torch.float64)
    q_nope, q_pe = (t.detach().requires_grad_(q_grad) for t in q.split([N, R], -1))
    kv = kv.detach().requires_grad_(kv_grad)
    w_uk, w_uv = w[:, :N].detach().requires_grad_(uk_grad), w[:, N:].detach().requires_grad_(uv_grad)
    out = sparse_mla_absorbed(q_nope, q_pe, kv, ids, w_uk, w_uv, 0.3, chunk)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.backward(grad)
    names = [e.name for e in prof.events()]
    grads = [t.grad for t in (q_nope, q_pe, kv, w_uk, w_uv)]
    return grads, names.count("aten::bmm"), names.count("spartron::sparse_mla_backward")


def test_the_backward_computes_only_the_gradients_its_inputs_need():
    """ctx.needs_input_grad: frozen w_uk / w_uv (a stage's trainable globs leave wkv_b out) skip their two products
    per chunk; with only w_uv trained no sparse backward runs; the gradients that are computed are bitwise the
    all-trained ones (it computed every gradient, the check can fail)."""
    everything, bmm_all, sparse_all = _backward_calls(7, True, True, True, True)
    assert sparse_all == 6  # one per chunk of 7 rows (40 rows)
    frozen_w, bmm_frozen, _ = _backward_calls(7, True, True, False, False)
    assert bmm_all - bmm_frozen == 2 * 6 and frozen_w[3:] == [None, None]
    for a, b in zip(everything[:3], frozen_w[:3], strict=True):
        assert torch.equal(a, b)
    only_uv, bmm_uv, sparse_uv = _backward_calls(7, False, False, False, True)
    assert sparse_uv == 0 and only_uv[:4] == [None] * 4 and torch.equal(only_uv[4], everything[4])
    assert bmm_uv <= bmm_frozen - 2 * 6  # per chunk at least d_lat's and d_nope's products skipped too


def _layer_grads(mode: str, chunk: int, ac: bool) -> list[torch.Tensor]:
    layer = make_layer(mode)
    layer.cfg.dsa.attention_chunk = chunk  # the layer reads it at each forward
    if ac:
        out, region, x = region_call(layer, 48)
    else:
        x = torch.randn(1, 48, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(48),
                        requires_grad=True)
        out = layer(x, torch.arange(48))
    loss = out["hidden_states"].square().sum() + (out["indexer_loss"] if out["indexer_loss"] is not None else 0)
    loss.backward()
    return [loss.detach(), x.grad, *(p.grad for p in layer.parameters() if p.grad is not None)]


@pytest.mark.parametrize("mode", ["kl_sparse", "frozen", "kl_dense"])
def test_a_dsa_layer_chunked_equals_unchunked_and_its_ac_replay_changes_no_bit(mode):
    unchunked, whole, chunked = (_layer_grads(mode, c, ac=False) for c in (0, 48, 11))
    assert len(unchunked) == (7 if mode == "frozen" else 12)
    for a, b in zip(unchunked, whole, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(unchunked[0], chunked[0])  # the loss: per-row outputs, and the KL target per row
    for a, b in zip(unchunked, chunked, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12 * b.abs().max().item())
    for a, b in zip(chunked, _layer_grads(mode, 11, ac=True), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["kl_sparse", "frozen", "kl_dense"])
def test_packed_documents_chunked_equal_unchunked(mode):
    """Block-causal ids (2-D positions, documents of 10 + 14 and 7 + 17 tokens) across chunk boundaries of 5."""
    positions = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]),
                             torch.cat([torch.arange(7), torch.arange(17)])])
    runs = []
    for chunk in (0, 5):
        layer = make_layer(mode)
        layer.cfg.dsa.attention_chunk = chunk
        x = torch.randn(2, 24, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                        requires_grad=True)
        out = layer(x, positions)
        loss = out["hidden_states"].square().sum() + (out["indexer_loss"] if out["indexer_loss"] is not None else 0)
        loss.backward()
        runs.append([loss.detach(), x.grad, *(p.grad for p in layer.parameters() if p.grad is not None)])
    assert torch.equal(runs[0][0], runs[1][0])
    for a, b in zip(*runs, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12 * b.abs().max().item())


class _Shapes(TorchDispatchMode):
    """Shapes of every tensor an op makes outside the project's custom ops (whose bodies the mode does not see:
    what they make lives a chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return out


@pytest.mark.parametrize("mode", ["kl_dense", "dense_warmup"])
def test_chunked_kl_dense_never_makes_the_whole_absorbed_query(mode):
    """kl_dense / dense_warmup with attention_chunk: the KL op absorbs its query chunk by chunk, so no [S, H, c + r]
    tensor is made (it was: AbsorbedQuery.full); the unchunked layer makes it (the check can fail). The loss and
    the indexer's gradients (the KL's alone) equal the unchunked layer's bitwise; the attention's too under dense
    attention (dense_warmup), to the chunked sums' rounding under sparse (kl_dense)."""
    runs, whole = [], (1, 48, H, LORA + ROPE)
    for chunk in (0, 11):
        layer = make_layer("kl_dense")
        layer.indexer_mode = mode
        layer.cfg.dsa.attention_chunk, layer.cfg.dsa.kl_dense_chunk = chunk, 5
        x = torch.randn(1, 48, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(3),
                        requires_grad=True)
        with _Shapes() as seen:
            out = layer(x, torch.arange(48))
            loss = out["hidden_states"].square().sum() + out["indexer_loss"]
            loss.backward()
        runs.append({"loss": loss.detach(), "x": x.grad} | {n: p.grad for n, p in layer.named_parameters()})
        assert (whole in seen.shapes) == (chunk == 0)
    assert len(runs[0]) == 12
    for name, a in runs[0].items():
        b = runs[1][name]
        if name == "loss" or name.startswith("indexer.") or mode == "dense_warmup":
            assert torch.equal(a, b), name
        else:
            assert torch.allclose(a, b, rtol=0, atol=1e-12 * b.abs().max().item()), name


def test_selective_ac_keeps_the_chunked_output_not_the_latent():
    layer = make_layer()
    layer.cfg.dsa.attention_chunk = 16
    _, region, _ = region_call(layer, 64)
    stats = region.last_stats
    assert dict(stats.saved_by_op) == {"aten::mm": 6, "spartron::sparse_mla_absorbed": 1,
                                       "spartron::kl_sparse_target": 4, "spartron::kl_selected_scores": 1}
    per_token = 8 * (H * (8 + ROPE) + LORA + ROPE + DIM  # wq, wkv_a, wo outputs
                     + 2 * 16 + 16 + 2  # the indexer's wq_b, wk, weights_proj outputs
                     + H * V  # the attention's output [S, H * v] (wo's input), no latent, no lse
                     + 2 * K)  # the KL target (4 chunks) and selected scores, [S, K] each
    assert stats.bytes_saved == 64 * per_token


def _plan(config: str, seq: int, extra: list[str]) -> float:
    from spartron.runtime.config import load_config
    from spartron.runtime.memory import plan_memory

    base = ["model.mtp.depth=0", "model.n_heads=128", f"train.seq_len={seq}", f"model.max_seq_len={seq}"]
    return plan_memory(load_config(ROOT / "configs" / config, [*base, *extra]), 1, 0)


def test_the_plan_puts_chunked_dsa_below_dense_and_128k_on_one_h200():
    kl = ["model.dsa.indexer_mode=kl_sparse", "model.dsa.indexer_loss_coeff=0.01"]
    chunked = [*kl, "model.dsa.attention_chunk=8192"]
    gib = 2**30
    for seq in (65536, 131072):
        dense, dsa, small = (_plan(c, seq, e) for c, e in (("dsa-4l-dense.toml", []), ("dsa-4l.toml", kl),
                                                           ("dsa-4l.toml", chunked)))
        assert small.peak < 0.85 * dense.peak < dense.peak < dsa.peak
        # the three DSA layers keep [T, H * v] bf16 instead of the latent [T, H, 512] bf16 + lse [T, H] fp32
        assert dsa.parts["activations"] - small.parts["activations"] == 3 * seq * 128 * (2 * 512 + 4 - 2 * 128)
    assert small.peak < 130 * gib  # 128k: fits an H200 (about 139 GiB)


def test_the_plan_holds_one_chunk_of_every_sequence_of_the_micro_batch():
    """The chunk is query rows of each sequence: two sequences double one chunk's backward temporaries."""
    from spartron.layers.step_memory import StepShape, _sparse_attention
    from spartron.runtime.config import load_config

    m = load_config(ROOT / "configs" / "dsa-4l.toml", ["model.dsa.attention_chunk=64"]).model
    one = _sparse_attention(m, 256, 256, StepShape(seq_len=256, micro_batch_size=1), 2)
    two = _sparse_attention(m, 512, 512, StepShape(seq_len=256, micro_batch_size=2), 2)
    assert two == tuple(2 * n for n in one)


def test_the_plan_counts_each_chunks_dkv_accumulator():
    """Each chunk's sparse backward allocates a dkv accumulator over all B x S_kv latent rows: float32 and its
    bf16 partial, or (deterministic_dkv) int64, its float64 copy and the scaled float64 at once; the plan's chunked
    work holds one beside the float32 total over chunks and one chunk's [rows, H, .] tensors."""
    from spartron.layers.step_memory import StepShape, _sparse_attention
    from spartron.runtime.config import load_config

    step, work = StepShape(seq_len=256, micro_batch_size=2), {}
    for det in (False, True):
        m = load_config(ROOT / "configs" / "dsa-4l.toml",
                        ["model.dsa.attention_chunk=64", f"model.dsa.deterministic_dkv={str(det).lower()}"]).model
        work[det] = _sparse_attention(m, 512, 512, step, 2)[3]
    h, n, c, r = m.n_heads, m.mla.qk_nope_head_dim, m.mla.kv_lora_rank, m.mla.qk_rope_head_dim
    chunk_rows = 2 * 64 * h * 2 * (2 * c + r) * 2
    assert work[False] == chunk_rows + 512 * (c + r) * 4 + 512 * h * (n + r) * 2 + 512 * (c + r) * (4 + 2)
    assert work[True] - work[False] == 512 * (c + r) * (24 - 6)


def test_the_plan_counts_kl_dense_absorbing_one_chunk_of_rows():
    """With attention_chunk, kl_dense's work holds its chunk's absorbed rows [B, rows, H, c + r] (bf16, and their
    float32 copy as before) and no [T, H, c + r] query exists; the dense warm-up's KL saves the roped q_pe
    [T, H, r] instead of the absorbed query [T, H, c + r]."""
    from spartron.layers.step_memory import StepShape, _attention_block, _kl_dense_work
    from spartron.runtime.config import load_config

    base = ["model.dsa.indexer_mode=kl_dense", "model.dsa.indexer_loss_coeff=0.5", "model.dsa.kl_dense_chunk=32"]
    step = StepShape(seq_len=256, micro_batch_size=2)
    plans = {}
    for chunk in (0, 64):
        m = load_config(ROOT / "configs" / "dsa-4l.toml", [*base, f"model.dsa.attention_chunk={chunk}"]).model
        warm = _attention_block(m, 512, StepShape(seq_len=256, micro_batch_size=2, dsa_mode="dense_warmup"),
                                "source", 1, 2)
        plans[chunk] = (_kl_dense_work(m, step, 1), warm.saved)
    h, c, r = m.n_heads, m.mla.kv_lora_rank, m.mla.qk_rope_head_dim
    assert plans[64][0] - plans[0][0] == 2 * 32 * h * (c + r) * 2
    assert plans[0][1] - plans[64][1] == 512 * h * c * 2


def _cuda_case(chunk: int | None, deterministic: bool) -> list[torch.Tensor]:
    """V3 shapes on the Triton kernels: 64 heads, nope / v 128, rope 64, kv_lora 512, 1024 rows, top-256."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h, s, k = 64, 1024, 256
    q = (torch.randn(1, s, h, 192, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    kv = torch.randn(1, s, 576, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(h, 256, 512, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    keys = torch.rand(s, s, device="cuda", generator=g).masked_fill(
        torch.ones(s, s, device="cuda", dtype=torch.bool).triu(1), -1.0)
    ids = keys.topk(k, dim=-1).indices.int()
    ids = torch.where(torch.arange(k, device="cuda")[None] <= torch.arange(s, device="cuda")[:, None], ids, -1)[None]
    grad = torch.randn(1, s, h * 128, device="cuda", generator=g).bfloat16()
    q_nope, q_pe = q.split([128, 64], -1)
    w_uk, w_uv = w[:, :128], w[:, 128:]
    if chunk is None:
        lat, _ = sparse_mla(absorb_query(q_nope, q_pe, w_uk), kv, ids.contiguous(), 192**-0.5, 512,
                            deterministic=deterministic)
        out = absorb_output(lat, w_uv)
    else:
        out = sparse_mla_absorbed(q_nope, q_pe, kv, ids.contiguous(), w_uk, w_uv, 192**-0.5, chunk, deterministic)
    out.backward(grad)
    return [out.detach(), q.grad, kv.grad, w.grad]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the Triton sparse-MLA kernels")
def test_cuda_chunks_match_the_unchunked_path():
    ref = _cuda_case(None, deterministic=True)
    for a, b in zip(ref, _cuda_case(4096, deterministic=True), strict=True):  # one chunk: the same calls
        assert torch.equal(a, b)
    for a, b in zip(ref, _cuda_case(256, deterministic=True), strict=True):  # four: summed gradients round apart
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()
