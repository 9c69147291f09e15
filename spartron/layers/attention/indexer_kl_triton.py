"""Launchers for kl_sparse's Triton kernels (indexer_kl_triton_kernels.py): shape limits and the three calls.

indexer_kl.py registers these as the CUDA kernels of its ops, so CUDA tensors take them and CPU tensors the
PyTorch reference; a CUDA input they cannot take is an error naming the limit. Triton is imported only when a
kernel runs (`spartron.optional.require`), so CPU installs without triton import this module.

Limits: the target's rows are the absorbed MLA layout (512 latent + 64 RoPE, as the sparse-MLA kernels);
the indexer's key width a power of two from 16 to 256 and at most 64 index heads; 16-bit inputs (bf16 or
fp16; the indexer's weights may be float32). Batch is flattened into the token axis.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from spartron.optional import require

TARGET_LATENT, TARGET_ROPE = 512, 64
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
TARGET_HEAD_BLOCK, TARGET_KEY_BLOCK = 16, 64
SCORES_KEY_BLOCK = 64
MAX_INDEX_HEADS = 64


def _kernels():
    require("triton", "kl_sparse's CUDA kernels", "pip install triton (it ships with CUDA builds of torch)")
    return importlib.import_module("spartron.layers.attention.indexer_kl_triton_kernels")


def _check_dtype(name: str, t: Tensor) -> None:
    if t.dtype not in KERNEL_DTYPES:
        raise ValueError(f"kl_sparse CUDA kernel: {name} must be bfloat16 or float16; got {t.dtype}")


def target(q: Tensor, kv: Tensor, ids: Tensor, scale: float) -> Tensor:
    """The detached KL target [B,S,K] float32: q [B,S,H,576] (absorbed queries), kv [B,S_kv,576], ids int32."""
    d = q.shape[-1]
    if d != TARGET_LATENT + TARGET_ROPE:
        raise ValueError(f"kl_sparse CUDA kernel: the attention rows must be {TARGET_LATENT} latent + "
                         f"{TARGET_ROPE} rope = {TARGET_LATENT + TARGET_ROPE} wide (absorbed MLA); got {d}")
    _check_dtype("q_abs", q)
    b, s, h, _ = q.shape
    out = torch.zeros(ids.shape, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    _kernels().kl_target_kernel[(b * s,)](
        q.contiguous(), kv.contiguous(), ids.contiguous(), out, s, kv.shape[1], scale * 1.4426950408889634,
        n_heads=h, topk=ids.shape[-1], BH=TARGET_HEAD_BLOCK, BK=TARGET_KEY_BLOCK, DV=TARGET_LATENT, DR=TARGET_ROPE,
        num_warps=4)
    return out


def _check_scores(q: Tensor, k: Tensor) -> int:
    """The padded index-head count (a power of two >= 16) after checking the limits."""
    h, d = q.shape[-2], q.shape[-1]
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"kl_sparse CUDA kernel: index_head_dim must be a power of two in 16..256; got {d}")
    if h > MAX_INDEX_HEADS:
        raise ValueError(f"kl_sparse CUDA kernel: at most {MAX_INDEX_HEADS} index heads; got {h}")
    _check_dtype("the indexer's q", q)
    if k.dtype != q.dtype:
        raise ValueError(f"kl_sparse CUDA kernel: the indexer's k ({k.dtype}) must match its q ({q.dtype})")
    return max(16, 1 << (h - 1).bit_length())


def selected_scores(q: Tensor, weights: Tensor, k: Tensor, ids: Tensor) -> Tensor:
    """I_sel [B,S,K] float32 (-inf at invalid slots): q [B,S,H,d], weights [B,S,H], k [B,S_kv,d], ids int32."""
    hp = _check_scores(q, k)
    b, s, h, d = q.shape
    out = torch.empty(ids.shape, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    _kernels().selected_scores_fwd_kernel[(b * s,)](
        q.contiguous(), weights.contiguous(), k.contiguous(), ids.contiguous(), out, s, k.shape[1], n_heads=h,
        topk=ids.shape[-1], HP=hp, D=d, BK=SCORES_KEY_BLOCK, num_warps=4)
    return out


def selected_scores_backward(grad: Tensor, q: Tensor, weights: Tensor, k: Tensor,
                             ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dq like q, dw like weights, dk like k); dk is summed in float32 with atomics, then cast."""
    hp = _check_scores(q, k)
    b, s, h, d = q.shape
    dq, dw = torch.empty_like(q), torch.empty_like(weights)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    if ids.numel() == 0:
        return dq.zero_(), dw.zero_(), dk.to(k.dtype)
    _kernels().selected_scores_bwd_kernel[(b * s,)](
        grad.contiguous(), q.contiguous(), weights.contiguous(), k.contiguous(), ids.contiguous(), dq, dw, dk, s,
        k.shape[1], n_heads=h, topk=ids.shape[-1], HP=hp, D=d, BK=SCORES_KEY_BLOCK, num_warps=4)
    return dq, dw, dk.to(k.dtype)
