"""Block-causal attention over packed documents (document masks).

A packed row holds several documents back to back. Its positions [B, S] restart at 0 at each
document start and count up by one inside a document (what spartron.data.packing produces), so
they say everything about the packing: query t sees key s iff s <= t and s >= t - positions[t]
(s lies in t's document, at or before t). RoPE takes the same per-document positions, so each
document is encoded as if it were alone.

Two implementations of the same mask: on CUDA FlexAttention with a block mask (fully masked
blocks are skipped, so the cost falls with the documents' lengths), elsewhere SDPA with the
explicit boolean mask (the CPU reference). Context parallelism with documents is refused by the
run config (train.data.doc_mask with parallel.cp > 1): the load-balanced CP shard would need the
global positions as well.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from spartron.layers.loss import IGNORE_INDEX


def check_document_positions(positions: Tensor, batch: int, seq: int) -> None:
    """Shape and dtype of per-document positions (values are the producer's contract: no host sync)."""
    if positions.dtype != torch.int64 or positions.shape != (batch, seq):
        raise ValueError(f"document positions must be int64 [{batch}, {seq}] (restarting at 0 at each packed "
                         f"document), got {positions.dtype} {tuple(positions.shape)}")


def document_visible(positions: Tensor, rows: slice | None = None) -> Tensor:
    """[B, R, S] bool: key s is visible to query t (rows of the sequence, all by default) iff s <= t and
    s is in t's document."""
    seq = positions.shape[-1]
    rows = rows or slice(0, seq)
    t = torch.arange(seq, device=positions.device)[rows]
    s = torch.arange(seq, device=positions.device)
    start = t[None, :] - positions[:, rows]  # [B, R]: where each query's document starts
    return (s[None, None, :] <= t[None, :, None]) & (s[None, None, :] >= start[:, :, None])


def reference_document_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, scale: float) -> Tensor:
    """SDPA with the explicit [B, 1, S, S] mask; q, k [B, H, S, E], v [B, H, S, Ev] -> [B, H, S, Ev]."""
    mask = document_visible(positions)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _mask_mod(positions: Tensor):  # noqa: ANN202 - FlexAttention's mask_mod of the document mask
    def visible(batch, head, q_idx, kv_idx):  # noqa: ANN001, ARG001
        return (kv_idx <= q_idx) & (kv_idx >= q_idx - positions[batch, q_idx])

    return visible


def reference_block_mask(positions: Tensor, block_size: int = 128):
    """The BlockMask through FlexAttention's create_block_mask (evaluates the mask at every (q, k))."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, s = positions.shape
    return create_block_mask(_mask_mod(positions), b, None, s, s, device=positions.device, BLOCK_SIZE=block_size)


def _block_indices(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """[B, nq, nk] bool -> (count [B, 1, nq], indices [B, 1, nq, nk]) int32, the True blocks first, ascending."""
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)
    return blocks.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]


def document_block_mask(positions: Tensor, block_size: int = 128):
    """FlexAttention BlockMask of the document mask, built from the document starts per block in
    O(B x S x S/block) (create_block_mask evaluates all B x S x S pairs: 4 ms per call at B2 x S4096 on an
    H200, and every layer builds one). A block is full when every query sees every key, partial when some
    do; only partial blocks evaluate the mask_mod. Rows not a multiple of the block: create_block_mask."""
    from torch.nn.attention.flex_attention import BlockMask

    b, s = positions.shape
    if s % block_size:
        return reference_block_mask(positions, block_size)
    n = s // block_size
    t = torch.arange(s, device=positions.device)
    start = (t - positions)[:, :, None]  # [B, S, 1]: each query's document start
    first = torch.arange(n, device=positions.device)[None, None, :] * block_size  # key blocks' first key
    last = first + block_size - 1
    q = t[None, :, None]
    any_visible = ((start <= last) & (q >= first)).view(b, n, block_size, n).any(2)
    all_visible = ((start <= first) & (q >= last)).view(b, n, block_size, n).all(2)
    partial_num, partial_idx = _block_indices(any_visible & ~all_visible)
    full_num, full_idx = _block_indices(all_visible)
    return BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=_mask_mod(positions), seq_lengths=(s, s))


def flex_document_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, scale: float,
                            compiled: bool = True) -> Tensor:
    """FlexAttention with the document block mask; `compiled` False runs flex eagerly (CPU tests: the
    unfused implementation, same numerics up to rounding)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    return fn(q, k, v, block_mask=document_block_mask(positions), scale=scale)


def document_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, scale: float) -> Tensor:
    """Block-causal attention over packed documents: FlexAttention on CUDA, the SDPA reference elsewhere."""
    check_document_positions(positions, q.shape[0], q.shape[2])
    if q.device.type == "cuda":
        return flex_document_attention(q, k, v, positions, scale)
    return reference_document_attention(q, k, v, positions, scale)


def document_shifted_labels(labels: Tensor, positions: Tensor, k: int) -> Tensor:
    """labels[:, i + k] at i where token i + k is in i's document, else IGNORE_INDEX: the MTP depth-k
    targets of packed documents never cross a document boundary."""
    if k == 0:
        return labels
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-k] = labels[:, k:]
    same = torch.zeros_like(labels, dtype=torch.bool)
    same[:, :-k] = positions[:, k:] == positions[:, :-k] + k
    return torch.where(same, shifted, IGNORE_INDEX)
