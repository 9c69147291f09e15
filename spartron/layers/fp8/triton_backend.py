"""The "triton" backend: Spartron's blockwise quantisation and grouped GEMM kernels (Hopper).

Same layouts, tilings and results (up to fp32 accumulation order) as the reference backend; the
expert counts stay on the device (tile slots are a static bound: no host sync). A dense linear is
one group.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spartron.layers.fp8 import triton_kernels as k
from spartron.layers.fp8.quant import FP8, TILE, check_tiled, tile_slots


def quantize_rows(x: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    m, kc = x.shape
    check_tiled("contraction dim", kc)
    x = x.contiguous()
    q = torch.empty(m, kc, dtype=FP8, device=x.device)
    s = torch.empty(kc // TILE, m, dtype=torch.float32, device=x.device)
    k.quantize_rows_kernel[(triton_cdiv(m, 32), kc // TILE)](x, q, s, m, kc, POW2=pow2, BM=32)
    return q, s


def quantize_blocks(w: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    *lead, n, kc = w.shape
    check_tiled("weight rows", n)
    check_tiled("weight columns", kc)
    w = w.contiguous()
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    s = torch.empty(*lead, n // TILE, kc // TILE, dtype=torch.float32, device=w.device)
    k.quantize_blocks_kernel[(w.numel() // (kc * TILE), kc // TILE)](w, q, s, n, kc, POW2=pow2)
    return q, s


def quantize_cols_grouped(x: Tensor, counts: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    m, c = x.shape
    check_tiled("columns", c)
    x = x.contiguous()
    slots = tile_slots(m, counts.numel())
    q_t = torch.empty(c, m, dtype=FP8, device=x.device)
    s = torch.zeros(c, slots, dtype=torch.float32, device=x.device)
    k.quantize_cols_kernel[(slots, c // 64)](x, counts, q_t, s, m, c, slots, N_GROUPS=counts.numel(), POW2=pow2,
                                                 BC=64)
    return q_t, s


def _gemm(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, counts: Tensor, dtype: torch.dtype) -> Tensor:
    m, kc = a.shape
    groups, nout, _ = b.shape
    check_tiled("output dim", nout)
    out = torch.empty(m, nout, dtype=dtype, device=a.device)
    grid = (tile_slots(m, groups), nout // 128)
    k.grouped_gemm_kernel[grid](a, sa, b, sb, out, counts, m, nout, kc, groups, b.stride(0), b.stride(1),
                                sb.stride(0), sb.stride(1), sb.stride(2), BN=128, num_stages_k=3, num_warps=8)
    return out


def grouped_forward(x: Tensor, w: Tensor, counts: Tensor, pow2: bool) -> Tensor:
    xq, xs = quantize_rows(x, pow2)
    wq, ws = quantize_blocks(w, pow2)
    return _gemm(xq, xs, wq, ws, counts, x.dtype)


def grouped_backward(grad: Tensor, x: Tensor, w: Tensor, counts: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    gq, gs = quantize_rows(grad, pow2)
    wq, ws = quantize_blocks(w, pow2)
    # dgrad contracts over N: the transposed FP8 weight (same 128x128 blocks, one byte per value to copy)
    dx = _gemm(gq, gs, wq.transpose(-2, -1).contiguous(), ws.transpose(-2, -1), counts, x.dtype)
    gt, gts = quantize_cols_grouped(grad, counts, pow2)
    xt, xts = quantize_cols_grouped(x, counts, pow2)
    groups, n, kc = w.shape
    dw = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    k.grouped_wgrad_kernel[(groups, n // 128, kc // 128)](gt, gts, xt, xts, dw, counts, x.shape[0], n, kc,
                                                          gts.shape[1], groups, BN=128, BK=128, num_warps=8)
    return dx, dw


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
