"""`spartron::indexer_topk`: the lightning indexer's scores + causal top-k op, its fp8 option and its kernel.

CPU: the reference equals the unchunked formula (causal and CP positions), the ids' order contract
(ascending key ids, ties to the lower id, -1 last), packed documents, fp8 quantisation, the dispatch,
the launcher's chunk and row plans, the kernel's limits, the config rule, the benchmark's smoke mode.
GPU (`pytest -m gpu`): the top-k kernel equals `topk_ids` on the same scores (ties, -inf, each of its
paths; a few cases also under Triton's interpreter with TRITON_INTERPRET=1), the Triton fp8
quantisation equals the PyTorch one bitwise, the score kernel against the reference, the op's ids
against a float64 oracle (the top-k set equal except keys within 1e-3 relative of the k-th score)
causal, under CP positions and with packed documents, fp8 against bf16, and no host sync in the op.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from spartron.layers.attention import indexer_triton
from spartron.layers.attention.context_parallel import local_positions
from spartron.layers.attention.dsa import LightningIndexer
from spartron.layers.attention.indexer_fp8 import fp8_operands, quantize_fp8
from spartron.layers.attention.indexer_topk import (
    causal_visible,
    index_scores,
    indexer_topk,
    reference_indexer_topk,
    topk_ids,
)
from spartron.layers.config import DSAConfig, ModelConfig

ROOT = Path(__file__).resolve().parents[3]
INTERPRET = importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the Triton indexer kernel")


def _inputs(b, s_q, s_kv, h, d, device="cpu", dtype=torch.float64, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, s_q, h, d, device=device, generator=g).to(dtype)
    k = torch.randn(b, s_kv, d, device=device, generator=g).to(dtype)
    w = (torch.randn(b, s_q, h, device=device, generator=g) * (h * d) ** -0.5).to(dtype)
    return q, w, k


# --- CPU -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("cp_rank", [None, 0, 1])
def test_reference_equals_the_unchunked_formula(cp_rank, monkeypatch):
    q, w, k = _inputs(2, 24 if cp_rank is None else 12, 24, 3, 8)
    q_pos = torch.arange(24) if cp_rank is None else local_positions(24, 2, cp_rank)
    k_pos = torch.arange(24)
    want = topk_ids(index_scores(q, w, k, causal_visible(q_pos, k_pos)), 5)
    monkeypatch.setattr("spartron.layers.attention.indexer_topk._REFERENCE_CHUNK_BYTES", 4 * 2 * 3 * 24 * 5)
    got = indexer_topk(q, w, k, q_pos, k_pos, 5)  # chunks of 5 queries
    assert got.dtype == torch.int32 and got.shape == (2, q.shape[1], 5)
    assert torch.equal(got, want) and torch.equal(reference_indexer_topk(q, w, k, q_pos, k_pos, 5), want)
    if cp_rank != 1:  # position 0 (on rank 0) sees one key: the rest of its row is -1
        assert got[:, int(q_pos.argmin())].tolist() == [[0, -1, -1, -1, -1]] * 2
    else:  # rank 1 holds positions 6..17: every row full
        assert q_pos.min() == 6 and bool((got >= 0).all())


def test_ids_are_the_set_in_ascending_key_order_ties_to_the_lower_id_and_padding_last():
    inf = float("inf")
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, -inf, 3.0],
                           [0.0, -inf, -inf, 1.0, -inf, -inf],
                           [-0.0, 0.0, -1.0, 0.0, -2.0, 5.0]])
    assert topk_ids(scores, 2).tolist() == [[1, 2], [0, 3], [0, 5]]
    assert topk_ids(scores, 4).tolist() == [[1, 2, 3, 5], [0, 3, -1, -1], [0, 1, 3, 5]]
    assert topk_ids(scores, 9).tolist() == [[0, 1, 2, 3, 5, -1], [0, 3, -1, -1, -1, -1], [0, 1, 2, 3, 4, 5]]


def test_packed_documents_select_within_each_document():
    q, w, k = _inputs(2, 12, 12, 2, 8)
    pos = torch.arange(12)
    starts = torch.tensor([[0] * 5 + [5] * 7, [0] * 12])
    visible = causal_visible(pos, pos) & (pos[None, None, :] >= starts[:, :, None])
    want = topk_ids(index_scores(q, w, k, visible), 3)
    got = indexer_topk(q, w, k, pos, pos, 3, q_starts=starts)
    assert torch.equal(got, want)
    assert got[0, 5].tolist() == [5, -1, -1] and got[0, 6].tolist() == [5, 6, -1]  # a new document
    assert torch.equal(got[1], indexer_topk(q[1:], w[1:], k[1:], pos, pos, 3)[0])
    with pytest.raises(ValueError, match=r"q_starts must be \[B, S_q\] = \(2, 12\), got \(2, 11\)"):
        indexer_topk(q, w, k, pos, pos, 3, q_starts=starts[:, :11])


def test_topk_is_capped_at_the_key_count():
    q, w, k = _inputs(1, 4, 4, 2, 8)
    assert indexer_topk(q, w, k, torch.arange(4), torch.arange(4), 10).shape == (1, 4, 4)


def test_fp8_quantises_each_row_to_its_amax():
    x = torch.tensor([[1.0, -2.0, 0.5], [448.0, 0.0, -224.0], [0.0, 0.0, 0.0]])
    x8, scale = quantize_fp8(x)
    assert x8.dtype == torch.float8_e4m3fn
    assert torch.equal(scale, torch.tensor([2.0 / 448, 1.0, torch.finfo(torch.float32).tiny]))
    assert x8.float()[1].tolist() == [448.0, 0.0, -224.0]
    assert x8.float().abs().amax(-1)[:2].tolist() == [448.0, 448.0]


def test_fp8_reference_is_the_top_k_of_the_dequantised_scores():
    q, w, k = _inputs(1, 16, 16, 2, 8, dtype=torch.float32)
    pos = torch.arange(16)
    q8, w8, k8, ks = fp8_operands(q, w, k)
    scores = index_scores(q8.float() * 1.0, w8, k8.float(), causal_visible(pos, pos)) * ks[:, None, :]
    # the same scores as dequantising first: ReLU(a q . b k) = a b ReLU(q . k) for a, b > 0
    _, qs = quantize_fp8(q)
    deq = index_scores(q8.float() * qs[..., None], w, k8.float() * ks[..., None], causal_visible(pos, pos))
    torch.testing.assert_close(scores, deq, rtol=1e-5, atol=1e-6)
    assert torch.equal(indexer_topk(q, w, k, pos, pos, 4, fp8=True), topk_ids(scores, 4))


def test_cuda_has_its_own_kernel():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("spartron::indexer_topk", "CUDA")


def test_fake_and_dispatch_registration():
    q, w, k = _inputs(1, 6, 6, 2, 8)
    pos = torch.arange(6)
    for starts in (None, torch.zeros(1, 6, dtype=torch.int64)):
        torch.library.opcheck(torch.ops.spartron.indexer_topk.default, (q, w, k, pos, pos, 3, False, starts),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("d, dtype, message", [
    (96, torch.bfloat16, "needs a power-of-two index head dim >= 16; got 96"),
    (8, torch.bfloat16, "got 8"),
    (128, torch.float32, "needs bfloat16 or float16 q and k; got torch.float32"),
])
def test_kernel_limits_are_errors_naming_the_limit(d, dtype, message):
    with pytest.raises(ValueError, match=message):
        indexer_triton.check_supported(torch.zeros(1, 2, 4, d, dtype=dtype), torch.zeros(1, 2, d, dtype=dtype))


def test_bad_shapes_are_rejected():
    q, w, k = _inputs(1, 6, 6, 2, 8)
    with pytest.raises(ValueError, match="expects q"):
        indexer_topk(q, w[..., :1], k, torch.arange(6), torch.arange(6), 3)
    with pytest.raises(ValueError, match="positions must be"):
        indexer_topk(q, w, k, torch.arange(5), torch.arange(6), 3)
    with pytest.raises(ValueError, match="topk must be >= 1"):
        indexer_topk(q, w, k, torch.arange(6), torch.arange(6), 0)


def test_score_chunks_stay_under_the_buffer_budget():
    assert indexer_triton.chunk_rows(1, 16384, 16384, 64) == 16384  # 1 GiB holds 16k x 16k fp32: one chunk
    assert indexer_triton.chunk_rows(1, 65536, 65536, 64) == 4096
    assert indexer_triton.chunk_rows(2, 65536, 65536, 64) == 2048
    assert indexer_triton.chunk_rows(1, 1 << 20, 1 << 20, 64) == 256  # 256 rows of a 4 MiB row stride
    assert indexer_triton.chunk_rows(1, 3000, 100000, 64) == 2624  # whole tiles: 2684 rounded down
    assert indexer_triton.chunk_rows(1, 100, 1 << 30, 64) == 64  # never below one tile
    assert indexer_triton.chunk_rows(1, 10, 10, 64) == 10  # never above S_q
    assert [indexer_triton.padded(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 112]


def test_keys_at_columns_is_a_device_flag():
    """Key s at position s for every s (no CP, or CP's gathered keys): 1; any other layout: 0."""
    flag = indexer_triton.keys_at_columns
    assert flag(torch.arange(6)).tolist() == [1] and flag(torch.arange(6)).dtype == torch.int32
    assert flag(torch.tensor([0, 1, 3, 2])).tolist() == [0]
    assert flag(torch.arange(1, 7)).tolist() == [0]


def test_top_k_grid_and_its_limits():
    cfg = indexer_triton.IndexerKernelConfig(topk_programs_per_sm=16)
    assert indexer_triton.topk_programs(torch.device("cpu"), 1000, cfg) == 64  # 16 per SM, 4 SMs off CUDA
    assert indexer_triton.select_scratch(10, cfg, 16384) == 10 * (4 + 2048)  # a bracket, 2048 candidate slots
    assert indexer_triton.select_scratch(10, cfg, 300) == 10 * (4 + 512)  # short rows: slots for all their keys
    assert indexer_triton.candidate_slots(cfg, 3) == 16
    assert indexer_triton.topk_programs(torch.device("cpu"), 10, cfg) == 10  # never above the rows
    ids = torch.empty(1, 4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="topk_tries must be >= 1 .*, got 0"):
        indexer_triton.select(torch.zeros(1, 4, 4), ids, torch.arange(4, dtype=torch.int32), 0, 0, 4,
                              cfg=indexer_triton.IndexerKernelConfig(topk_tries=0))
    with pytest.raises(ValueError, match="scratch needs 80 int32, got 10"):  # 4 rows of 4 keys: 16 slots
        indexer_triton.select(torch.zeros(1, 4, 4), ids, torch.arange(4, dtype=torch.int32), 0, 0, 4,
                              scratch=torch.empty(10, dtype=torch.int32))


def test_fp8_is_for_the_indexer_topk_selection_only():
    with pytest.raises(ValidationError, match=r"model.dsa.indexer_fp8 applies to the indexer_topk selection "
                                              r"\(frozen, kl_sparse\); indexer_mode 'kl_dense' selects"):
        DSAConfig(indexer_fp8=True, indexer_mode="kl_dense", indexer_loss_coeff=0.1)
    assert DSAConfig(indexer_fp8=True, indexer_mode="kl_sparse", indexer_loss_coeff=0.1).indexer_fp8
    cfg = ModelConfig.model_validate(dict(
        dim=16, n_heads=2, n_layers=2, first_k_dense=1,
        mla=dict(q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
        dsa=dict(n_index_heads=2, index_head_dim=8, index_topk=3, indexer_fp8=True)))
    assert LightningIndexer(cfg).fp8 is True


def test_benchmark_smoke_mode(tmp_path):
    out = tmp_path / "indexer.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "indexer.py"), "--smoke", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["cases"][0]["results"]["bf16_vs_float64_oracle"]["ids_outside_tolerance"] == 0


# --- GPU -----------------------------------------------------------------------------------------

def _outside_tolerance(q, w, k, q_pos, k_pos, ids, rows, rel_tol=1e-3, starts=None) -> int:
    """Ids of sampled rows that differ from the float64 top-k by more than rel_tol of the k-th score."""
    bad = 0
    for r in rows:
        vis = causal_visible(q_pos[r:r + 1], k_pos)[None].expand(q.shape[0], -1, -1)
        if starts is not None:
            vis = vis & (k_pos[None, None, :] >= starts[:, r:r + 1, None])
        exact = index_scores(q[:, r:r + 1].double(), w[:, r:r + 1].double(), k.double(), vis)
        for bi in range(q.shape[0]):
            row = exact[bi, 0]
            kk = min(ids.shape[-1], int(vis[bi].sum()))
            top = row.topk(kk)
            got = ids[bi, r][ids[bi, r] >= 0].long()
            diff = torch.cat([got[~torch.isin(got, top.indices)], top.indices[~torch.isin(top.indices, got)]])
            bad += int(((row[diff] - top.values[-1]).abs() > rel_tol * top.values[-1].abs()).sum())
            bad += abs(got.numel() - kk)
    return bad


GPU_CASES = [  # (batch, s_q, heads, head dim, top-k)
    (1, 333, 4, 64, 50),  # lengths off every tile size
    (2, 1000, 32, 128, 256),
    (1, 16384, 32, 128, 2048),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("b, s, h, d, topk", GPU_CASES)
def test_kernel_ids_match_float64_oracle(b, s, h, d, topk):
    q, w, k = _inputs(b, s, s, h, d, "cuda", torch.bfloat16, seed=s)
    pos = torch.arange(s, device="cuda")
    ids = indexer_topk(q, w, k, pos, pos, topk)
    assert ids.shape == (b, s, min(topk, s)) and ids.dtype == torch.int32
    assert torch.equal((ids >= 0).sum(-1), torch.clamp(pos + 1, max=topk).expand(b, -1).int())
    rows = sorted(set(torch.randint(0, s, (64,), generator=torch.Generator().manual_seed(1)).tolist()) | {0, s - 1})
    assert _outside_tolerance(q, w, k, pos, pos, ids, rows) == 0


def _scores_with_ties(b, rows, cols, device="cuda"):
    g = torch.Generator(device=device).manual_seed(7)
    x = torch.randn(b, rows, cols, device=device, generator=g)
    x[:, ::3] = torch.round(x[:, ::3] * 4) / 4  # many equal scores
    x[:, 1::5, : cols // 2] = 0.0
    x[:, 1::5, 1] = -0.0
    x[0, 2::7, cols // 3:] = float("-inf")
    x[-1, 4] = float("-inf")
    return x


SELECT_PATHS = {  # (candidate slots, passes before the histogram) as a fraction of the row length
    "sampled bracket": (1 / 3, 3), "short rows": (1.2, 3), "narrowed": (0.0, 3), "histogram fallback": (0.0, 1)}


def _check_select(device, path, layout, b, rows, cols, kk, launch_rows):
    """The persistent top-k of rows cols - rows .. cols - 1 (launched launch_rows at a time) equals
    topk_ids on the same scores; other rows' ids untouched."""
    x = _scores_with_ties(b, rows, cols, device)
    q_start = cols - rows
    qpos = torch.arange(cols, device=device, dtype=torch.int32)
    starts = None
    visible = torch.ones(b, rows, cols, dtype=torch.bool, device=device)
    if layout != "whole rows":
        visible = causal_visible(qpos[q_start:], qpos)[None].expand(b, -1, -1)
    if layout == "documents":
        a, c, e = cols * 2 // 3, cols * 4 // 5, cols * 3 // 5
        starts = torch.tensor([[0] * a + [a] * (c - a) + [c] * (cols - c), [0] * e + [e] * (cols - e)],
                              dtype=torch.int32, device=device)
        visible = visible & (qpos[None, None, :] >= starts[:, q_start:, None])
    buf = torch.full((b, rows, indexer_triton.padded(cols)), float("nan"), device=device)
    # outside a row's range: a score that would win if the kernel read it
    buf[..., :cols] = torch.where(visible, x, float("-inf") if layout == "whole rows" else 1e30)
    ids = torch.full((b, cols, kk), 12345, dtype=torch.int32, device=device)
    frac, tries = SELECT_PATHS[path]
    cfg = indexer_triton.IndexerKernelConfig(topk_block=256, topk_sample=1024, topk_tries=tries,
                                             topk_candidates=max(16, int(frac * cols)), topk_programs_per_sm=1)
    for r0 in range(0, rows, launch_rows):
        indexer_triton.select(buf[..., :cols], ids, qpos, q_start, r0, min(launch_rows, rows - r0), starts,
                              layout != "whole rows", cfg)
    want = topk_ids(x.masked_fill(~visible, float("-inf")), kk)
    assert torch.equal(ids[:, q_start:], want)
    assert bool((ids[:, :q_start] == 12345).all())  # rows of other chunks untouched


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", list(SELECT_PATHS))
@pytest.mark.parametrize("layout", ["whole rows", "causal", "documents"])
def test_radix_topk_equals_topk_ids_on_the_same_scores(path, layout):
    _check_select("cuda", path, layout, 2, 700, 1500, 100, 300)


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter (triton installed, TRITON_INTERPRET=1)")
@pytest.mark.parametrize("path, layout", [("sampled bracket", "documents"), ("narrowed", "causal"),
                                          ("histogram fallback", "whole rows")])
def test_topk_kernel_under_the_interpreter(path, layout):
    _check_select("cpu", path, layout, 2, 24, 300, 20, 16)


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter (triton installed, TRITON_INTERPRET=1)")
@pytest.mark.parametrize("documents", [False, True])
def test_op_under_the_interpreter(documents):
    """The launcher end to end on CPU (fp16: the interpreter computes bf16 dots wrongly): small tiles and
    blocks, so rows span several blocks and tiles; ids equal topk_ids of the kernel's own scores, which
    equal the reference's."""
    b, s, h, d, kk = 2, 150, 4, 16, 20
    q, w, k = _inputs(b, s, s, h, d, "cpu", torch.float16, seed=2)
    pos = torch.arange(s)
    starts = torch.tensor([[0] * 60 + [60] * 90, [0] * 150]) if documents else None
    cfg = indexer_triton.IndexerKernelConfig(block_m=16, block_n=32, topk_block=32, topk_sample=64)
    ids = indexer_triton.indexer_topk(q, w, k, pos, pos, kk, False, starts, cfg)
    whole = torch.empty(b, s, s)
    indexer_triton.scores(q, w.float(), k, None, pos, pos, 0, s, whole, starts, False, cfg)
    visible = causal_visible(pos, pos)[None].expand(b, -1, -1)
    if documents:
        visible = visible & (pos[None, None, :] >= starts[:, :, None])
    assert torch.equal(torch.isneginf(whole), ~visible)
    ref = index_scores(q, w, k, visible)
    torch.testing.assert_close(whole[visible], ref[visible], rtol=1e-4, atol=1e-4)
    assert torch.equal(ids, topk_ids(whole, kk))


@pytest.mark.gpu
@needs_cuda
def test_triton_fp8_quantisation_equals_the_pytorch_formula_bitwise():
    q, w, k = _inputs(2, 300, 300, 8, 128, "cuda", torch.bfloat16, seed=9)
    q[0, 3] = 0.0  # an all-zero row: the tiny scale
    got = indexer_triton.quantize_fp8(q, w, k)
    want = fp8_operands(q, w, k)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn \
            else torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("documents", [False, True])
def test_op_equals_topk_ids_of_its_own_scores_across_chunks_and_blocks(documents, monkeypatch):
    """Chunks of 1024 rows, a persistent top-k grid (2 programs per SM), rows longer than the candidate
    slots: the op's ids equal topk_ids over the kernel's whole score matrix, and its scores equal the
    reference's."""
    b, s, h, d, kk = 2, 3000, 8, 64, 300
    q, w, k = _inputs(b, s, s, h, d, "cuda", torch.bfloat16, seed=11)
    pos = torch.arange(s, device="cuda")
    starts = None
    visible = causal_visible(pos, pos)[None].expand(b, -1, -1)
    if documents:
        starts = torch.tensor([[0] * 700 + [700] * 1800 + [2500] * 500, [0] * 3000], device="cuda")
        visible = visible & (pos[None, None, :] >= starts[:, :, None])
    cfg = indexer_triton.IndexerKernelConfig(topk_programs_per_sm=2, topk_block=512, topk_sample=256,
                                             topk_candidates=1024)
    monkeypatch.setattr(indexer_triton, "SCORE_BUFFER_BYTES", 4 * b * 1024 * indexer_triton.padded(s))
    ids = indexer_triton.indexer_topk(q, w, k, pos, pos, kk, False, starts, cfg)
    whole = torch.empty(b, s, s, device="cuda")
    indexer_triton.scores(q, w.float(), k, None, pos.int(), pos.int(), 0, s, whole,
                          None if starts is None else starts.int(), False, cfg)
    assert torch.equal(torch.isneginf(whole), ~visible)
    assert torch.equal(ids, topk_ids(whole, kk))
    ref = index_scores(q[:, 2000:2100], w[:, 2000:2100], k, visible[:, 2000:2100])
    fin = torch.isfinite(ref)
    torch.testing.assert_close(whole[:, 2000:2100][fin], ref[fin], rtol=1e-4, atol=1e-4)
    rows = [0, 699, 700, 701, 1500, 2499, 2500, 2999]
    assert _outside_tolerance(q, w, k, pos, pos, ids, rows, starts=starts) == 0
    default = indexer_topk(q, w, k, pos, pos, kk, q_starts=starts)  # the op on CUDA: the kernel, its own tiles
    assert _outside_tolerance(q, w, k, pos, pos, default, rows, starts=starts) == 0


@pytest.mark.gpu
@needs_cuda
def test_kernel_scores_match_reference_and_mask():
    q, w, k = _inputs(2, 300, 300, 8, 64, "cuda", torch.bfloat16)
    pos = torch.arange(300, device="cuda")
    out = torch.empty(2, 170, 300, device="cuda")
    indexer_triton.scores(q, w.float(), k, None, pos.int(), pos.int(), 100, 170, out)
    ref = index_scores(q[:, 100:270], w[:, 100:270], k, causal_visible(pos[100:270], pos))
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(out[fin], ref[fin], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_kernel_under_cp_equals_cp1():
    """Local queries (load-balanced shard, global positions) against all-gathered keys: CP=2 ids
    equal the CP=1 ids of the same queries."""
    s = 4096
    q, w, k = _inputs(1, s, s, 32, 128, "cuda", torch.bfloat16, seed=3)
    pos = torch.arange(s, device="cuda")
    full = indexer_topk(q, w, k, pos, pos, 512)
    for rank in range(2):
        local = local_positions(s, 2, rank, "cuda")
        ids = indexer_topk(q[:, local], w[:, local], k, local, pos, 512)
        assert torch.equal(ids, full[:, local])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_the_cuda_op_never_syncs_the_host(fp8):
    """Causal, packed documents, CP's local queries and keys not at their columns: no call waits on the
    device (torch.cuda.set_sync_debug_mode('error') raises on any synchronising call)."""
    s = 2000
    q, w, k = _inputs(1, s, s, 8, 64, "cuda", torch.bfloat16, seed=5)
    pos = torch.arange(s, device="cuda")
    starts = torch.tensor([[0] * 900 + [900] * 1100], device="cuda")
    local = local_positions(s, 2, 1, "cuda")
    calls = [(q, w, pos, pos, None), (q, w, pos, pos, starts), (q[:, local], w[:, local], local, pos, None),
             (q, w, pos, pos.flip(0), None)]
    want = [indexer_topk(qq, ww, k, qp, kp, 300, fp8, st) for qq, ww, qp, kp, st in calls]  # compiles first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [indexer_topk(qq, ww, k, qp, kp, 300, fp8, st) for qq, ww, qp, kp, st in calls]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    if not fp8:  # keys reversed (the unranged path) and documents, against the float64 oracle
        assert _outside_tolerance(q, w, k, pos, pos.flip(0), got[3], [0, 299, 300, 1000, 1999]) == 0
        assert _outside_tolerance(q, w, k, pos, pos, got[1], [0, 899, 900, 1400, 1999], starts=starts) == 0


@pytest.mark.gpu
@needs_cuda
def test_fp8_ids_match_their_oracle_and_mostly_agree_with_bf16():
    s, topk = 4096, 512
    q, w, k = _inputs(1, s, s, 32, 128, "cuda", torch.bfloat16, seed=4)
    pos = torch.arange(s, device="cuda")
    ids8 = indexer_topk(q, w, k, pos, pos, topk, fp8=True)
    ids = indexer_topk(q, w, k, pos, pos, topk)
    rows = list(range(topk, s, 97))
    q8, w8, k8, ks = fp8_operands(q, w, k)
    # the fp8 oracle: float64 scores of the quantised operands (key scale applied per column)
    bad = _outside_tolerance(q8.float(), w8, k8.float() * ks[..., None], pos, pos, ids8, rows)
    assert bad == 0
    shared = [torch.isin(ids8[0, r], ids[0, r]).float().mean().item() for r in rows]
    print(f"fp8 vs bf16 shared ids: mean {sum(shared) / len(shared):.4f} min {min(shared):.4f}")
    assert sum(shared) / len(shared) > 0.75


@pytest.mark.gpu
@needs_cuda
def test_cuda_float32_is_an_error_not_a_fallback():
    q, w, k = _inputs(1, 4, 4, 2, 16, "cuda", torch.float32)
    with pytest.raises(ValueError, match="needs bfloat16 or float16 q and k; got torch.float32"):
        indexer_topk(q, w, k, torch.arange(4, device="cuda"), torch.arange(4, device="cuda"), 2)
