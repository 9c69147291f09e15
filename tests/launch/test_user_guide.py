"""The user guide's path started from a Hugging Face checkpoint, on CPU: tokenize a folder of jsonl
(`spartron data`), take the checkpoint's `[model]` from `spartron convert --from-hf` and start from it with
`train.init_from`, train with evaluation every 2 steps and TensorBoard, save, resume, export (`spartron
convert --to-hf`), and `transformers` loads the export and computes the validation loss that `spartron eval`
reports for the same step. (The README's own commands, from the tiny-hf preset, run as printed in
tests/launch/test_readme_commands.py.)"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from spartron.launch.cli import main
from spartron.runtime.config import load_config
from spartron.runtime.data import build_eval_loader
from spartron.runtime.metrics import read_metrics
from spartron.runtime.trainer import evaluate_saved, train
from spartron.testing import run_distributed

WORDS = "the cat sat on a mat and dog ran to big red house we saw it in park why not yes no".split()


def _tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    tok.save(str(path))
    return path


def _corpus(folder):
    folder.mkdir()
    for part in range(2):
        docs = [" ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(6 + i % 17)) for i in range(part, 40, 2)]
        (folder / f"part-{part}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return folder


def _train(rank, world, cfg):
    result = train(cfg)
    return result.resumed_from, [r["step"] for r in result.records]


def _evaluate(rank, world, cfg, path):
    return evaluate_saved(cfg, path)


def test_user_guide_from_a_hugging_face_checkpoint(tmp_path, capsys):
    # a Hugging Face checkpoint (here a tiny random one saved by transformers itself)
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=32, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=16,
        q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=1, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64))
    hf.save_pretrained(tmp_path / "hf")

    # spartron data CORPUS --tokenizer tokenizer.json --out DIR
    tok = _tokenizer(tmp_path / "tokenizer.json")
    assert main(["data", str(_corpus(tmp_path / "corpus")), "--tokenizer", str(tok), "--out", str(tmp_path / "tokens"),
                 "--eos", "<eos>"]) == 0
    run_dir = tmp_path / "runs" / "mine"
    # spartron convert --from-hf DIR --to RUN_DIR: also writes the checkpoint's [model] section
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "imported")]) == 0
    config, init_from = (tmp_path / "imported" / "model.toml").read_text(), f"hf:{tmp_path / 'hf'}"
    (tmp_path / "run.toml").write_text(config + f"""
[train]
steps = 2
seq_len = 16
global_batch_size = 2
save_every = 2
eval_every = 2
eval_steps = 2
progress = false
peak_tflops = 1.0
run_dir = {json.dumps(str(run_dir))}
init_from = {json.dumps(init_from)}

[train.data]
kind = "packed"
path = {json.dumps(str(tmp_path / "tokens"))}
val_fraction = 0.2
doc_mask = false

[observe]
tensorboard = true
""")
    capsys.readouterr()
    cfg = load_config(tmp_path / "run.toml")
    assert run_distributed(_train, 1, cfg, timeout=120) == [(None, [1, 2])]
    more = load_config(tmp_path / "run.toml", ["train.steps=4"])  # resume: steps 3 and 4
    assert run_distributed(_train, 1, more, timeout=120) == [(2, [3, 4])]
    _, steps = read_metrics(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps if s.get("val_loss") is not None] == [2, 4]
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith("step-")) == ["step-00000002", "step-00000004"]
    assert any((run_dir / "tensorboard").iterdir())

    # spartron convert --from RUN_DIR --to-hf DIR: transformers loads it; its loss on the held-out batches is
    # the validation loss spartron eval reports for that step (and the run logged)
    assert main(["convert", "--from", str(run_dir), "--to-hf", str(tmp_path / "export")]) == 0
    (result,) = run_distributed(_evaluate, 1, more, run_dir, timeout=120)
    assert result["step"] == 4 and result["val_loss"] == steps[-1]["val_loss"]
    exported = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "export").eval()
    loader, total, targets = build_eval_loader(more, 0, 1), 0.0, 0
    with torch.no_grad():
        for _ in range(2 * 2):  # eval_steps x global_batch_size micro-batches of one sequence
            batch = loader.next(1)
            logits = exported(batch.tokens).logits
            total += float(F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100,
                                           reduction="sum"))
            targets += int((batch.labels != -100).sum())
    assert result["val_tokens"] == targets
    assert abs(total / targets - result["val_loss"]) < 1e-5  # the held-out token mean
