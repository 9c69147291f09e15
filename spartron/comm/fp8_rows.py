"""Rows sent as E4M3 with one fp32 scale per 128 values (model.fp8.dispatch), turned back into the compute dtype
on arrival. The wires that carry them (the all-to-all's uint8 rows: spartron.layers.fp8.wire; DeepEP's FP8
dispatch) share this one rule, so every dispatcher hands the experts the same values."""

from __future__ import annotations

import torch
from torch import Tensor

TILE = 128  # values per scale


def dequantize_tiles(q: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """q [rows, dim] float8_e4m3fn, scales [rows, dim / 128] float32 -> [rows, dim] in `dtype`: each value times
    its tile's scale, computed in `dtype` (with power-of-two scales the E4M3 value, the scale and their product
    are exact there: no fp32 intermediate to write)."""
    rows, dim = q.shape
    values = q.to(dtype).view(rows, dim // TILE, TILE)
    return (values * scales.to(dtype).view(rows, dim // TILE, 1)).view(rows, dim)
