"""Launcher for the Triton lightning-indexer kernels: shape limits, tile configs, query chunks, the top-k.

`spartron::indexer_topk` registers `indexer_topk` below as its CUDA kernel (indexer_topk.py); a CUDA
input the kernels cannot take is an error naming the limit, never a silent fallback. Triton is
imported only when a kernel runs. Queries go in chunks so the fp32 [B, chunk, S_kv] score buffer
stays under `SCORE_BUFFER_BYTES`; each chunk is scored (indexer_triton_kernels) and then selected by
the top-k launches (topk_triton_kernels). When key positions are 0..S_kv-1 (no CP, or CP's gathered
keys) a row's visible keys are the contiguous columns [document start or 0, query position]: the score
kernel skips the tiles outside every row's range and the top-k reads each row's range only. Whether
that holds is a device flag (`keys_at_columns`) the kernels read, and every size comes from shapes: the
launcher never waits on the device (no host sync per call). The score kernel is the first launch (a
single call's device time starts with the host's way to it): it leaves the dead tiles unwritten, and a
second launch of it after the flag fills them with -inf where the flag is 0.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import Tensor

from spartron.optional import require

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
SCORE_BUFFER_BYTES = 1 << 30
FP8_ROWS = 64  # rows per program of the fp8 quantisation


@dataclass(frozen=True)
class IndexerKernelConfig:
    """Score tile (query rows, key columns, warps, head-loop pipeline depth, two heads a step when the head
    count is even; the fp8 scores' own depth and pairing) and top-k selection (columns per streamed
    block, sampled keys, candidate slots, warps per streaming program and per search program, persistent
    programs per SM of the fallback, the bracket's margin in standard deviations, passes before the
    histogram fallback, the next block's load issued before a block's work: see topk_triton_kernels)."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2
    head_pairs: bool = True
    fp8_num_stages: int = 3  # fp8: faster than bf16's 2 stages and head pairs (docs/KERNEL_NOTES.md)
    fp8_head_pairs: bool = False
    topk_block: int = 1024  # the fastest top-k of the sweep at 16k (docs/KERNEL_NOTES.md)
    topk_sample: int = 2048
    topk_candidates: int = 2048
    topk_warps: int = 2
    topk_search_warps: int = 4
    topk_programs_per_sm: int = 8
    topk_margin: float = 4.0
    topk_tries: int = 3
    topk_prefetch: bool = True


def check_supported(q: Tensor, k: Tensor) -> None:
    """Raise ValueError naming the limit when the CUDA kernel cannot take these inputs."""
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        raise ValueError(f"indexer_topk CUDA kernel: needs a power-of-two index head dim >= 16; got {d}")
    if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"indexer_topk CUDA kernel: needs bfloat16 or float16 q and k; got {q.dtype}, {k.dtype}")


def _kernels(name: str = "indexer_triton_kernels"):
    require("triton", "the indexer_topk CUDA kernel", "pip install triton (it ships with CUDA builds of torch)")
    return importlib.import_module(f"spartron.layers.attention.{name}")


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def padded(n: int) -> int:
    """Row stride of the score buffer: n rounded up to 16 columns (aligned rows for vector loads)."""
    return -(-n // 16) * 16


def chunk_rows(b: int, s_q: int, s_kv: int, block_m: int) -> int:
    """Queries per chunk: the score buffer under SCORE_BUFFER_BYTES, a multiple of the tile rows."""
    rows = max(1, SCORE_BUFFER_BYTES // (4 * b * padded(max(s_kv, 1))))
    return min(s_q, max(block_m, rows // block_m * block_m))


def quantize_fp8(q: Tensor, weights: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """indexer_fp8.fp8_operands in two Triton passes (one read of q and k each): (q8, weights * q scale,
    k8, k scale), bitwise the same values."""
    kern = _kernels()
    out = []
    for x, w in ((q, weights), (k, None)):
        rows = x.numel() // x.shape[-1]
        x8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        w_out = torch.empty_like(scale) if w is not None else scale
        kern.fp8_rows_kernel[(-(-rows // FP8_ROWS),)](
            x.contiguous(), w.contiguous() if w is not None else scale, x8, scale, w_out, rows, D=x.shape[-1],
            BR=FP8_ROWS, HAS_W=w is not None, num_warps=4)
        out.append((x8, w_out if w is not None else scale))
    (q8, w8), (k8, k_scale) = out
    return q8, w8, k8, k_scale


def keys_at_columns(k_positions: Tensor) -> Tensor:
    """int32 [1] on the positions' device: 1 when key s sits at position s for every s (computed there,
    no host sync)."""
    at = k_positions == torch.arange(k_positions.shape[0], device=k_positions.device, dtype=k_positions.dtype)
    return at.all().to(torch.int32).reshape(1)


def _flag(ranged: Tensor | bool, device: torch.device) -> Tensor:
    return ranged if isinstance(ranged, Tensor) else torch.full((1,), int(ranged), dtype=torch.int32, device=device)


def scores(q: Tensor, weights: Tensor, k: Tensor, k_scale: Tensor | None, q_positions: Tensor,
           k_positions: Tensor, q_start: int, c_len: int, out: Tensor, q_starts: Tensor | None = None,
           ranged: Tensor | bool = False, cfg: IndexerKernelConfig | None = None, dead_only: bool = False) -> Tensor:
    """Fill out [B, c_len, n_cols] fp32 (a view whose row stride may exceed n_cols) with the scores of queries
    q_start .. q_start + c_len against the first n_cols keys, -inf where not visible; `ranged` True (or a
    `keys_at_columns` flag that is 1): tiles without a visible key are left unwritten. dead_only: only
    those tiles (-inf where the flag is 0), the rest untouched. q [B, S_q, H, d], k [B, S_kv, d]
    contiguous (bf16/fp16, or fp8 with k_scale: fp8_num_stages / fp8_head_pairs); weights fp32; positions
    and q_starts int32 or int64."""
    cfg = cfg or IndexerKernelConfig()
    b, s_q, h, d = q.shape
    s_kv, n_cols = k.shape[1], out.shape[-1]
    if out.stride(-1) != 1 or out.stride(0) != c_len * out.stride(1):
        raise ValueError("indexer scores: out must be [B, c_len, n_cols] rows of one stride")
    fp8 = k_scale is not None
    dead = 2 if isinstance(ranged, Tensor) else int(not ranged)
    grid = (-(-n_cols // cfg.block_n), -(-c_len // cfg.block_m), b)
    _kernels().indexer_scores_kernel[grid](
        q, weights, k, k_scale if fp8 else weights, q_positions, k_positions,
        q_starts if q_starts is not None else q_positions, ranged if dead == 2 else q_positions, out, s_q, s_kv,
        q_start, c_len, n_cols, out.stride(1), dead, H=h, D=d, BM=cfg.block_m, BN=cfg.block_n, HAS_KSCALE=fp8,
        HAS_STARTS=q_starts is not None, PAIRS=(cfg.fp8_head_pairs if fp8 else cfg.head_pairs) and h % 2 == 0,
        STAGES=cfg.fp8_num_stages if fp8 else cfg.num_stages, LIVE=not dead_only, num_warps=cfg.num_warps)
    return out


def topk_programs(device: torch.device, rows: int, cfg: IndexerKernelConfig) -> int:
    """Programs of the persistent fallback grid: topk_programs_per_sm per SM (4 SMs off CUDA), at most rows."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(rows, cfg.topk_programs_per_sm * sms))


def candidate_slots(cfg: IndexerKernelConfig, n_cols: int) -> int:
    """Candidate slots a row: topk_candidates, or fewer when every row is shorter (a row of at most that
    many keys holds all of them: the scratch stays within about twice the score rows)."""
    return max(16, min(_pow2(cfg.topk_candidates), _pow2(n_cols)))


def select_scratch(rows: int, cfg: IndexerKernelConfig, n_cols: int) -> int:
    """int32 scratch the selection of `rows` rows of n_cols columns needs: 4 per row (its bracket, then its
    threshold) and `candidate_slots` per row (the keys inside its bracket)."""
    return rows * (4 + candidate_slots(cfg, n_cols))


def select(out: Tensor, ids: Tensor, q_positions: Tensor, q_start: int, row0: int, n_rows: int,
           q_starts: Tensor | None = None, ranged: Tensor | bool = False, cfg: IndexerKernelConfig | None = None,
           scratch: Tensor | None = None) -> tuple:
    """Write ids[:, q_start + row0 : q_start + row0 + n_rows], the top-k of rows row0.. of the chunk's
    scores `out` (see `scores`); scratch: int32, at least `select_scratch(B * n_rows, cfg, n_cols)` (made if
    None).
    Four launches (topk_triton_kernels): bracket + compaction, search, write, and the whole selection
    for the rows whose bracket missed. Returns Triton's launch handles (n_regs / n_spills for the
    benchmark; None under the interpreter)."""
    cfg = cfg or IndexerKernelConfig()
    if cfg.topk_tries < 1:
        raise ValueError(f"indexer select: topk_tries must be >= 1 (the bracket's first pass), got {cfg.topk_tries}")
    b, c_len, n_cols = out.shape
    cand = candidate_slots(cfg, n_cols)
    jobs = b * n_rows
    need = select_scratch(jobs, cfg, n_cols)
    if scratch is None:
        scratch = torch.empty(need, dtype=torch.int32, device=out.device)
    if scratch.numel() < need:
        raise ValueError(f"indexer select: scratch needs {need} int32, got {scratch.numel()}")
    meta, cand_buf = scratch[: 4 * jobs], scratch[4 * jobs:]
    kern = _kernels("topk_triton_kernels")
    flag = _flag(ranged, out.device)
    starts = q_starts if q_starts is not None else q_positions
    s_q, kk, stride = ids.shape[1], ids.shape[2], out.stride(1)
    block, sample = _pow2(cfg.topk_block), max(16, _pow2(cfg.topk_sample))
    has = q_starts is not None
    bracket = kern.topk_bracket_kernel[(jobs,)](
        out, q_positions, starts, flag, meta, cand_buf, c_len, row0, n_rows, n_cols, stride, q_start, s_q, kk,
        HAS_STARTS=has, BLOCK=block, SAMPLE=sample, CAND=cand, MARGIN=float(cfg.topk_margin),
        PREFETCH=cfg.topk_prefetch, num_warps=cfg.topk_warps)
    search = kern.topk_search_kernel[(jobs,)](
        q_positions, starts, flag, meta, cand_buf, n_rows, row0, n_cols, q_start, s_q, kk, HAS_STARTS=has, CAND=cand,
        num_warps=cfg.topk_search_warps)
    write = kern.topk_write_kernel[(jobs,)](
        out, q_positions, starts, flag, meta, ids, c_len, row0, n_rows, n_cols, stride, q_start, s_q, kk,
        HAS_STARTS=has, BLOCK=block, PREFETCH=cfg.topk_prefetch, num_warps=cfg.topk_warps)
    programs = topk_programs(out.device, jobs, cfg)
    whole = kern.select_topk_kernel[(programs,)](
        out, q_positions, starts, flag, meta, ids, cand_buf, c_len, row0, n_rows, n_cols, stride, q_start, s_q, kk,
        jobs, programs, HAS_STARTS=has, BLOCK=block, SAMPLE=sample, CAND=cand, MARGIN=float(cfg.topk_margin),
        TRIES=cfg.topk_tries, PREFETCH=cfg.topk_prefetch, num_warps=cfg.topk_warps)
    return bracket, search, write, whole


def indexer_topk(q: Tensor, weights: Tensor, k: Tensor, q_positions: Tensor, k_positions: Tensor, topk: int,
                 fp8: bool, q_starts: Tensor | None = None, cfg: IndexerKernelConfig | None = None) -> Tensor:
    """int32 ids [B, S_q, min(topk, S_kv)] (ascending key order, -1 padding last; see indexer_topk.topk_ids)."""
    check_supported(q, k)
    cfg = cfg or IndexerKernelConfig()
    b, s_q, _, _ = q.shape
    s_kv = k.shape[1]
    ids = torch.empty(b, s_q, min(topk, s_kv), dtype=torch.int32, device=q.device)
    if ids.numel() == 0:
        return ids
    k_scale = None
    if fp8:
        q, w, k, k_scale = quantize_fp8(q, weights, k)
    else:
        w = weights.float()  # fp32 head weights: 4-byte loads, which the head loop's pipelining needs
    q, w, k = q.contiguous(), w.contiguous(), k.contiguous()
    # int64 positions as given: the kernels narrow them as they load them (no conversion launches on the
    # host's path to the score kernel, which a single call waits for)
    qpos, kpos = q_positions.contiguous(), k_positions.contiguous()
    starts = q_starts.contiguous() if q_starts is not None else None
    chunk = chunk_rows(b, s_q, s_kv, cfg.block_m)
    stride = padded(s_kv)
    buf = torch.empty(b * chunk * stride, dtype=torch.float32, device=q.device)
    ranged = scratch = None
    for c0 in range(0, s_q, chunk):
        c = min(chunk, s_q - c0)
        out = buf[: b * c * stride].view(b, c, stride)[..., :s_kv]
        # the scores first, their dead tiles unwritten: the first launch waits on nothing but the host
        scores(q, w, k, k_scale, qpos, kpos, c0, c, out, starts, True, cfg)
        if ranged is None:  # made after the first score launch: off the host's path to it
            ranged = keys_at_columns(kpos)
            scratch = torch.empty(select_scratch(b * chunk, cfg, s_kv), dtype=torch.int32, device=q.device)
        scores(q, w, k, k_scale, qpos, kpos, c0, c, out, starts, ranged, cfg, dead_only=True)  # -inf unless ranged
        select(out, ids, qpos, c0, 0, c, starts, ranged, cfg, scratch)
    return ids
