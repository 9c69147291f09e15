"""`spartron::indexer_topk`: lightning-indexer scores and their causal top-k as one op (no gradient).

  q [B, S_q, H, d] index queries, weights [B, S_q, H] head weights, k [B, S_kv, d] (one key head);
  q_positions [S_q] / k_positions [S_kv] int64 global positions (key s is visible to query t iff
  k_positions[s] <= q_positions[t]; under CP the queries are local and the keys all-gathered);
  q_starts [B, S_q] (packed documents, attention.doc_mask): also k_positions[s] >= q_starts[b, t];
  returns int32 ids [B, S_q, min(topk, S_kv)]: the SET of the keys with the highest
  I[t,s] = sum_h w[t,h] ReLU(q[t,h] . k[s]) over visible keys (equal scores: the lower key id first), in
  ascending key order, -1 padding last where a query sees fewer keys than the slots (`topk_ids`).
  No consumer needs score order: sparse attention and the KL loss sum over the slots, and ascending ids
  make the sparse kernel's gathers walk the keys forward.
`fp8`: q and k are quantised to float8 e4m3 (one scale per (query, head) row and per key row,
amax / 448) before the dot, as Hopper's fp8 MMA would take them; both paths quantise the same way.

The PyTorch reference (`reference_indexer_topk`, chunked over queries so [chunk, H, S_kv] stays
bounded) is the CPU path and the test oracle; on CUDA (indexer_triton.py) a Triton kernel scores tiles
without the per-head logits, skipping tiles no query of them sees, and a Triton selection kernel
(topk_triton_kernels) takes each row's exact top-k from its visible keys only, with `topk_ids`'s rule.
kl_dense (the dense warm-up) selects inside its chunked KL op from the same differentiable scores, with
`topk_ids` (attention.indexer_kl_dense); kl_sparse selects through this op and scores its top-k only
(attention.indexer_kl).
"""

from __future__ import annotations

import torch
from torch import Tensor

from spartron.layers.attention.indexer_fp8 import fp8_operands

# Bytes of [chunk, H, S_kv] score temporaries of the reference path.
_REFERENCE_CHUNK_BYTES = 1 << 29


def causal_visible(q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """[S_q, S_kv] bool: key s is visible to query t iff position(s) <= position(t)."""
    return k_positions[None, :] <= q_positions[:, None]


def visible_keys(q_positions: Tensor, k_positions: Tensor, q_starts: Tensor | None = None) -> Tensor:
    """The op's visibility as a mask: [S_q, S_kv], or [B, S_q, S_kv] with packed documents' `q_starts` [B, S_q]
    (key s also needs k_positions[s] >= q_starts[b, t])."""
    visible = causal_visible(q_positions, k_positions)
    if q_starts is None:
        return visible
    return visible & (k_positions[None, None, :] >= q_starts[:, :, None])


def index_scores(q: Tensor, weights: Tensor, k: Tensor, visible: Tensor) -> Tensor:
    """I [B,S_q,S_kv] (>= float32, -inf where not visible); q [B,S_q,H,d], weights [B,S_q,H], k [B,S_kv,d]."""
    acc = torch.promote_types(q.dtype, torch.float32)
    logits = torch.einsum("bthd,bsd->bths", q.to(acc), k.to(acc)).relu()
    scores = torch.einsum("bths,bth->bts", logits, weights.to(acc))
    return scores.masked_fill(~visible, float("-inf"))


def topk_ids(scores: Tensor, topk: int) -> Tensor:
    """int32 ids [..., min(topk, S_kv)]: the keys of the highest finite scores (-inf: not visible), ties
    to the lower key id, in ascending key order, -1 padding last. The one rule of the top-k's order: the
    CUDA radix select follows it too, so on the same scores both give the same ids."""
    kk = min(topk, scores.shape[-1])
    finite = scores > float("-inf")
    kth = scores.topk(kk, dim=-1).values[..., -1:]
    above = finite & (scores > kth)
    tied = finite & (scores == kth)
    need = kk - above.sum(-1, keepdim=True)
    take = above | (tied & (tied.cumsum(-1) <= need))
    slot = torch.where(take, take.cumsum(-1) - 1, kk)  # the untaken go to a spare last column
    cols = torch.arange(scores.shape[-1], device=scores.device).expand_as(scores)
    out = torch.full((*scores.shape[:-1], kk + 1), -1, dtype=torch.int64, device=scores.device)
    out.scatter_(-1, slot, cols)
    return out[..., :kk].to(torch.int32)


def reference_indexer_topk(q: Tensor, weights: Tensor, k: Tensor, q_positions: Tensor, k_positions: Tensor,
                           topk: int, fp8: bool = False, q_starts: Tensor | None = None) -> Tensor:
    """The PyTorch path: chunked `index_scores` + `topk_ids` (float32 or wider accumulation). `q_starts`
    [B, S_q]: packed documents, key s also needs k_positions[s] >= q_starts[b, t] (attention.doc_mask)."""
    k_scale = None
    if fp8:
        q8, weights, k8, k_scale = fp8_operands(q, weights, k)
        q, k = q8.float(), k8.float()
    s_q, s_kv = q.shape[1], k.shape[1]
    chunk = max(1, _REFERENCE_CHUNK_BYTES // (4 * q.shape[0] * q.shape[2] * max(s_kv, 1)))
    parts = []
    for c0 in range(0, s_q, chunk):
        c1 = min(c0 + chunk, s_q)
        visible = visible_keys(q_positions[c0:c1], k_positions, None if q_starts is None else q_starts[:, c0:c1])
        scores = index_scores(q[:, c0:c1], weights[:, c0:c1], k, visible)
        if k_scale is not None:
            scores = scores * k_scale[:, None, :]
        parts.append(topk_ids(scores, topk))
    return torch.cat(parts, dim=1)


@torch.library.custom_op("spartron::indexer_topk", mutates_args=())
def _indexer_topk(q: Tensor, weights: Tensor, k: Tensor, q_positions: Tensor, k_positions: Tensor, topk: int,
                  fp8: bool, q_starts: Tensor | None) -> Tensor:
    return reference_indexer_topk(q, weights, k, q_positions, k_positions, topk, fp8, q_starts)


@_indexer_topk.register_kernel("cuda")
def _(q, weights, k, q_positions, k_positions, topk, fp8, q_starts):
    from spartron.layers.attention import indexer_triton  # the kernel imports triton only when used

    return indexer_triton.indexer_topk(q, weights, k, q_positions, k_positions, topk, fp8, q_starts)


@_indexer_topk.register_fake
def _(q, weights, k, q_positions, k_positions, topk, fp8, q_starts):
    return q.new_empty(q.shape[0], q.shape[1], min(topk, k.shape[1]), dtype=torch.int32)


def indexer_topk(q: Tensor, weights: Tensor, k: Tensor, q_positions: Tensor, k_positions: Tensor, topk: int,
                 fp8: bool = False, q_starts: Tensor | None = None) -> Tensor:
    """Top-k key ids per query of the lightning indexer (see the module docstring); no gradient."""
    if q.dim() != 4 or weights.shape != q.shape[:3] or k.dim() != 3 or k.shape[0] != q.shape[0] \
            or k.shape[2] != q.shape[3]:
        raise ValueError(f"indexer_topk expects q [B,S_q,H,d], weights [B,S_q,H], k [B,S_kv,d]; got "
                         f"{tuple(q.shape)}, {tuple(weights.shape)}, {tuple(k.shape)}")
    if q_positions.shape != (q.shape[1],) or k_positions.shape != (k.shape[1],):
        raise ValueError(f"indexer_topk: positions must be [S_q] and [S_kv] = [{q.shape[1]}] and [{k.shape[1]}]; "
                         f"got {tuple(q_positions.shape)} and {tuple(k_positions.shape)}")
    if topk < 1:
        raise ValueError(f"indexer_topk: topk must be >= 1, got {topk}")
    if q_starts is not None and q_starts.shape != q.shape[:2]:  # packed documents (attention.doc_mask)
        raise ValueError(f"indexer_topk: q_starts must be [B, S_q] = {tuple(q.shape[:2])}, "
                         f"got {tuple(q_starts.shape)}")
    return _indexer_topk(q.detach().contiguous(), weights.detach().contiguous(), k.detach().contiguous(),
                         q_positions.contiguous(), k_positions.contiguous(), int(topk), bool(fp8),
                         None if q_starts is None else q_starts.contiguous())
