"""The "triton" backend's primitives: Spartron's blockwise quantisation and grouped GEMM kernels
(Hopper; spartron.layers.fp8.triton_kernels).

Same layouts, tilings and quantised values as the reference backend (GEMM results up to the order of
fp32 accumulation); the expert counts stay on the device (tile slots are a static bound: no host
sync). What compiles when: a kernel compiles once per distinct set of its constexpr arguments — the
contraction dim KC and the group count N_GROUPS (model dims: fixed per model), POW2, the block
sizes — and per Triton's specialisation of the runtime ints (a value of 1, or divisible by 16). The
routed-row count M and the slot count T are runtime arguments: a new row count each step reuses the
compiled kernel (at most the "M % 16 == 0 or not" variants; tested on the GPU).
"""

from __future__ import annotations

import torch
from torch import Tensor

from spartron.layers.fp8 import triton_kernels as k
from spartron.layers.fp8.quant import (
    FP8,
    TILE,
    check_tiled,
    gemm_rows,
    group_counts,
    one_group,
    rows_in_order,
    slot_layout,
    tile_slots,
)

__all__ = ["dgrad", "fprop", "gemm_rows", "group_counts", "one_group", "place_gathered", "quantize_blocks",
           "quantize_blocks_both", "quantize_blocks_cat", "quantize_blocks_t", "quantize_cols_grouped", "quantize_rows",
           "slot_layout", "slot_rows", "swiglu_quantize_rows", "wgrad"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _gather_index(x: Tensor, index: Tensor | None) -> tuple[Tensor, int]:
    """(the row index the kernels read x through, the rows they produce): `index` [M'] of x's rows, or x's own."""
    if index is None:
        return x, x.shape[0]
    if index.dim() != 1 or index.dtype != torch.int64:
        raise ValueError(f"fp8 gathered quantisation: the row index must be 1-D int64, got {index.dtype} "
                         f"{tuple(index.shape)}")
    return index, index.numel()


def quantize_rows(x: Tensor, pow2: bool, index: Tensor | None = None, block_m: int = 32,
                  num_warps: int = 4) -> tuple[Tensor, Tensor]:
    """1x128 quantisation of x, or of x[index] read through the index (the gathered rows never written).
    block_m, num_warps: the kernel's config (benchmarks/fp8_gemms.py sweeps them; every config writes the same
    values, GPU test)."""
    _, kc = x.shape
    check_tiled("contraction dim", kc)
    x = x.contiguous()
    idx, m = _gather_index(x, index)
    q = torch.empty(m, kc, dtype=FP8, device=x.device)
    s = torch.empty(kc // TILE, m, dtype=torch.float32, device=x.device)
    k.quantize_rows_kernel[(_cdiv(m, block_m), kc // TILE)](x, x, idx, q, s, m, kc, kc, POW2=pow2, SWIGLU=False,
                                                            GATHER=index is not None, BM=block_m,
                                                            num_warps=num_warps)
    return q, s


def swiglu_quantize_rows(gate: Tensor, up: Tensor, pow2: bool, index: Tensor | None = None, block_m: int = 32,
                         num_warps: int = 4) -> tuple[Tensor, Tensor]:
    """1x128 quantisation of silu(gate) * up (of their rows `index`) in one pass: h (rounded to gate's dtype as
    torch's eager SwiGLU rounds it) is never written. gate and up may be the two halves of one [M, 2I] tensor
    (the experts' w1|w3 output): read in place, by their row stride."""
    kc = gate.shape[1]
    check_tiled("contraction dim", kc)
    if gate.stride(1) != 1 or up.stride() != gate.stride():
        gate, up = gate.contiguous(), up.contiguous()
    idx, m = _gather_index(gate, index)
    q = torch.empty(m, kc, dtype=FP8, device=gate.device)
    s = torch.empty(kc // TILE, m, dtype=torch.float32, device=gate.device)
    k.quantize_rows_kernel[(_cdiv(m, block_m), kc // TILE)](gate, up, idx, q, s, m, kc, gate.stride(0), POW2=pow2,
                                                            SWIGLU=True, GATHER=index is not None, BM=block_m,
                                                            num_warps=num_warps)
    return q, s


def _quantize_blocks(weights: tuple[Tensor, ...], pow2: bool, rows: bool, cols: bool,
                     config: tuple[int, int] = k.QUANTIZE_BLOCKS_CONFIG) -> list[Tensor]:
    """The weights [..., N_i, K] quantised into buffers concatenated along N (one kernel launch per
    weight, each writing its rows of the outputs: no concatenating copy): [q, s] (rows), [q^T, s^T]
    (cols) or [q, s, q^T, s^T] (both, from one read of each weight; s^T a view of s)."""
    *lead, _, kc = weights[0].shape
    sizes = [w.shape[-2] for w in weights]
    for n in sizes:
        check_tiled("weight rows", n)
    check_tiled("weight columns", kc)
    n_out, device = sum(sizes), weights[0].device
    q = torch.empty(*lead, n_out, kc, dtype=FP8, device=device) if rows else None
    qt = torch.empty(*lead, kc, n_out, dtype=FP8, device=device) if cols else None
    s = torch.empty(*lead, n_out // TILE, kc // TILE, dtype=torch.float32, device=device)
    row0 = 0
    for w, n in zip(weights, sizes, strict=True):
        w = w.contiguous()
        # each output from this weight's first element on (the kernel indexes from there)
        q_part = q[..., row0:, :] if rows else None
        qt_part = qt[..., :, row0:] if cols else None
        q_part, qt_part = (q_part if rows else qt_part), (qt_part if cols else q_part)  # an unwritten one: the other
        k.quantize_blocks_kernel[(w.numel() // (kc * TILE), kc // TILE)](w, q_part, qt_part, s[..., row0 // TILE:, :],
                                                                         n, kc, n_out, ROWS=rows, COLS=cols,
                                                                         POW2=pow2, CHUNK=config[0],
                                                                         num_warps=config[1])
        row0 += n
    return ([q, s] if rows else []) + ([qt, s.transpose(-2, -1)] if cols else [])


def quantize_blocks(w: Tensor, pow2: bool, config: tuple[int, int] = k.QUANTIZE_BLOCKS_CONFIG
                    ) -> tuple[Tensor, Tensor]:
    return tuple(_quantize_blocks((w,), pow2, rows=True, cols=False, config=config))


def quantize_blocks_t(w: Tensor, pow2: bool, config: tuple[int, int] = k.QUANTIZE_BLOCKS_CONFIG
                      ) -> tuple[Tensor, Tensor]:
    """q^T [..., K, N] written by the quantisation kernel itself (dgrad's contraction-contiguous operand)."""
    return tuple(_quantize_blocks((w,), pow2, rows=False, cols=True, config=config))


def quantize_blocks_cat(weights: tuple[Tensor, ...], pow2: bool, transpose: bool = False,
                        config: tuple[int, int] = k.QUANTIZE_BLOCKS_CONFIG) -> tuple[Tensor, Tensor]:
    """quantize_blocks (or _t) of the weights concatenated along N, without concatenating them."""
    return tuple(_quantize_blocks(weights, pow2, rows=not transpose, cols=transpose, config=config))


def quantize_blocks_both(weights: tuple[Tensor, ...], pow2: bool,
                         config: tuple[int, int] = k.QUANTIZE_BLOCKS_BOTH_CONFIG) -> list[Tensor]:
    """[q, s, q^T, s^T] of the weights concatenated along N, each weight read once (config: (rows a chunk,
    warps), the sweep's)."""
    return _quantize_blocks(weights, pow2, rows=True, cols=True, config=config)


def place_gathered(q: Tensor, out: Tensor | None, out_t: Tensor, start: int) -> None:
    """gathered.JointBlocks.write's two copies in one kernel: q [..., N, K] (E4M3, contiguous) into
    out[..., start:start + N, :] (None: q is the joint operand itself) and, transposed, into
    out_t[..., :, start:start + N]."""
    *lead, n, kdim = q.shape
    check_tiled("an FP8-gathered weight's rows", n)
    check_tiled("an FP8-gathered weight's columns", kdim)
    n_out = out_t.shape[-1]
    groups = q.numel() // (n * kdim)
    src = q.contiguous().view(torch.uint8)
    dst = out.view(torch.uint8) if out is not None else src
    k.place_gathered_kernel[(groups * (n // TILE), kdim // TILE)](src, dst, out_t.view(torch.uint8), n, kdim, n_out,
                                                                  start, ROWS=out is not None, num_warps=8)


def quantize_cols_grouped(x: Tensor, counts: Tensor, pow2: bool, index: Tensor | None = None, block_c: int = 64,
                          num_warps: int = 4) -> tuple[Tensor, Tensor]:
    """The slot-aligned column layout (spartron.layers.fp8.quant) of x, or of x[index] read through the
    index: q_t [C, T*128], scales [C, T] slot-major (block_c, num_warps: the sweep's, as quantize_rows')."""
    _, c = x.shape
    check_tiled("columns", c)
    x = x.contiguous()
    idx, m = _gather_index(x, index)
    slots = tile_slots(m, counts.numel())
    q_t = torch.empty(c, slots * TILE, dtype=FP8, device=x.device)
    s = torch.empty(slots, c, dtype=torch.float32, device=x.device)
    if c % block_c:
        raise ValueError(f"fp8 quantize_cols_grouped: block_c {block_c} must divide the {c} columns")
    k.quantize_cols_kernel[(slots, c // block_c)](x, idx, counts, q_t, s, c, slots * TILE, N_GROUPS=counts.numel(),
                                                  POW2=pow2, GATHER=index is not None, BC=block_c,
                                                  num_warps=num_warps)
    return q_t, s.t()


def slot_rows(counts: Tensor, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """deep_gemm_backend.padded_rows in one kernel launch (its torch form is a score of small kernels, each a
    host launch: the MoE layer at V3's 8k rows was launch-bound)."""
    groups = counts.numel()
    slots = tile_slots(rows, groups)
    source = torch.empty(slots * TILE, dtype=torch.int64, device=counts.device)
    dest = torch.empty(rows, dtype=torch.int64, device=counts.device)
    ends = torch.empty(groups, dtype=torch.int32, device=counts.device)
    k.slot_rows_kernel[(slots,)](counts, source, dest, ends, N_GROUPS=groups)
    return source, dest, ends


def _gemm(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, counts: Tensor, dtype: torch.dtype, block_m: int,
          num_warps: int, num_stages: int) -> Tensor:
    m, kc = a.shape
    groups, nout, _ = b.shape
    check_tiled("output dim", nout)
    out = torch.empty(m, nout, dtype=dtype, device=a.device)
    grid = ((m // block_m + groups) * (nout // 128),)  # BM-row slots (a static bound, as tile_slots) x column blocks
    k.grouped_gemm_kernel[grid](a, sa, b, sb, out, counts, m, nout, kc, groups, b.stride(0), b.stride(1),
                                sb.stride(0), sb.stride(1), sb.stride(2), BM=block_m, BN=128,
                                num_stages_k=num_stages, num_warps=num_warps)
    return out


def fprop(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, counts: Tensor, dtype: torch.dtype, block_m: int = 128,
          num_warps: int = 8, num_stages: int = 4) -> Tensor:
    """Defaults measured on the H100 at 62cf2cd (v3_8k: BN 128, 8 warps, 4 stages 760 TFLOP/s; 3 stages 692);
    the keywords are benchmarks/fp8_gemms.py's sweep."""
    return _gemm(xq, xs, wq, ws, counts, dtype, block_m, num_warps, num_stages)


def dgrad(gq: Tensor, gs: Tensor, wtq: Tensor, wts: Tensor, counts: Tensor, dtype: torch.dtype,
          rows: Tensor | None = None, k: int = 1, block_m: int = 128, num_warps: int = 8,
          num_stages: int = 4) -> Tensor:
    """dgrad contracts over N: w^T [G, K, N] as quantize_blocks_t wrote it (scales [G, K/128, N/128], a view);
    `rows`, `k`: quant.rows_in_order."""
    return rows_in_order(_gemm(gq, gs, wtq, wts, counts, dtype, block_m, num_warps, num_stages), rows, k)


def wgrad(gt: Tensor, gts: Tensor, xt: Tensor, xts: Tensor, counts: Tensor, dtype: torch.dtype,
          block_n: int = 64, num_warps: int = 4, num_stages: int = 3) -> Tensor:
    """grad^T [N, L] and x^T [K, L] in the slot-aligned layout, scales [*, T] slot-major -> dw [G, N, K]
    (the keywords are benchmarks/fp8_gemms.py's sweep; the defaults its fastest, docs/KERNEL_NOTES.md;
    every config gives the same result bitwise, GPU test)."""
    (n, width), kc, groups = gt.shape, xt.shape[0], counts.numel()
    if gts.stride(0) != 1 or xts.stride(0) != 1 or gt.stride(1) != 1 or xt.stride(1) != 1:
        raise ValueError("fp8 wgrad: the column scales must be slot-major (as quantize_cols_grouped stores them)")
    if gt.stride(0) != width or xt.stride(0) != width:
        raise ValueError("fp8 wgrad: the operands' rows must be whole slot-aligned rows (row stride T*128)")
    dw = torch.empty(groups, n, kc, dtype=dtype, device=gt.device)
    k.grouped_wgrad_kernel[(groups * (n // block_n) * (kc // 128),)](gt, gts, xt, xts, dw, counts, width, n, kc,
                                                                     gts.stride(1), xts.stride(1),
                                                                     groups, BN=block_n, BK=128,
                                                                     num_stages_t=num_stages, num_warps=num_warps)
    return dw
