"""FP8 on the wire: the MoE dispatch all-to-all sends the routed rows as E4M3 with their 1x128 scales
(model.fp8.dispatch), as DeepSeek-V3 dispatches: 0.52x the bf16 bytes at dim 7168.

Each row travels as one uint8 row: dim E4M3 bytes, then its dim/128 fp32 scales (4 bytes each), so one
all-to-all with the dispatcher's split sizes moves values and scales together and the receiving side's
row permutation stays a row permutation. On arrival the rows are dequantised to the compute dtype. With
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

from spartron.layers.fp8.ops import backend_impl
from spartron.layers.fp8.quant import FP8, TILE, check_tiled

SCALE_BYTES = 4  # one fp32 scale per 128 values


def wire_row_bytes(dim: int) -> int:
    """Bytes one routed row of `dim` values takes on the wire: dim E4M3 bytes and dim/128 fp32 scales."""
    return dim + SCALE_BYTES * (dim // TILE)


def fp8_dispatch_refusal(dispatcher: str, transport: str, ep: int) -> str | None:
    """THE rule for model.fp8.dispatch against the MoE layout: why it cannot run (None: it can)."""
    if ep == 1:
        return "model.fp8.dispatch = true needs parallel.ep > 1: with one EP rank no rows are dispatched"
    if dispatcher != "all_to_all" or transport != "nccl":
        return ("model.fp8.dispatch = true is built for model.moe.dispatcher = 'all_to_all' with "
                f"all_to_all_transport = 'nccl', got dispatcher {dispatcher!r}, transport {transport!r}")
    return None


def pack(x: Tensor, backend: str) -> Tensor:
    """[rows, dim] in the compute dtype -> [rows, wire_row_bytes(dim)] uint8 (power-of-two scales)."""
    if x.shape[0] == 0:  # an EP rank that routes nothing this micro-batch: no kernel launch
        return x.new_empty(0, wire_row_bytes(x.shape[1]), dtype=torch.uint8)
    q, scales = backend_impl(backend).quantize_rows(x, True)  # scales [dim/128, rows]
    return torch.cat((q.view(torch.uint8), scales.t().contiguous().view(torch.uint8)), dim=1)


def unpack(wire: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """pack's rows back in `dtype` (values times their tile's scale), computed in `dtype`: an E4M3 value and a
    power-of-two scale are both exact there, and so is their product (no fp32 intermediate to write)."""
    rows = wire.shape[0]
    q = wire[:, :dim].contiguous().view(FP8).to(dtype).view(rows, dim // TILE, TILE)
    scales = wire[:, dim:].contiguous().view(torch.float32).to(dtype).view(rows, dim // TILE, 1)
    return (q * scales).view(rows, dim)


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
    """The hook an AllToAllDispatcher sends its dispatch rows through (apply_fp8 installs it)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def send(self, x: Tensor, send: Callable[[Tensor], Tensor], send_back: Callable[[Tensor], Tensor]) -> Tensor:
        """x [rows, dim] sent by `send` (the dispatcher's all-to-all of a uint8 [rows, bytes] tensor) as FP8 with
        scales, returned dequantised in x's dtype; the gradient goes back by `send_back` in that dtype."""
        check_tiled("model.dim", x.shape[1])
        return _FP8Send.apply(x, self.backend, send, send_back)
