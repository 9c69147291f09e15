"""The training engine on real gloo ranks, with a small causal LM defined here that implements the
trainer's model protocol (the reference model is tested against the trainer in its own tests).

Run as a script, this file is one training rank (used for the kill -9 and failing-rank tests):
    python tests/runtime/test_trainer.py CONFIG [--sleep S] [--fail-rank R --fail-step N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from spartron.layers.outputs import ModelOutput
from spartron.runtime.config import config_from_dict, dump_config
from spartron.runtime.metrics import read_metrics
from spartron.runtime.optim import lr_at
from spartron.runtime.state import COMPLETE, latest_complete_step
from spartron.runtime.trainer import TrainableModel, TrainingError, train
from spartron.testing import DistributedTestError, run_distributed, sigkill_when_exists

N_EXPERTS = 4


class TinyCausalLM(nn.Module):
    """Embedding -> previous-token mixing -> top-1 routed expert MLP with an aux-loss-free bias -> head.

    Dropout makes the forward consume the RNG, so resume tests check the RNG state is restored.
    The `fail_*`, `sleep_s` and `nan_at_step` knobs inject real failures / slowness for the tests.
    """

    def __init__(self, vocab: int, dim: int, sleep_s: float = 0.0, fail_rank: int | None = None,
                 fail_step: int | None = None, nan_at_step: int | None = None, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(2 * dim, dim)
        self.router = nn.Linear(dim, N_EXPERTS, bias=False)
        self.experts = nn.Parameter(torch.randn(N_EXPERTS, dim, dim) * dim**-0.5)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("expert_bias", torch.zeros(N_EXPERTS))
        self.register_buffer("step_counts", torch.zeros(N_EXPERTS, dtype=torch.int64), persistent=False)
        self.sleep_s, self.fail_rank, self.fail_step = sleep_s, fail_rank, fail_step
        self.nan_at_step = nan_at_step
        self.steps_done = 0

    def forward(self, tokens, labels) -> ModelOutput:
        step = self.steps_done + 1
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if self.fail_step == step and dist.get_rank() == self.fail_rank:
            raise RuntimeError(f"injected failure on rank {self.fail_rank}")
        h = self.embed(tokens)
        prev = F.pad(h, (0, 0, 1, 0))[:, :-1]
        h = h + torch.tanh(self.mix(torch.cat([h, prev], dim=-1)))
        logits = self.router(h)
        ids = (logits.detach() + self.expert_bias).argmax(-1)
        gate = torch.sigmoid(logits.gather(-1, ids[..., None]))
        h = h + gate * torch.einsum("bsd,bsde->bse", h, self.experts[ids])
        counts = torch.bincount(ids.flatten(), minlength=N_EXPERTS)
        self.step_counts += counts
        lm_loss = F.cross_entropy(self.head(self.dropout(self.norm(h))).flatten(0, 1), labels.flatten())
        if self.nan_at_step == step:
            lm_loss = lm_loss * float("nan")
        return ModelOutput(loss=lm_loss, lm_loss=lm_loss, mtp_losses=[], aux_loss=None, indexer_loss=None,
                           tokens_per_expert=counts[None])

    def ep_sharded_parameters(self):
        return []  # every rank holds all experts

    @torch.no_grad()
    def update_expert_bias(self, group) -> None:
        counts = self.step_counts.clone()
        dist.all_reduce(counts, group=group)
        self.expert_bias += 1e-2 * torch.sign(counts.float().mean() - counts.float())
        self.step_counts.zero_()
        self.steps_done += 1


@dataclass
class TinyFactory:
    sleep_s: float = 0.0
    fail_rank: int | None = None
    fail_step: int | None = None
    nan_at_step: int | None = None
    dropout: float = 0.1

    def __call__(self, cfg, groups):
        from torch.distributed.fsdp import fully_shard

        model = TinyCausalLM(cfg.model.vocab_size, cfg.model.dim, self.sleep_s, self.fail_rank,
                             self.fail_step, self.nan_at_step, self.dropout)
        if groups.size("world") > 1:
            fully_shard(model.mix, mesh=groups.fsdp_mesh)
            fully_shard(model, mesh=groups.fsdp_mesh)
        return model


def make_cfg(run_dir, **train) -> object:
    base = {"steps": 4, "seq_len": 16, "global_batch_size": 4, "micro_batch_size": 1, "lr": 3e-2,
            "warmup_steps": 1, "progress": False, "run_dir": str(run_dir), "peak_tflops": 1.0}
    base.update(train)
    par = base.pop("parallel", {})
    return config_from_dict({"name": "t", "device": "cpu", "model": {"vocab_size": 64, "dim": 16},
                             "parallel": {"timeout_s": 20.0, **par}, "train": base})


def _train(rank, world, cfg, factory=None):
    result = train(cfg, factory or TinyFactory())
    return [(r["step"], r["loss"], r["grad_norm"], r["expert_load_max_violation"]) for r in result.records]


def test_tiny_model_satisfies_protocol():
    assert isinstance(TinyCausalLM(8, 4), TrainableModel)


def test_one_rank_trains_and_writes_metrics(tmp_path):
    cfg = make_cfg(tmp_path / "run", steps=6)
    (records,) = run_distributed(_train, 1, cfg)
    assert [r[0] for r in records] == list(range(1, 7))
    assert records[-1][1] < records[0][1]  # it learns the synthetic progressions
    headers, steps = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(headers) == 1 and headers[0]["deterministic"] is True
    assert headers[0]["config_toml"] == dump_config(cfg)
    assert {"python", "torch"} <= set(headers[0]["versions"]) and headers[0]["hardware"]["world_size"] == 1
    for rec, (step, loss, gnorm, violation) in zip(steps, records, strict=True):
        assert (rec["step"], rec["loss"], rec["grad_norm"]) == (step, loss, gnorm)
        assert rec["lr"] == lr_at(step, cfg.train)
        assert rec["tokens"] == step * 4 * 16 and rec["tokens_per_s"] > 0
        assert rec["tokens_per_s_per_gpu"] == rec["tokens_per_s"]
        assert rec["peak_memory_allocated_bytes"] > 0 and rec["mfu"] > 0 and violation >= 0


def test_four_ranks_ep2_cp2_match_one_rank(tmp_path):
    """Same global batch on 1 rank (4 micro-steps) and on EP2 x CP2 x FSDP2 (2 dp ranks x 2 micro-steps)."""
    no_dropout = TinyFactory(dropout=0.0)  # dropout masks depend on which rank draws them
    one = run_distributed(_train, 1, make_cfg(tmp_path / "a", global_batch_size=4), no_dropout)[0]
    four = run_distributed(_train, 4, make_cfg(tmp_path / "b", global_batch_size=4,
                                               parallel={"cp": 2, "ep": 2}), no_dropout)
    for rank_records in four:
        assert rank_records == four[0]  # every rank reports the same all-reduced values
    for (s1, l1, g1, v1), (s4, l4, g4, v4) in zip(one, four[0], strict=True):
        assert s1 == s4
        assert l4 == pytest.approx(l1, rel=1e-5) and g4 == pytest.approx(g1, rel=1e-4)
        assert v4 == pytest.approx(v1)  # CP ranks count the same tokens twice: the ratio is unchanged


@dataclass
class KeepingFactory(TinyFactory):
    """Remembers the model it built, so a test can look at its gradients after training."""

    built: list = None  # type: ignore[assignment]

    def __call__(self, cfg, groups):
        model = super().__call__(cfg, groups)
        self.built.append(model)
        return model


def _train_and_grads(rank, world, cfg):
    factory = KeepingFactory(dropout=0.0, built=[])
    records = _train(rank, world, cfg, factory)
    grads = [p.grad for p in factory.built[0].parameters() if p.requires_grad]
    if any(g is None for g in grads):
        return records, None
    return records, float(sum(g.full_tensor().abs().sum() if hasattr(g, "full_tensor") else g.abs().sum()
                              for g in grads))


def test_keep_grad_buffers_zeroes_in_place_and_trains_identically(tmp_path):
    """train.keep_grad_buffers: after each step the gradients stay allocated (zeroed), and every step's
    loss and grad norm equal the default run's (which frees them) exactly, on 2 FSDP ranks."""
    freed = run_distributed(_train_and_grads, 2, make_cfg(tmp_path / "a"))
    kept = run_distributed(_train_and_grads, 2, make_cfg(tmp_path / "b", keep_grad_buffers=True))
    for (rec_freed, grads_freed), (rec_kept, grads_kept) in zip(freed, kept, strict=True):
        assert rec_kept == rec_freed
        assert grads_freed is None  # set to None after the last step
        assert grads_kept == 0.0  # allocated and zeroed


def test_nan_loss_is_reported_with_its_step(tmp_path):
    with pytest.raises(DistributedTestError, match="non-finite values at step 3: loss nan"):
        run_distributed(_train, 2, make_cfg(tmp_path / "r", steps=4), TinyFactory(nan_at_step=3))


def test_batch_not_divisible_is_a_config_error_on_every_rank(tmp_path):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_train, 4, make_cfg(tmp_path / "r", global_batch_size=6))
    text = str(info.value)
    assert "4 of 4 ranks failed" in text
    assert text.count("train.global_batch_size 6 must be divisible by dp size 4") == 4


def _crash_at_step_4(tmp_dir: Path) -> None:
    if tmp_dir.name.endswith("step-00000004"):
        raise OSError("disk full (injected while saving step 4)")


def _train_with_hook(rank, world, cfg):
    try:
        train(cfg, TinyFactory(), before_commit=_crash_at_step_4)
    except TrainingError as err:
        return str(err)
    return "no error"


def test_crash_during_save_keeps_previous_state_loadable(tmp_path):
    run = tmp_path / "run"
    errors = run_distributed(_train_with_hook, 2, make_cfg(run, steps=5, save_every=2))
    assert all("failed at step 4" in e and "disk full" in e for e in errors)
    assert latest_complete_step(run) == 2
    assert (run / ".tmp-step-00000004").is_dir() and not (run / ".tmp-step-00000004" / COMPLETE).exists()
    assert not (run / "step-00000004").exists()
    resumed = run_distributed(_train, 2, make_cfg(run, steps=5, save_every=2))[0]
    fresh = run_distributed(_train, 2, make_cfg(tmp_path / "fresh", steps=5))[0]
    assert [r[0] for r in resumed] == [3, 4, 5]
    assert resumed == fresh[2:]  # bitwise: losses, grad norms, expert load


def _spawn_rank(cfg_path: Path, rank: int, world: int, port: int, *extra: str) -> subprocess.Popen:
    env = dict(os.environ)
    if world > 1:
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
    return subprocess.Popen([sys.executable, __file__, str(cfg_path), *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_kill9_mid_run_then_resume_matches_uninterrupted_bitwise(tmp_path):
    cfg = make_cfg(tmp_path / "run", steps=8, save_every=2, global_batch_size=2)
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(dump_config(cfg))
    proc = _spawn_rank(cfg_path, 0, 1, 0, "--sleep", "0.15")
    sigkill_when_exists(proc, tmp_path / "run" / "step-00000004" / COMPLETE, timeout=60)

    resumed = run_distributed(_train, 1, cfg)[0]
    assert resumed[0][0] in (5, 7)  # resumed after the last complete save
    uninterrupted = run_distributed(_train, 1, make_cfg(tmp_path / "ref", steps=8, global_batch_size=2))[0]
    _, trace = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in trace] == [r[:3] for r in uninterrupted]


def test_a_rank_raising_at_step_3_ends_every_rank_nonzero_within_the_timeout(tmp_path, master_port):
    cfg = make_cfg(tmp_path / "run", steps=6, parallel={"timeout_s": 4.0})
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(dump_config(cfg))
    start = time.monotonic()
    procs = [_spawn_rank(cfg_path, r, 2, master_port, "--fail-rank", "1", "--fail-step", "3") for r in range(2)]
    outputs = [p.communicate(timeout=60) for p in procs]
    elapsed = time.monotonic() - start
    assert [p.returncode for p in procs] == [1, 1]
    assert elapsed < 40
    failing = outputs[1][1]
    assert "[spartron rank 1] training failed" in failing
    assert "rank 1 failed at step 3: RuntimeError: injected failure on rank 1" in failing
    assert "Traceback" in failing
    assert "[spartron rank 0] training failed" in outputs[0][1]


if __name__ == "__main__":
    from spartron.launch.process import exit_process
    from spartron.launch.rank import main

    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--fail-step", type=int, default=None)
    args = parser.parse_args()
    exit_process(main([args.config], TinyFactory(args.sleep, args.fail_rank, args.fail_step)))
