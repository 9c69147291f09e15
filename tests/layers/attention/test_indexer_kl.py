"""kl_sparse in O(S x K): against the materialising implementation it replaces, memory, MLA with AC, 16k on CUDA."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from spartron.checkpointing.apply import apply_activation_checkpointing
from spartron.checkpointing.config import ACConfig
from spartron.layers.attention.dsa import LightningIndexer, trained_indexer_ids_and_loss
from spartron.layers.attention.indexer_kl import (
    kl_rows,
    selected_index_scores,
    sparse_attention_target,
    sparse_indexer_kl,
)
from spartron.layers.attention.indexer_topk import causal_visible, index_scores, indexer_topk, topk_ids
from spartron.layers.attention.mla import MLA
from spartron.layers.attention.rope import rope_cos_sin
from spartron.layers.config import ModelConfig

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.toml"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the Triton indexer kernel at 16k")


def make_cfg(**dsa):
    return ModelConfig.model_validate(dict(
        dim=16, n_heads=2, n_layers=3, first_k_dense=1,
        mla=dict(q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
        dsa={**dict(n_index_heads=3, index_head_dim=8, index_topk=5, topk_freq=2, indexer_mode="kl_sparse",
                    indexer_loss_coeff=0.5), **dsa}))


def inputs(b, s, h_idx, d, heads, width, dtype, seed=0, device="cpu"):
    """Indexer q, w, k and absorbed-MLA q_abs, kv with the scales the layers give them."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    return (randn(b, s, h_idx, d), randn(b, s, h_idx, scale=(h_idx * d) ** -0.5), randn(b, s, d),
            randn(b, s, heads, width), randn(b, s, width))


def starts_of(lengths_per_row):
    """[B, S] document start of every query of rows packed with documents of these lengths."""
    return torch.tensor([[sum(ls[:i]) for i, n in enumerate(ls) for _ in range(n)] for ls in lengths_per_row])


def visible_keys(pos, starts):
    vis = causal_visible(pos, pos)[None].expand(starts.shape[0], -1, -1)
    return vis & (pos[None, None, :] >= starts[:, :, None])


def materialised_kl_sparse(q, w, k, visible, q_abs, kv, scale, topk):
    """The implementation kl_sparse replaced (dsa.py before indexer_kl): full [B,S,S_kv] index scores, ids by
    topk_ids over them, the target over [B,S,K,D] gathered rows, the KL over the gathered scores."""
    scores = index_scores(q, w, k, visible)
    ids = topk_ids(scores.detach(), topk)
    acc = torch.promote_types(q_abs.dtype, torch.float32)
    with torch.no_grad():
        b, s, kk = ids.shape
        picked = torch.gather(kv, 1, ids.clamp_min(0).long().reshape(b, s * kk, 1).expand(-1, -1, kv.shape[-1]))
        logits = torch.einsum("bthd,btkd->bhtk", q_abs.to(acc), picked.reshape(b, s, kk, -1).to(acc)) * scale
        probs = torch.softmax(logits.masked_fill((ids < 0)[:, None], float("-inf")), -1).nan_to_num(0.0).sum(1)
        target = probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(acc).tiny)
    picked_scores = torch.gather(scores, -1, ids.clamp_min(0).long()).masked_fill(ids < 0, float("-inf"))
    log_q = F.log_softmax(picked_scores, -1)
    kl = torch.where(target > 0, target * (target.clamp_min(1e-300).log() - torch.where(target > 0, log_q, 0)), 0)
    return ids, picked_scores, target, kl.sum(-1).mean()


# float64: only the order of the float reductions changed (a [H, K] product per query against slices of one
# [S_q*H, S_kv] product; dk by index_add_ instead of a matmul), so the results agree to rounding;
# float32: the same at its rounding.
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-14), torch.float32: dict(rtol=1e-6, atol=1e-6)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [3, None])
@pytest.mark.parametrize("documents", [False, True])
def test_new_path_equals_the_materialising_implementation(dtype, chunk, documents):
    """Same ids (bitwise: the op's reference is the same scores and rule), scores, target, loss and
    gradients into q, w and k; packed documents, -1 slots (early rows, short documents), chunks < S."""
    b, s, topk = 2, 13, 5
    q, w, k, q_abs, kv = inputs(b, s, 3, 8, 4, 12, dtype)
    pos = torch.arange(s)
    starts = starts_of([[4, 6, 3], [13]]) if documents else torch.zeros(b, s, dtype=torch.int64)
    leaves = [t.requires_grad_() for t in (q, w, k)]
    ids_old, scores_old, target_old, loss_old = materialised_kl_sparse(q, w, k, visible_keys(pos, starts), q_abs, kv,
                                                                       0.3, topk)
    old_grads = torch.autograd.grad(loss_old, leaves)

    ids = indexer_topk(q, w, k, pos, pos, topk, q_starts=starts if documents else None)
    assert torch.equal(ids, ids_old) and bool((ids < 0).any())
    scores = selected_index_scores(q, w, k, ids, chunk)
    target = sparse_attention_target(q_abs, kv, 0.3, ids, chunk)
    assert torch.equal(target, target_old)  # the per-query products, the same ops in the same order
    assert torch.equal(torch.isneginf(scores), ids < 0)
    torch.testing.assert_close(scores, scores_old, **TOL[dtype])
    loss = sparse_indexer_kl(q, w, k, ids, q_abs, kv, 0.3, chunk)
    torch.testing.assert_close(loss, loss_old, **TOL[dtype])
    torch.testing.assert_close(loss, kl_rows(target, F.log_softmax(scores, -1)).mean(), rtol=0, atol=0)
    for new, old in zip(torch.autograd.grad(loss, leaves), old_grads, strict=True):
        assert bool(old.abs().sum() > 0)
        torch.testing.assert_close(new, old, **TOL[dtype])


def test_selected_scores_gradient_matches_autograd_of_the_formula():
    """The hand-written backward against autograd of the formula on the gathered rows (float64 gradcheck)."""
    q, w, k, _, _ = inputs(1, 7, 2, 4, 1, 4, torch.float64, seed=2)
    ids = indexer_topk(q, w, k, torch.arange(7), torch.arange(7), 3)
    q, w, k = (t.requires_grad_() for t in (q, w, k))
    finite = ids >= 0

    def f(q, w, k):
        return torch.where(finite, selected_index_scores(q, w, k, ids, 2), 0.0)

    assert torch.autograd.gradcheck(f, (q, w, k))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_deterministic_key_gradient_is_order_free_and_equals_the_scatter_add(dtype):
    """model.dsa.deterministic_dkv: the key gradient added in fixed point equals the index_add_ one to rounding
    and keeps its bits when the adds of a chunk (one chunk here) come in another order; the float index_add_
    does not (the check can fail): on CUDA its atomics reorder the adds run to run."""
    s = 64
    q, w, k, _, _ = inputs(1, s, 4, 8, 1, 4, dtype, seed=6)
    pos = torch.arange(s)
    ids = indexer_topk(q, w, k, pos, pos, 16)
    upstream = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)

    def dk(order, deterministic):
        keys = k.clone().requires_grad_()
        scores = selected_index_scores(q[:, order], w[:, order], keys, ids[:, order], s, deterministic)
        picked = torch.where(ids[:, order] >= 0, scores, 0.0)
        return torch.autograd.grad((picked * upstream[:, order]).sum(), keys)[0]

    ident, perm = torch.arange(s), torch.randperm(s, generator=torch.Generator().manual_seed(0))
    fixed = dk(ident, True)
    assert torch.equal(fixed, dk(perm, True))
    assert not torch.equal(dk(ident, False), dk(perm, False))
    torch.testing.assert_close(fixed, dk(ident, False), **TOL[dtype])


def test_mla_passes_deterministic_dkv_to_the_kl_loss():
    results = []
    for deterministic in (False, True):
        torch.manual_seed(0)
        m = MLA(make_cfg(deterministic_dkv=deterministic), 1).double()
        assert m.indexer.deterministic is deterministic
        m(torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2)),
          torch.arange(9))["indexer_loss"].backward()
        results.append([p.grad for p in m.indexer.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


def test_chunk_must_be_positive():
    q, w, k, _, _ = inputs(1, 4, 2, 4, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="indexer_kl: chunk must be >= 1 query row, got 0"):
        selected_index_scores(q, w, k, torch.zeros(1, 4, 2, dtype=torch.int32), 0)


def test_kl_sparse_compiles_as_one_graph():
    """train.compile: the selection op, the chunked Function (forward and backward) and the KL trace with
    fullgraph=True (aot_eager: the graph, not inductor's codegen), equal to eager."""
    q, w, k, q_abs, kv = inputs(2, 13, 3, 8, 4, 12, torch.float32, seed=4)
    pos = torch.arange(13)

    def loss(q, w, k):
        return sparse_indexer_kl(q, w, k, indexer_topk(q, w, k, pos, pos, 5), q_abs, kv, 0.3, chunk=4)

    results = []
    for fn in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (q, w, k)]
        value = fn(*leaves)
        results.append((value.detach(), *torch.autograd.grad(value, leaves)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


class LargestTensor(TorchDispatchMode):
    """The largest numel any op returns (forward and backward), and how often each op ran."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.calls = 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.calls[str(func)] = self.calls.get(str(func), 0) + 1
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


def indexer_setup(s, topk, seed=0):
    cfg = make_cfg(index_topk=topk)
    indexer = LightningIndexer(cfg)
    g = torch.Generator().manual_seed(seed)
    x, q_in = torch.randn(1, s, 16, generator=g), torch.randn(1, s, 12, generator=g)
    q_abs, kv = torch.randn(1, s, 2, 14, generator=g), torch.randn(1, s, 14, generator=g)
    pos = torch.arange(s)
    return indexer, x, q_in, *rope_cos_sin(pos, cfg.mla), pos, q_abs, kv


@pytest.mark.parametrize("sparse", [True, False])
def test_kl_sparse_allocates_nothing_of_size_s_by_s_kv(sparse):
    """Forward + backward of trained_indexer_ids_and_loss at S = 1024: every tensor any op makes (the selection
    op, kl_dense's chunked op, each counts as one) stays under S x S_kv / 8 (the chunks' own peak and the
    materialising path that fails the bound: tests/layers/test_indexer_kl_chunked.py)."""
    s, topk = 1024, 8
    indexer, x, q_in, cos, sin, pos, q_abs, kv = indexer_setup(s, topk)
    with LargestTensor() as seen:
        ids, loss = trained_indexer_ids_and_loss(indexer, x, q_in, cos, sin, pos, pos, None, q_abs, kv, 0.3,
                                                 sparse=sparse, coeff=0.5)
        loss.backward()
    assert ids.shape == (1, s, topk) and all(p.grad is not None for p in indexer.parameters())
    assert seen.calls["spartron.indexer_topk.default" if sparse else "spartron.kl_dense.default"] == 1
    assert seen.largest < s * s / 8, seen.largest


def test_kl_sparse_peak_memory_at_16k_on_fake_tensors():
    """The 16k case's shapes (32 index heads x 128, top-k 2048, 16 heads x 576, bf16) on fake tensors (no data,
    no compute) under torch's MemTracker: forward + backward peaks near 2 GiB (the chunks' temporaries and a few
    [S, K] float32 tensors; one [S, S_kv] float32 tensor alone is 1 GiB, the per-head logits 32 GiB); the
    materialising implementation's peak is 144 GiB, more than an H200 holds."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    s, h_idx, d, topk, heads, width = 16384, 32, 128, 2048, 16, 576
    peaks = []
    for materialised in (False, True):
        with FakeTensorMode():
            q, w, k = (torch.empty(shape, dtype=torch.bfloat16, requires_grad=True)
                       for shape in ((1, s, h_idx, d), (1, s, h_idx), (1, s, d)))
            q_abs, kv = torch.empty(1, s, heads, width, dtype=torch.bfloat16), torch.empty(1, s, width,
                                                                                            dtype=torch.bfloat16)
            pos = torch.arange(s)
            tracker = MemTracker()
            with tracker:
                if materialised:
                    loss = materialised_kl_sparse(q, w, k, causal_visible(pos, pos)[None], q_abs, kv, 0.04, topk)[3]
                else:
                    loss = sparse_indexer_kl(q, w, k, indexer_topk(q, w, k, pos, pos, topk), q_abs, kv, 0.04)
                loss.backward()
            peaks.append(sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()))
    assert peaks[0] < 3 * 2**30 < 100 * 2**30 < peaks[1], [p / 2**30 for p in peaks]


@pytest.mark.parametrize("ac", [dict(mode="full"), dict(mode="selective", reentrant=False)])
def test_kl_sparse_trains_through_mla_under_activation_checkpointing(ac):
    """One step under AC equals eager (ids, losses, gradients), the selection runs once (its replay reuses the
    ids), the indexer gets nonzero gradients, and SGD on the indexer lowers the KL loss."""
    cfg = make_cfg(index_topk=4, indexer_loss_coeff=1.0)
    torch.manual_seed(0)
    eager = MLA(cfg, 1)
    checkpointed = apply_activation_checkpointing(copy.deepcopy(eager), ACConfig(**ac))
    x, pos = torch.randn(2, 12, 16), torch.arange(12)

    def step(module):
        out = module(x, pos)
        (out["hidden_states"].square().mean() + out["indexer_loss"]).backward()
        return out

    want = step(eager)
    with LargestTensor() as seen:
        got = step(checkpointed)
    assert seen.calls["spartron.indexer_topk.default"] == 1
    # selective AC keeps kl_sparse's target and slot scores (policy DEFAULT_TARGETS); full AC recomputes them
    runs = 1 if ac["mode"] == "selective" else 2
    assert seen.calls["spartron.kl_sparse_target.default"] == runs
    assert seen.calls["spartron.kl_selected_scores.default"] == runs
    assert torch.equal(got["dsa_topk_ids"], want["dsa_topk_ids"]) and bool((want["dsa_topk_ids"] < 0).any())
    torch.testing.assert_close(got["indexer_loss"], want["indexer_loss"], rtol=0, atol=0)
    for (name, a), b in zip(checkpointed.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name  # the replay recomputes the same ops on the same ids
    assert all(bool(p.grad.abs().sum() > 0) for p in checkpointed.indexer.parameters())

    opt = torch.optim.SGD(checkpointed.indexer.parameters(), lr=1.0)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = checkpointed(x, pos)["indexer_loss"]
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses


def _packed_documents_cp_worker(rank, world):  # noqa: ANN001, ARG001
    from spartron.layers.model import build_model
    from spartron.parallel.dims import ParallelDims
    from spartron.parallel.groups import ParallelGroups
    from spartron.runtime.config import load_config

    g = torch.Generator().manual_seed(1)
    lengths = ([5, 11, 16], [20, 12])
    tokens = torch.randint(2, 512, (2, 32), generator=g)
    positions = torch.tensor([[p for n in row for p in range(n)] for row in lengths])
    cfg = load_config(str(TINY), ["model.mtp.depth=1", "model.dsa.indexer_mode=kl_sparse", "model.dsa.index_topk=4",
                                  "model.dsa.indexer_loss_coeff=0.5"]).model
    ref = build_model(cfg, seed=0)(tokens, tokens.roll(-1, 1), positions=positions)
    groups = ParallelGroups.build(ParallelDims(world, fsdp=1, cp=2), "cpu")
    out = build_model(cfg, groups, seed=0)(tokens, tokens.roll(-1, 1), positions=positions)
    got = {}
    for key in ("lm_loss", "indexer_loss"):
        value = out[key].detach().clone()
        torch.distributed.all_reduce(value)  # each rank's loss is scaled so the mean over ranks is global
        got[key] = (float(value / world), float(ref[key]))
    return got


def test_kl_sparse_with_packed_documents_under_context_parallelism_equals_one_rank():
    """The V3.2 preset's case (kl_sparse, CP, packed rows): local queries with their document starts and global
    indices select from the all-gathered keys; the LM and indexer losses equal one rank's."""
    from spartron.testing import run_distributed

    for rank_result in run_distributed(_packed_documents_cp_worker, 2, timeout=120):
        for key, (cp2, one) in rank_result.items():
            assert one > 0 and cp2 == pytest.approx(one, rel=1e-5, abs=1e-6), key


# --- sampled rows against float64 math (CPU here; CUDA at 16k below) -------------------------------------------

def reference_rows(q, w, k, q_abs, kv, scale, ids, rows):
    """float64 I_sel, target, per-row KL and its gradients into q and w at `rows` (batch 0), from the formula."""
    sel = ids[0, rows].long()
    valid = sel >= 0
    keys, latent = k[0].double()[sel.clamp_min(0)], kv[0].double()[sel.clamp_min(0)]  # [R, K, d], [R, K, D]
    qr = q[0, rows].detach().double().requires_grad_()
    wr = w[0, rows].detach().double().requires_grad_()
    scores = torch.einsum("rhk,rh->rk", torch.einsum("rhd,rkd->rhk", qr, keys).relu(), wr)
    scores = scores.masked_fill(~valid, float("-inf"))
    logits = torch.einsum("rhd,rkd->rhk", q_abs[0, rows].double(), latent) * scale
    probs = torch.softmax(logits.masked_fill(~valid[:, None], float("-inf")), -1).sum(1)
    target = probs / probs.sum(-1, keepdim=True)
    log_q = F.log_softmax(scores, -1)
    kl = torch.where(valid, target * (target.clamp_min(1e-300).log() - torch.where(valid, log_q, 0)), 0).sum(-1)
    dq, dw = torch.autograd.grad(kl.sum() / (q.shape[0] * q.shape[1]), (qr, wr))
    return scores.detach(), target, kl.detach(), dq, dw


def reference_dk(q, w, k, q_abs, kv, scale, ids, key):
    """float64 gradient of the mean KL into key row `key` (batch 0): a sum over the queries that selected it."""
    rows = (ids[0] == key).any(-1).nonzero().flatten().tolist()
    assert rows, f"no query selected key {key}"
    scores, target, _, _, _ = reference_rows(q, w, k, q_abs, kv, scale, ids, rows)
    g = ((torch.softmax(scores, -1) - target) * (ids[0, rows] == key)).sum(-1) / (q.shape[0] * q.shape[1])
    qr, wr = q[0, rows].double(), w[0, rows].double()
    active = (qr @ k[0, key].double() > 0).double()  # ReLU's derivative, [R, H]
    return torch.einsum("r,rh,rhd->d", g, wr * active, qr)


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def check_sampled_rows(device, s, h_idx, d, heads, width, topk, rows, tol, memory_bound=None):
    """kl_sparse at (s, topk) on `device`; rows compared with `reference_rows` on the CPU in float64.
    Returns the peak bytes allocated by the path on CUDA (None elsewhere)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, w, k, q_abs, kv = inputs(1, s, h_idx, d, heads, width, dtype, seed=5, device=device)
    q, w, k = (t.requires_grad_() for t in (q, w, k))
    pos = torch.arange(s, device=device)
    scale = width**-0.5
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    ids = indexer_topk(q, w, k, pos, pos, topk)
    scores = selected_index_scores(q, w, k, ids)
    target = sparse_attention_target(q_abs, kv, scale, ids)
    per_row = kl_rows(target, F.log_softmax(scores, -1))
    per_row.mean().backward()
    peak = None
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert peak < memory_bound, f"kl_sparse peak {peak / 2**30:.2f} GiB >= {memory_bound / 2**30:.2f} GiB"
    cpu = [t.detach().cpu() for t in (q, w, k, q_abs, kv)]
    want_scores, want_target, want_kl, want_dq, want_dw = reference_rows(*cpu, scale, ids.cpu(), rows)
    fin = ids[0, rows].cpu() >= 0
    assert torch.equal(torch.isneginf(scores[0, rows].cpu()), ~fin)
    assert rel(scores[0, rows].cpu()[fin], want_scores[fin]) < tol
    assert rel(target[0, rows], want_target) < tol
    assert rel(per_row[0, rows].detach(), want_kl) < tol
    assert rel(q.grad[0, rows], want_dq) < tol and rel(w.grad[0, rows], want_dw) < tol
    key = s - 200  # seen by the last 200 queries: a few dozen select it, so the reference stays small
    assert rel(k.grad[0, key], reference_dk(*cpu, scale, ids.cpu(), key)) < tol
    # the ids: the float64 top-k of every sampled row, except keys within 1e-3 of the k-th score
    for r in rows:
        exact = index_scores(cpu[0][:, r:r + 1].double(), cpu[1][:, r:r + 1].double(), cpu[2].double(),
                             causal_visible(pos[r:r + 1].cpu(), pos.cpu()))[0, 0]
        top = exact.topk(min(topk, r + 1))
        got = ids[0, r].cpu()
        got = got[got >= 0].long()
        assert got.numel() == top.indices.numel()
        differ = torch.cat([got[~torch.isin(got, top.indices)], top.indices[~torch.isin(top.indices, got)]])
        assert bool(((exact[differ] - top.values[-1]).abs() <= 1e-3 * top.values[-1].abs()).all()), r
    return peak


def test_sampled_rows_match_float64_math_on_cpu():
    """The CUDA check's own logic at a CPU size (float32 inputs)."""
    check_sampled_rows("cpu", 300, 4, 16, 3, 24, 32, [0, 1, 31, 32, 150, 299], tol=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_kl_sparse_at_16k_on_cuda_under_a_memory_bound():
    """16k tokens, 32 index heads x 128, top-k 2048, 16 heads x 576 (the preset's attention): the indexer kernel's
    ids, the chunked loss and its gradients in bf16 on the H200, sampled rows against float64 CPU math. The
    materialising path needed 32 GiB for the per-head logits alone; the bound is 8 GiB."""
    peak = check_sampled_rows("cuda", 16384, 32, 128, 16, 576, 2048, [0, 1, 2047, 2048, 5000, 12345, 16383],
                              tol=1e-2, memory_bound=8 << 30)
    q, w, k, q_abs, kv = inputs(1, 16384, 32, 128, 16, 576, torch.bfloat16, device="cuda")
    q, w, k = (t.requires_grad_() for t in (q, w, k))
    pos = torch.arange(16384, device="cuda")
    times, dks = {False: [], True: []}, {False: [], True: []}
    for deterministic in (False,) * 4 + (True,) * 3:  # the times are informational (no assertion)
        k.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        ids = indexer_topk(q, w, k, pos, pos, 2048)
        sparse_indexer_kl(q, w, k, ids, q_abs, kv, 576**-0.5, deterministic=deterministic).backward()
        end.record()
        torch.cuda.synchronize()
        times[deterministic].append(start.elapsed_time(end))
        dks[deterministic].append(k.grad.clone())
    assert all(torch.equal(dks[True][0], dk) for dk in dks[True][1:])  # model.dsa.deterministic_dkv: same bits
    assert rel(dks[True][0], dks[False][0]) < 1e-2
    print(f"kl_sparse 16k x 32 index heads, top-k 2048, 16 heads x 576: peak {peak / 2**30:.2f} GiB; selection + "
          f"loss + backward {sorted(times[False])[1]:.1f} ms (runs {[round(t, 1) for t in times[False]]}), "
          f"deterministic dk {sorted(times[True])[1]:.1f} ms; float dk the same bits over its runs: "
          f"{all(torch.equal(dks[False][0], dk) for dk in dks[False][1:])}")
