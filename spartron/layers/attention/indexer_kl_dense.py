"""kl_dense / a dense warm-up's indexer KL loss in query chunks: nothing [S, S_kv] outlives a chunk.

DeepSeek-V3.2's dense warm-up trains the lightning indexer by KL(p || softmax(I)) per query row, p the
detached, head-summed, L1-normalised main attention over ALL visible keys and I[t,s] = sum_h w[t,h]
ReLU(q[t,h] . k[s]). Materialised, p and I are [B, S, S_kv] and the per-head logits [B, S, H, S_kv] (at 128k
one [S, S] float32 tensor is 64 GiB). Here one op, `spartron::kl_dense`, walks the queries in chunks of
`chunk` rows and returns only the per-row KL [B, S] and the top-k ids [B, S, K] picked from the same chunk's
scores (`topk_ids`'s rule, as kl_dense always selected). Its autograd saves the inputs (O(S x d)) and its
backward op, `spartron::kl_dense_backward`, recomputes each chunk's logits, p and log-softmax (the per-row
statistics come back with them: their cost is the matmuls', which the backward redoes anyway) to form
dI = g * (softmax(I) * sum(p) - p) and from it dq, dw and dk. Peak temporaries are about
B x chunk x S_kv x (3 x heads + 4 x index heads) float32 (`chunk_rows` derives chunk from a byte budget when
model.dsa.kl_dense_chunk is 0). No gradient reaches the main attention (its queries and rows are
detached: the target is a label, as in the materialising form this replaces). Under activation
checkpointing the op is MANDATORY (checkpointing.policy): the replay reuses its ids and never redoes the
S x S_kv walk. Plain PyTorch on every device (kl_sparse's Triton kernels serve the top-k slots only); at 128k x
128 heads the 1 GiB budget is 3 rows a chunk, so a long warm-up wants a larger kl_dense_chunk where memory
allows (or a fused kernel: not written).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from spartron.layers.attention.absorb import absorb_query
from spartron.layers.attention.indexer_kl import head_summed_distribution, kl_rows
from spartron.layers.attention.indexer_topk import topk_ids, visible_keys
from spartron.layers.attention.sparse_mla_absorbed import AbsorbedQuery

# Bytes of one chunk's temporaries when model.dsa.kl_dense_chunk = 0 (derived).
CHUNK_BYTES = 1 << 30
# Operand dtypes whose products `_by_keys` leaves to a CUDA GEMM with a float32 output.
_HALF = (torch.bfloat16, torch.float16)


def chunk_elements(heads: int, index_heads: int) -> int:
    """float32 temporaries per (query row, key) of one chunk: the main scores, their softmax and its NaN-free
    copy (3 x heads), the index logits, their gradient and einsum copies (4 x index heads), scores, p, log q,
    their gradients and the head sum."""
    return 3 * heads + 4 * index_heads + 8


def chunk_rows(chunk: int | None, batch: int, keys: int, heads: int, index_heads: int) -> int:
    """Query rows per chunk: `chunk` (model.dsa.kl_dense_chunk), else as many as keep one chunk's temporaries
    (`chunk_elements` float32 per row and key) under CHUNK_BYTES."""
    if chunk is not None:
        if chunk < 1:
            raise ValueError(f"model.dsa.kl_dense_chunk must be >= 1 query row, got {chunk}")
        return chunk
    return max(1, CHUNK_BYTES // (4 * batch * max(keys, 1) * chunk_elements(heads, index_heads)))


def _visible(q_positions: Tensor, k_positions: Tensor, q_starts: Tensor | None, rows: slice) -> Tensor:
    return visible_keys(q_positions[rows], k_positions, None if q_starts is None else q_starts[:, rows])


def _tensor_core_products(*operands: Tensor, acc: torch.dtype) -> bool:
    """Whether `_by_keys` multiplies these operands as they are: CUDA, one bf16 / fp16 dtype, float32 output."""
    first = operands[0]
    return (first.is_cuda and acc == torch.float32 and first.dtype in _HALF
            and all(t.dtype == first.dtype for t in operands))


def _by_keys(rows: Tensor, keys: Tensor, acc: torch.dtype) -> Tensor:
    """rows [B, c, H, D] . keys [B, S_kv, D] -> [B, c, H, S_kv] in `acc`: one batched GEMM. bf16 / fp16
    operands on CUDA go to the tensor cores with a float32 output (every product is exact in float32 and summed
    in float32, as after an upcast: only the order of the sums differs); elsewhere both are upcast first (an
    fp32 GEMM without TF32 runs at about a tenth of the bf16 rate)."""
    b, c, h, d = rows.shape
    flat, keys_t = rows.reshape(b, c * h, d), keys.transpose(1, 2)
    if _tensor_core_products(rows, keys, acc=acc):
        out = torch.bmm(flat, keys_t, out_dtype=acc)
    else:
        out = torch.bmm(flat.to(acc), keys_t.to(acc))
    return out.view(b, c, h, keys.shape[1])


def _target(q_abs: Tensor, kv: Tensor, scale: float, visible: Tensor, acc: torch.dtype) -> Tensor:
    """p [B, c, S_kv] of one chunk: the materialising target's formula (dsa.main_attention_target until the
    chunked op replaced it) on these rows."""
    scores = _by_keys(q_abs, kv, acc).transpose(1, 2).mul_(scale)  # scaled and masked in place: no copies
    return head_summed_distribution(scores.masked_fill_(~(visible[:, None] if visible.dim() == 3 else visible),
                                                        float("-inf")))


def _main_rows(q_main: Tensor, q_pe: Tensor | None, w_uk: Tensor | None, rows: slice) -> Tensor:
    """One chunk's absorbed query: rows of `q_main` (the absorbed query), or, with `w_uk` (the attention runs in
    query chunks: an AbsorbedQuery), absorb_query of these rows of q_nope and q_pe, so nothing [S, H, c + r]
    exists (each row's value the whole absorb's: per-row products)."""
    if w_uk is None:
        return q_main[:, rows]
    return absorb_query(q_main[:, rows], q_pe[:, rows], w_uk)


def _scores(relu_logits: Tensor, weights: Tensor, visible: Tensor) -> Tensor:
    return torch.einsum("bths,bth->bts", relu_logits, weights).masked_fill(~visible, float("-inf"))


def _product_keys(q: Tensor, k: Tensor, kv: Tensor) -> tuple[torch.dtype, Tensor, Tensor]:
    """The accumulation dtype (float32 or wider) and both key sets as `_by_keys` takes them, once per call:
    as they are where its GEMM takes them directly, else upcast (once, not per chunk)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    if _tensor_core_products(q, k, kv, acc=acc):
        return acc, k, kv
    return acc, k.to(acc), kv.to(acc)


def reference_forward(q: Tensor, weights: Tensor, k: Tensor, q_abs: Tensor, kv: Tensor, q_positions: Tensor,
                      k_positions: Tensor, q_starts: Tensor | None, scale: float, topk: int,
                      chunk: int, q_pe: Tensor | None = None, w_uk: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(KL per row [B, S] in float32 or wider, ids [B, S, min(topk, S_kv)] int32), chunk by chunk. With q_pe and
    w_uk, `q_abs` is q_nope and each chunk absorbs its rows (`_main_rows`)."""
    acc, k_x, kv_x = _product_keys(q, k, kv)
    b, s = q.shape[:2]
    kl = torch.empty(b, s, dtype=acc, device=q.device)
    ids = torch.empty(b, s, min(topk, k.shape[1]), dtype=torch.int32, device=q.device)
    for c0 in range(0, s, chunk):
        rows = slice(c0, c0 + chunk)
        visible = _visible(q_positions, k_positions, q_starts, rows)
        p = _target(_main_rows(q_abs, q_pe, w_uk, rows), kv_x, scale, visible, acc)
        scores = _scores(_by_keys(q[:, rows], k_x, acc).relu_(), weights[:, rows].to(acc), visible)
        ids[:, rows] = topk_ids(scores, topk)
        kl[:, rows] = kl_rows(p, F.log_softmax(scores, dim=-1))
    return kl, ids


def reference_backward(grad: Tensor, q: Tensor, weights: Tensor, k: Tensor, q_abs: Tensor, kv: Tensor,
                       q_positions: Tensor, k_positions: Tensor, q_starts: Tensor | None, scale: float,
                       chunk: int, q_pe: Tensor | None = None,
                       w_uk: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dw, dk) of the per-row KL for its gradient `grad` [B, S], each chunk recomputed: dI = -g p + g
    softmax(I) sum(p) over the keys where p > 0 (kl_rows' terms; log_softmax's backward). q_pe, w_uk: as for
    reference_forward."""
    acc, k_x, kv_x = _product_keys(q, k, kv)
    k_acc = k_x.to(acc)  # dq's GEMM takes the float32 gradient: its keys in float32 too (no copy if k_x is)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dw = torch.empty(weights.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    grad = grad.to(acc)
    for c0 in range(0, q.shape[1], chunk):
        rows = slice(c0, c0 + chunk)
        visible = _visible(q_positions, k_positions, q_starts, rows)
        p = _target(_main_rows(q_abs, q_pe, w_uk, rows), kv_x, scale, visible, acc)
        qc, wc = q[:, rows].to(acc), weights[:, rows].to(acc)
        relu = _by_keys(q[:, rows], k_x, acc).relu_()  # relu(x) <= 0 exactly where x <= 0: ReLU's backward mask
        log_q = F.log_softmax(_scores(relu, wc, visible), dim=-1)
        d_log_q = torch.where(p > 0, -p * grad[:, rows, None], 0.0)
        del p
        d_scores = (d_log_q - log_q.exp() * d_log_q.sum(-1, keepdim=True)).masked_fill_(~visible, 0.0)
        del d_log_q, log_q
        dw[:, rows] = torch.einsum("bths,bts->bth", relu, d_scores)
        d_logits = (d_scores[:, :, None, :] * wc[..., None]).masked_fill_(relu <= 0, 0.0)
        del relu, d_scores
        dq[:, rows] = torch.einsum("bths,bsd->bthd", d_logits, k_acc)
        dk += torch.einsum("bths,bthd->bsd", d_logits, qc)
    return dq.to(q.dtype), dw.to(weights.dtype), dk.to(k.dtype)


@torch.library.custom_op("spartron::kl_dense", mutates_args=())
def _kl_dense(q: Tensor, weights: Tensor, k: Tensor, q_abs: Tensor, kv: Tensor, q_positions: Tensor,
              k_positions: Tensor, q_starts: Tensor | None, scale: float, topk: int,
              chunk: int, q_pe: Tensor | None, w_uk: Tensor | None) -> tuple[Tensor, Tensor]:
    """Saves the inputs only (module docstring); the ids are the op's second output, no gradient."""
    return reference_forward(q, weights, k, q_abs, kv, q_positions, k_positions, q_starts, scale, topk, chunk,
                             q_pe, w_uk)


@_kl_dense.register_fake
def _(q, weights, k, q_abs, kv, q_positions, k_positions, q_starts, scale, topk, chunk, q_pe, w_uk):
    acc = torch.promote_types(q.dtype, torch.float32)
    return (q.new_empty(q.shape[:2], dtype=acc),
            q.new_empty(*q.shape[:2], min(topk, k.shape[1]), dtype=torch.int32))


@torch.library.custom_op("spartron::kl_dense_backward", mutates_args=())
def _kl_dense_backward(grad: Tensor, q: Tensor, weights: Tensor, k: Tensor, q_abs: Tensor, kv: Tensor,
                       q_positions: Tensor, k_positions: Tensor, q_starts: Tensor | None, scale: float,
                       chunk: int, q_pe: Tensor | None, w_uk: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    return reference_backward(grad, q, weights, k, q_abs, kv, q_positions, k_positions, q_starts, scale, chunk,
                              q_pe, w_uk)


@_kl_dense_backward.register_fake
def _(grad, q, weights, k, q_abs, kv, q_positions, k_positions, q_starts, scale, chunk, q_pe, w_uk):
    return torch.empty_like(q), torch.empty_like(weights), torch.empty_like(k)


def _setup_context(ctx, inputs, output):
    q, weights, k, q_abs, kv, q_positions, k_positions, q_starts, scale, _, chunk, q_pe, w_uk = inputs
    ctx.save_for_backward(q, weights, k, q_abs, kv, q_positions, k_positions, q_starts, q_pe, w_uk)
    ctx.args = (scale, chunk)
    ctx.set_materialize_grads(True)


def _backward(ctx, grad_kl, _grad_ids):
    q, weights, k, q_abs, kv, q_positions, k_positions, q_starts, q_pe, w_uk = ctx.saved_tensors
    dq, dw, dk = _kl_dense_backward(grad_kl.contiguous(), q, weights, k, q_abs, kv, q_positions, k_positions,
                                    q_starts, *ctx.args, q_pe, w_uk)
    return dq, dw, dk, None, None, None, None, None, None, None, None, None, None


_kl_dense.register_autograd(_backward, setup_context=_setup_context)


def dense_indexer_kl(q: Tensor, weights: Tensor, k: Tensor, q_abs: Tensor | AbsorbedQuery, kv: Tensor, scale: float,
                     q_positions: Tensor, k_positions: Tensor, q_starts: Tensor | None, topk: int,
                     chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """(ids [B, S, min(topk, S_kv)] int32, mean over the B x S rows of KL(p || softmax(I))) over all visible keys;
    gradient into the indexer's q [B,S,H,d], weights [B,S,H] and k [B,S_kv,d] only. q_abs [B,S,Hm,D] / kv
    [B,S_kv,D]: the main attention's absorbed queries and latent rows (detached here), or an AbsorbedQuery (the
    attention runs in query chunks): each chunk absorbs its own rows, nothing [S, H, D] made. Positions and
    q_starts as for indexer_topk; `chunk`: query rows per chunk (None: `chunk_rows` derives it)."""
    if isinstance(q_abs, AbsorbedQuery):
        main, q_pe, w_uk = (t.detach() for t in (q_abs.q_nope, q_abs.q_pe, q_abs.w_uk))  # views: no copy saved
    else:
        main, q_pe, w_uk = q_abs.detach().contiguous(), None, None
    rows = chunk_rows(chunk, q.shape[0], k.shape[1], main.shape[2], q.shape[2])
    kl, ids = _kl_dense(q.contiguous(), weights.contiguous(), k.contiguous(), main, kv.detach().contiguous(),
                        q_positions.contiguous(), k_positions.contiguous(),
                        None if q_starts is None else q_starts.contiguous(), float(scale), int(topk), rows, q_pe, w_uk)
    return ids, kl.mean()
