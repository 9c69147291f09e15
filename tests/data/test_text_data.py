"""Corpora, the tokenizer, token folders, packing and the loaders: exact values and one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from text_corpus import WORDS, make_tokenizer, text_folder, write_jsonl  # next to this file

from spartron.data import open_token_folder, prepare_corpus, read_corpus
from spartron.data.corpus import Chat, Document
from spartron.data.packing import PackedDocuments, split_documents
from spartron.data.tokenizer import load_tokenizer
from spartron.runtime.config import ConfigError, load_config
from spartron.runtime.data import build_eval_loader, build_train_loader


@pytest.fixture
def tok(tmp_path):
    return make_tokenizer(tmp_path / "tok" / "tokenizer.json")


def ids(tokenizer, text):
    return load_tokenizer(tokenizer, "<eos>").encode(text)


def test_folder_is_read_in_sorted_path_order_with_chats(tmp_path):
    write_jsonl(tmp_path / "b" / "x.jsonl", [{"text": "the cat"}, {"messages": [
        {"role": "user", "content": "why"}, {"role": "assistant", "content": "yes"}]}])
    write_jsonl(tmp_path / "a.jsonl", [{"text": "dog"}])
    (tmp_path / "c.txt").write_text("red house")
    (tmp_path / "ignored.csv").write_text("x")
    got = [(p.relative_to(tmp_path).as_posix(), r) for p, r in read_corpus(tmp_path)]
    assert got == [("a.jsonl", Document("dog")), ("b/x.jsonl", Document("the cat")),
                   ("b/x.jsonl", Chat((("user", "why"), ("assistant", "yes")))), ("c.txt", Document("red house"))]


def test_text_key_names_the_field_of_pretraining_records(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"body": "the cat", "text": 3}])
    assert [r for _, r in read_corpus(tmp_path, text_key="body")] == [Document("the cat")]
    with pytest.raises(ConfigError, match="a record needs a string 'text' or a list 'messages'"):
        list(read_corpus(tmp_path))


def test_gzipped_jsonl_and_a_broken_gzip_stream(tmp_path):
    import gzip

    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b'{"text": "the cat"}\n{"text": "a dog"}\n'))
    (tmp_path / "b.jsonl").write_text('{"text": "red"}\n')
    assert [(p.name, r) for p, r in read_corpus(tmp_path)] == [
        ("a.jsonl.gz", Document("the cat")), ("a.jsonl.gz", Document("a dog")), ("b.jsonl", Document("red"))]
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:40])
    with pytest.raises(ConfigError, match=r"corpus file '.*c.jsonl.gz' cannot be read: Compressed file ended"):
        list(read_corpus(tmp_path))


def test_parquet_corpus(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="parquet corpora need pyarrow (the test extra installs it)")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["the cat", "a dog"], "id": [1, 2]}), tmp_path / "p.parquet")
    assert [r for _, r in read_corpus(tmp_path / "p.parquet")] == [Document("the cat"), Document("a dog")]
    chat = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "yes"}]
    pq.write_table(pa.table({"messages": [chat]}), tmp_path / "c.parquet")
    assert [r for _, r in read_corpus(tmp_path / "c.parquet")] == [Chat((("user", "why"), ("assistant", "yes")))]
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "q.parquet")
    with pytest.raises(ConfigError, match=r"q.parquet: no 'text' or 'messages' column \(columns: body\)"):
        list(read_corpus(tmp_path / "q.parquet"))


@pytest.mark.parametrize("line, message", [
    ("{not json", r"bad.jsonl:2: not valid JSON"),
    ('["a"]', r"bad.jsonl:2: a record must be a JSON object, got list"),
    ('{"body": "x"}', r"bad.jsonl:2: a record needs a string 'text' or a list 'messages'"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', r"messages\[0\].role 'robot' is not one of"),
    ('{"messages": []}', r"'messages' must be a non-empty list"),
])
def test_bad_records_are_one_line_errors_naming_file_and_line(tmp_path, line, message):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=message):
        list(read_corpus(tmp_path))


def test_corpus_and_tokenizer_path_errors(tmp_path, tok):
    with pytest.raises(ConfigError, match="holds no .jsonl, .jsonl.gz, .parquet, .txt file"):
        list(read_corpus(tmp_path / "tok"))
    with pytest.raises(ConfigError, match=r"corpus '.*nope' does not exist"):
        list(read_corpus(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="which token ends a document\\? Pass --eos TOKEN"):
        load_tokenizer(tok)
    with pytest.raises(ConfigError, match="the EOS token '</s>' is not in its vocabulary"):
        load_tokenizer(tok, "</s>")
    with pytest.raises(ConfigError, match="no tokenizer.json there"):
        load_tokenizer(tmp_path)
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ConfigError, match="is not a tokenizers JSON file"):
        load_tokenizer(tmp_path / "junk.json", "<eos>")


def test_transformers_folder_gives_the_eos_token(tmp_path, tok):
    transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok), eos_token="<eos>")
    fast.save_pretrained(tmp_path / "saved")
    t = load_tokenizer(tmp_path / "saved")
    assert t.eos_id == 1 and t.encode("the cat") == ids(tok, "the cat")


def test_chat_formats_chatml_and_deepseek(tmp_path):
    specials = ("<|im_start|>", "<|im_end|>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")
    path = make_tokenizer(tmp_path / "t.json", words=[*WORDS, "system", "user", "assistant"], specials=specials)
    chat = Chat((("system", "we"), ("user", "why"), ("assistant", "yes")))
    t = load_tokenizer(path, "<eos>", chat_format="chatml")
    v = t.backend.token_to_id
    got, mask = t.encode_record(chat)
    s, e = v("<|im_start|>"), v("<|im_end|>")
    assert got == [s, v("system"), v("we"), e, s, v("user"), v("why"), e, s, v("assistant"), v("yes"), e, 1]
    assert mask == [0] * 10 + [1, 1, 0]  # the answer and its <|im_end|>; the closing EOS is no answer
    t = load_tokenizer(path, "<｜end▁of▁sentence｜>", chat_format="deepseek")
    got, mask = t.encode_record(chat)
    eos = v("<｜end▁of▁sentence｜>")
    assert got == [v("we"), v("<｜User｜>"), v("why"), v("<｜Assistant｜>"), v("yes"), eos]
    assert mask == [0, 0, 0, 0, 1, 1]
    with pytest.raises(ConfigError, match="chat format 'llama' is not one of spartron, chatml, deepseek"):
        load_tokenizer(path, "<eos>", chat_format="llama")


def test_a_begin_of_sequence_token_starts_every_document(tmp_path, tok):
    t = load_tokenizer(tok, "<eos>", "<|system|>")  # any vocabulary token can serve as BOS here
    bos = t.backend.token_to_id("<|system|>")
    assert t.encode_record(Document("the cat")) == ([bos] + ids(tok, "the cat") + [1], [1, 1, 1, 1])
    got, mask = t.encode_record(Chat((("user", "why"), ("assistant", "yes"))))
    assert got[0] == bos and mask[0] == 0 and got[-1] == 1
    assert t.encode_records([Document("a dog")]) == [t.encode_record(Document("a dog"))]
    write_jsonl(tmp_path / "c.jsonl", [{"text": "the cat"}, {"text": "a dog"}])
    meta = prepare_corpus(tmp_path / "c.jsonl", tok, tmp_path / "out", eos_token="<eos>", bos_token="<|system|>")
    assert meta["bos_id"] == bos and open_token_folder(tmp_path / "out").offsets.tolist() == [0, 4, 8]
    transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok), eos_token="<eos>", bos_token="<|user|>")
    fast.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert load_tokenizer(tmp_path / "saved").bos_id is None  # bos_token alone does not add it
    (tmp_path / "saved" / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    assert load_tokenizer(tmp_path / "saved").bos_id == t.backend.token_to_id("<|user|>")
    with pytest.raises(ConfigError, match="the BOS token '<s>' is not in its vocabulary"):
        load_tokenizer(tok, "<eos>", "<s>")


def test_a_bos_the_tokenizers_post_processor_adds_starts_every_document_unless_the_config_says_no(tmp_path, tok):
    """Llama-3's folders add BOS in tokenizer.json's post-processor and say nothing of add_bos_token:
    tokenizer(text) starts with it, and so do the documents (they started without, silently)."""
    from tokenizers import Tokenizer, processors

    backend = Tokenizer.from_file(str(tok))
    bos = backend.token_to_id("<|user|>")
    backend.post_processor = processors.TemplateProcessing(single="<|user|> $A", special_tokens=[("<|user|>", bos)])
    folder = tmp_path / "llama3-like"
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|user|>", "eos_token": "<eos>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    t = load_tokenizer(folder)
    assert t.bos_id == bos and t.encode_record(Document("the cat"))[0] == [bos] + ids(tok, "the cat") + [1]
    assert backend.encode("the cat").ids == [bos] + ids(tok, "the cat")  # what the tokenizer itself gives
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    assert load_tokenizer(folder).bos_id is None  # said: no BOS
    assert load_tokenizer(tok, "<eos>").bos_id is None  # no post-processor: none


def test_chat_loss_mask_covers_assistant_content_and_its_eos(tok):
    t = load_tokenizer(tok, "<eos>")
    got, mask = t.encode_record(Chat((("system", "we"), ("user", "why not"), ("assistant", "yes"))))
    v = t.backend.token_to_id
    assert got == [v("<|system|>"), v("we"), v("<|user|>"), v("why"), v("not"), v("<|assistant|>"), v("yes"), 1]
    assert mask == [0, 0, 0, 0, 0, 0, 1, 1]  # the "\n" after headers / turns is no token of this WordLevel
    got, mask = t.encode_record(Chat((("user", "why"),)))  # no answer: context only, still EOS-terminated
    assert got == [v("<|user|>"), v("why"), 1] and mask == [0, 0, 0]
    assert t.encode_record(Document("the cat")) == (ids(tok, "the cat") + [1], [1, 1, 1])


def test_batched_encoding_keeps_the_order_and_equals_one_at_a_time(tmp_path, tok):
    t = load_tokenizer(tok, "<eos>")
    records = [Document("the cat"), Chat((("user", "why"), ("assistant", "yes"))), Document("a dog ran"),
               Document("red")]
    assert t.encode_records(records) == [t.encode_record(r) for r in records]
    write_jsonl(tmp_path / "c.jsonl", [{"text": f"the cat {'sat ' * i}"} for i in range(7)])
    calls = []
    a = prepare_corpus(tmp_path / "c.jsonl", tok, tmp_path / "a", eos_token="<eos>", batch_records=3,
                       progress=lambda d, t: calls.append((d, t)))
    assert [d for d, _ in calls] == [3, 6, 7] and calls[-1][1] == a["n_tokens"]
    b = prepare_corpus(tmp_path / "c.jsonl", tok, tmp_path / "b", eos_token="<eos>", batch_records=1)
    assert a == {**b, "corpus": a["corpus"]} and a["n_documents"] == 7
    for name in ("tokens.bin", "documents.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_token_folder_records_dtype_vocabulary_hash_and_offsets(tmp_path, tok):
    write_jsonl(tmp_path / "c" / "a.jsonl", [{"text": "the cat sat"}, {"text": ""}, {"text": "a dog"}])
    meta = prepare_corpus(tmp_path / "c", tok, tmp_path / "out", eos_token="<eos>")
    data = np.fromfile(tmp_path / "out" / "tokens.bin", dtype=np.uint16).tolist()
    assert data == ids(tok, "the cat sat") + [1] + ids(tok, "a dog") + [1]
    on_disk = json.loads((tmp_path / "out" / "tokens.json").read_text())
    assert on_disk == meta
    assert {k: meta[k] for k in ("dtype", "vocab_size", "eos_id", "n_tokens", "n_documents", "loss_mask",
                                 "documents")} == {
        "dtype": "uint16", "vocab_size": 40, "eos_id": 1, "n_tokens": 7, "n_documents": 2, "loss_mask": None,
        "documents": "documents.bin"}
    assert np.fromfile(tmp_path / "out" / "documents.bin", dtype=np.int64).tolist() == [0, 4, 7]
    import hashlib
    assert meta["tokenizer"]["sha256"] == hashlib.sha256(tok.read_bytes()).hexdigest()
    assert meta["corpus"] == {"files": ["a.jsonl"], "text_key": "text", "skipped_empty": 1, "chat_format": "spartron",
                              "special_tokens_in_text": "split", "skipped_files": []}
    with pytest.raises(ConfigError, match="exists and is not empty"):
        prepare_corpus(tmp_path / "c", tok, tmp_path / "out", eos_token="<eos>")


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(format="other"), "not a spartron-tokens version 1 file"),
    (lambda m: m.update(dtype="int8"), "dtype must be 'uint16' or 'uint32', got 'int8'"),
    (lambda m: m.update(n_tokens=8), r"document offsets must rise strictly from 0 to n_tokens = 8"),
    (lambda m: m.update(n_documents=3), r"documents.bin has 24 bytes, but tokens.json says 4 document offsets"),
    (lambda m: m.update(n_documents=0), r"n_documents 0 must be in 1..n_tokens \(7\)"),
    (lambda m: m.update(documents="../x.bin"), "documents must be 'documents.bin', got '../x.bin'"),
    (lambda m: m.update(eos_id=99), "do not fit dtype uint16"),
    (lambda m: m.pop("vocab_size"), "key 'vocab_size' is missing or not int"),
    (lambda m: m.update(loss_mask="../x"), "loss_mask must be null or 'loss_mask.bin'"),
    (lambda m: m.update(bos_id=40), "bos_id must be null or a token id below vocab_size 40, got 40"),
])
def test_damaged_token_folders_are_refused(tmp_path, tok, edit, message):
    write_jsonl(tmp_path / "c.jsonl", [{"text": "the cat sat"}, {"text": "a dog"}])
    prepare_corpus(tmp_path / "c.jsonl", tok, tmp_path / "out", eos_token="<eos>")
    meta_file = tmp_path / "out" / "tokens.json"
    meta = json.loads(meta_file.read_text())
    edit(meta)
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=message):
        open_token_folder(tmp_path / "out")


def test_a_failed_run_of_spartron_data_leaves_nothing_behind(tmp_path, tok):
    write_jsonl(tmp_path / "c" / "a.jsonl", [{"text": "the cat"}])
    (tmp_path / "c" / "b.jsonl").write_text('{"text": "a dog"}\n{broken\n')
    with pytest.raises(ConfigError, match=r"b.jsonl:2: not valid JSON"):
        prepare_corpus(tmp_path / "c", tok, tmp_path / "out", eos_token="<eos>")
    assert not (tmp_path / "out").exists()
    (tmp_path / "empty").mkdir()
    write_jsonl(tmp_path / "e.jsonl", [{"text": ""}])
    with pytest.raises(ConfigError, match="the corpus holds no document"):
        prepare_corpus(tmp_path / "e.jsonl", tok, tmp_path / "empty", eos_token="<eos>")
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())  # the user's folder stays
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="output folder '.*file' exists and is not a folder"):
        prepare_corpus(tmp_path / "e.jsonl", tok, tmp_path / "file", eos_token="<eos>")


def test_document_offsets_that_do_not_rise_are_refused(tmp_path, tok):
    write_jsonl(tmp_path / "c.jsonl", [{"text": "the cat sat"}, {"text": "a dog"}])
    prepare_corpus(tmp_path / "c.jsonl", tok, tmp_path / "out", eos_token="<eos>")
    np.asarray([0, 7, 7], dtype=np.int64).tofile(tmp_path / "out" / "documents.bin")
    with pytest.raises(ConfigError, match="documents.bin: the document offsets must rise strictly from 0"):
        open_token_folder(tmp_path / "out")


def test_truncated_tokens_and_missing_metadata(tmp_path, tok):
    write_jsonl(tmp_path / "c.jsonl", [{"text": "the cat sat"}])
    prepare_corpus(tmp_path / "c.jsonl", tok, tmp_path / "out", eos_token="<eos>")
    (tmp_path / "out" / "tokens.bin").write_bytes(b"\0\0")
    with pytest.raises(ConfigError, match=r"tokens.bin has 2 bytes, but tokens.json says 4 tokens of uint16"):
        open_token_folder(tmp_path / "out")
    (tmp_path / "out" / "tokens.json").unlink()
    with pytest.raises(ConfigError, match="has no tokens.json \\(not written by `spartron data`, or not finished\\)"):
        open_token_folder(tmp_path / "out")


def _folder(tmp_path, docs: list[list[int]], mask: list[list[int]] | None = None):
    """A token folder holding exactly these documents (ids < 40)."""
    from spartron.data.tokenfile import write_token_folder

    recs = [(d, m) for d, m in zip(docs, mask or [[1] * len(d) for d in docs], strict=True)]
    write_token_folder(tmp_path / "f", recs, vocab_size=40, eos_id=1, tokenizer={"sha256": "ab" * 32}, corpus={})
    return open_token_folder(tmp_path / "f")


def test_packing_positions_and_labels_exact(tmp_path):
    folder = _folder(tmp_path, [[5, 6, 1], [7, 8, 9, 10, 1], [11, 1]],
                     mask=[[1, 1, 1], [0, 0, 1, 1, 1], [1, 1]])  # document 2: a chat whose first 2 are prompt
    packed = PackedDocuments(folder, split_documents(3, 0.0)[0], seq_len=4, vocab_size=40)
    assert packed.n_samples == 2  # 10 tokens: windows of 5 at 0 and 4
    tokens, labels, positions = packed.example(0)
    assert tokens.tolist() == [5, 6, 1, 7] and positions.tolist() == [0, 1, 2, 0]
    assert labels.tolist() == [6, 1, -100, -100]  # EOS -> next document: ignored; 8 is a prompt token
    tokens, labels, positions = packed.example(1)
    assert tokens.tolist() == [8, 9, 10, 1] and positions.tolist() == [0, 1, 2, 3]  # continued: starts afresh
    assert labels.tolist() == [9, 10, 1, -100]
    assert [t.tolist() for t in packed.example(2)] == [t.tolist() for t in packed.example(0)]  # wraps around


def test_rows_without_a_document_start_take_the_plain_causal_path(tmp_path):
    from spartron.runtime.data import PackedSource, TokenLoader

    folder = _folder(tmp_path, [list(range(2, 12)) + [1], [20, 21, 1]])  # 11 + 3 tokens
    loader = TokenLoader(PackedSource(PackedDocuments(folder, split_documents(2, 0.0)[0], 4, 40), True, "x"), 0, 1)
    first, second, third = loader.next(1), loader.next(1), loader.next(1)
    assert first.positions is None and second.positions is None  # inside document 0: positions are 0..3
    assert third.tokens.tolist() == [[10, 11, 1, 20]] and third.positions.tolist() == [[0, 1, 2, 0]]


def test_held_out_documents_are_never_trained_on(tmp_path):
    docs = [[2 + i, 3 + i, 1] for i in range(10)]
    folder = _folder(tmp_path, docs)
    train, val = split_documents(10, 0.2)
    assert (train.first, train.last, val.first, val.last) == (0, 8, 8, 10)
    t = PackedDocuments(folder, train, 2, 40)
    v = PackedDocuments(folder, val, 2, 40, "val")
    seen_train = {x for i in range(t.n_samples) for x in t.example(i)[0].tolist()}
    seen_val = {x for i in range(v.n_samples) for x in v.example(i)[0].tolist()}
    assert seen_val == {10, 11, 1} and not (seen_val - {1}) & seen_train
    with pytest.raises(ConfigError, match=r"train.data.val_fraction = 0.05 of 10 documents holds no document"):
        split_documents(10, 0.05)


def _cfg(tmp_path, *extra):
    return load_config("configs/tiny.toml", ["train.seq_len=8", *extra])


def test_loaders_shard_by_dp_rank_resume_and_hold_out(tmp_path, tok):
    text_folder(tmp_path / "corpus", n_docs=30)
    prepare_corpus(tmp_path / "corpus", tok, tmp_path / "out", eos_token="<eos>")
    cfg = _cfg(tmp_path, "train.data.kind=packed", f"train.data.path={tmp_path / 'out'}", "train.data.val_fraction=0.1")
    one = build_train_loader(cfg, 0, 1).next(4)
    r0, r1 = build_train_loader(cfg, 0, 2).next(2), build_train_loader(cfg, 1, 2).next(2)
    assert torch.equal(one.tokens[0::2], r0.tokens) and torch.equal(one.tokens[1::2], r1.tokens)
    def rows(batch):  # None: no document starts inside any row (positions 0..S-1)
        return torch.arange(8).expand(len(batch.tokens), 8) if batch.positions is None else batch.positions

    assert torch.equal(rows(one)[1::2], rows(r1)) and torch.equal(rows(one)[0::2], rows(r0))
    assert one.positions.dtype == torch.int64
    assert set(one.model_kwargs(torch.device("cpu"))) == {"positions"}
    a = build_train_loader(cfg, 1, 2)
    a.next(3)
    state = a.state_dict()
    assert state == {"position": 3, "dp_rank": 1, "dp_size": 2, "source": "packed:" + state["source"][7:]}
    expected = a.next(2)
    b = build_train_loader(cfg, 1, 2)
    b.load_state_dict(state)
    got = b.next(2)
    assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.labels, expected.labels)
    with pytest.raises(ValueError, match="the data position was saved for data 'synthetic', but train.data now"):
        b.load_state_dict({**state, "source": "synthetic"})
    ev1, ev2 = build_eval_loader(cfg, 0, 1).next(2), build_eval_loader(cfg, 0, 1).next(2)
    assert torch.equal(ev1.tokens, ev2.tokens)  # every evaluation reads the same samples
    no_mask = _cfg(tmp_path, "train.data.kind=packed", f"train.data.path={tmp_path / 'out'}",
                   "train.data.doc_mask=false")
    batch = build_train_loader(no_mask, 0, 1).next(4)  # the same tokens and labels, plain causal attention
    assert batch.positions is None and torch.equal(batch.tokens, one.tokens) and torch.equal(batch.labels, one.labels)
    assert batch.model_kwargs(torch.device("cpu")) == {}
    with pytest.raises(ConfigError, match="train.data.val_fraction = 0: no documents are held out"):
        build_eval_loader(no_mask, 0, 1)


def test_packed_folder_must_fit_the_model_vocabulary(tmp_path, tok):
    text_folder(tmp_path / "corpus", n_docs=4)
    prepare_corpus(tmp_path / "corpus", tok, tmp_path / "out", eos_token="<eos>")
    cfg = _cfg(tmp_path, "train.data.kind=packed", f"train.data.path={tmp_path / 'out'}", "model.vocab_size=16")
    with pytest.raises(ConfigError, match="its tokenizer has 40 tokens, more than model.vocab_size 16"):
        build_train_loader(cfg, 0, 1)


def test_mmap_and_synthetic_held_out_splits(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(81, dtype=np.uint16).tofile(path)  # 10 samples of 8 (+1)
    cfg = _cfg(tmp_path, "train.data.kind=mmap", f"train.data.path={path}", "train.data.val_fraction=0.2")
    train = build_train_loader(cfg, 0, 1)
    assert [train.next(1).tokens[0, 0].item() for _ in range(9)] == [0, 8, 16, 24, 32, 40, 48, 56, 0]
    val = build_eval_loader(cfg, 0, 1)
    assert [val.next(1).tokens[0, 0].item() for _ in range(3)] == [64, 72, 64]
    plain = _cfg(tmp_path, "train.data.kind=mmap", f"train.data.path={path}")
    with pytest.raises(ConfigError, match="train.data.kind = 'mmap' has no held-out split"):
        build_eval_loader(plain, 0, 1)
    syn = _cfg(tmp_path)
    t, v = build_train_loader(syn, 0, 1).next(2), build_eval_loader(syn, 0, 1).next(2)
    assert not torch.equal(t.tokens, v.tokens) and v.positions is None


def test_a_sidecar_beside_a_flat_token_file_is_checked(tmp_path, tok):
    write_jsonl(tmp_path / "c.jsonl", [{"text": "the cat sat on a mat and dog ran"}])
    prepare_corpus(tmp_path / "c.jsonl", tok, tmp_path / "out", eos_token="<eos>")
    cfg = _cfg(tmp_path, "train.data.kind=mmap", f"train.data.path={tmp_path / 'out' / 'tokens.bin'}",
               "train.data.token_dtype=uint32")
    with pytest.raises(ConfigError, match="tokens.json says the tokens are uint16, but train.data.token_dtype"):
        build_train_loader(cfg, 0, 1)
    # a chat folder's flat tokens: kind 'mmap' would train on every prompt token (its loss mask unread)
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "why the cat"},
                                                        {"role": "assistant", "content": "a dog sat on a mat"}]}] * 4)
    prepare_corpus(tmp_path / "chat.jsonl", tok, tmp_path / "chats", eos_token="<eos>")
    flat = _cfg(tmp_path, "train.data.kind=mmap", f"train.data.path={tmp_path / 'chats' / 'tokens.bin'}")
    with pytest.raises(ConfigError) as info:
        build_train_loader(flat, 0, 1)
    assert str(info.value).endswith(
        f"{tmp_path / 'chats' / 'tokens.json'} records a loss mask (chats: only the answers are targets), which "
        f"train.data.kind = 'mmap' would ignore: read the folder with train.data.kind = 'packed', "
        f"train.data.path = {str(tmp_path / 'chats')!r}")


def test_shuffle_is_a_permutation_per_epoch_and_resumes(tmp_path):
    from spartron.data.shuffle import permute, shuffled_index

    for n in (1, 2, 3, 17, 100, 1025):
        assert sorted(permute(k, n, b"key") for k in range(n)) == list(range(n))
    epochs = [[shuffled_index(e * 10 + k, 10, 7) for k in range(10)] for e in range(3)]
    assert [sorted(x - e * 10 for x in row) for e, row in enumerate(epochs)] == [list(range(10))] * 3
    assert epochs[0] != epochs[1] and [x % 10 for x in epochs[0]] != list(range(10))
    assert epochs[0] == [shuffled_index(k, 10, 7) for k in range(10)]  # deterministic
    assert epochs[0] != [shuffled_index(k, 10, 8) for k in range(10)]  # another seed, another order

    path = tmp_path / "t.bin"
    np.arange(81, dtype=np.uint16).tofile(path)  # 10 samples of 8 (+1)
    cfg = _cfg(tmp_path, "train.data.kind=mmap", f"train.data.path={path}", "train.data.shuffle=true")
    loader = build_train_loader(cfg, 0, 1)
    firsts = [loader.next(1).tokens[0, 0].item() // 8 for _ in range(10)]
    assert sorted(firsts) == list(range(10)) and firsts != list(range(10))
    state = loader.state_dict()
    assert state["source"] == "mmap:81:uint16:shuffled:0"
    again = build_train_loader(cfg, 0, 1)
    again.load_state_dict(state)
    assert torch.equal(again.next(3).tokens, loader.next(3).tokens)
    plain = build_train_loader(_cfg(tmp_path, "train.data.kind=mmap", f"train.data.path={path}"), 0, 1)
    with pytest.raises(ValueError, match="saved for data 'mmap:81:uint16:shuffled:0', but train.data now reads "
                                         "'mmap:81:uint16'"):
        plain.load_state_dict(state)
    with pytest.raises(ConfigError, match="train.data.shuffle is set but train.data.kind = 'synthetic'"):
        _cfg(tmp_path, "train.data.shuffle=true")


def test_blend_schedule_is_exact_per_round_and_addressable():
    from spartron.data.blend import blend_schedule

    s = blend_schedule([2.0, 1.0], round_size=3)
    assert (s.counts, s.pattern, s.rank) == ((2, 1), (0, 1, 0), (0, 0, 1))
    assert [s.locate(g) for g in range(7)] == [(0, 0), (1, 0), (0, 1), (0, 2), (1, 1), (0, 3), (0, 4)]
    s = blend_schedule([0.7, 0.2, 0.1], round_size=1000)
    assert s.counts == (700, 200, 100)
    seen = [[], [], []]
    for g in range(3000):
        i, k = s.locate(g)
        seen[i].append(k)
        assert abs(len(seen[i]) - (g + 1) * s.counts[i] / 1000) <= 1  # never more than one pick off its share
    assert [sorted(x) == list(range(len(x))) for x in seen] == [True] * 3  # each source read in order, once
    assert blend_schedule([1.0, 1e-9], round_size=100).counts == (99, 1)  # every source at least once a round


def test_blended_token_files_by_weight(tmp_path):
    for name, base in (("a.bin", 0), ("b.bin", 1000)):
        np.arange(base, base + 81, dtype=np.uint16).tofile(tmp_path / name)  # 10 samples of 8 each
    paths = f'train.data.paths=["{tmp_path / "a.bin"}", "{tmp_path / "b.bin"}"]'
    cfg = _cfg(tmp_path, "train.data.kind=mmap", paths, "train.data.weights=[3.0, 1.0]", "model.vocab_size=2048")
    loader = build_train_loader(cfg, 0, 1)
    firsts = [loader.next(1).tokens[0, 0].item() for _ in range(8)]
    assert firsts == [0, 8, 1000, 16, 24, 32, 1008, 40]  # 3 : 1, each file in its order
    state = loader.state_dict()
    assert state["source"] == "blend[mmap:81:uint16x750;mmap:81:uint16x250]"
    again = build_train_loader(cfg, 0, 1)
    again.load_state_dict(state)
    assert torch.equal(again.next(2).tokens, loader.next(2).tokens)
    with pytest.raises(ConfigError, match="train.data.val_fraction = 0: train.data.kind = 'mmap' has no held-out"):
        build_eval_loader(cfg, 0, 1)


@pytest.mark.parametrize("overrides, message", [
    (["train.data.kind=mmap", "train.data.path=a", 'train.data.paths=["b"]'], "path and train.data.paths are both"),
    (["train.data.kind=mmap", "train.data.path=a", "train.data.weights=[1.0]"], "weights is set without"),
    (["train.data.kind=mmap", 'train.data.paths=["a", "b"]', "train.data.weights=[1.0]"], "must be 2 positive"),
    (["train.data.kind=mmap", 'train.data.paths=["a"]', "train.data.weights=[0.0]"], "must be 1 positive"),
    (["train.data.kind=mmap", "train.data.paths=[]"], "must list at least one path"),
    (['train.data.paths=["a"]'], "train.data.paths is set but train.data.kind = 'synthetic'"),
])
def test_blend_config_errors(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(tmp_path, *overrides)


def test_blended_packed_folders_keep_their_own_held_out_documents(tmp_path, tok):
    for name, n in (("x", 30), ("y", 20)):
        text_folder(tmp_path / f"corpus-{name}", n_docs=n)
        prepare_corpus(tmp_path / f"corpus-{name}", tok, tmp_path / name, eos_token="<eos>")
    paths = f'train.data.paths=["{tmp_path / "x"}", "{tmp_path / "y"}"]'
    cfg = _cfg(tmp_path, "train.data.kind=packed", paths, "train.data.val_fraction=0.1", "train.data.shuffle=true")
    assert torch.equal(build_train_loader(cfg, 0, 1).next(4).tokens, build_train_loader(cfg, 0, 1).next(4).tokens)
    ev = build_eval_loader(cfg, 0, 1)
    assert ev.source.fingerprint.startswith("blend[packed:") and ":shuffled:" not in ev.source.fingerprint
    assert ev.next(2).tokens.shape == (2, 8)
