"""Evaluation: the validation loss (and perplexity) of a model on the held-out split.

`train.eval_every = N` evaluates after every N-th optimizer step (and `spartron eval` a saved step) on
`train.eval_steps` batches of `train.global_batch_size` held-out sequences: the SAME sequences every
time, so the values of one run are comparable step to step, and the same for every layout (each
data-parallel rank reads its share, as in training). The value is the mean language-model loss
(MTP, auxiliary and indexer losses are training objectives, not reported here); perplexity is its
exponential.

The held-out split is the data's own (spartron.runtime.data.build_eval_loader: synthetic data's
disjoint stream, the last `train.data.val_fraction` of a token file or corpus, never trained on).

An evaluation leaves the run as it found it: no gradients, dropout off, the model's buffers (the
routers' step counts that feed the expert-bias update) restored, the RNG streams untouched (a resumed
run must replay the uninterrupted one exactly).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from spartron.runtime.data import build_eval_loader


class Evaluator:
    """Validation loss over a fixed held-out set; `run(model)` is a collective over `group` (dp x cp)."""

    def __init__(self, cfg, dp_rank: int, dp_size: int, n_micro: int, group: dist.ProcessGroup,  # noqa: ANN001
                 device: torch.device) -> None:
        self.cfg, self.dp_rank, self.dp_size = cfg, dp_rank, dp_size
        self.n_batches = cfg.train.eval_steps * n_micro  # micro-batches per rank per evaluation
        self.loader = build_eval_loader(cfg, dp_rank, dp_size)  # here: a split that is empty fails at setup
        self.group, self.device = group, device

    def run(self, model: nn.Module) -> dict[str, Any]:
        """{"val_loss", "val_ppl", "val_tokens", "eval_time_s"}: the same values on every rank."""
        t = self.cfg.train
        loader = self.loader
        loader.position = 0  # the same held-out samples every time
        start = time.perf_counter()
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        was_training = model.training
        cuda = [self.device] if self.device.type == "cuda" else []
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        try:
            with torch.random.fork_rng(devices=cuda), torch.no_grad():
                model.eval()
                for _ in range(self.n_batches):
                    batch = loader.next(t.micro_batch_size)
                    out = model(batch.tokens.to(self.device), batch.labels.to(self.device),
                                **batch.model_kwargs(self.device))
                    total += out["lm_loss"].detach().double()
        finally:
            model.train(was_training)
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(buffers[name])
        total /= self.n_batches
        dist.all_reduce(total, group=self.group)  # gloo has no AVG: sum, then divide
        loss = float(total) / dist.get_world_size(self.group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)),
                "val_tokens": t.eval_steps * t.global_batch_size * t.seq_len,
                "eval_time_s": time.perf_counter() - start}
