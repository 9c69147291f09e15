"""Does the lightning indexer learn? Recall of the dense attention mass by its top-k, and the KL, per layer.

For sampled queries t of a DSA source layer: p_t = the main attention's probabilities over all visible keys,
summed over heads and L1-normalised (the KL target of V3.2's warm-up); recall_t = sum of p_t over the keys
the indexer selects (its top-k: the training selection's rule, `indexer_topk`); kl_t = KL(p_t || softmax(I_t))
over all visible keys. Only the sampled rows are scored: O(Q x S_kv) memory, heads taken a few at a time
(never O(S^2), never [H, Q, S_kv] for all heads at once). No gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from spartron.layers.attention.indexer_kl import kl_rows
from spartron.layers.attention.indexer_topk import index_scores, indexer_topk

_HEAD_CHUNK = 16


def sampled_rows(n_local: int, n: int, device: torch.device | str) -> Tensor:
    """`n` local query rows spread evenly over 0..n_local-1 (the last included), fewer when the rows are fewer."""
    if n < 1:
        raise ValueError(f"indexer metrics: at least one sampled query, got {n}")
    return torch.linspace(0, n_local - 1, min(n, n_local), device=device).round().long().unique()


def dense_distribution(q_abs: Tensor, kv: Tensor, scale: float, visible: Tensor, head_chunk: int = _HEAD_CHUNK
                       ) -> Tensor:
    """[B,Q,S_kv] float32+: softmax per head of scale * q_abs . kv over the visible keys, summed over heads,
    L1-normalised; q_abs [B,Q,H,D] (absorbed queries), kv [B,S_kv,D], visible [Q,S_kv] or [B,Q,S_kv]."""
    acc = torch.promote_types(q_abs.dtype, torch.float32)
    hidden = ~(visible[:, None] if visible.dim() == 3 else visible)
    total = q_abs.new_zeros((q_abs.shape[0], q_abs.shape[1], kv.shape[1]), dtype=acc)
    kv = kv.to(acc)
    for h0 in range(0, q_abs.shape[2], head_chunk):
        scores = torch.einsum("bqhd,bsd->bhqs", q_abs[:, :, h0:h0 + head_chunk].to(acc), kv) * scale
        total += torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).nan_to_num(0.0).sum(1)
    return total / total.sum(-1, keepdim=True).clamp_min(torch.finfo(acc).tiny)


def recall_and_kl(target: Tensor, scores: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: the target mass on the selected ids (-1 slots count nothing) and KL(target || softmax(scores));
    target, scores [B,Q,S_kv] (scores -inf where not visible), ids [B,Q,K]."""
    picked = target.gather(-1, ids.clamp_min(0).long()) * (ids >= 0)
    return picked.sum(-1), kl_rows(target, F.log_softmax(scores.to(target.dtype), dim=-1))


def indexer_quality(probe: dict[str, Tensor], scale: float, topk: int, fp8: bool = False) -> tuple[Tensor, Tensor]:
    """(mean recall, mean KL) over the sampled rows of one layer, from `MLA.indexer_probe`'s tensors; the ids are
    the indexer's top-k by its training selection's rule (`fp8`: the float8 scores of model.dsa.indexer_fp8)."""
    target = dense_distribution(probe["q_abs"], probe["kv"], scale, probe["visible"])
    scores = index_scores(probe["q_index"], probe["weights"], probe["k_index"], probe["visible"])
    ids = indexer_topk(probe["q_index"], probe["weights"], probe["k_index"], probe["q_positions"],
                       probe["k_positions"], topk, fp8, probe["q_starts"])
    recall, kl = recall_and_kl(target, scores, ids)
    return recall.mean(), kl.mean()
