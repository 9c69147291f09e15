"""128x128 block quantisation of one FSDP shard of a weight with the FULL weight's block scales
(model.fp8.param_gather): what quant.quantize_blocks gives for the shard's elements, computed on the shard.

A shard is torch.chunk's: shard `rank` of `world` holds, along `dim`, the `padded` entries from rank * padded
(FSDP2 pads the last ranks' shards with zeros). Sharded along the weight's rows (dim -2: a dense linear at 256
ranks holds 28 of 7168 rows) a 128-row block spans several shards, so each shard contributes the amax of its
part of each block (`partial_block_amax`), the parts are reduced with MAX over the shard group (exact and
order-free: the global amax), and `quantize_shard` divides by the global scales. Sharded along a leading dim
(whole experts per rank) every block is the shard's own. Either way the values and scales equal
quantize_blocks' of the full weight bitwise: the same amax, the same `tile_scales`, the same cast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spartron.layers.fp8.quant import TILE, _cast, check_tiled


def _valid(full: int, padded: int, rank: int) -> tuple[int, int]:
    """(first global index, how many real entries) of shard `rank` along the sharded dim."""
    start = rank * padded
    return start, max(0, min(padded, full - start))


def partial_block_amax(shard: Tensor, full_shape: torch.Size, dim: int, rank: int) -> Tensor:
    """The fp32 amax grid [..., N/128, K/128] of the full weight with only this shard's elements counted
    (0 elsewhere: a MAX over the shard group gives every block's amax). `shard`: the padded local shard in
    the compute dtype, sharded along `dim` (non-negative)."""
    *lead, n, k = full_shape
    check_tiled("weight rows", n)
    check_tiled("weight columns", k)
    grid = torch.zeros(*lead, n // TILE, k // TILE, dtype=torch.float32, device=shard.device)
    start, count = _valid(full_shape[dim], shard.shape[dim], rank)
    if count == 0:
        return grid
    real = shard.narrow(dim, 0, count)
    if dim == len(full_shape) - 2:  # rows: each row's 1x128 amax, reduced into its global block
        rows = torch.zeros(*lead, n, k // TILE, dtype=torch.float32, device=shard.device)
        rows.narrow(dim, start, count).copy_(real.abs().reshape(*lead, count, k // TILE, TILE).amax(dim=-1))
        return rows.reshape(*lead, n // TILE, TILE, k // TILE).amax(dim=-2)
    blocks = real.abs().reshape(*real.shape[:-2], n // TILE, TILE, k // TILE, TILE).amax(dim=(-3, -1)).float()
    grid.narrow(dim, start, count).copy_(blocks)
    return grid


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
