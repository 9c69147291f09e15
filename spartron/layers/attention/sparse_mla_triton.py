"""Launchers for the Triton sparse-MLA kernels: shape limits, block configs, and the forward / backward.

The kernels are Triton (sparse_mla_triton_kernels.py) and, for the 64-row forward, Gluon, Triton's
explicit-layout dialect (sparse_mla_gluon_kernels.py, shipped with triton >= 3.5).

`spartron::sparse_mla` registers these as its CUDA kernels (sparse_mla.py), so CUDA tensors always
take them and CPU tensors the PyTorch reference; a CUDA input the kernels cannot take is an error
naming the limit, never a silent fallback. Triton is imported only when a kernel runs
(`spartron.optional.require`), so CPU installs without triton import this module.

Limits: D = 576 (kv_lora 512 + rope 64) with d_v = 512, bfloat16 or float16, any head count (heads
are padded to the head block inside the kernel). Batch is flattened into the token axis.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from spartron.optional import require

LATENT_DIM = 512
ROPE_DIM = 64
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
# Deterministic dkv: int64 fixed point with this many fraction bits. Resolution 2^-40 (9.1e-13) per
# added term; every partial sum of a dkv entry must stay below 2^23 (8.4e6) in magnitude, or it wraps.
DKV_FIXED_POINT_BITS = 40
LOG2E = 1.4426950408889634
DELTA_ROWS = 16  # rows per program of the backward's Delta pass


@dataclass(frozen=True)
class KernelConfig:
    """Head block (MMA rows), key block, warps and software-pipeline depth of one launch. Backward
    only: `walks` (1: one fused walk; 3: P / dS, then dkv, then dq, each its own walk over the ids,
    through a per-program scratch tile) and `stages2`, the pipeline depth of the later two walks."""

    block_h: int
    block_k: int
    num_warps: int
    num_stages: int
    walks: int = 1
    stages2: int = 2
    gluon: bool = False  # forward only: the Gluon kernel (sparse_mla_gluon_kernels.py; block_h 64, 8 warps)
    gather_early: bool = True  # Gluon forward: refill a stage before (True) or after each score product
    dkv_key_rows: bool = False  # backward: dkv tiles as [keys, columns] (else transposed; see the kernels)


def check_supported(q: Tensor, kv: Tensor, d_v: int) -> None:
    """Raise ValueError naming the limit when the CUDA kernels cannot take these shapes."""
    d = q.shape[-1]
    if d != LATENT_DIM + ROPE_DIM or d_v != LATENT_DIM:
        raise ValueError(f"sparse_mla CUDA kernel: needs head dim {LATENT_DIM + ROPE_DIM} (kv_lora "
                         f"{LATENT_DIM} + rope {ROPE_DIM}) and d_v {LATENT_DIM}; got head dim {d}, d_v {d_v}")
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"sparse_mla CUDA kernel: needs bfloat16 or float16 inputs; got {q.dtype}")


def forward_config(n_heads: int, hopper: bool = True) -> KernelConfig:
    """Head block 64 (one wgmma row tile, two warpgroups) from 33 heads up: on Hopper the Gluon kernel,
    2 stages of 64 keys, refill before each score product; elsewhere (`hopper` false: its wgmma is sm90
    only) the Triton kernel. Below 33 heads, head block 16 (mma rows) with the Triton kernel, q and the
    gathered rows in four 128-column latent chunks and the rope part. Each choice was the fastest
    measured; deeper pipelines were slower. The measurements: docs/KERNEL_NOTES.md."""
    if n_heads > 32:
        return KernelConfig(block_h=64, block_k=64, num_warps=8, num_stages=2, gluon=hopper)
    return KernelConfig(block_h=16, block_k=64, num_warps=4, num_stages=2)


def is_hopper(device: torch.device) -> bool:
    """An sm90 GPU: the Gluon forward's warpgroup MMA exists there only."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def backward_config(n_heads: int, dkv_in_l2: bool = True) -> KernelConfig:
    """From 33 heads up: three walks, 64 keys, later walks 2 stages (about half the time of one walk).
    At 16 heads one walk of 32 keys with [keys, columns] dkv tiles: that tile needs no layout change
    through shared memory before its atomics, which leaves room to pipeline the gathers. Three stages
    pay while the float32 dkv accumulator stays in L2 (`dkv_in_l2`); past it the atomics reach HBM and
    one stage is fastest. The measurements: docs/KERNEL_NOTES.md."""
    if n_heads > 32:
        return KernelConfig(block_h=64, block_k=64, num_warps=8, num_stages=1, walks=3, stages2=2)
    return KernelConfig(block_h=16, block_k=32, num_warps=4, num_stages=3 if dkv_in_l2 else 1, dkv_key_rows=True)


def dkv_in_l2(kv: Tensor) -> bool:
    """Whether the backward's float32 dkv accumulator (kv's shape) fits in three quarters of the GPU's L2."""
    if kv.device.type != "cuda":
        return True
    return kv.numel() * 4 <= 0.75 * torch.cuda.get_device_properties(kv.device).L2_cache_size


def _kernels(module: str = "sparse_mla_triton_kernels"):
    require("triton", "the sparse_mla CUDA kernels", "pip install triton (it ships with CUDA builds of torch)")
    return importlib.import_module(f"spartron.layers.attention.{module}")


def _pow2(n: int) -> int:
    """The id row's length rounded up to a power of two (>= 16), for the kernels' slot scan."""
    return max(16, 1 << max(n - 1, 0).bit_length())


def _grid(tokens: int, n_heads: int, cfg: KernelConfig) -> tuple[int]:
    return (tokens * math.ceil(n_heads / cfg.block_h),)


def _persistent_programs(device: torch.device, n_work: int) -> int:
    """One program per SM (the kernels' shared memory allows no second), at most one per work item."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(sms, n_work))


def forward(q: Tensor, kv: Tensor, topk_ids: Tensor, softmax_scale: float, d_v: int,
            cfg: KernelConfig | None = None) -> tuple[Tensor, Tensor]:
    """out [B, S_q, H, 512] (q's dtype), lse [B, S_q, H] float32; inputs contiguous."""
    check_supported(q, kv, d_v)
    b, s_q, h, _ = q.shape
    cfg = cfg or forward_config(h, is_hopper(q.device))
    out = q.new_empty(b, s_q, h, d_v)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if cfg.gluon:
        if (cfg.block_h, cfg.num_warps) != (64, 8) or cfg.block_k not in (32, 64) or cfg.num_stages not in (2, 3):
            raise ValueError(f"sparse_mla Gluon forward: needs block_h 64, 8 warps, block_k 32 or 64, 2 or 3 "
                             f"stages; got {cfg}")
        if not is_hopper(q.device):
            raise ValueError(f"sparse_mla Gluon forward: needs an sm90 (Hopper) GPU for its warpgroup MMA; got "
                             f"{q.device}")
        kern = _kernels("sparse_mla_gluon_kernels").sparse_mla_fwd_gluon_kernel
        extra = dict(DV=LATENT_DIM, STAGES=cfg.num_stages, EARLY=cfg.gather_early)
    else:
        kern = _kernels().sparse_mla_fwd_kernel
        extra = dict(DC=LATENT_DIM // 4, num_stages=cfg.num_stages)
    kern[_grid(b * s_q, h, cfg)](
        q, kv, topk_ids, out, lse, s_q, kv.shape[1], h, topk_ids.shape[-1], softmax_scale * LOG2E,
        BH=cfg.block_h, BK=cfg.block_k, DR=ROPE_DIM, KP=_pow2(topk_ids.shape[-1]), num_warps=cfg.num_warps,
        **extra)
    return out, lse


def backward(grad_out: Tensor, grad_lse: Tensor, q: Tensor, kv: Tensor, topk_ids: Tensor, out: Tensor,
             lse: Tensor, softmax_scale: float, d_v: int, cfg: KernelConfig | None = None,
             deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """(dq like q, dkv like kv); dkv is accumulated in float32 with atomics, then cast, or with
    `deterministic` in int64 fixed point (DKV_FIXED_POINT_BITS), bitwise the same on every run."""
    check_supported(q, kv, d_v)
    b, s_q, h, d = q.shape
    s_kv = kv.shape[1]
    cfg = cfg or backward_config(h, dkv_in_l2(kv))
    if cfg.walks not in (1, 3):
        raise ValueError(f"sparse_mla backward kernel: walks must be 1 or 3; got {cfg.walks}")
    grad_q = torch.empty_like(q)
    grad_kv = torch.zeros(b, s_kv, d, dtype=torch.int64 if deterministic else torch.float32, device=kv.device)
    if q.numel() == 0:
        return grad_q, grad_kv.to(kv.dtype)
    k = _kernels()
    grad_out = grad_out.contiguous()
    delta = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device)  # rowsum(dO * out) - dlse
    k.delta_kernel[(math.ceil(b * s_q * h / DELTA_ROWS),)](
        grad_out, out.contiguous(), grad_lse.float().contiguous(), delta, b * s_q * h, DV=d_v, BR=DELTA_ROWS,
        num_warps=4)
    n_work = _grid(b * s_q, h, cfg)[0]
    grid = (_persistent_programs(q.device, n_work),) if cfg.walks > 1 else (n_work,)
    # scratch for 3 walks: per program, dS and P tiles [block_h, topk rounded up to block_k] (q's dtype)
    row = math.ceil(topk_ids.shape[-1] / cfg.block_k) * cfg.block_k if cfg.walks > 1 else 1
    scratch = q.new_empty(grid[0] if cfg.walks > 1 else 1, 2, cfg.block_h, row)
    k.sparse_mla_bwd_kernel[grid](
        q, kv, topk_ids, grad_out, lse.contiguous(), delta, grad_q, grad_kv, scratch, s_q, s_kv, h,
        topk_ids.shape[-1], n_work, softmax_scale, softmax_scale * LOG2E, BH=cfg.block_h, BK=cfg.block_k,
        DC=LATENT_DIM // 4, DR=ROPE_DIM, KP=_pow2(topk_ids.shape[-1]),
        FIXED=float(2**DKV_FIXED_POINT_BITS) if deterministic else 0.0, WALKS=cfg.walks, STAGES2=cfg.stages2,
        KEY_ROWS=cfg.dkv_key_rows, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if deterministic:
        return grad_q, (grad_kv.double() * 2.0**-DKV_FIXED_POINT_BITS).to(kv.dtype)
    return grad_q, grad_kv.to(kv.dtype)
