"""Megatron's own training machinery around Spartron's layers, on real gloo ranks, against Spartron's Trainer.

What a Megatron user runs: `parallel_state` groups, a `GPTModel` from `spartron_block_spec`, Megatron's
`DistributedDataParallel`, its optimizer, `get_forward_backward_func` over several micro-batches and
`finalize_model_grads` (which also updates the routers' expert bias). The reference is Spartron's own
`Trainer` on the same config, seed and data (its synthetic loader, drawn again for Megatron), so both
start from the same weights (layout-invariant init; the embedding and output layer are copied by name)
and must give the same loss at every step. megatron-core's CUDA-named bookkeeping tensors go to the CPU
through the test-only `cpu_shim` (what it replaces is in its docstring).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core==0.16.1)")

import torch.distributed as dist  # noqa: E402

from spartron.interop.megatron import SideChannel, megatron_config_from_spartron, spartron_block_spec  # noqa: E402
from spartron.layers.init import init_tensor_  # noqa: E402
from spartron.runtime.config import RunConfig, load_config  # noqa: E402
from spartron.runtime.data import build_train_loader  # noqa: E402
from spartron.runtime.optim import lr_at  # noqa: E402
from spartron.runtime.trainer import Trainer  # noqa: E402
from spartron.testing import run_distributed  # noqa: E402
from cpu_shim import cpu_megatron  # noqa: E402 - next to this file

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.toml"
STEPS = 4


def run_config(run_dir: Path, ep: int, *extra: str) -> RunConfig:
    """tiny.toml (DSA sources and consumers) without MTP (not adapted), aux-loss-free routing, 2 micro-batches
    per rank, no clipping (Megatron clips expert and dense parameters by separate norms)."""
    return load_config(TINY, [
        "device=cpu", "model.mtp.depth=0", "model.n_layers=3", f"parallel.ep={ep}",
        "ac.mode=none", "train.seq_len=16", "train.micro_batch_size=1", "train.global_batch_size=4",
        f"train.steps={STEPS}", "train.warmup_steps=0", "train.grad_clip=0", "train.save_every=0",
        "train.progress=false", "train.peak_tflops=1.0", f"train.run_dir={run_dir}", *extra])


def spartron_losses(cfg: RunConfig) -> list[float]:
    trainer = Trainer(cfg).setup()
    try:
        losses = [trainer.step()["loss"] for _ in range(cfg.train.steps)]
    finally:
        trainer.close()
        trainer.release_run_dir()
    return losses


class MegatronRun:
    """A Megatron-core training set-up around Spartron's layers, as a Megatron user writes it."""

    def __init__(self, cfg: RunConfig, *, bf16: bool = False):
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.process_groups_config import ProcessGroupCollection

        self.cfg, m, t = cfg, cfg.model, cfg.train
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(expert_model_parallel_size=cfg.parallel.ep)
        self.pgc = ProcessGroupCollection.use_mpu_process_groups()
        tcfg = megatron_config_from_spartron(m, use_cpu_initialization=True)
        self.side = SideChannel()
        gpt = GPTModel(tcfg, spartron_block_spec(tcfg, self.side, base_config=m, pg_collection=self.pgc,
                                                 init_seed=t.seed),
                       vocab_size=m.vocab_size, max_sequence_length=m.max_seq_len, position_embedding_type="none",
                       share_embeddings_and_output_weights=m.tie_embeddings, pg_collection=self.pgc)
        with torch.no_grad():  # Megatron-owned weights: Spartron's init under the reference model's names
            init_tensor_(gpt.embedding.word_embeddings.weight, "embed.weight", t.seed, m.init_std)
            if not m.tie_embeddings:
                init_tensor_(gpt.output_layer.weight, "head.weight", t.seed, m.init_std)
        with cpu_megatron():
            self.model = DistributedDataParallel(
                tcfg, DistributedDataParallelConfig(use_distributed_optimizer=False), gpt, pg_collection=self.pgc)
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=t.lr, weight_decay=t.weight_decay, adam_beta1=t.beta1,
                                adam_beta2=t.beta2, adam_eps=1e-8, clip_grad=0.0, bf16=bf16),
                [self.model], use_gloo_process_groups=False, pg_collection=self.pgc)
        tcfg.finalize_model_grads_func = finalize_model_grads
        tcfg.no_sync_func = self.model.no_sync
        dp_rank, dp = dist.get_rank(self.pgc.dp), dist.get_world_size(self.pgc.dp)
        self.loader = build_train_loader(cfg, dp_rank, dp)  # the Trainer's data, drawn again
        self.n_micro = t.micro_steps(dp)

    def forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        self.side.reset()
        per_token = model(batch.tokens, None, None, labels=batch.labels)

        def loss_func(output):
            loss = output.float().mean() + self.side.loss()
            return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place

        return per_token, loss_func

    def batches(self):
        while True:
            yield self.loader.next(self.cfg.train.micro_batch_size)

    def step(self, step: int) -> float:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        t = self.cfg.train
        with cpu_megatron():
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            out = get_forward_backward_func()(
                forward_step_func=self.forward_step, data_iterator=self.batches(), model=[self.model],
                num_microbatches=self.n_micro, seq_length=t.seq_len, micro_batch_size=t.micro_batch_size)
            for group in self.optimizer.param_groups:  # what Megatron's OptimizerParamScheduler sets,
                group["lr"] = lr_at(step, t) * group["lr_mult"]  # on the Trainer's schedule
                group["weight_decay"] = t.weight_decay * group["wd_mult"]  # 0 for vectors, as Spartron's
            ok, _, _ = self.optimizer.step()
        assert ok, "the Megatron optimizer skipped a step"
        loss = torch.stack([o["loss"] for o in out]).mean()
        dist.all_reduce(loss, group=self.pgc.dp_cp)
        return loss.item() / dist.get_world_size(self.pgc.dp_cp)


def _parity(rank, world, run_dir, ep):
    cfg = run_config(run_dir, ep)
    ours = spartron_losses(cfg)
    run = MegatronRun(cfg)
    theirs = [run.step(s) for s in range(1, STEPS + 1)]
    return ours, theirs


@pytest.mark.parametrize("world", [2, 4])
def test_megatron_ddp_schedule_matches_spartron_trainer(tmp_path, world):
    results = run_distributed(_parity, world, tmp_path / "run", 2, timeout=120)
    ours, theirs = results[0]
    assert all(r == results[0] for r in results), results
    diffs = [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
    assert max(diffs) < 1e-6, (ours, theirs)
