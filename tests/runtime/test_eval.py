"""Evaluation (train.eval_every / eval_steps, spartron.runtime.evaluate) on the reference model, on real
gloo ranks: the logged validation loss is the held-out set's LM token mean (not a mean of batch means), an
evaluation changes nothing the training sees (every step's loss and grad norm equal a run without it, RNG and
buffers restored), the value does not depend on the layout, and `spartron eval` recomputes it from a saved
step."""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pytest
import torch

from spartron.launch.cli import main
from spartron.runtime.config import ConfigError, load_config
from spartron.runtime.data import build_eval_loader
from spartron.runtime.evaluate import Evaluator
from spartron.runtime.metrics import read_metrics
from spartron.runtime.state import StateLoadError
from spartron.runtime.trainer import Trainer, evaluate_saved, train
from spartron.testing import run_distributed

SMALL = ["model.n_layers=2", "model.mtp.depth=1", "train.seq_len=16", "train.global_batch_size=2",
         "train.progress=false", "train.peak_tflops=1.0", "train.warmup_steps=1", "train.lr=1e-2",
         "ac.mode='none'"]


def small_cfg(run_dir, *overrides):
    return load_config("configs/tiny.toml", [*SMALL, f"train.run_dir={json.dumps(str(run_dir))}", *overrides])


def _train_records(rank, world, cfg):
    return [{k: r.get(k) for k in ("step", "loss", "grad_norm", "val_loss", "val_ppl", "val_tokens")}
            for r in train(cfg).records]


def _steps_then_manual_eval(rank, world, cfg):
    trainer = Trainer(cfg).setup()
    records = [trainer.step() for _ in range(cfg.train.steps)]
    model, loader = trainer.model, build_eval_loader(cfg, 0, 1)
    rng = torch.get_rng_state()
    bias = [b.clone() for n, b in model.named_buffers()]
    again = Evaluator(cfg, 0, 1, trainer.n_micro, trainer.groups.dp_cp, trainer.device).run(model)
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    assert all(torch.equal(a, b) for a, b in zip(bias, [b for _, b in model.named_buffers()], strict=True))
    total, targets, means = 0.0, 0, []
    with torch.no_grad():
        model.eval()
        for _ in range(cfg.train.eval_steps * trainer.n_micro):  # each batch's token mean, weighed by its targets
            batch = loader.next(cfg.train.micro_batch_size)
            mean = float(model(batch.tokens, batch.labels, **batch.model_kwargs(trainer.device))["lm_loss"].double())
            count = int((batch.labels != -100).sum())
            total, targets = total + mean * count, targets + count
            means.append(mean)
        model.train()
    trainer.close()
    return records, again, total / targets, sum(means) / len(means), targets


def _packed_text(tmp_path) -> list[str]:
    """A token folder of 30 short documents (spartron.data), as packed-data overrides with documents masked."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from spartron.data import prepare_corpus

    words = "a b c d e f g h i j k l".split()
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    tok.save(str(tmp_path / "tok.json"))
    docs = [" ".join(words[(i + j * 5) % 12] for j in range(3 + i % 9)) for i in range(30)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare_corpus(tmp_path / "c.jsonl", tmp_path / "tok.json", tmp_path / "tokens", eos_token="<eos>")
    return ["train.data.kind='packed'", f"train.data.path={json.dumps(str(tmp_path / 'tokens'))}",
            "train.data.val_fraction=0.3"]


@pytest.mark.parametrize("data", ["synthetic", "packed documents"])
def test_val_loss_is_the_heldout_mean_lm_loss(tmp_path, data):
    extra = _packed_text(tmp_path) if data != "synthetic" else []
    cfg = small_cfg(tmp_path / "r", "train.steps=2", "train.eval_every=2", "train.eval_steps=2", *extra)
    assert cfg.train.data.documents == (data != "synthetic")
    records, again, manual, mean_of_means, targets = run_distributed(_steps_then_manual_eval, 1, cfg,
                                                                     timeout=120)[0]
    assert "val_loss" not in records[0]
    last = records[-1]
    # the held-out token mean (float32 shares of it, summed: 1e-7 from the float64 sum of batch means x counts)
    assert last["val_loss"] == again["val_loss"] == pytest.approx(manual, rel=1e-6)
    if data != "synthetic":  # documents end inside batches: their target counts differ, and so do the two means
        assert abs(mean_of_means - manual) > 1e-4, (mean_of_means, manual)
    assert last["val_ppl"] == math.exp(last["val_loss"])
    assert last["val_tokens"] == targets  # the LM targets evaluated: every token of synthetic rows
    assert (targets == 2 * 2 * 16) == (data == "synthetic")  # eval_steps x global_batch_size x seq_len


def test_evaluation_changes_nothing_training_sees_and_is_layout_free(tmp_path):
    plain = run_distributed(_train_records, 1, small_cfg(tmp_path / "a", "train.steps=3"), timeout=120)[0]
    evald = run_distributed(_train_records, 1, small_cfg(tmp_path / "b", "train.steps=3", "train.eval_every=1"),
                            timeout=120)[0]
    assert [(r["loss"], r["grad_norm"]) for r in evald] == [(r["loss"], r["grad_norm"]) for r in plain]
    assert all(r["val_loss"] is not None for r in evald) and all(r["val_loss"] is None for r in plain)
    two = run_distributed(_train_records, 2, small_cfg(tmp_path / "c", "train.steps=3", "train.eval_every=1"),
                          timeout=120)
    assert two[0] == two[1]
    for one, other in zip(evald, two[0], strict=True):
        assert other["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
    _, steps = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [s["val_loss"] for s in steps] == [r["val_loss"] for r in evald]


def test_eval_at_multiples_and_the_last_step(tmp_path):
    records = run_distributed(_train_records, 1, small_cfg(tmp_path / "r", "train.steps=3", "train.eval_every=2"),
                              timeout=120)[0]
    assert [r["val_loss"] is not None for r in records] == [False, True, True]


def _evaluate_saved(rank, world, cfg, path):
    return evaluate_saved(cfg, path)


def test_evaluate_saved_recomputes_a_saved_steps_val_loss(tmp_path):
    cfg = small_cfg(tmp_path / "r", "train.steps=2", "train.eval_every=2", "train.save_every=2")
    logged = run_distributed(_train_records, 1, cfg, timeout=120)[0][-1]["val_loss"]
    result = run_distributed(_evaluate_saved, 1, cfg, tmp_path / "r", timeout=120)[0]
    assert result["val_loss"] == logged and result["step"] == 2
    assert result["path"] == str(tmp_path / "r" / "step-00000002")


def test_a_token_file_without_a_heldout_part_is_refused_at_setup(tmp_path):
    path = tmp_path / "tokens.bin"
    (np.arange(4096) % 512).astype(np.uint16).tofile(path)
    cfg = small_cfg(tmp_path / "r", "train.eval_every=1", "train.data.kind='mmap'",
                    f"train.data.path={json.dumps(str(path))}")
    with pytest.raises(ConfigError, match="train.data.val_fraction"):
        Evaluator(cfg, 0, 1, 2, None, torch.device("cpu"))


def test_a_held_out_split_an_evaluation_would_read_round_again_is_refused(tmp_path):
    """12 held-out samples read 80 times weighed 8 of them 7x and 4 of them 6x, and val_tokens said 2,560."""
    path = tmp_path / "tokens.bin"
    (np.arange(16 * 20 + 1) % 512).astype(np.uint16).tofile(path)  # 20 samples of 16 (+1), the last 4 held out
    data = ["train.data.kind='mmap'", f"train.data.path={json.dumps(str(path))}", "train.data.val_fraction=0.2"]
    Evaluator(small_cfg(tmp_path / "r", "train.eval_steps=2", *data), 0, 1, 2, None, torch.device("cpu"))  # 4 of 4
    with pytest.raises(ConfigError) as info:
        Evaluator(small_cfg(tmp_path / "r", "train.eval_steps=3", *data), 0, 1, 2, None, torch.device("cpu"))
    assert str(info.value) == (
        "an evaluation reads train.eval_steps = 3 x train.global_batch_size = 2 held-out samples, but the held-out "
        "split holds 4: some would be read twice and weigh double; lower train.eval_steps or raise "
        "train.data.val_fraction")


def _cli(rank, world, argv):
    """`spartron ...` in a rank of the test harness (its process group already up); (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


def test_spartron_eval_command(tmp_path):
    """`spartron eval CONFIG --step DIR` prints the JSON result of the run directory's newest step; a path
    holding no step is refused naming it (a StateLoadError: one line, exit 2, from the CLI)."""
    over = [*SMALL, "train.steps=2", "train.save_every=2", "train.eval_every=2",
            f"train.run_dir={json.dumps(str(tmp_path / 'r'))}"]
    cfg = load_config("configs/tiny.toml", over)
    logged = run_distributed(_train_records, 1, cfg, timeout=120)[0][-1]
    sets = [arg for item in over for arg in ("--set", item)]
    status, out, err = run_distributed(_cli, 1, ["eval", "configs/tiny.toml", *sets, "--step", str(tmp_path / "r")],
                                       timeout=120)[0]
    assert status == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["val_loss"] == logged["val_loss"] and result["val_tokens"] == 2 * 16
    assert (result["step"], result["path"]) == (2, str(tmp_path / "r" / "step-00000002"))
    assert err.strip().splitlines()[-1] == (f"spartron: {tmp_path / 'r' / 'step-00000002'} (step 2): validation "
                                            f"loss {result['val_loss']:.6g} (perplexity {result['val_ppl']:.6g}) over "
                                            "32 tokens of the held-out stream of synthetic data (train.seed 0), held "
                                            "out: never trained on")
    with pytest.raises(StateLoadError) as info:
        evaluate_saved(cfg, tmp_path / "nothing")
    assert str(info.value) == f"{tmp_path / 'nothing'}: neither a saved step nor a run directory holding one"
