"""Launcher for the Triton lightning-indexer kernel: shape limits, tile config, chunked top-k.

`spartron::indexer_topk` registers `indexer_topk` below as its CUDA kernel (indexer_topk.py); a CUDA
input the kernel cannot take is an error naming the limit, never a silent fallback. Triton is
imported only when the kernel runs. Queries go in chunks so the fp32 [B, chunk, S_kv] score buffer
stays near `SCORE_BUFFER_BYTES` (and the sequence is cut in at least `MIN_CHUNKS`); each chunk is
scored by the kernel and reduced by torch.topk. When key positions are 0..S_kv-1 (no CP, or CP's
gathered keys) a chunk's visible keys are a prefix, up to its last query position: only that prefix is
scored and searched, which roughly halves the top-k work of a causal sequence.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import Tensor

from spartron.layers.attention.indexer_fp8 import fp8_operands
from spartron.optional import require

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
SCORE_BUFFER_BYTES = 1 << 30
MIN_CHUNKS = 4


@dataclass(frozen=True)
class IndexerKernelConfig:
    """Query rows and key columns of one tile, warps, and pipeline depth of the head loop."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3


def check_supported(q: Tensor, k: Tensor) -> None:
    """Raise ValueError naming the limit when the CUDA kernel cannot take these inputs."""
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        raise ValueError(f"indexer_topk CUDA kernel: needs a power-of-two index head dim >= 16; got {d}")
    if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"indexer_topk CUDA kernel: needs bfloat16 or float16 q and k; got {q.dtype}, {k.dtype}")


def _kernels():
    require("triton", "the indexer_topk CUDA kernel", "pip install triton (it ships with CUDA builds of torch)")
    return importlib.import_module("spartron.layers.attention.indexer_triton_kernels")


def chunk_rows(b: int, s_q: int, s_kv: int, block_m: int) -> int:
    """Queries per chunk: the score buffer near SCORE_BUFFER_BYTES and at least MIN_CHUNKS chunks, a
    multiple of the tile rows."""
    rows = min(max(1, SCORE_BUFFER_BYTES // (4 * b * max(s_kv, 1))), -(-s_q // MIN_CHUNKS))
    return min(s_q, max(block_m, -(-rows // block_m) * block_m))


def scores(q: Tensor, weights: Tensor, k: Tensor, k_scale: Tensor | None, q_positions: Tensor,
           k_positions: Tensor, q_start: int, c_len: int, out: Tensor,
           cfg: IndexerKernelConfig | None = None) -> Tensor:
    """Fill out [B, c_len, n_cols] fp32 with the scores of queries q_start .. q_start + c_len against the
    first n_cols keys (-inf where not visible). q [B, S_q, H, d] and k [B, S_kv, d] contiguous
    (bf16/fp16, or fp8 with k_scale)."""
    cfg = cfg or IndexerKernelConfig()
    b, s_q, h, d = q.shape
    s_kv, n_cols = k.shape[1], out.shape[-1]
    grid = (-(-n_cols // cfg.block_n), -(-c_len // cfg.block_m), b)
    _kernels().indexer_scores_kernel[grid](
        q, weights, k, k_scale if k_scale is not None else weights, q_positions, k_positions, out, s_q, s_kv,
        q_start, c_len, n_cols, H=h, D=d, BM=cfg.block_m, BN=cfg.block_n, HAS_KSCALE=k_scale is not None,
        STAGES=cfg.num_stages, num_warps=cfg.num_warps)
    return out


def indexer_topk(q: Tensor, weights: Tensor, k: Tensor, q_positions: Tensor, k_positions: Tensor, topk: int,
                 fp8: bool, cfg: IndexerKernelConfig | None = None) -> Tensor:
    """int32 ids [B, S_q, min(topk, S_kv)] (descending score, -1 past a query's visible keys)."""
    check_supported(q, k)
    cfg = cfg or IndexerKernelConfig()
    b, s_q, _, _ = q.shape
    s_kv = k.shape[1]
    kk = min(topk, s_kv)
    ids = torch.empty(b, s_q, kk, dtype=torch.int32, device=q.device)
    if ids.numel() == 0:
        return ids
    k_scale = None
    if fp8:
        q, w, k, k_scale = fp8_operands(q, weights, k)
    else:
        w = weights.float()
    q, w, k = q.contiguous(), w.contiguous(), k.contiguous()
    qpos, kpos = q_positions.to(torch.int32), k_positions.to(torch.int32)
    chunk = chunk_rows(b, s_q, s_kv, cfg.block_m)
    buf = torch.empty(b * chunk * s_kv, dtype=torch.float32, device=q.device)
    n_chunks = -(-s_q // chunk)
    n_cols = [s_kv] * n_chunks
    if torch.equal(kpos, torch.arange(s_kv, dtype=torch.int32, device=q.device)):  # visible keys: a prefix
        last = qpos.new_full((n_chunks * chunk,), 0)
        last[:s_q] = qpos
        n_cols = [min(s_kv, p + 1) for p in last.view(n_chunks, chunk).amax(-1).clamp_min(0).tolist()]
    for i, c0 in enumerate(range(0, s_q, chunk)):
        c, n = min(chunk, s_q - c0), n_cols[i]
        out = scores(q, w, k, k_scale, qpos, kpos, c0, c, buf[: b * c * n].view(b, c, n), cfg)
        values, picked = out.topk(min(kk, n), dim=-1)
        if n < kk:
            ids[:, c0:c0 + c, n:] = -1
        ids[:, c0:c0 + c, : values.shape[-1]] = torch.where(torch.isfinite(values), picked, -1)
    return ids
