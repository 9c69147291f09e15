"""kl_dense / dense warm-up KL in query chunks (attention.indexer_kl_dense): equal to the materialising
implementation it replaced (loss, ids, every gradient), under AC, with packed documents and CP's query rows,
and in memory: saved-for-backward linear in S, peak temporaries bounded by chunk x S_kv."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from spartron.checkpointing.apply import apply_activation_checkpointing
from spartron.checkpointing.config import ACConfig
from spartron.checkpointing.policy import build_policy
from spartron.layers.attention.dsa import LightningIndexer, trained_indexer_ids_and_loss
from spartron.layers.attention.indexer_kl import head_summed_distribution, kl_rows
from spartron.layers.attention.indexer_kl_dense import (
    CHUNK_BYTES,
    chunk_elements,
    chunk_rows,
    dense_indexer_kl,
    reference_backward,
    reference_forward,
)
from spartron.layers.attention.indexer_topk import index_scores, topk_ids, visible_keys
from spartron.layers.attention.mla import MLA, set_indexer_mode
from spartron.layers.attention.rope import rope_cos_sin
from spartron.layers.config import ModelConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_cfg(**dsa):
    return ModelConfig.model_validate(dict(
        dim=16, n_heads=2, n_layers=3, first_k_dense=1,
        mla=dict(q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
        dsa={**dict(n_index_heads=3, index_head_dim=8, index_topk=5, topk_freq=2, indexer_mode="kl_dense",
                    indexer_loss_coeff=0.5), **dsa}))


def materialised(q, w, k, q_abs, kv, scale, q_pos, k_pos, q_starts, topk):
    """The implementation kl_dense had before the chunked op (dsa.py until this change), verbatim in substance:
    [B, S, S_kv] scores and target, ids from the detached scores, mean KL."""
    visible = visible_keys(q_pos, k_pos, q_starts)
    scores = index_scores(q, w, k, visible)
    ids = topk_ids(scores.detach(), topk)
    acc = torch.promote_types(q_abs.dtype, torch.float32)
    with torch.no_grad():
        main = torch.einsum("bthd,bsd->bhts", q_abs.to(acc), kv.to(acc)) * scale
        target = head_summed_distribution(main.masked_fill(~(visible[:, None] if visible.dim() == 3 else visible),
                                                           float("-inf")))
    return ids, kl_rows(target, F.log_softmax(scores, dim=-1)).mean()


def make_inputs(b, s, s_kv, h_idx=3, d=8, heads=4, width=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, w = torch.randn(b, s, h_idx, d, generator=g), torch.randn(b, s, h_idx, generator=g) * (h_idx * d) ** -0.5
    k = torch.randn(b, s_kv, d, generator=g)
    return q, w, k, torch.randn(b, s, heads, width, generator=g), torch.randn(b, s_kv, width, generator=g)


def both(q, w, k, q_abs, kv, q_pos, k_pos, q_starts, topk, chunk, scale=0.3):
    """(ids, loss, dq, dw, dk) of the chunked op and of the materialising implementation."""
    out = []
    for fn in (lambda *a: dense_indexer_kl(*a, topk, chunk), lambda *a: materialised(*a, topk)):
        leaves = [t.clone().requires_grad_() for t in (q, w, k)]
        ids, loss = fn(*leaves, q_abs, kv, scale, q_pos, k_pos, q_starts)
        out.append((ids, loss.detach(), *torch.autograd.grad(loss, leaves)))
    return out


def assert_equal_to_1e6(new, old):
    assert torch.equal(new[0], old[0])
    for a, b in zip(new[1:], old[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("s", [1, 7, 16, 33])
@pytest.mark.parametrize("chunk", [1, 4, 5, 16, 64])
def test_chunked_equals_materialising_causal(s, chunk):
    """Chunk sizes that divide S and that do not (and one above S); top-k 5 below S (-1 padding on the first
    rows: the causal edge) and above it at S = 1."""
    q, w, k, q_abs, kv = make_inputs(2, s, s, seed=s)
    pos = torch.arange(s)
    new, old = both(q, w, k, q_abs, kv, pos, pos, None, 5, chunk)
    assert_equal_to_1e6(new, old)
    assert bool((new[0] < 0).any()) == (s > 1)  # row 0 sees one key: -1 padding whenever K = min(5, S) > 1
    assert all(bool(g.abs().sum() > 0) for g in new[2:]) or s == 1  # one key: log q = 0, no gradient


def test_chunked_equals_materialising_packed_documents():
    s = 12
    starts = torch.tensor([[0] * 5 + [5] * 4 + [9] * 3, [0] * 12])
    q, w, k, q_abs, kv = make_inputs(2, s, s, seed=1)
    pos = torch.arange(s)
    for chunk in (3, 5, 12):
        assert_equal_to_1e6(*both(q, w, k, q_abs, kv, pos, pos, starts, 4, chunk))


def test_chunked_equals_materialising_on_a_cp_shard():
    """Under CP a rank holds non-contiguous query rows (global positions) against all gathered keys; the op
    itself does not communicate (the gather's backward sums dk: test_context_parallel's kl_dense)."""
    s_kv = 16
    q_pos = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])  # rank 0 of 2 under the zig-zag split
    q, w, k, q_abs, kv = make_inputs(1, len(q_pos), s_kv, seed=2)
    k_pos = torch.arange(s_kv)
    for chunk in (3, 8):
        assert_equal_to_1e6(*both(q, w, k, q_abs, kv, q_pos, k_pos, None, 6, chunk))


def test_float64_inputs_stay_float64_and_bf16_accumulates_in_float32():
    q, w, k, q_abs, kv = make_inputs(1, 9, 9, seed=4)
    pos = torch.arange(9)
    new, old = both(*(t.double() for t in (q, w, k, q_abs, kv)), pos, pos, None, 3, 4)
    assert new[1].dtype == torch.float64 and new[2].dtype == torch.float64
    assert torch.equal(new[0], old[0])
    for a, b in zip(new[1:], old[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    ids, loss = dense_indexer_kl(*(t.bfloat16() for t in (q, w, k, q_abs, kv)), 0.3, pos, pos, None, 3, 4)
    assert loss.dtype == torch.float32 and ids.dtype == torch.int32


def test_trained_indexer_parameters_get_the_materialising_gradients():
    """Through the LightningIndexer's projections (what MLA calls): coeff x loss and every indexer parameter's
    gradient equal the materialising path's to 1e-6."""
    cfg = make_cfg(kl_dense_chunk=3)
    torch.manual_seed(0)
    indexer = LightningIndexer(cfg)
    s = 11
    g = torch.Generator().manual_seed(5)
    x, q_in = torch.randn(2, s, 16, generator=g), torch.randn(2, s, 12, generator=g)
    q_abs, kv = torch.randn(2, s, 2, 14, generator=g), torch.randn(2, s, 14, generator=g)
    pos = torch.arange(s)
    cos, sin = rope_cos_sin(pos, cfg.mla)
    ids, loss = trained_indexer_ids_and_loss(indexer, x, q_in, cos, sin, pos, pos, None, q_abs, kv, 0.3,
                                             sparse=False, coeff=0.5)
    new = torch.autograd.grad(loss, list(indexer.parameters()))
    q, w, k = indexer(x, q_in, cos, sin)
    want_ids, want = materialised(q, w, k, q_abs, kv, 0.3, pos, pos, None, cfg.dsa.index_topk)
    old = torch.autograd.grad(0.5 * want, list(indexer.parameters()))
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(loss, 0.5 * want, rtol=0, atol=1e-6)
    for (name, _), a, b in zip(indexer.named_parameters(), new, old, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_compiled_equals_eager():
    """torch.compile (fullgraph) traces the op through its fake kernels: the same loss, ids and gradients."""
    q, w, k, q_abs, kv = make_inputs(1, 13, 13, seed=6)
    pos = torch.arange(13)

    def loss(q, w, k):
        return dense_indexer_kl(q, w, k, q_abs, kv, 0.3, pos, pos, None, 5, 4)

    results = []
    for fn in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (q, w, k)]
        ids, value = fn(*leaves)
        results.append((ids, value.detach(), *torch.autograd.grad(value, leaves)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


class OpCalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.calls[str(func)] = self.calls.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["kl_dense", "dense_warmup"])
@pytest.mark.parametrize("ac", [dict(mode="full"), dict(mode="selective", reentrant=False),
                                dict(mode="selective", reentrant=True)])
def test_under_activation_checkpointing_the_op_runs_once_and_equals_eager(mode, ac):
    """spartron::kl_dense is MANDATORY (checkpointing.policy): every AC mode keeps its ids and KL, the replay
    never reruns it, and the step equals eager bitwise (loss, ids, every gradient)."""
    assert build_policy("full").decide(torch.ops.spartron.kl_dense.default, (), {}) == "mandatory"
    cfg = make_cfg(index_topk=4, indexer_loss_coeff=1.0, kl_dense_chunk=5)
    torch.manual_seed(0)
    eager = MLA(cfg, 1)
    set_indexer_mode(eager, mode)
    checkpointed = apply_activation_checkpointing(copy.deepcopy(eager), ACConfig(**ac))
    x, pos = torch.randn(2, 12, 16), torch.arange(12)

    def step(module):
        inp = x.clone().requires_grad_()
        out = module(inp, pos)
        (out["hidden_states"].square().mean() + out["indexer_loss"]).backward()
        return out, inp.grad

    (want, want_dx) = step(eager)
    with OpCalls() as seen:
        got, got_dx = step(checkpointed)
    assert seen.calls["spartron.kl_dense.default"] == 1 and seen.calls["spartron.kl_dense_backward.default"] == 1
    assert torch.equal(got["dsa_topk_ids"], want["dsa_topk_ids"]) and bool((want["dsa_topk_ids"] < 0).any())
    assert torch.equal(got["indexer_loss"], want["indexer_loss"]) and torch.equal(got_dx, want_dx)
    for (name, a), b in zip(checkpointed.named_parameters(), eager.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), name
    assert all(bool(p.grad.abs().sum() > 0) for p in checkpointed.indexer.parameters())


def test_chunk_rows_config_and_derivation():
    assert chunk_rows(7, 2, 1000, 128, 64) == 7
    assert chunk_elements(128, 64) == 3 * 128 + 4 * 64 + 8
    assert chunk_rows(None, 2, 1000, 128, 64) == CHUNK_BYTES // (4 * 2 * 1000 * 648) == 207
    assert chunk_rows(None, 1, 131072, 128, 64) == 3  # at 128k x 128 heads one row's temporaries are 340 MB
    with pytest.raises(ValueError, match="model.dsa.kl_dense_chunk must be >= 1 query row, got 0"):
        chunk_rows(0, 1, 8, 2, 2)
    assert LightningIndexer(make_cfg()).kl_dense_chunk is None and LightningIndexer(make_cfg(kl_dense_chunk=9)) \
        .kl_dense_chunk == 9
    with pytest.raises(ValueError, match="kl_dense_chunk"):
        make_cfg(kl_dense_chunk=-1)


def test_the_memory_plan_counts_one_chunk_of_temporaries_at_the_backward_peak():
    """step_memory: a kl_dense model's backward phase holds B x rows x S x chunk_elements float32 more than the
    same model with kl_sparse's chunk-free accounting would for its work (rows from model.dsa.kl_dense_chunk);
    its ids and per-row KL stay kept under full AC (the op is MANDATORY)."""
    from pathlib import Path

    from spartron.runtime.config import load_config
    from spartron.runtime.memory import plan_memory

    tiny = Path(__file__).parents[2] / "configs" / "tiny.toml"
    base = ["ac.mode=full", "model.dsa.indexer_mode=kl_dense", "model.dsa.indexer_loss_coeff=0.5"]
    plans = {c: plan_memory(load_config(tiny, [*base, f"model.dsa.kl_dense_chunk={c}"]), 1, 0) for c in (2, 6)}
    cfg = load_config(tiny, base)
    seq, mb, m = cfg.train.seq_len, cfg.train.micro_batch_size, cfg.model
    per_row = 4 * mb * seq * chunk_elements(m.n_heads, m.dsa.n_index_heads)
    assert plans[6].phases["backward"] - plans[2].phases["backward"] == 4 * per_row
    derived = plan_memory(cfg, 1, 0).phases["backward"] - plans[2].phases["backward"]
    assert derived == (min(chunk_rows(None, mb, seq, m.n_heads, m.dsa.n_index_heads), seq) - 2) * per_row


def saved_bytes(s, chunk, fn=dense_indexer_kl):
    """Bytes autograd saves for backward (saved_tensors_hooks) for forward(S) of the op, or the materialising."""
    q, w, k, q_abs, kv = (t.requires_grad_(i < 3) for i, t in enumerate(make_inputs(1, s, s, seed=s)))
    pos = torch.arange(s)
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if fn is dense_indexer_kl:
            dense_indexer_kl(q, w, k, q_abs, kv, 0.3, pos, pos, None, 4, chunk)
        else:
            materialised(q, w, k, q_abs, kv, 0.3, pos, pos, None, 4)
    return sum(total)


def test_saved_for_backward_is_linear_in_s():
    """The op saves its inputs only: q, w, k, q_abs, kv (float32) and the positions (int64), exactly; doubling
    S doubles it. The materialising path saves [S, S] tensors: nearly 4 x (the check can fail)."""
    per_token = 4 * (3 * 8 + 3 + 8 + 4 * 12 + 12) + 2 * 8
    assert saved_bytes(64, 8) == 64 * per_token and saved_bytes(128, 8) == 128 * per_token
    assert saved_bytes(128, 8, materialised) > 3.5 * saved_bytes(64, 8, materialised)


def peak_bytes(fn, *args):
    """Peak of live CPU tensor bytes while `fn(*args)` runs (torch's MemTracker, which counts the tensor
    arguments it sees too), less the arguments' bytes."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        fn(*args)
    inputs = sum(t.numel() * t.element_size() for t in args if isinstance(t, torch.Tensor))
    return sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()) - inputs


@pytest.mark.parametrize("chunk", [4, 16])
def test_peak_inside_the_op_is_bounded_by_chunk_times_s(chunk):
    """Forward and backward bodies (the op's kernels, run directly so every temporary is seen) at S = 256 with
    6 heads x 16 and 4 index heads x 8: the peak stays under the outputs plus chunk x S_kv x chunk_elements
    float32, and grows with the chunk, not with S x S_kv (one [S, S] float32 alone is 256 KiB here; the
    materialising path peaks above 20 x that: the check can fail)."""
    s, b, heads, h_idx = 256, 1, 6, 4
    q, w, k, q_abs, kv = make_inputs(b, s, s, h_idx=h_idx, d=8, heads=heads, width=16, seed=3)
    pos = torch.arange(s)
    bound = 4 * b * chunk * s * chunk_elements(heads, h_idx)
    fwd = peak_bytes(reference_forward, q, w, k, q_abs, kv, pos, pos, None, 0.3, 4, chunk)
    outputs = 4 * b * s + 4 * b * s * 4
    assert fwd <= outputs + bound, (fwd, outputs + bound)
    bwd = peak_bytes(reference_backward, torch.ones(b, s), q, w, k, q_abs, kv, pos, pos, None, 0.3, chunk)
    grads = 4 * (q.numel() + w.numel() + k.numel() + k.numel())  # dq, dw, dk (+ k in float32 once)
    assert bwd <= grads + bound, (bwd, grads + bound)
    square = 4 * s * s  # one [S, S_kv] float32

    def old(*a):
        qq, ww, kk = (t.clone().requires_grad_() for t in a[:3])
        loss = materialised(qq, ww, kk, *a[3:])[1]
        torch.autograd.grad(loss, [qq, ww, kk])

    assert peak_bytes(old, q, w, k, q_abs, kv, 0.3, pos, pos, None, 4) > 20 * square


@needs_cuda
def test_cuda_op_equals_cpu_and_peaks_near_its_chunk_at_16k():
    """GPU (the lead: `python -m pytest -q tests/layers/test_indexer_kl_chunked.py -k cuda`): V3.2's shapes at
    16k (128 heads x 576, 64 index heads x 128, top-k 2048, bf16). The op's forward + backward peak over its
    inputs stays within 2 x CHUNK_BYTES plus the [S, K] ids and the gradients (the materialising path: 128 GiB
    of per-head target scores alone); and at 1k it equals the CPU result to 1e-4 (float32 accumulation of
    bf16 inputs in a different order)."""
    s, heads, width, h_idx, d, topk = 16384, 128, 576, 64, 128, 2048
    dev = torch.device("cuda")
    q, w, k, q_abs, kv = (t.to(dev, torch.bfloat16) for t in make_inputs(1, s, s, h_idx, d, heads, width))
    pos = torch.arange(s, device=dev)
    leaves = [t.requires_grad_() for t in (q, w, k)]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ids, loss = dense_indexer_kl(*leaves, q_abs, kv, 0.04, pos, pos, None, topk)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 2 * CHUNK_BYTES + ids.numel() * 4 + 3 * sum(t.numel() * 4 for t in leaves), extra / 2**30
    small = [t[:, :1024].detach() for t in (q, w, k, q_abs, kv)]
    p1 = torch.arange(1024)
    got = both(*(t.float() for t in small), p1.to(dev), p1.to(dev), None, 64, 100)[0]
    cpu = both(*(t.float().cpu() for t in small), p1, p1, None, 64, 100)[0]
    for a, b in zip(got[1:], cpu[1:], strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4)


@needs_cuda
def test_cuda_half_operands_take_the_tensor_core_path_with_the_upcast_values():
    """GPU: bf16 inputs on CUDA reach the chunk's three key products as bf16 GEMMs with a float32 output
    (`_by_keys`); the same inputs upcast to float32 take the float32 GEMMs. Every product is exact in float32
    either way, so the KL per row agrees to float32 summation-order noise and the gradients to their bf16
    rounding; the top-k ids agree on (almost) every row (a near-tie may order differently)."""
    s, heads, width, h_idx, d, topk, chunk = 2048, 16, 576, 16, 128, 256, 128
    dev = torch.device("cuda")
    q, w, k, q_abs, kv = (t.to(dev, torch.bfloat16) for t in make_inputs(1, s, s, h_idx, d, heads, width))
    pos = torch.arange(s, device=dev)
    grad = torch.rand(1, s, device=dev)
    half = (q, w, k, q_abs, kv)
    full = tuple(t.float() for t in half)
    kl_h, ids_h = reference_forward(*half, pos, pos, None, 0.04, topk, chunk)
    kl_f, ids_f = reference_forward(*full, pos, pos, None, 0.04, topk, chunk)
    assert kl_h.dtype == kl_f.dtype == torch.float32
    torch.testing.assert_close(kl_h, kl_f, rtol=1e-5, atol=1e-6)
    same_rows = (ids_h.sort(-1).values == ids_f.sort(-1).values).all(-1).float().mean().item()
    assert same_rows > 0.99, same_rows
    for a, b in zip(reference_backward(grad, *half, pos, pos, None, 0.04, chunk),
                    reference_backward(grad, *full, pos, pos, None, 0.04, chunk), strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.to(torch.bfloat16).float(), rtol=2e-2, atol=1e-5)
