"""Load-balanced causal sharding of a sequence over context-parallel ranks.

With causal attention, later tokens attend to more keys. Splitting the sequence into 2*cp chunks
and giving rank r chunks r and 2cp-1-r pairs a cheap chunk with an expensive one, so every rank
does the same attention work. Queries stay sharded; keys (the compressed KV, indexer keys) are
all-gathered and put back into global order with `gather_sequence`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from spartron.comm import collectives


def _check_divisible(seq_len: int, cp_size: int) -> None:
    if seq_len % (2 * cp_size):
        raise ValueError(f"context parallelism {cp_size} needs the sequence length {seq_len} to be a "
                         f"multiple of 2*cp = {2 * cp_size} (load-balanced causal sharding)")


def shard_sequence(x: Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> Tensor:
    """Rank `cp_rank`'s part of a full sequence: chunks cp_rank and 2cp-1-cp_rank of 2cp, concatenated."""
    if cp_size == 1:
        return x
    _check_divisible(x.shape[dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat((chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]), dim=dim)


def global_chunk_order(cp_size: int) -> list[int]:
    """For each global chunk c, its index in the rank-major gathered layout [r0a, r0b, r1a, r1b, ...]."""
    return [2 * c if c < cp_size else 2 * (2 * cp_size - 1 - c) + 1 for c in range(2 * cp_size)]


def unshard_sequence(gathered: Tensor, cp_size: int, dim: int = 1) -> Tensor:
    """Global-order sequence from the concatenation of every rank's local part (rank order)."""
    if cp_size == 1:
        return gathered
    _check_divisible(gathered.shape[dim], cp_size)
    chunks = gathered.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[i] for i in global_chunk_order(cp_size)], dim=dim)


def local_positions(seq_len: int, cp_size: int, cp_rank: int, device: torch.device | str = "cpu") -> Tensor:
    """int64 global positions [seq_len / cp] of the tokens rank `cp_rank` holds."""
    return shard_sequence(torch.arange(seq_len, device=device), cp_size, cp_rank, dim=0)


def cp_size_of(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def check_local_positions(positions: Tensor, group: dist.ProcessGroup | None) -> None:
    """Under CP the key order after gathering is fixed; positions must be this rank's shard of 0..S-1.

    Checked locally (no collective), so a bad call fails on every rank before anything can hang.
    """
    cp = cp_size_of(group)
    if cp == 1:
        return
    rank = dist.get_rank(group)
    expected = local_positions(positions.numel() * cp, cp, rank, positions.device)
    if positions.shape != expected.shape or not torch.equal(positions, expected):
        raise ValueError(f"context parallelism {cp}: rank {rank} must hold positions "
                         "spartron.layers.attention.context_parallel.local_positions(seq_len, cp, rank) "
                         "(load-balanced chunks r and 2cp-1-r of 0..seq_len-1)")


def gather_sequence(x: Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> Tensor:
    """All-gather every rank's local part along `dim` (differentiable) and restore global order."""
    cp = cp_size_of(group)
    if cp == 1:
        return x
    return unshard_sequence(collectives.all_gather(x.contiguous(), group, dim=dim, purpose="cp_sequence"), cp, dim=dim)


def cp_shard(x: Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> Tensor:
    """This rank's load-balanced shard of a full sequence (identity without CP)."""
    cp = cp_size_of(group)
    return x if cp == 1 else shard_sequence(x, cp, dist.get_rank(group), dim=dim)


def cp_positions(seq_len: int, group: dist.ProcessGroup | None, device: torch.device | str = "cpu") -> Tensor:
    """int64 global positions of this rank's tokens (0..seq_len-1 without CP)."""
    cp = cp_size_of(group)
    return local_positions(seq_len, cp, 0 if cp == 1 else dist.get_rank(group), device)
