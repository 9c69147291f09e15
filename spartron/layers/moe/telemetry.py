"""Routing telemetry as the custom op `spartron::record_routing_stats`.

Why an op: adding per-expert token counts into a caller-owned buffer is a side effect. If it ran
as plain tensor code inside a checkpoint region, a replay would count every token twice. As a
named op with a declared mutation, the checkpoint policy lists it as mandatory (saved, never
replayed) and torch.compile keeps the in-place update in the graph (functionalised, no break).
"""

from __future__ import annotations

import torch
from torch import Tensor

OPS: tuple[str, ...] = ("spartron::record_routing_stats",)


@torch.library.custom_op("spartron::record_routing_stats", mutates_args=("counts",))
def _record_routing_stats(topk_ids: Tensor, counts: Tensor) -> None:
    # scatter_add instead of bincount: bincount sizes its output from the data (a device sync on
    # CUDA); scatter_add never syncs and rejects out-of-range ids instead of dropping them.
    ids = topk_ids.reshape(-1).to(torch.int64)
    counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=counts.dtype))


@_record_routing_stats.register_fake
def _(topk_ids, counts):
    return None


def record_routing_stats(topk_ids: Tensor, counts: Tensor) -> None:
    """Add how many times each expert id occurs in `topk_ids` into `counts` (in place).

    `counts` is a 1-D integer buffer with one slot per expert, owned by the caller (the MoE layer),
    on the same device as `topk_ids`. Ids outside [0, counts.numel()) are an error, not dropped
    (checked here for host tensors; a device-side assert on CUDA, where a check would sync).
    """
    if counts.dim() != 1 or counts.dtype.is_floating_point or counts.dtype.is_complex:
        raise ValueError(f"record_routing_stats: counts must be a 1-D integer buffer, got "
                         f"{counts.dtype} of shape {tuple(counts.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex:
        raise ValueError(f"record_routing_stats: topk_ids must be integer expert ids, got {topk_ids.dtype}")
    if topk_ids.device != counts.device:
        raise ValueError(f"record_routing_stats: topk_ids on {topk_ids.device} but counts on {counts.device}")
    if not torch.compiler.is_compiling() and topk_ids.device.type == "cpu" and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= counts.numel():
            raise ValueError(f"record_routing_stats: expert ids span [{lo}, {hi}] but counts has "
                             f"{counts.numel()} slots")
    _record_routing_stats(topk_ids, counts)
