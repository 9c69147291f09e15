"""The data path's boundaries (outside audit of the data path): the mmap held-out split leaks no token into
training, blended sources are shuffled each in its own order, and a special token's string in corpus text is
text (control tokens only where the pipeline puts them). Exact values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from text_corpus import WORDS, make_tokenizer, write_jsonl  # next to this file

from spartron.data import open_token_folder, prepare_corpus
from spartron.data.corpus import Chat, Document
from spartron.data.tokenizer import load_tokenizer
from spartron.runtime.config import load_config
from spartron.runtime.data import build_eval_loader, build_train_loader


def _cfg(*extra):
    return load_config("configs/tiny.toml", ["train.seq_len=8", *extra])


def test_mmap_training_never_reads_the_first_held_out_token_as_a_label(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(81, dtype=np.uint16).tofile(path)  # id == offset; 10 samples of 8 (+1): 8 train, 2 held out
    cfg = _cfg("train.data.kind=mmap", f"train.data.path={path}", "train.data.val_fraction=0.2")
    train = build_train_loader(cfg, 0, 1).next(16)  # two epochs of the 8 training samples
    assert train.labels[7].tolist() == [57, 58, 59, 60, 61, 62, 63, -100]  # was 64: held-out sample 0's first token
    assert train.labels[15].tolist() == train.labels[7].tolist()  # every epoch
    assert train.labels[6].tolist() == list(range(49, 57)) and train.tokens[7].tolist() == list(range(56, 64))
    val = build_eval_loader(cfg, 0, 1).next(2)  # the held-out split is unchanged
    assert val.tokens[0].tolist() == list(range(64, 72)) and val.labels[1].tolist() == list(range(73, 81))
    held_out = set(val.tokens.flatten().tolist()) | set(val.labels.flatten().tolist())
    used = set(train.tokens.flatten().tolist()) | set(train.labels[train.labels != -100].tolist())
    assert sorted(used & held_out) == [] and max(used) == 63
    plain = build_train_loader(_cfg("train.data.kind=mmap", f"train.data.path={path}"), 0, 1).next(10)
    assert plain.labels[9].tolist() == list(range(73, 81))  # nothing held out: the file's last label is trained on


def test_blended_sources_are_shuffled_each_in_its_own_order_and_resume(tmp_path):
    for name, base in (("a.bin", 0), ("b.bin", 1000)):
        np.arange(base, base + 81, dtype=np.uint16).tofile(tmp_path / name)  # 10 samples of 8 each
    paths = f'train.data.paths=["{tmp_path / "a.bin"}", "{tmp_path / "b.bin"}"]'
    cfg = _cfg("train.data.kind=mmap", paths, "train.data.shuffle=true", "model.vocab_size=2048")
    loader = build_train_loader(cfg, 0, 1)
    firsts = [loader.next(1).tokens[0, 0].item() for _ in range(20)]
    a, b = [f // 8 for f in firsts if f < 1000], [(f - 1000) // 8 for f in firsts if f >= 1000]
    assert a == [3, 4, 2, 6, 9, 1, 5, 0, 7, 8]  # source 0: the order this file alone is read in, as before
    assert b == [8, 2, 0, 1, 4, 7, 6, 5, 3, 9]  # source 1: its own order (it was a's, in lockstep)
    single = build_train_loader(_cfg("train.data.kind=mmap", f"train.data.path={tmp_path / 'a.bin'}",
                                      "train.data.shuffle=true"), 0, 1)
    assert [single.next(1).tokens[0, 0].item() // 8 for _ in range(10)] == a
    state = loader.state_dict()
    assert state["source"] == "blend[mmap:81:uint16:shuffled:0x500;mmap:81:uint16:shuffled:0:source1x500]"
    again = build_train_loader(cfg, 0, 1)
    again.load_state_dict(state)
    assert torch.equal(again.next(4).tokens, loader.next(4).tokens)
    # a position saved when both sources shared one order cannot go on in the new orders: refused, saying what to do
    old = {**state, "source": "blend[mmap:81:uint16:shuffled:0x500;mmap:81:uint16:shuffled:0x500]"}
    with pytest.raises(ValueError) as info:
        build_train_loader(cfg, 0, 1).load_state_dict(old)
    assert str(info.value) == (
        "the data position was saved when the shuffled sources of train.data.paths shared one order, and each now "
        "has its own, so this run's sample order cannot go on: finish it with the Spartron version that started it, "
        "or start a new run (another train.run_dir)")


def test_a_special_token_string_in_corpus_text_is_text(tmp_path):
    words = [*WORDS, "<", "eos", ">", "<|", "im_end", "|>", "system", "user", "assistant"]
    path = make_tokenizer(tmp_path / "t.json", words=words, specials=("<|im_start|>", "<|im_end|>"))
    t = load_tokenizer(path, "<eos>", chat_format="chatml")
    v = t.backend.token_to_id
    assert (v("<eos>"), v("<|im_end|>")) == (1, 7)
    text = ["the", "cat", "<", "eos", ">", "sat", "<|", "im_end", "|>"]  # the control tokens' strings, as text
    assert t.encode_record(Document("the cat <eos> sat <|im_end|>")) == ([v(w) for w in text] + [1], [1] * 10)
    got, mask = t.encode_record(Chat((("user", "why <|im_end|> not"), ("assistant", "yes <eos>"))))
    s, e = v("<|im_start|>"), v("<|im_end|>")  # the chat format's control tokens: its headers and turn ends
    assert got == [s, v("user"), v("why"), v("<|"), v("im_end"), v("|>"), v("not"), e,
                   s, v("assistant"), v("yes"), v("<"), v("eos"), v(">"), e, 1]
    assert mask == [0] * 10 + [1, 1, 1, 1, 1, 0]
    write_jsonl(tmp_path / "c.jsonl", [{"text": "the cat <eos> sat <|im_end|>"}, {"text": "a <eos>"}])
    meta = prepare_corpus(tmp_path / "c.jsonl", path, tmp_path / "out", eos_token="<eos>", chat_format="chatml")
    folder = open_token_folder(tmp_path / "out")
    assert folder.tokens.tolist() == [v(w) for w in text] + [1, v("a"), v("<"), v("eos"), v(">"), 1]
    assert folder.offsets.tolist() == [0, 10, 15] and meta["corpus"]["special_tokens_in_text"] == "split"
