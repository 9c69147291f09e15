"""End to end on CPU: `spartron data` tokenizes a folder of jsonl, the tiny preset trains on the packed
documents (document mask, DSA, MTP, selective AC), saves, and a resumed run continues bitwise."""

from __future__ import annotations

import json

from text_corpus import make_tokenizer, text_folder, write_jsonl  # next to this file

from spartron.launch.cli import main
from spartron.runtime.config import load_config
from spartron.runtime.trainer import train
from spartron.testing import run_distributed


def _losses(rank, world, cfg):  # noqa: ANN001, ARG001
    result = train(cfg)
    return result.resumed_from, [r["loss"] for r in result.records]


def test_tokenize_a_folder_train_the_tiny_preset_and_resume(tmp_path, capsys):
    tok = make_tokenizer(tmp_path / "tok" / "tokenizer.json")
    text_folder(tmp_path / "corpus", n_docs=50)
    write_jsonl(tmp_path / "corpus" / "sft.jsonl", [{"messages": [{"role": "user", "content": "what is two plus three"},
                                                                  {"role": "assistant", "content": "five"}]}] * 5)
    out = tmp_path / "tokens"
    assert main(["data", str(tmp_path / "corpus"), "--tokenizer", str(tok), "--out", str(out), "--eos", "<eos>"]) == 0
    meta = json.loads((out / "tokens.json").read_text())
    assert meta["n_documents"] == 55 and meta["loss_mask"] == "loss_mask.bin"
    assert capsys.readouterr().out.startswith(f"spartron: wrote {meta['n_tokens']} tokens (uint16) of 55 documents")

    base = ["train.data.kind=packed", f"train.data.path={out}", "train.data.val_fraction=0.1", "train.seq_len=32",
            "train.progress=false", "train.save_every=2"]
    full = load_config("configs/tiny.toml", [*base, "train.steps=4", f"train.run_dir={tmp_path / 'full'}"])
    (_, losses), = run_distributed(_losses, 1, full, timeout=120)
    first = load_config("configs/tiny.toml", [*base, "train.steps=2", f"train.run_dir={tmp_path / 'cut'}"])
    (_, head), = run_distributed(_losses, 1, first, timeout=120)
    resumed = load_config("configs/tiny.toml", [*base, "train.steps=4", f"train.run_dir={tmp_path / 'cut'}"])
    (start, tail), = run_distributed(_losses, 1, resumed, timeout=120)
    assert start == 2 and head + tail == losses  # the data position came back with the state: same batches
    assert losses[-1] < losses[0]
    saved = json.loads((tmp_path / "cut" / "step-00000002" / "rank-00000.json").read_text())["rank"]["data"]
    assert saved["position"] == 8 and saved["source"] == "packed:" + meta["tokenizer"]["sha256"][:16] + ":" + \
        f"{meta['n_tokens']}:55"


def test_spartron_data_errors_are_one_line(tmp_path, capsys):
    text_folder(tmp_path / "corpus", n_docs=2)
    assert main(["data", str(tmp_path / "corpus"), "--tokenizer", str(tmp_path / "none"), "--out",
                 str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (f"spartron: error: tokenizer {str(tmp_path / 'none')!r}: no tokenizer.json "
                                       "there (give the file or a folder saved by transformers' save_pretrained)\n")


def test_spartron_train_checks_the_data_before_spawning(tmp_path, capsys):
    tok = make_tokenizer(tmp_path / "tok" / "tokenizer.json")
    text_folder(tmp_path / "corpus", n_docs=20)
    out = tmp_path / "tokens"
    assert main(["data", str(tmp_path / "corpus"), "--tokenizer", str(tok), "--out", str(out), "--eos", "<eos>"]) == 0
    capsys.readouterr()
    base = ["train", "configs/tiny.toml", "--set", "train.data.kind=packed", "--set", f"train.run_dir={tmp_path / 'r'}"]
    assert main([*base, "--set", f"train.data.path={tmp_path / 'corpus'}"]) == 2
    assert capsys.readouterr().err == (f"spartron: error: train.data.path {str(tmp_path / 'corpus')!r} has no "
                                       "tokens.json (not written by `spartron data`, or not finished)\n")
    assert main([*base, "--set", f"train.data.path={out}", "--set", "train.eval_every=2"]) == 2
    assert capsys.readouterr().err == ("spartron: error: train.data.val_fraction = 0: no documents are held out for "
                                       "evaluation (set train.data.val_fraction, e.g. 0.01)\n")
    assert not (tmp_path / "r").exists()  # refused before any rank or run directory
