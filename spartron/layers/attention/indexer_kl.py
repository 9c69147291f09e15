"""The trained indexer's sparse KL loss (`model.dsa.indexer_mode = "kl_sparse"`) in O(S x K) memory.

V3.2's sparse training stage trains the indexer on the main attention's distribution over the indexer's own
top-k. Every quantity is per query row over its K selected keys, so all of it runs in query chunks and no
[S, S_kv] tensor exists (materialised, the per-head logits alone are 34 GB at 16k with 32 index heads):
- `selected_index_scores`: I_sel[b,t,j] = sum_h w[b,t,h] ReLU(q[b,t,h] . k[b, ids[b,t,j]]), -inf at -1 slots;
  the op `spartron::kl_selected_scores`, which saves only its inputs and recomputes the logits in its
  backward op (saved, the [S, H, K] logits would be O(S x H x K));
- `sparse_attention_target`: the detached, head-summed, L1-normalised main attention distribution over the
  same slots (absorbed MLA form, q [B,S,H,D] against the latent rows kv [B,S_kv,D]);
- `kl_rows`: KL(target || softmax(I_sel)) per row.
The ops' PyTorch code is the CPU path and the oracle; on CUDA they run the Triton kernels of
indexer_kl_triton.py, one program per query walking its slots (no [S, K, D] gathers), except the
deterministic key gradient, which stays this module's fixed-point path on every device.
Accumulation is float32 or wider (the inputs' dtype promoted), as in `indexer_topk.index_scores`. The ids
come from `spartron::indexer_topk` (dsa.trained_indexer_ids_and_loss). Chunks hold about `_CHUNK_BYTES` of
temporaries; `chunk` (query rows) overrides that, for tests. The key gradient is a scatter-add over the
selected keys (float atomics on CUDA, so its last bits vary run to run); `deterministic` (model.dsa.deterministic_dkv)
adds each chunk's rows in int64 fixed point instead (`_add_rows_fixed_point`): bitwise reproducible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from spartron.layers.attention.sparse_mla_absorbed import AbsorbedQuery

# Bytes of per-chunk temporaries (gathered key rows and [chunk, H, K] logits).
_CHUNK_BYTES = 1 << 29


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _rows(chunk: int | None, batch: int, slots: int, row_bytes: int) -> int:
    """Query rows per chunk: `chunk`, else as many as keep batch x rows x slots x row_bytes under the budget."""
    if chunk is not None:
        if chunk < 1:
            raise ValueError(f"indexer_kl: chunk must be >= 1 query row, got {chunk}")
        return chunk
    return max(1, _CHUNK_BYTES // max(1, batch * slots * row_bytes))


def gather_keys(keys: Tensor, ids: Tensor) -> Tensor:
    """keys [B,S_kv,D] at ids [B,S,K] (-1 -> key 0, the caller masks) -> [B,S,K,D]."""
    b, s, k = ids.shape
    safe = ids.clamp_min(0).long().reshape(b, s * k, 1).expand(-1, -1, keys.shape[-1])
    return torch.gather(keys, 1, safe).reshape(b, s, k, -1)


def _add_rows_fixed_point(dst: Tensor, index: Tensor, rows: Tensor) -> None:
    """dst (float64) += rows index-added at `index`, the same bits whatever order the adds run in: the rows are
    rounded to integers at one power-of-two scale, summed as int64 (associative), then scaled back. No partial
    sum of n rows exceeds n x max|rows| < 2^e, so the scale 2^(62 - e) never overflows, and each add is exact
    to 2^(e - 63) (a chunk of at most 16k x 2048 = 2^25 rows: 2^-37 of max|rows|, far below float32's
    rounding of the sum). The scale is computed on the device: no host sync."""
    bound = rows.abs().amax().double() * rows.shape[0]
    two = torch.full((), 2.0, dtype=torch.float64, device=rows.device)
    scale = two.pow((62 - torch.frexp(bound).exponent).clamp_max(1000).double())  # finite in float64
    ints = torch.round(rows.double() * scale).long()
    dst += torch.zeros(dst.shape, dtype=torch.int64, device=dst.device).index_add_(0, index, ints).double() / scale


def _reference_scores(q: Tensor, weights: Tensor, k: Tensor, ids: Tensor, chunk: int) -> Tensor:
    """I_sel chunk by chunk in float32 (or wider) PyTorch: the CPU path and the kernels' oracle."""
    acc = _acc(q.dtype)
    out = torch.empty(ids.shape, dtype=acc, device=q.device)
    k_acc = k.to(acc)  # once: the chunks gather float rows directly (exact either way)
    for c0 in range(0, ids.shape[1], chunk):
        rows = slice(c0, c0 + chunk)
        logits = torch.einsum("bthd,btkd->bthk", q[:, rows].to(acc), gather_keys(k_acc, ids[:, rows]))
        out[:, rows] = torch.einsum("bthk,bth->btk", logits.relu(), weights[:, rows].to(acc))
    return out.masked_fill_(ids < 0, float("-inf"))


def _reference_scores_backward(grad: Tensor, q: Tensor, weights: Tensor, k: Tensor, ids: Tensor, chunk: int,
                               deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dw, dk) of I_sel, the logits recomputed chunk by chunk; dk by index_add_ (or fixed point)."""
    acc, (b, s_kv, d) = _acc(q.dtype), k.shape
    grad = grad.to(acc).masked_fill(ids < 0, 0.0)  # -1 slots: no gradient (their score is -inf)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dw = torch.empty(weights.shape, dtype=acc, device=q.device)
    dk = torch.zeros(b * s_kv, d, dtype=torch.float64 if deterministic else acc, device=q.device)
    flat = ids.clamp_min(0).long() + torch.arange(b, device=ids.device)[:, None, None] * s_kv
    k_acc = k.to(acc)
    for c0 in range(0, ids.shape[1], chunk):
        rows = slice(c0, c0 + chunk)
        qc, keys, g = q[:, rows].to(acc), gather_keys(k_acc, ids[:, rows]), grad[:, rows]
        logits = torch.einsum("bthd,btkd->bthk", qc, keys)
        dw[:, rows] = torch.einsum("bthk,btk->bth", logits.relu(), g)
        dlogits = (g[:, :, None, :] * weights[:, rows, :, None].to(acc)).masked_fill_(logits <= 0, 0.0)
        dq[:, rows] = torch.einsum("bthk,btkd->bthd", dlogits, keys)
        index, dk_rows = flat[:, rows].reshape(-1), torch.einsum("bthk,bthd->btkd", dlogits, qc).reshape(-1, d)
        if deterministic:
            _add_rows_fixed_point(dk, index, dk_rows)
        else:
            dk.index_add_(0, index, dk_rows)
    return dq.to(q.dtype), dw.to(weights.dtype), dk.view(k.shape).to(k.dtype)


@torch.library.custom_op("spartron::kl_selected_scores", mutates_args=())
def _selected_scores(q: Tensor, weights: Tensor, k: Tensor, ids: Tensor, chunk: int, deterministic: bool) -> Tensor:
    """`deterministic` only rides along to the backward; saves q, w, k, ids only (module docstring)."""
    return _reference_scores(q, weights, k, ids, chunk)


@_selected_scores.register_kernel("cuda")
def _(q, weights, k, ids, chunk, deterministic):
    from spartron.layers.attention import indexer_kl_triton  # the kernels import triton only when used

    return indexer_kl_triton.selected_scores(q, weights, k, ids)


@_selected_scores.register_fake
def _(q, weights, k, ids, chunk, deterministic):
    return q.new_empty(ids.shape, dtype=_acc(q.dtype))


@torch.library.custom_op("spartron::kl_selected_scores_backward", mutates_args=())
def _selected_scores_backward(grad: Tensor, q: Tensor, weights: Tensor, k: Tensor, ids: Tensor, chunk: int,
                              deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _reference_scores_backward(grad, q, weights, k, ids, chunk, deterministic)


@_selected_scores_backward.register_kernel("cuda")
def _(grad, q, weights, k, ids, chunk, deterministic):
    if deterministic:  # the kernel adds key rows with float atomics; fixed point is the PyTorch path's
        return _reference_scores_backward(grad, q, weights, k, ids, chunk, deterministic)
    from spartron.layers.attention import indexer_kl_triton

    return indexer_kl_triton.selected_scores_backward(grad, q, weights, k, ids)


@_selected_scores_backward.register_fake
def _(grad, q, weights, k, ids, chunk, deterministic):
    return torch.empty_like(q), torch.empty_like(weights), torch.empty_like(k)


def _scores_setup_context(ctx, inputs, output):
    q, weights, k, ids, chunk, deterministic = inputs
    ctx.save_for_backward(q, weights, k, ids)
    ctx.args = (chunk, deterministic)


def _scores_backward(ctx, grad):
    q, weights, k, ids = ctx.saved_tensors
    dq, dw, dk = _selected_scores_backward(grad.contiguous(), q, weights, k, ids, *ctx.args)
    return dq, dw, dk, None, None, None


_selected_scores.register_autograd(_scores_backward, setup_context=_scores_setup_context)


def selected_index_scores(q: Tensor, weights: Tensor, k: Tensor, ids: Tensor, chunk: int | None = None,
                          deterministic: bool = False) -> Tensor:
    """I_sel [B,S,K] (>= float32, -inf at -1 slots), differentiable in q [B,S,H,d], weights [B,S,H], k [B,S_kv,d];
    `deterministic`: the key gradient in fixed point (module docstring). On CUDA the Triton kernels
    (indexer_kl_triton), except the deterministic key gradient, which is this module's fixed-point path."""
    b, _, h, d = q.shape
    rows = _rows(chunk, b, ids.shape[-1], 4 * (2 * d + 3 * h))  # backward: keys, dk rows, logits, relu, dlogits
    return _selected_scores(q, weights, k, ids, rows, deterministic)


def head_summed_distribution(scores: Tensor) -> Tensor:
    """scores [B, H, S, N] (-inf: not a key of the row) -> [B, S, N]: softmax per head, summed over heads,
    L1-normalised; 0 where a row has no key. The KL target's one form, dense (indexer_kl_dense) and sparse (here)."""
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0).sum(1)  # in place: a target, never differentiated
    return probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)


def _reference_target(q: Tensor, kv: Tensor, ids: Tensor, scale: float, chunk: int) -> Tensor:
    """The KL target chunk by chunk in float32 (or wider) PyTorch: the CPU path and the kernel's oracle."""
    out = torch.empty(ids.shape, dtype=_acc(q.dtype), device=q.device)
    kv_acc = kv.to(out.dtype)  # once: the chunks gather float rows directly (exact either way)
    for c0 in range(0, ids.shape[1], chunk):
        sl = slice(c0, c0 + chunk)
        scores = torch.einsum("bthd,btkd->bhtk", q[:, sl].to(out.dtype), gather_keys(kv_acc, ids[:, sl])) * scale
        scores = scores.masked_fill(ids[:, None, sl] < 0, float("-inf"))
        out[:, sl] = head_summed_distribution(scores)
    return out


@torch.library.custom_op("spartron::kl_sparse_target", mutates_args=())
def _sparse_target(q: Tensor, kv: Tensor, ids: Tensor, scale: float, chunk: int) -> Tensor:
    return _reference_target(q, kv, ids, scale, chunk)


@_sparse_target.register_kernel("cuda")
def _(q, kv, ids, scale, chunk):
    from spartron.layers.attention import indexer_kl_triton

    return indexer_kl_triton.target(q, kv, ids, scale)


@_sparse_target.register_fake
def _(q, kv, ids, scale, chunk):
    return q.new_empty(ids.shape, dtype=_acc(q.dtype))


def sparse_attention_target(q: Tensor | AbsorbedQuery, kv: Tensor, scale: float, ids: Tensor,
                            chunk: int | None = None) -> Tensor:
    """Detached [B,S,K]: sum over heads of softmax(scale * q . kv[ids]) over the valid slots, L1-normalised;
    0 at -1 slots. q [B,S,H,D] (absorbed queries), kv [B,S_kv,D] (latent rows). On CUDA the Triton kernel.
    An AbsorbedQuery (chunked attention): one op call per chunk of its rows, each row's value the same."""
    if isinstance(q, AbsorbedQuery):
        return torch.cat([sparse_attention_target(q.at(r), kv, scale, ids[:, r].contiguous(), chunk)
                          for r in q.rows()], dim=1)
    b, _, h, d = q.shape
    rows = _rows(chunk, b, ids.shape[-1], 4 * (d + 3 * h))  # gathered rows, scores, probabilities
    return _sparse_target(q.detach(), kv.detach(), ids, scale, rows)


def kl_rows(target: Tensor, log_pred: Tensor) -> Tensor:
    """sum_s p * (log p - log q) per row, with 0 * log 0 = 0 (and masked log q never multiplied)."""
    positive = target > 0
    log_target = torch.where(positive, target, torch.ones_like(target)).log()
    safe_pred = torch.where(positive, log_pred, torch.zeros_like(log_pred))
    return (target * (log_target - safe_pred)).sum(-1)


def sparse_indexer_kl(q: Tensor, weights: Tensor, k: Tensor, ids: Tensor, q_abs: Tensor | AbsorbedQuery, kv: Tensor,
                      scale: float, chunk: int | None = None, deterministic: bool = False) -> Tensor:
    """Mean over the B x S query rows of KL(main attention over the ids || softmax(I_sel)); gradient into the
    indexer's q, weights and k only."""
    target = sparse_attention_target(q_abs, kv, scale, ids, chunk)
    scores = selected_index_scores(q, weights, k, ids, chunk, deterministic)
    return kl_rows(target, F.log_softmax(scores, dim=-1)).mean()
