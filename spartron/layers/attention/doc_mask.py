"""Block-causal attention over packed documents (document masks).

A packed row holds several documents back to back. Its positions [B, S] restart at 0 at each
document start and count up by one inside a document (what spartron.data.packing produces), so
they say everything about the packing: query t sees key s iff s <= t and s >= t - positions[t]
(s lies in t's document, at or before t). RoPE takes the same per-document positions, so each
document is encoded as if it were alone.

Under context parallelism a rank holds the positions of its own (load-balanced) queries, and `q_index`
[S_q] gives their global indices: query t sees key s iff s <= q_index[t] and s >= q_index[t] -
positions[t]; the keys are the all-gathered sequence 0..S-1.

Two implementations of the same mask: on CUDA FlexAttention with a block mask (fully masked
blocks are skipped, so the cost falls with the documents' lengths), elsewhere SDPA with the
explicit boolean mask (the CPU reference). Inside activation-checkpoint regions (ac.mode full /
selective) the CUDA path is SDPA with the mask too: the operator policy watches ops from a
TorchDispatchMode, and FlexAttention's higher-order op has no rule for such a mode (it raises).
`uses_flex` is that rule, in one place.
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


def document_visible(positions: Tensor, rows: slice | None = None, q_index: Tensor | None = None,
                     n_keys: int | None = None) -> Tensor:
    """[B, R, n_keys] bool: key s is visible to query t (rows of the queries, all by default) iff s <= t's
    global index and s is in t's document. q_index: the queries' global indices (default 0..S_q-1);
    n_keys: default S_q."""
    s_q = positions.shape[-1]
    rows = rows or slice(0, s_q)
    t = (torch.arange(s_q, device=positions.device) if q_index is None else q_index)[rows]
    s = torch.arange(s_q if n_keys is None else n_keys, device=positions.device)
    start = t[None, :] - positions[:, rows]  # [B, R]: where each query's document starts
    return (s[None, None, :] <= t[None, :, None]) & (s[None, None, :] >= start[:, :, None])


def reference_document_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, scale: float,
                                 q_index: Tensor | None = None) -> Tensor:
    """SDPA with the explicit [B, 1, S_q, S_kv] mask; q [B, H, S_q, E], k [B, H, S_kv, E], v [B, H, S_kv, Ev]."""
    mask = document_visible(positions, q_index=q_index, n_keys=k.shape[2])[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _mask_mod(positions: Tensor, q_index: Tensor | None = None):  # noqa: ANN202 - FlexAttention's mask_mod
    if q_index is None:
        def visible(batch, head, q_idx, kv_idx):  # noqa: ANN001, ARG001
            return (kv_idx <= q_idx) & (kv_idx >= q_idx - positions[batch, q_idx])
    else:
        def visible(batch, head, q_idx, kv_idx):  # noqa: ANN001, ARG001
            t = q_index[q_idx]
            return (kv_idx <= t) & (kv_idx >= t - positions[batch, q_idx])

    return visible


def reference_block_mask(positions: Tensor, block_size: int = 128, q_index: Tensor | None = None,
                         n_keys: int | None = None):
    """The BlockMask through FlexAttention's create_block_mask (evaluates the mask at every (q, k))."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, s = positions.shape
    return create_block_mask(_mask_mod(positions, q_index), b, None, s, s if n_keys is None else n_keys,
                             device=positions.device, BLOCK_SIZE=block_size)


def _block_indices(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """[B, nq, nk] bool -> (count [B, 1, nq], indices [B, 1, nq, nk]) int32, the True blocks first, ascending."""
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)
    return blocks.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]


def document_block_mask(positions: Tensor, block_size: int = 128, q_index: Tensor | None = None,
                        n_keys: int | None = None):
    """FlexAttention BlockMask of the document mask, built from the document starts per block in
    O(B x S_q x S_kv/block) (create_block_mask evaluates all B x S_q x S_kv pairs: 4 ms per call at B2 x S4096
    on an H200, and every layer builds one). A block is full when every query sees every key, partial when
    some do; only partial blocks evaluate the mask_mod. q_index / n_keys as in `document_visible` (CP: the
    local queries against all keys). Lengths not a multiple of the block: create_block_mask."""
    from torch.nn.attention.flex_attention import BlockMask

    b, s_q = positions.shape
    s_kv = s_q if n_keys is None else n_keys
    if s_q % block_size or s_kv % block_size:
        return reference_block_mask(positions, block_size, q_index, n_keys)
    nq, nk = s_q // block_size, s_kv // block_size
    t = torch.arange(s_q, device=positions.device) if q_index is None else q_index
    start = (t - positions)[:, :, None]  # [B, S_q, 1]: each query's document start
    first = torch.arange(nk, device=positions.device)[None, None, :] * block_size  # key blocks' first key
    last = first + block_size - 1
    q = t[None, :, None]
    any_visible = ((start <= last) & (q >= first)).view(b, nq, block_size, nk).any(2)
    all_visible = ((start <= first) & (q >= last)).view(b, nq, block_size, nk).all(2)
    partial_num, partial_idx = _block_indices(any_visible & ~all_visible)
    full_num, full_idx = _block_indices(all_visible)
    return BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=_mask_mod(positions, q_index), seq_lengths=(s_q, s_kv))


def flex_document_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, scale: float,
                            compiled: bool = True, q_index: Tensor | None = None) -> Tensor:
    """FlexAttention with the document block mask; `compiled` False runs flex eagerly (CPU tests: the
    unfused implementation, same numerics up to rounding). q_index: the queries' global indices (CP)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    mask = document_block_mask(positions, q_index=q_index, n_keys=k.shape[2])
    return fn(q, k, v, block_mask=mask, scale=scale)


def uses_flex(device: torch.device) -> bool:
    """FlexAttention on CUDA outside a user TorchDispatchMode (the AC policy's); compile's own modes count not."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    return device.type == "cuda" and not is_in_torch_dispatch_mode(include_infra_modes=False)


def document_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, scale: float,
                       q_index: Tensor | None = None) -> Tensor:
    """Block-causal attention over packed documents: FlexAttention where `uses_flex`, else the SDPA reference.
    q [B, H, S_q, E]; positions [B, S_q]; q_index [S_q] the queries' global indices under CP."""
    check_document_positions(positions, q.shape[0], q.shape[2])
    if uses_flex(q.device):
        return flex_document_attention(q, k, v, positions, scale, q_index=q_index)
    return reference_document_attention(q, k, v, positions, scale, q_index)


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
