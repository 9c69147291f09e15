"""FP8 on the wire: the MoE dispatch sends the routed rows as E4M3 with their 1x128 scales (model.fp8.dispatch),
as DeepSeek-V3 dispatches: 0.52x the bf16 bytes at dim 7168.

The all-to-all dispatchers (NCCL or the copy engines) send each row as one uint8 row: dim E4M3 bytes, then its
dim/128 fp32 scales (4 bytes each), so one exchange with the dispatcher's split sizes moves values and scales
together and the receiving side's row permutation stays a row permutation. DeepEP takes the values and the
scales as its own FP8 dispatch does (a pair of tensors; its handle and combine unchanged). On arrival the rows
are dequantised to the compute dtype (spartron.comm.fp8_rows, one rule for every dispatcher). With
power-of-two scales that is exact (an E4M3 value times 2^k is a bf16 value), and the experts' own 1x128
quantisation of the received rows gives back the FP8 values that were sent: their forward GEMM is the
recipe's, bitwise the one without this option. Their weight gradient reads the received (dequantised)
rows, as Megatron's and DeepSeek's FP8 dispatch do. The backward all-to-all carries the rows' gradient in
the compute dtype (the straight-through gradient of the rounding), like the combine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from spartron.comm.fp8_rows import dequantize_tiles
from spartron.layers.fp8.ops import backend_impl
from spartron.layers.fp8.quant import FP8, TILE, check_tiled

SCALE_BYTES = 4  # one fp32 scale per 128 values


def wire_row_bytes(dim: int) -> int:
    """Bytes one routed row of `dim` values takes on the wire: dim E4M3 bytes and dim/128 fp32 scales."""
    return dim + SCALE_BYTES * (dim // TILE)


def fp8_dispatch_refusal(ep: int) -> str | None:
    """THE rule for model.fp8.dispatch against the MoE layout: why it cannot run (None: it can). Every dispatcher
    that moves rows sends them as FP8 (all_to_all over NCCL or the copy engines, deepep)."""
    if ep == 1:
        return "model.fp8.dispatch = true needs parallel.ep > 1: with one EP rank no rows are dispatched"
    return None


def quantize(x: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    """[rows, dim] in the compute dtype -> what a dispatch sends: (E4M3 [rows, dim], fp32 scales [rows, dim / 128],
    a transposed view of the backend's [dim / 128, rows]), power-of-two scales."""
    if x.shape[0] == 0:  # an EP rank that routes nothing this micro-batch: no kernel launch
        return x.new_empty(x.shape, dtype=FP8), x.new_empty(0, x.shape[1] // TILE, dtype=torch.float32)
    q, scales = backend_impl(backend).quantize_rows(x, True)
    return q, scales.t()


def pack(x: Tensor, backend: str) -> Tensor:
    """[rows, dim] in the compute dtype -> [rows, wire_row_bytes(dim)] uint8: each row's E4M3 values, then its
    scales."""
    q, scales = quantize(x, backend)
    return torch.cat((q.view(torch.uint8), scales.contiguous().view(torch.uint8)), dim=1)


def unpack(wire: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """pack's rows back in `dtype` (values times their tile's scale), computed in `dtype`: an E4M3 value and a
    power-of-two scale are both exact there, and so is their product (no fp32 intermediate to write)."""
    return dequantize_tiles(wire[:, :dim].contiguous().view(FP8), wire[:, dim:].contiguous().view(torch.float32),
                            dtype)


class _FP8Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, backend: str, send: Callable[[Tensor], Tensor],
                send_back: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.send_back = send_back
        return unpack(send(pack(x, backend)), x.shape[1], x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return ctx.send_back(grad.contiguous()), None, None, None


class FP8Wire:
    """The hook a dispatcher sends its dispatch rows through (install_wire puts it on the all-to-all dispatchers,
    NCCL or copy engine, and on DeepEP's)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def send(self, x: Tensor, send: Callable[[Tensor], Tensor], send_back: Callable[[Tensor], Tensor]) -> Tensor:
        """x [rows, dim] sent by `send` (the dispatcher's all-to-all of a uint8 [rows, bytes] tensor) as FP8 with
        scales, returned dequantised in x's dtype; the gradient goes back by `send_back` in that dtype."""
        check_tiled("model.dim", x.shape[1])
        return _FP8Send.apply(x, self.backend, send, send_back)

    def rows(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [rows, dim] as DeepEP's FP8 dispatch takes it: (E4M3 [rows, dim], fp32 scales [rows, dim / 128]). The
        dispatch op sends these in x's place, dequantises them on arrival (spartron.comm.fp8_rows) and sends the
        gradient back in x's dtype."""
        check_tiled("model.dim", x.shape[1])
        return quantize(x.detach(), self.backend)
