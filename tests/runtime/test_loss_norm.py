"""A step's loss is the exact token mean of all its micro-batches (spartron.runtime.loss_norm): on chat data a
window can be all prompt (no target), and a mean of micro-batch means weighed such a window like a full one: the
same global batch gave half the loss and half the gradient with one sample per micro-batch (the outside audit's
repro). The step's loss, its gradient norm and the validation loss are now the same in every layout, and equal
the token mean computed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spartron.runtime.config import load_config
from spartron.runtime.evaluate import Evaluator
from spartron.runtime.trainer import Trainer
from spartron.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    """60 chats, long prompts with short answers and the reverse: 32-token windows that are all prompt."""
    from spartron.data import prepare_corpus

    work = tmp_path_factory.mktemp("chats")
    rows = [{"messages": [{"role": "user", "content": "please explain the data path " * (1 + 6 * (i % 2))},
                          {"role": "assistant", "content": "the loader reads windows " * (1 + 6 * ((i + 1) % 2))}]}
            for i in range(60)]
    (work / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_corpus(work / "chat.jsonl", ROOT / "examples" / "tokenizer.json", work / "tok", eos_token="<eos>")
    return work / "tok"


def _layout(rank, world, tok: str, micro_batch: int, run_dir: str):
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        "model.n_layers=2", "model.mtp.depth=1", "train.seq_len=32", "train.global_batch_size=2",
        f"train.micro_batch_size={micro_batch}", "train.progress=false", "train.peak_tflops=1.0",
        "train.warmup_steps=1", "train.lr=1e-2", "ac.mode='none'", "train.steps=1", "train.eval_steps=2",
        "train.data.kind='packed'", f"train.data.path={json.dumps(tok)}", "train.data.val_fraction=0.3",
        f"train.run_dir={json.dumps(run_dir)}"])
    trainer = Trainer(cfg).setup()
    evaluator = Evaluator(cfg, trainer.groups.rank_in("dp"), trainer.groups.size("dp"), trainer.n_micro,
                          trainer.groups.dp_cp, trainer.device)
    val = evaluator.run(trainer.model)["val_loss"]
    # by hand, the first step's training samples on one rank: each one's token mean, weighed by its targets
    by_hand = None
    if world == 1:
        from spartron.runtime.data import build_train_loader

        loader, means = build_train_loader(cfg, 0, 1), []
        with torch.no_grad():
            for _ in range(2):
                batch = loader.next(1)
                out = trainer.model(batch.tokens, batch.labels, **batch.model_kwargs(trainer.device))
                means.append((float(out["lm_loss"]), int((batch.labels != -100).sum())))
        by_hand = means
    record = trainer.step()
    trainer.close()
    return val, record["lm_loss"], record["loss"], record["grad_norm"], by_hand


def test_loss_gradient_and_val_loss_are_the_token_mean_in_every_layout(chats, tmp_path):
    one = run_distributed(_layout, 1, str(chats), 1, str(tmp_path / "a"), timeout=240)[0]
    two = run_distributed(_layout, 1, str(chats), 2, str(tmp_path / "b"), timeout=240)[0]
    ranks = run_distributed(_layout, 2, str(chats), 1, str(tmp_path / "c"), timeout=240)
    means = one[4]
    assert min(count for _, count in means) == 0 < max(count for _, count in means)  # a window without targets
    token_mean = sum(m * c for m, c in means) / sum(c for _, c in means)
    assert one[1] == pytest.approx(token_mean, rel=1e-6)  # the step's LM loss: the token mean of its 2 samples
    assert abs(one[1] - sum(m for m, _ in means) / 2) > 1  # not the mean of the two means (one is 0)
    for other in (two, ranks[0], ranks[1]):
        for mine, theirs in zip(one[:4], other[:4], strict=True):
            assert theirs == pytest.approx(mine, rel=1e-5)
