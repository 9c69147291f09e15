"""The indexer-quality metric while a DSA model trains: per DSA source layer, the recall of the dense attention
mass by the indexer's top-k and the KL, on sampled queries (spartron.layers.attention.indexer_recall).

`[train.indexer_metrics]`: `queries` sampled per rank and layer, `every` n-th step (default 0: off). Opt-in
because a measured step runs the main attention of the sampled rows over every key (O(queries x H x S) memory
and time beside the model's): a benchmark or a run that does not ask for it pays nothing. Measured on the
first micro-batch of a step by forward hooks on the source layers (through `reuse_during_recompute`: a
checkpoint replay gets the result back, the region's recorded operators stay those of the model), averaged
over the dp x cp ranks; a step record gets `indexer_recall_per_layer`,
`indexer_kl_per_layer` (the order of `indexer_metric_layers`) and their means `indexer_recall`, `indexer_kl`.
Refused with train.compile (TrainConfig: a hook in a compiled block would break its graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn

from spartron.checkpointing.replay import reuse_during_recompute
from spartron.comm import labelled
from spartron.configbase import ConfigSection
from spartron.layers.attention.indexer_recall import indexer_quality, sampled_rows
from spartron.layers.attention.mla import MLA


def layer_quality(module: MLA, x: torch.Tensor, positions: torch.Tensor, queries: int) -> tuple:
    """(recall, KL) of one DSA source layer on `queries` sampled rows of its input `x`."""
    with torch.no_grad():
        probe = module.indexer_probe(x, positions, sampled_rows(x.shape[1], queries, x.device))
        fp8 = module.indexer.fp8 and module.indexer_mode in ("frozen", "kl_sparse")
        return indexer_quality(probe, module.softmax_scale, module.indexer.topk, fp8)


class IndexerMetricsConfig(ConfigSection):
    queries: int = Field(32, ge=1)  # sampled query rows per rank and layer
    every: int = Field(0, ge=0)  # measure every n-th step; 0 (the default): never


class IndexerProbe:
    """Hooks the DSA source layers of a model for the steps that measure; `None` from `for_model` when none."""

    def __init__(self, layers: list[MLA], queries: int, every: int, group: dist.ProcessGroup | None) -> None:
        self.layers, self.queries, self.every, self.group = layers, queries, every, group

    @classmethod
    def for_model(cls, model: nn.Module, train, group) -> IndexerProbe | None:  # noqa: ANN001
        layers = [m for m in model.modules() if isinstance(m, MLA) and m.indexer is not None]
        every = train.indexer_metrics.every
        return cls(layers, train.indexer_metrics.queries, every, group) if layers and every else None

    @contextlib.contextmanager
    def measuring(self, step: int, results: dict[int, tuple]) -> Iterator[None]:
        """Within (a micro-batch's forward AND backward: checkpoint replays find their frames): each source layer's
        first forward of a measured step adds (recall, kl) to `results`."""
        if step % self.every:
            yield
            return

        def hook(module: MLA, args: tuple, kwargs: dict, output: Any) -> None:
            x, positions = args[0], args[1] if len(args) > 1 else kwargs["positions"]
            # Measured once per checkpoint-region call, its replay gets the result back (and runs no extra op)
            quality = reuse_during_recompute(layer_quality, module, x, positions, self.queries)
            results.setdefault(module.layer_idx, quality)  # the first: not a replay, nor a later micro-batch

        handles = [m.register_forward_hook(hook, with_kwargs=True) for m in self.layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def record(self, results: dict[int, tuple]) -> dict[str, Any]:
        """The step record's fields from one measured step's results, averaged over the group's ranks."""
        if not results:
            return {}
        layers = sorted(results)
        values = torch.stack([torch.stack([results[i][0], results[i][1]]).float() for i in layers])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            with labelled("indexer_metrics", self.group):
                dist.all_reduce(values, group=self.group)
            values /= dist.get_world_size(self.group)
        recall, kl = values[:, 0].tolist(), values[:, 1].tolist()
        return {"indexer_metric_layers": layers, "indexer_recall_per_layer": recall, "indexer_kl_per_layer": kl,
                "indexer_recall": sum(recall) / len(recall), "indexer_kl": sum(kl) / len(kl)}
