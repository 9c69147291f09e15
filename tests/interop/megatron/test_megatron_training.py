"""Megatron's own training machinery around Spartron's layers, on real gloo ranks, against Spartron's Trainer.

What a Megatron user runs (examples/megatron_gpt.py's MegatronTraining): `parallel_state` groups, a
`GPTModel` from `spartron_block_spec`, Megatron's `DistributedDataParallel`, its optimizer (plain or
distributed), `Float16Module` for bf16, `get_forward_backward_func` over several micro-batches and
`finalize_model_grads` (which also updates the routers' expert bias). The reference is Spartron's own
`Trainer` on the same config, seed and data (its synthetic loader, drawn again for Megatron): both start
from the same weights (layout-invariant init; the embedding and output layer drawn under the reference
model's names) and must give the same loss at every step. megatron-core's CUDA-named bookkeeping tensors
go to the CPU through the test-only `cpu_shim` (what it replaces is in its docstring).
dist_checkpointing forks writer processes, which these (daemonic) ranks may not: its save / resume /
load-under-another-EP tests run the example as a program (test_megatron_example.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core==0.16.1)")

from examples.megatron_gpt import MegatronTraining  # noqa: E402 - the README's example: what users run
from spartron.runtime.config import RunConfig, load_config  # noqa: E402
from spartron.runtime.trainer import Trainer  # noqa: E402
from spartron.testing import run_distributed  # noqa: E402

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.toml"
STEPS = 4


def run_config(run_dir: Path, ep: int, *extra: str) -> RunConfig:
    """tiny.toml (DSA sources and consumers) without MTP (not adapted), aux-loss-free routing with group-limited
    routing and the expert bias, 2 micro-batches per rank, AdamW with weight decay on the matrices."""
    return load_config(TINY, [
        "device=cpu", "model.mtp.depth=0", "model.n_layers=3", f"parallel.ep={ep}",
        "ac.mode=none", "train.seq_len=16", "train.micro_batch_size=1", "train.global_batch_size=4",
        f"train.steps={STEPS}", "train.warmup_steps=0", "train.grad_clip=0", "train.save_every=0",
        "train.progress=false", "train.peak_tflops=1.0", f"train.run_dir={run_dir}", *extra])


def spartron_losses(cfg: RunConfig, key: str = "loss") -> list[float]:
    """The Trainer's per-step `key` ("loss", or "lm_loss": without the aux loss, which Megatron tracks apart)."""
    trainer = Trainer(cfg).setup()
    try:
        losses = [trainer.step()[key] for _ in range(cfg.train.steps)]
    finally:
        trainer.close()
    return losses


def _parity(rank, world, run_dir, ep, *extra):
    cfg = run_config(run_dir, ep, f"train.global_batch_size={2 * world}", *extra)
    ours = spartron_losses(cfg, "lm_loss" if cfg.model.moe.aux_loss_coeff else "loss")
    run = MegatronTraining(cfg, ep)
    theirs = [run.step(s) for s in range(1, STEPS + 1)]
    return ours, theirs


@pytest.mark.parametrize(("world", "extra"), [
    (2, ()), (4, ()),
    (2, ("model.moe.aux_loss_coeff=0.01",)),  # its gradient through Megatron's MoEAuxLossAutoScaler
], ids=["2-ranks", "4-ranks", "2-ranks-aux-loss"])
def test_megatron_ddp_schedule_matches_spartron_trainer(tmp_path, world, extra):
    results = run_distributed(_parity, world, tmp_path / "run", 2, *extra, timeout=120)
    ours, theirs = results[0]
    assert all(r == results[0] for r in results), results
    diffs = [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
    assert max(diffs) < 1e-6, (ours, theirs)


def _bf16(rank, world, run_dir, *extra):
    cfg = run_config(run_dir, 2, *extra)
    fp32 = MegatronTraining(cfg, 2)
    fp32_losses = [fp32.step(s) for s in range(1, STEPS + 1)]
    bf16 = MegatronTraining(cfg, 2, bf16=True)
    bf16_losses = [bf16.step(s) for s in range(1, STEPS + 1)]
    dtypes = sorted({str(p.dtype) for p in bf16.gpt.parameters()})
    bias = [str(r.expert_bias.dtype) for r in bf16.gpt.modules() if hasattr(r, "expert_bias")]
    return fp32_losses, bf16_losses, dtypes, bias


def test_float16_module_bf16_follows_the_fp32_run(tmp_path):
    fp32, bf16, dtypes, bias = run_distributed(_bf16, 2, tmp_path / "run", timeout=120)[0]
    assert dtypes == ["torch.bfloat16"]
    assert bias and set(bias) == {"torch.float32"}  # the routers' expert bias stays fp32 under Float16Module
    diffs = [abs(a - b) for a, b in zip(fp32, bf16, strict=True)]
    assert max(diffs) < 5e-3, (fp32, bf16)  # bf16 matmuls, fp32 loss and master weights: 3.3e-4 measured


# model.fp8 at the smallest dims FP8 tiles (multiples of 128), on the reference backend (CPU)
FP8 = ('model.dtype="bfloat16"', "model.dim=128", "model.moe.moe_inter_dim=128", "model.dense_inter_dim=256",
       "model.mla.q_lora_rank=128", "model.mla.kv_lora_rank=128", 'model.fp8.backend="reference"')


def _fp8(rank, world, run_dir):
    from spartron.layers.fp8.modules import FP8FeedForward, FP8GroupedExperts, FP8Linear

    cfg = run_config(run_dir, 2, *FP8)
    ours = spartron_losses(cfg)
    run = MegatronTraining(cfg, 2, bf16=True)
    fp8_modules = sorted({type(m).__name__ for m in run.gpt.modules()
                          if isinstance(m, (FP8Linear, FP8GroupedExperts, FP8FeedForward))})
    return ours, [run.step(s) for s in range(1, STEPS + 1)], run.gpt.config.fp8, run.gpt.config.fp8_recipe, fp8_modules


def test_megatron_blockwise_fp8_training_follows_spartrons_fp8_trainer(tmp_path):
    """Megatron's fp8 = 'e4m3', fp8_recipe = 'blockwise' (from model.fp8) under Float16Module and Megatron's DDP
    runs Spartron's FP8 layers: the first step's loss equals the Trainer's FP8 run, later steps follow it (Megatron
    keeps fp32 main weights, the bf16 Trainer bf16 ones: 1.1e-3 measured)."""
    ours, theirs, fp8, recipe, modules = run_distributed(_fp8, 2, tmp_path / "run", timeout=300)[0]
    assert (fp8, recipe, modules) == ("e4m3", "blockwise", ["FP8FeedForward", "FP8GroupedExperts", "FP8Linear"])
    assert abs(ours[0] - theirs[0]) < 1e-5, (ours, theirs)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 3e-3, (ours, theirs)


def _distributed_optimizer(rank, world, run_dir, *extra):
    cfg = run_config(run_dir, 2, "train.grad_clip=0.05", *extra)  # clips every step: one norm over all shards
    ours = spartron_losses(cfg)
    run = MegatronTraining(cfg, 2, distributed_optimizer=True)
    return ours, [run.step(s) for s in range(1, STEPS + 1)]


def test_megatron_distributed_optimizer_matches_spartron_trainer(tmp_path):
    """Megatron's distributed optimizer (sharded fp32 state, reduce-scatter / all-gather of the buffers) and its
    gradient clipping (one norm over dense and expert shards, as Spartron's global_grad_norm)."""
    ours, theirs = run_distributed(_distributed_optimizer, 2, tmp_path / "run", timeout=120)[0]
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-6, (ours, theirs)


def _pipeline_on_gloo(rank, world):
    """Megatron's 1F1B schedule over 2 stages of a toy model: its p2p works on gloo (evidence for PP support)."""
    from cpu_shim import cpu_megatron  # next to this file
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, pipeline_model_parallel_size=2,
                            pipeline_dtype=torch.float32)
    first = parallel_state.is_pipeline_first_stage()

    class Stage(MegatronModule):
        def __init__(self):
            super().__init__(cfg)
            self.model_type = ModelType.encoder_or_decoder
            self.lin = torch.nn.Linear(16, 16)
            self.received = None

        def set_input_tensor(self, tensors):
            self.received = tensors[0]

        def forward(self, x):
            return torch.tanh(self.lin(x if first else self.received))

    torch.manual_seed(rank)
    stage = Stage()
    xs = [torch.randn(8, 1, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def forward_step(data_iterator, model):
        return model(next(data_iterator)), lambda out: (out.square().mean(), {"loss": out.square().mean().detach()})

    with cpu_megatron():
        out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(xs), model=[stage],
                                          num_microbatches=4, seq_length=8, micro_batch_size=1)
    return [o["loss"].item() for o in out], {k: (p.detach(), p.grad) for k, p in stage.lin.named_parameters()}, xs


def test_megatron_pipeline_schedule_p2p_works_on_gloo():
    (none, first, xs), (losses, last, _) = run_distributed(_pipeline_on_gloo, 2, timeout=120)
    assert none == []  # only the last stage computes the loss
    lin0, lin1 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    lin0.load_state_dict({k: value for k, (value, _) in first.items()})
    lin1.load_state_dict({k: value for k, (value, _) in last.items()})
    expected = []
    for x in xs:  # the same two layers in one process; the schedule averages over micro-batches
        loss = torch.tanh(lin1(torch.tanh(lin0(x)))).square().mean()
        (loss / len(xs)).backward()
        expected.append(loss.item())
    assert losses == expected
    for mine, theirs in ((first, lin0), (last, lin1)):
        assert all(torch.equal(mine[k][1], p.grad) for k, p in theirs.named_parameters())


def test_spartron_spec_refuses_pipeline_parallelism_and_says_why():
    from spartron.interop.megatron import MegatronConfigError, megatron_config_from_spartron

    cfg = run_config(Path("unused"), 1).model
    with pytest.raises(MegatronConfigError) as info:
        megatron_config_from_spartron(cfg, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    assert ("pipeline_model_parallel_size=2: must be one of [1] (DSA ids and the SideChannel do not cross "
            "pipeline stages)") in str(info.value)


OVERLAP = {"overlap_grad_reduce": True, "overlap_param_gather": True, "bucket_size": 8192}


def _overlapped(rank, world, run_dir):
    from spartron.layers.attention.mla import MLA

    cfg = run_config(run_dir, 1)  # tiny.toml's DSA layers keep a frozen indexer
    plain = MegatronTraining(cfg, 1, distributed_optimizer=True)
    plain_losses = [plain.step(s) for s in range(1, STEPS + 1)]
    run = MegatronTraining(cfg, 1, distributed_optimizer=True, ddp=OVERLAP)
    dsa = [m for m in run.gpt.modules() if isinstance(m, MLA) and m.dsa_role is not None]
    pending = []

    def check_gathered(mla, args):  # noqa: ANN001, ANN202 - runs after the adapter readied wkv_b's bucket
        group = run.model.param_to_bucket_group[mla.wkv_b.weight]
        pending.append(group.param_gather_handle is not None)

    for m in dsa:
        m.register_forward_pre_hook(check_gathered)
    frozen = {n: p.detach().clone() for m in dsa if m.indexer is not None for n, p in m.indexer.named_parameters()}
    losses = [run.step(s) for s in range(1, STEPS + 1)]
    after = {n: p for m in dsa if m.indexer is not None for n, p in m.indexer.named_parameters()}
    return plain_losses, losses, pending, len(dsa), frozen, after


def test_overlapped_param_gather_and_grad_reduce_train_as_the_plain_distributed_optimizer(tmp_path):
    """Megatron waits for a bucket's parameter all-gather in the forward pre-hook of a module owning one of its
    weights; a DSA layer reads wkv_b's weight (absorbed) without calling wkv_b, so the adapter runs its hooks
    first: at every DSA attention the bucket is gathered (with a bucket of 8192 elements wkv_b's bucket holds no
    weight of a module called earlier: its read raced the all-gather). The frozen indexer is no trainable
    parameter: the overlapped reduction does not wait for its gradient, and Megatron's AdamW does not decay it."""
    plain, losses, pending, n_dsa, frozen, after = run_distributed(_overlapped, 2, tmp_path / "run", timeout=300)[0]
    assert n_dsa == 2 and len(pending) == n_dsa * STEPS * 2  # 2 micro-batches a step
    assert not any(pending)
    assert losses == plain, (losses, plain)
    assert frozen and all(torch.equal(after[n], v) for n, v in frozen.items())


CHAT_TARGETS = (0, 3, 16, 9)  # the step's 4 samples: targets on their last n positions (sample 0 is all prompt)


def _chat_step(rank, world, run_dir, micro_batch):
    """One step of MegatronTraining on a fixed chat-like global batch (4 samples of 16 tokens, rank r holding
    samples r, r + world, ...), `micro_batch` samples per micro-batch: (the step's loss, every parameter's
    gradient after Megatron's reductions, and on 1 rank the token mean computed by hand before the step)."""
    from spartron.runtime.data import Batch

    cfg = run_config(run_dir, 1, f"train.micro_batch_size={micro_batch}")
    run = MegatronTraining(cfg, 1)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.train.seq_len + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    for i, n in enumerate(CHAT_TARGETS):
        labels[i, :cfg.train.seq_len - n] = -100
    by_hand = None
    if world == 1:  # every sample's per-token loss from the same weights; the targets' mean
        run.gpt.eval()  # no router counts (the expert-bias update reads them); the same logits
        with torch.no_grad():
            per_token = run.gpt(inputs, None, None, labels=labels.clamp(min=0)).float()
        run.gpt.train()
        by_hand = float((per_token * (labels != -100)).sum() / (labels != -100).sum())
    mine = list(range(rank, 4, world))
    batches = [Batch(inputs[mine[i:i + micro_batch]], labels[mine[i:i + micro_batch]])
               for i in range(0, len(mine), micro_batch)]
    assert len(batches) == run.n_micro
    loss = run.step(1, iter(batches))
    return loss, {n: p.main_grad.clone() for n, p in run.gpt.named_parameters() if p.requires_grad}, by_hand


def test_megatron_step_is_the_token_mean_in_every_micro_batch_layout(tmp_path):
    """A mean of micro-batch means (the example before) weighed the all-prompt sample's micro-batch like a full
    one: the loss and gradient changed with the layout. Now 4 micro-batches of 1 sample, one of 4, and 2 ranks
    x 2 micro-batches give the same loss, equal to the token mean by hand, and the same gradients."""
    split = run_distributed(_chat_step, 1, tmp_path / "a", 1, timeout=180)[0]
    whole = run_distributed(_chat_step, 1, tmp_path / "b", 4, timeout=180)[0]
    ranks = run_distributed(_chat_step, 2, tmp_path / "c", 1, timeout=180)
    loss, grads, by_hand = split
    assert by_hand > 1 and loss == pytest.approx(by_hand, rel=1e-6)
    for other in (whole, *ranks):
        assert other[0] == pytest.approx(by_hand, rel=1e-6)
        assert sorted(other[1]) == sorted(grads)
        for name, grad in grads.items():  # float rounding of other summation orders: ~1e-7 of the largest
            assert float((other[1][name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()), name
    assert max(float(g.abs().max()) for g in grads.values()) > 1e-3  # not a vacuous comparison
