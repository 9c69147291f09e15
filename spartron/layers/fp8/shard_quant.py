"""128x128 block quantisation of one FSDP shard of a weight with the FULL weight's block scales
(model.fp8.param_gather): what quant.quantize_blocks gives for the shard's elements, computed on the shard.

A shard is torch.chunk's: shard `rank` of `world` holds, along `dim`, the `padded` entries from rank * padded
(FSDP2 pads the last ranks' shards with zeros). Sharded along the weight's rows (dim -2: a dense linear at 256
ranks holds 28 of 7168 rows) a 128-row block spans several shards. Each shard computes its `local_amax` (its
rows' 1x128 tile amax, or its own blocks' amax when sharded along a leading dim), the shard group all-gathers
them (concatenated along `dim` they are the full weight's), `block_amax` reduces them into the full weight's
block amax, and `quantize_shard` divides by those scales. The values and scales equal quantize_blocks' of the
full weight bitwise: the same maxima, the same `tile_scales`, the same cast.

Why an all-gather of local maxima and not an all-reduce MAX of a grid each rank fills only where its rows
fall: the local maxima do not depend on the rank's position, so a rehearsal's mirrored group (every slot of an
all-gather the local input: spartron.comm.mirror) gives exactly what a run with identical shards gives, where a
position-dependent grid would leave the other ranks' blocks at 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spartron.layers.fp8.quant import TILE, _cast, check_tiled


def _valid(full: int, padded: int, rank: int) -> tuple[int, int]:
    """(first global index, how many real entries) of shard `rank` along the sharded dim."""
    start = rank * padded
    return start, max(0, min(padded, full - start))


def local_amax(shard: Tensor, full_shape: torch.Size, dim: int) -> Tensor:
    """What one shard contributes to the full weight's block amax, in the shard's own coordinates (so that
    gathering every rank's along `dim` lays them out as the full weight's): sharded along the rows (dim -2),
    each row's 1x128 tile amax [..., padded rows, K/128]; along a leading dim, the shard's own 128x128 block
    amax [..., N/128, K/128]. fp32; FSDP2's zero padding contributes 0. `shard`: the padded local shard in
    the compute dtype."""
    *lead, n, k = full_shape
    check_tiled("weight rows", n)
    check_tiled("weight columns", k)
    tiles = shard.abs().reshape(*shard.shape[:-1], k // TILE, TILE).amax(dim=-1).float()
    if dim == len(full_shape) - 2:
        return tiles
    return tiles.reshape(*shard.shape[:-2], n // TILE, TILE, k // TILE).amax(dim=-2)


def block_amax(gathered: Tensor, full_shape: torch.Size, dim: int) -> Tensor:
    """The full weight's 128x128 block amax [..., N/128, K/128] from every rank's `local_amax`, concatenated
    along `dim` in rank order (padding included): the same maxima quantize_blocks takes over the full weight."""
    *lead, n, k = full_shape
    full = gathered.narrow(dim, 0, n if dim == len(full_shape) - 2 else full_shape[dim])
    if dim == len(full_shape) - 2:
        return full.reshape(*lead, n // TILE, TILE, k // TILE).amax(dim=-2)
    return full


def quantize_shard(shard: Tensor, scales: Tensor, dim: int, rank: int) -> Tensor:
    """The padded shard's E4M3 values [shard shape] with the full weight's block `scales` [..., N/128, K/128]
    (padding rows: 0)."""
    n, k = scales.shape[-2] * TILE, scales.shape[-1] * TILE
    full = (*scales.shape[:-2], n, k)
    start, count = _valid(full[dim], shard.shape[dim], rank)
    if dim == shard.dim() - 2:
        rows = torch.arange(shard.shape[dim], device=shard.device)
        row_scales = scales.index_select(dim, ((start + rows) // TILE).clamp(max=scales.shape[dim] - 1))
        row_scales = torch.where((rows < count).view(-1, 1), row_scales, torch.ones_like(row_scales))
        tiles = shard.reshape(*shard.shape[:-1], k // TILE, TILE)
        return _cast(tiles, row_scales[..., None]).reshape(shard.shape)
    local = torch.ones(*scales.shape[:dim], shard.shape[dim], *scales.shape[dim + 1:], dtype=scales.dtype,
                       device=scales.device)
    local.narrow(dim, 0, count).copy_(scales.narrow(dim, start, count))
    blocks = shard.reshape(*shard.shape[:-2], n // TILE, TILE, k // TILE, TILE)
    return _cast(blocks, local[..., :, None, :, None]).reshape(shard.shape)
