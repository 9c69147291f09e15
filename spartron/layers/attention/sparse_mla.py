"""`spartron::sparse_mla`: attention of each query over only its selected key positions (DSA).

Interface (the absorbed-MLA form of FlashMLA's sparse kernel, so a GPU kernel can sit behind it):
  q          [B, S_q, H, D]   absorbed queries: (q_nope @ W_uk) ++ q_pe, D = kv_lora_rank + rope_dim
  kv         [B, S_kv, D]     one latent head shared by all query heads: kv_norm(latent) ++ k_pe
  topk_ids   [B, S_q, K]      int32 key positions per query; -1 (or >= S_kv) marks an empty slot
  returns out [B, S_q, H, d_v] with values kv[..., :d_v] (the latent), and lse [B, S_q, H] float32
  (float64 for float64 inputs): natural-log log-sum-exp of the scaled scores, -inf for a query
  with no valid id. Both outputs are differentiable.
FlashMLA has no batch axis: a kernel wrapper flattens B into the sequence and offsets ids by b*S_kv.
Ids must be unique per query (gather semantics: a repeated id is counted twice). The op does not
apply a causal mask: the indexer only selects visible keys.

The reference implementation is PyTorch: gather the selected latents per chunk of queries, so peak
temporary memory is bounded by `chunk_size` (16k queries x 2048 ids x 64 heads fit in a few GiB),
accumulating in float32 (float64 for float64 inputs). Backward is its own op,
`spartron::sparse_mla_backward`, recomputing probabilities from the saved lse (flash-style) and
scatter-adding key gradients; it is wired through `register_autograd`, so AC policies, autograd and
torch.compile all see these two boundaries.

On CUDA both ops run the Triton kernels of sparse_mla_triton.py (registered below as the ops' CUDA
kernels); a CUDA input they cannot take (head dim other than 576, d_v other than 512, float32) is an
error naming the limit. `deterministic` (model.dsa.deterministic_dkv) makes the CUDA backward add
key gradients in int64 fixed point (bitwise reproducible); the CPU reference is sequential and
deterministic either way. The PyTorch code here is the CPU path and the oracle the kernels are tested
against (`reference_forward` / `reference_backward`, callable on any device).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Bytes of temporaries one chunk of queries may use in the reference implementation.
_CHUNK_BUDGET_BYTES = 1 << 30


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def default_chunk_size(q: Tensor, kv: Tensor, topk_ids: Tensor) -> int:
    """Queries per chunk so gathered latents and [H, K] score tiles stay near 1 GiB."""
    b, _, h, d = q.shape
    k = topk_ids.shape[-1]
    acc = torch.finfo(_acc_dtype(q.dtype)).bits // 8
    per_query = b * k * (d * (kv.element_size() + acc) + 4 * h * acc)
    return max(1, _CHUNK_BUDGET_BYTES // max(per_query, 1))


def _gather_chunk(kv: Tensor, ids: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Selected latents [B, C, K, D] (acc dtype), validity mask [B, C, K], clamped int64 ids."""
    b, c, k = ids.shape
    s_kv = kv.shape[1]
    valid = (ids >= 0) & (ids < s_kv)
    safe = torch.where(valid, ids, 0).long()
    picked = torch.gather(kv, 1, safe.reshape(b, c * k, 1).expand(-1, -1, kv.shape[-1]))
    return picked.reshape(b, c, k, -1).to(acc), valid, safe


def _chunk_probs(q_c: Tensor, kv_sel: Tensor, valid: Tensor, scale: float, lse: Tensor | None):
    """Scores -> probabilities [B, C, H, K]; computes lse when not given."""
    scores = torch.einsum("bchd,bckd->bchk", q_c, kv_sel) * scale
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - finite[..., None])  # exp(-inf) = 0 for masked slots
    return probs, lse


def reference_forward(q: Tensor, kv: Tensor, topk_ids: Tensor, softmax_scale: float, d_v: int,
                      chunk_size: int) -> tuple[Tensor, Tensor]:
    """The PyTorch forward (chunked gathers, float32 or float64 accumulation) on any device."""
    b, s_q, h, _ = q.shape
    acc = _acc_dtype(q.dtype)
    out = q.new_empty(b, s_q, h, d_v)
    lse = torch.empty(b, s_q, h, dtype=acc, device=q.device)
    for c0 in range(0, s_q, chunk_size):
        c1 = min(c0 + chunk_size, s_q)
        kv_sel, valid, _ = _gather_chunk(kv, topk_ids[:, c0:c1], acc)
        probs, lse_c = _chunk_probs(q[:, c0:c1].to(acc), kv_sel, valid, softmax_scale, None)
        out[:, c0:c1] = torch.einsum("bchk,bckv->bchv", probs, kv_sel[..., :d_v]).to(q.dtype)
        lse[:, c0:c1] = lse_c
    return out, lse


@torch.library.custom_op("spartron::sparse_mla", mutates_args=())
def _sparse_mla(q: Tensor, kv: Tensor, topk_ids: Tensor, softmax_scale: float, d_v: int,
                chunk_size: int, deterministic: bool) -> tuple[Tensor, Tensor]:
    """`deterministic` only rides along to the backward (the forward has no cross-query sums)."""
    return reference_forward(q, kv, topk_ids, softmax_scale, d_v, chunk_size)


@_sparse_mla.register_kernel("cuda")
def _(q, kv, topk_ids, softmax_scale, d_v, chunk_size, deterministic):
    from spartron.layers.attention import sparse_mla_triton  # the kernels import triton only when used

    return sparse_mla_triton.forward(q, kv, topk_ids, softmax_scale, d_v)


@_sparse_mla.register_fake
def _(q, kv, topk_ids, softmax_scale, d_v, chunk_size, deterministic):
    b, s_q, h, _ = q.shape
    return q.new_empty(b, s_q, h, d_v), q.new_empty(b, s_q, h, dtype=_acc_dtype(q.dtype))


def reference_backward(grad_out: Tensor, grad_lse: Tensor, q: Tensor, kv: Tensor, topk_ids: Tensor,
                       lse: Tensor, softmax_scale: float, d_v: int, chunk_size: int) -> tuple[Tensor, Tensor]:
    """The PyTorch backward (recomputed probabilities, index_add_ into the key gradient)."""
    b, s_q, _, _ = q.shape
    s_kv, d = kv.shape[1], kv.shape[2]
    acc = _acc_dtype(q.dtype)
    grad_q = torch.empty_like(q)
    grad_kv = torch.zeros(b * s_kv, d, dtype=acc, device=kv.device)
    batch_offset = (torch.arange(b, device=kv.device) * s_kv).view(b, 1, 1)
    for c0 in range(0, s_q, chunk_size):
        c1 = min(c0 + chunk_size, s_q)
        kv_sel, valid, safe = _gather_chunk(kv, topk_ids[:, c0:c1], acc)
        q_c = q[:, c0:c1].to(acc)
        probs, _ = _chunk_probs(q_c, kv_sel, valid, softmax_scale, lse[:, c0:c1])
        go = grad_out[:, c0:c1].to(acc)
        dprobs = torch.einsum("bchv,bckv->bchk", go, kv_sel[..., :d_v])
        delta = (probs * dprobs).sum(-1, keepdim=True)
        dscores = probs * (dprobs - delta + grad_lse[:, c0:c1].to(acc)[..., None])
        grad_q[:, c0:c1] = (torch.einsum("bchk,bckd->bchd", dscores, kv_sel) * softmax_scale).to(q.dtype)
        dkv_sel = torch.einsum("bchk,bchd->bckd", dscores, q_c) * softmax_scale
        dkv_sel[..., :d_v] += torch.einsum("bchk,bchv->bckv", probs, go)
        grad_kv.index_add_(0, (safe + batch_offset).reshape(-1), dkv_sel.reshape(-1, d))
    return grad_q, grad_kv.view(b, s_kv, d).to(kv.dtype)


@torch.library.custom_op("spartron::sparse_mla_backward", mutates_args=())
def _sparse_mla_backward(grad_out: Tensor, grad_lse: Tensor, q: Tensor, kv: Tensor, topk_ids: Tensor,
                         out: Tensor, lse: Tensor, softmax_scale: float, d_v: int,
                         chunk_size: int, deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """`out` is unused here; the CUDA kernel takes Delta = rowsum(dO * out) from it."""
    return reference_backward(grad_out, grad_lse, q, kv, topk_ids, lse, softmax_scale, d_v, chunk_size)


@_sparse_mla_backward.register_kernel("cuda")
def _(grad_out, grad_lse, q, kv, topk_ids, out, lse, softmax_scale, d_v, chunk_size, deterministic=False):
    from spartron.layers.attention import sparse_mla_triton

    return sparse_mla_triton.backward(grad_out, grad_lse, q, kv, topk_ids, out, lse, softmax_scale, d_v,
                                      deterministic=deterministic)


@_sparse_mla_backward.register_fake
def _(grad_out, grad_lse, q, kv, topk_ids, out, lse, softmax_scale, d_v, chunk_size, deterministic=False):
    return torch.empty_like(q), torch.empty_like(kv)


def _setup_context(ctx, inputs, output):
    q, kv, topk_ids, softmax_scale, d_v, chunk_size, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, topk_ids, out, lse)
    ctx.args = (softmax_scale, d_v, chunk_size, deterministic)


def _backward(ctx, grad_out, grad_lse):
    q, kv, topk_ids, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = q.new_zeros(*q.shape[:3], ctx.args[1])
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    grad_q, grad_kv = _sparse_mla_backward(grad_out.contiguous(), grad_lse.contiguous(), q, kv, topk_ids, out,
                                           lse, *ctx.args)
    return grad_q, grad_kv, None, None, None, None, None


_sparse_mla.register_autograd(_backward, setup_context=_setup_context)


def sparse_mla(q: Tensor, kv: Tensor, topk_ids: Tensor, softmax_scale: float, d_v: int,
               chunk_size: int | None = None, deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """Sparse absorbed-MLA attention; returns (out [B,S_q,H,d_v], lse [B,S_q,H]).

    `chunk_size` (queries per chunk of the reference implementation) changes memory, not results;
    `deterministic` makes the CUDA backward's dkv bitwise reproducible (module docstring).
    """
    if q.dim() != 4 or kv.dim() != 3 or topk_ids.dim() != 3:
        raise ValueError(f"sparse_mla expects q [B,S_q,H,D], kv [B,S_kv,D], topk_ids [B,S_q,K]; got "
                         f"{tuple(q.shape)}, {tuple(kv.shape)}, {tuple(topk_ids.shape)}")
    if kv.shape[0] != q.shape[0] or kv.shape[2] != q.shape[3]:
        raise ValueError(f"sparse_mla: kv {tuple(kv.shape)} must match q {tuple(q.shape)} in batch and "
                         "head dim")
    if topk_ids.shape[:2] != q.shape[:2]:
        raise ValueError(f"sparse_mla: topk_ids {tuple(topk_ids.shape)} must match q {tuple(q.shape)} "
                         "in [B, S_q]")
    if topk_ids.dtype != torch.int32:
        raise ValueError(f"sparse_mla: topk_ids must be int32, got {topk_ids.dtype}")
    if not 0 < d_v <= q.shape[3]:
        raise ValueError(f"sparse_mla: d_v {d_v} must be in 1..{q.shape[3]} (the latent part of kv)")
    if q.dtype != kv.dtype:
        raise ValueError(f"sparse_mla: q {q.dtype} and kv {kv.dtype} must share a dtype")
    if chunk_size is None:
        chunk_size = default_chunk_size(q, kv, topk_ids)
    if chunk_size < 1:
        raise ValueError(f"sparse_mla: chunk_size must be >= 1, got {chunk_size}")
    return _sparse_mla(q.contiguous(), kv.contiguous(), topk_ids.contiguous(), float(softmax_scale),
                       int(d_v), int(chunk_size), bool(deterministic))
