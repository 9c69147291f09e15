"""`spartron data`: corpora with lone surrogates, empty or malformed chats, bad encodings and compressions,
hostile tokenizers and output folders, and interruptions (signals, a full disk) followed by a retry."""

from __future__ import annotations

import gzip
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

from benchmarks.auditing.core import ROOT, Case, decoy, new_entry

BASE = ["data", "corpus", "--tokenizer", "tokenizer.json", "--eos", "<eos>", "--out", "o"]
WORDS = "the cat sat on a mat".split()


def corpus_and_tokenizer(work: Path, lines: int = 3) -> None:
    """tokenizer.json (word level, <unk> and <eos>) and corpus/a.jsonl of `lines` short documents."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    tok.save(str(work / "tokenizer.json"))
    (work / "corpus").mkdir(exist_ok=True)
    text = " ".join(WORDS * 20)
    (work / "corpus" / "a.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(lines)))


def _corpus(name: str, data: bytes, keep_a: bool = True) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        corpus_and_tokenizer(work)
        if not keep_a:
            (work / "corpus" / "a.jsonl").unlink()
        (work / "corpus" / name).write_bytes(data)
    return setup


def _records(*records) -> bytes:  # noqa: ANN002 - JSON values
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _big(work: Path) -> None:
    corpus_and_tokenizer(work, lines=60_000)


def _written(case_dir: Path) -> str | None:
    meta = case_dir / "work" / "o" / "tokens.json"
    return None if meta.is_file() else "exit 0 without o/tokens.json"


def _eos_only_at_ends(case_dir: Path) -> str | None:
    """The EOS id (1) only where a document ends: a literal "<eos>" in the text is text, not the control token."""
    import numpy as np

    out = case_dir / "work" / "o"
    if not (out / "tokens.json").is_file():
        return "exit 0 without o/tokens.json"
    tokens = np.fromfile(out / "tokens.bin", dtype=np.uint16)
    ends = np.fromfile(out / "documents.bin", dtype=np.int64)[1:] - 1
    inside = sorted(set(np.flatnonzero(tokens == 1).tolist()) - set(ends.tolist()))
    return f"the text's literal '<eos>' became the EOS token at {inside[:5]}" if inside else None


def _regex_tokenizer(work: Path) -> None:
    """A tokenizer whose pre-tokenizer regex backtracks catastrophically on a long run of 'a'."""
    corpus_and_tokenizer(work)
    data = json.loads((work / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated",
                             "invert": False}
    (work / "tokenizer.json").write_text(json.dumps(data))
    (work / "corpus" / "a.jsonl").write_text(json.dumps({"text": "a" * 40 + "!"}) + "\n")


def cases() -> list[Case]:
    out: list[Case] = []

    def add(cid, setup, names, category="values", argv=BASE, **kw):
        if kw.get("harm") is _written:  # "exit 0 without o/tokens.json": a refusal is judged by its message
            kw.setdefault("harm_on_refusal", False)
        out.append(Case(f"tokenize-{cid}", "tokenize", argv, tuple(names), category=category, setup=setup,
                        timeout=kw.pop("timeout", 60.0), **kw))

    add("plain", corpus_and_tokenizer, (), accept_ok=True, harm=_written, quick=True)
    # outside audit: files of other suffixes in a corpus folder were skipped without a word
    for name in ("B.JSONL", "c.json", "d.jsonl.zst"):
        add(f"skipped-{name.lower().replace('.', '-')}", _corpus(name, _records({"text": "the cat"})), (),
            accept_ok=True, harm=_written, expect_out="not corpus files")
    # text that is not text
    add("lone-surrogate", _corpus("b.jsonl", b'{"text": "a \\ud800 b"}\n'), ["b.jsonl:1", "surrogate"], "corrupt")
    add("lone-surrogate-chat", _corpus("b.jsonl", b'{"messages": [{"role": "user", "content": "\\udfff"}]}\n'),
        ["b.jsonl:1"], "corrupt")
    add("invalid-utf8", _corpus("b.jsonl", b'{"text": "a \xff\xfe b"}\n'), ["b.jsonl:1", "b.jsonl"], "corrupt")
    # outside audit (data): a special token's string in a document became the control token
    add("special-token-in-text", _corpus("b.jsonl", _records({"text": "the cat <eos> sat"}, {"text": "a<eos>"})), (),
        "values", accept_ok=True, harm=_eos_only_at_ends, harm_on_refusal=False)
    add("nul-in-text", _corpus("b.jsonl", _records({"text": "a\x00b"})), (), "corrupt", accept_ok=True,
        harm=_written, note="a NUL character is text")
    add("bom", _corpus("b.jsonl", b"\xef\xbb\xbf" + _records({"text": "a"})), ["b.jsonl:1"], "corrupt",
        accept_ok=True, harm=_written)
    add("crlf", _corpus("b.jsonl", b'{"text": "a"}\r\n{"text": "b"}\r\n'), (), "corrupt", accept_ok=True,
        harm=_written)
    add("utf16", _corpus("b.jsonl", '{"text": "a"}\n'.encode("utf-16")), ["b.jsonl"], "corrupt")
    add("binary", _corpus("b.jsonl", bytes(range(256)) * 8), ["b.jsonl"], "corrupt")
    add("txt-binary", _corpus("b.txt", bytes(range(256)) * 8), ["b.txt"], "corrupt")
    # chats
    for fmt in ("spartron", "chatml", "deepseek"):
        argv = [*BASE, "--chat-format", fmt]
        add(f"empty-chat-{fmt}", _corpus("b.jsonl", _records({"messages": []})), ["b.jsonl:1", "messages"],
            argv=argv)
        add(f"chat-no-role-{fmt}", _corpus("b.jsonl", _records({"messages": [{"content": "hi"}]})),
            ["b.jsonl:1", "role"], argv=argv)
        add(f"chat-content-null-{fmt}", _corpus("b.jsonl", _records({"messages": [{"role": "user",
                                                                                     "content": None}]})),
            ["b.jsonl:1", "content"], "dtypes", argv=argv)
        add(f"chat-bad-role-{fmt}", _corpus("b.jsonl", _records({"messages": [{"role": "wizard", "content": "x"}]})),
            ["b.jsonl:1", "role", "wizard"], argv=argv)
    add("chat-messages-dict", _corpus("b.jsonl", _records({"messages": {"role": "user"}})), ["b.jsonl:1",
                                                                                            "messages"], "dtypes")
    add("chat-content-list", _corpus("b.jsonl", _records({"messages": [{"role": "user", "content": [1]}]})),
        ["b.jsonl:1", "content"], "dtypes")
    add("chat-role-number", _corpus("b.jsonl", _records({"messages": [{"role": 1, "content": "x"}]})),
        ["b.jsonl:1", "role"], "dtypes")
    add("chat-format-bogus", corpus_and_tokenizer, ["--chat-format", "bogus"], argv=[*BASE, "--chat-format", "bogus"])
    # records
    for cid, record in (("text-null", {"text": None}), ("text-number", {"text": 5}), ("text-list", {"text": ["a"]}),
                        ("no-text", {"body": "a"}), ("list", [1, 2]), ("string", "a"), ("number", 3),
                        ("both", {"text": "a", "messages": [{"role": "user", "content": "b"}]})):
        add(f"record-{cid}", _corpus("b.jsonl", _records(record)), ["b.jsonl:1"], "dtypes")
    add("text-key-missing", corpus_and_tokenizer, ["body", "--text-key", "a.jsonl:1"],
        argv=[*BASE, "--text-key", "body"])
    add("deep-json", _corpus("b.jsonl", b"[" * 100_000 + b"\n"), ["b.jsonl:1"], "sizes")
    add("huge-line", _corpus("b.jsonl", _records({"text": " ".join(WORDS * 400_000)})), (), "sizes", accept_ok=True,
        harm=_written, timeout=120.0)
    add("empty-file", _corpus("b.jsonl", b"", keep_a=False), ["corpus", "b.jsonl", "no documents", "empty"],
        "partial")
    add("empty-folder", lambda w: (corpus_and_tokenizer(w), (w / "corpus" / "a.jsonl").unlink()), ["corpus"],
        "partial")
    add("only-other-files", _corpus("notes.md", b"# x\n", keep_a=False), ["corpus"], "values")
    add("gz-truncated", _corpus("b.jsonl.gz", gzip.compress(_records({"text": "a"}) * 100)[:30]), ["b.jsonl.gz"],
        "corrupt")
    add("gz-garbage", _corpus("b.jsonl.gz", b"\x1f\x8b" + os.urandom(200)), ["b.jsonl.gz"], "corrupt")
    add("parquet-garbage", _corpus("b.parquet", b"PAR1" + os.urandom(100) + b"PAR1"), ["b.parquet"], "corrupt")

    def parquet_no_text(work: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        corpus_and_tokenizer(work)
        pq.write_table(pa.table({"body": ["a", "b"]}), work / "corpus" / "b.parquet")

    add("parquet-no-text", parquet_no_text, ["b.parquet", "text"], "dtypes")

    def without_pyarrow(work: Path) -> None:  # a machine without the optional package: its import fails
        _corpus("b.parquet", b"PAR1" + os.urandom(100) + b"PAR1")(work)
        shim = work / "no-pyarrow" / "pyarrow"
        shim.mkdir(parents=True)
        (shim / "__init__.py").write_text("raise ImportError('pyarrow is not installed (the audit hides it)')\n")

    add("parquet-without-pyarrow", without_pyarrow, ["pyarrow", "pip install"], "paths",
        env={"PYTHONPATH": os.pathsep.join(["no-pyarrow", str(ROOT)])})
    # paths
    add("corpus-fifo", lambda w: (corpus_and_tokenizer(w), os.mkfifo(w / "corpus" / "b.jsonl")), ["b.jsonl"],
        "paths", timeout=40.0)
    add("corpus-dev-zero", lambda w: (corpus_and_tokenizer(w), (w / "corpus" / "b.jsonl").symlink_to("/dev/zero")),
        ["b.jsonl", "/dev/zero"], "paths", timeout=40.0)
    add("corpus-link-loop", lambda w: (corpus_and_tokenizer(w), (w / "corpus" / "b.jsonl").symlink_to("b.jsonl")),
        ["b.jsonl"], "paths")
    add("corpus-dir-loop", lambda w: (corpus_and_tokenizer(w), (w / "corpus" / "sub").symlink_to("..")),
        ["sub", "corpus"], "paths", timeout=40.0, accept_ok=True, harm=_written,
        note="a linked folder read once, or refused; never followed forever")
    add("corpus-link-outside", lambda w: (corpus_and_tokenizer(w), (decoy(w) / "b.jsonl").write_text(
        '{"text": "a"}\n'), (w / "corpus" / "b.jsonl").symlink_to(decoy(w) / "b.jsonl")), (), "paths",
        accept_ok=True, harm=_written, note="reading a linked file; it stays unchanged (hashed)")
    for cid, make in (("link-empty-dir", lambda w: (w / "o").symlink_to(decoy(w) / "empty")),
                      ("link-dir", lambda w: (w / "o").symlink_to(decoy(w) / "notes")),
                      ("link-dangling", lambda w: (w / "o").symlink_to(decoy(w) / "new")),
                      ("link-file", lambda w: (w / "o").symlink_to(decoy(w) / "precious.txt")),
                      ("is-file", lambda w: (w / "o").write_text("mine")),
                      ("fifo", lambda w: os.mkfifo(w / "o"))):
        add(f"out-{cid}", lambda w, make=make: (corpus_and_tokenizer(w), make(w)), ["'o'", "o:", "--out", " o "],
            "paths", timeout=40.0)
    add("out-empty-dir", lambda w: (corpus_and_tokenizer(w), (w / "o").mkdir()), (), "paths", accept_ok=True,
        harm=_written)
    add("out-too-long", corpus_and_tokenizer, ["ooo"], "sizes", argv=[*BASE[:-1], "o" * 5000])
    # tokenizers
    add("tokenizer-regex-backtracking", _regex_tokenizer, ["tokenizer", "regex"], "sizes", timeout=60.0,
        accept_ok=True, harm=_written, note="a slow regex must end (or be refused), not hang")
    add("tokenizer-fifo", lambda w: (corpus_and_tokenizer(w), (w / "tokenizer.json").unlink(),
                                     os.mkfifo(w / "tokenizer.json")), ["tokenizer.json"], "paths", timeout=40.0)
    add("tokenizer-dev-zero", lambda w: (corpus_and_tokenizer(w), (w / "tokenizer.json").unlink(),
                                         (w / "tokenizer.json").symlink_to("/dev/zero")), ["tokenizer.json"], "paths",
        timeout=40.0)
    add("tokenizer-list", lambda w: (corpus_and_tokenizer(w), (w / "tokenizer.json").write_text("[]")),
        ["tokenizer.json"], "corrupt")
    add("tokenizer-empty", lambda w: (corpus_and_tokenizer(w), (w / "tokenizer.json").write_text("")),
        ["tokenizer.json"], "corrupt")
    add("tokenizer-dir-no-config", lambda w: (corpus_and_tokenizer(w), (w / "tk").mkdir(),
                                              (w / "tokenizer.json").rename(w / "tk" / "tokenizer.json")),
        ["--eos", "eos_token", "tokenizer_config.json"], argv=["data", "corpus", "--tokenizer", "tk", "--out", "o"])
    add("tokenizer-config-garbage", lambda w: (corpus_and_tokenizer(w), (w / "tk").mkdir(),
                                               (w / "tokenizer.json").rename(w / "tk" / "tokenizer.json"),
                                               (w / "tk" / "tokenizer_config.json").write_text("{x")),
        ["tokenizer_config.json"], "corrupt", argv=["data", "corpus", "--tokenizer", "tk", "--out", "o"])
    add("tokenizer-config-eos-dict", lambda w: (corpus_and_tokenizer(w), (w / "tk").mkdir(),
                                                (w / "tokenizer.json").rename(w / "tk" / "tokenizer.json"),
                                                (w / "tk" / "tokenizer_config.json").write_text(
                                                    json.dumps({"eos_token": {"content": 5}}))),
        ["tokenizer_config.json", "eos_token"], "dtypes", argv=["data", "corpus", "--tokenizer", "tk", "--out", "o"])
    add("eos-unknown", corpus_and_tokenizer, ["</s>", "--eos"], argv=[*BASE[:4], "--eos", "</s>", "--out", "o"])
    add("eos-empty", corpus_and_tokenizer, ["--eos"], argv=[*BASE[:4], "--eos", "", "--out", "o"])
    add("bos-unknown", corpus_and_tokenizer, ["<s>", "--bos"], argv=[*BASE, "--bos", "<s>"])
    # interrupted, then retried: nothing left that blocks the retry
    for signame in ("SIGTERM", "SIGINT", "SIGKILL"):
        add(f"{signame.lower()}-then-retry", _big, (), "signals",
            interrupt=(getattr(signal, signame), new_entry("corpus", "tokenizer.json")), retry=BASE, accept_ok=True,
            harm=_written, timeout=180.0)
    add("disk-full-then-retry", _big, ["o", "tokens.bin", "File too large", "space"], "partial", fsize=100_000,
        retry=BASE, accept_ok=True, harm=_written, timeout=180.0)
    return out
