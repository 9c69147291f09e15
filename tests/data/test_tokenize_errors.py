"""`spartron data` refuses every bad input with one line naming the file and the record (exit 2, nothing
else on stderr, no output folder), and an interrupted run leaves nothing that blocks the same command."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from text_corpus import make_tokenizer, write_jsonl  # next to this file

from spartron.launch.cli import main


@pytest.fixture
def tok(tmp_path):
    return make_tokenizer(tmp_path / "tok" / "tokenizer.json")


def _data(capfd, corpus: Path, tokenizer: Path, out: Path, *extra: str) -> tuple[int, str]:
    """`spartron data` in this process; (status, all of file descriptor 2) -- a Rust panic writes there."""
    capfd.readouterr()
    code = main(["data", str(corpus), "--tokenizer", str(tokenizer), "--out", str(out), "--eos", "<eos>", *extra])
    return code, capfd.readouterr().err


def _refused(capfd, corpus, tokenizer, out, *extra) -> str:
    code, err = _data(capfd, corpus, tokenizer, out, *extra)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("spartron: error: "), err
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))
    return err.strip().removeprefix("spartron: error: ")


@pytest.mark.parametrize(("line", "message"), [
    (b'{"text": "the cat \\ud800 sat"}', r"a.jsonl:1: 'text' holds a lone surrogate '\ud800' at character 8 "
                                         r"(not Unicode text)"),
    (b'{"messages": [{"role": "user", "content": "a \\udc00"}]}',
     r"a.jsonl:1: messages[0].content holds a lone surrogate '\udc00' at character 2 (not Unicode text)"),
    (b'{"messages": []}', "a.jsonl:1: 'messages' must be a non-empty list of {role, content} objects"),
    (b'{"messages": {"role": "user"}}', "a.jsonl:1: 'messages' must be a non-empty list of {role, content} objects"),
    (b'{"messages": [{"role": "boss", "content": "x"}]}',
     "a.jsonl:1: messages[0].role 'boss' is not one of system, user, assistant, tool"),
    (b'{"messages": [{"role": 3, "content": "x"}]}',
     "a.jsonl:1: messages[0] must be an object with string 'role' and 'content'"),
    (b'{"messages": [{"role": "user", "content": ["x"]}]}',
     "a.jsonl:1: messages[0] must be an object with string 'role' and 'content'"),
    (b'{"messages": [{"role": "user", "content": null}]}',
     "a.jsonl:1: messages[0] must be an object with string 'role' and 'content'"),
    (b'{"text": 5}', "a.jsonl:1: a record needs a string 'text' or a list 'messages'"),
    (b'{"text": "a", "messages": [{"role": "user", "content": "b"}]}',
     "a.jsonl:1: ambiguous record: it holds both 'text' (a document) and 'messages' (a chat); keep one"),
    (b'[1, 2]', "a.jsonl:1: a record must be a JSON object, got list"),
    (b'{"text": "a", "n": ' + b"9" * 5000 + b"}",
     "a.jsonl:1: not valid JSON: Exceeds the limit (4300 digits) for integer string conversion"),
    (b"\xff\xfe\x00garbage", "a.jsonl:1: not UTF-8 text (byte 0)"),
    (b"[" * 100000 + b"]" * 100000, "a.jsonl:1: not valid JSON: maximum recursion depth exceeded"),
])
def test_bad_records_are_one_line_naming_file_and_line(tmp_path, tok, capfd, line, message):
    corpus = tmp_path / "a.jsonl"
    corpus.write_bytes(b'{"text": "the cat"}\n' + line + b"\n")
    first, rest = message.split(":1: ", 1)
    got = _refused(capfd, corpus, tok, tmp_path / "out")
    assert got.startswith(f"{tmp_path / first}:2: {rest}"), got


def test_empty_inputs(tmp_path, tok, capfd):
    (tmp_path / "e.jsonl").write_bytes(b"")
    assert _refused(capfd, tmp_path / "e.jsonl", tok, tmp_path / "out") == "the corpus holds no document"
    (tmp_path / "blank.jsonl.gz").write_bytes(gzip.compress(b"\n \n"))
    assert _refused(capfd, tmp_path / "blank.jsonl.gz", tok, tmp_path / "out") == "the corpus holds no document"
    (tmp_path / "none").mkdir()
    assert _refused(capfd, tmp_path / "none", tok, tmp_path / "out") == (
        f"corpus folder {str(tmp_path / 'none')!r} holds no .jsonl, .jsonl.gz, .parquet, .txt file")


def test_gzip_truncated_or_not_gzip(tmp_path, tok, capfd):
    data = gzip.compress(b"".join(b'{"text": "the cat sat"}\n' for _ in range(2000)))
    (tmp_path / "t.jsonl.gz").write_bytes(data[:len(data) // 2])
    assert _refused(capfd, tmp_path / "t.jsonl.gz", tok, tmp_path / "out") == (
        f"corpus file {str(tmp_path / 't.jsonl.gz')!r} cannot be read: Compressed file ended before the "
        "end-of-stream marker was reached")
    (tmp_path / "n.jsonl.gz").write_bytes(b"hello")
    assert _refused(capfd, tmp_path / "n.jsonl.gz", tok, tmp_path / "out") == (
        f"corpus file {str(tmp_path / 'n.jsonl.gz')!r} cannot be read: Not a gzipped file (b'he')")


def test_parquet_corruption_is_one_line_naming_the_file_and_row(tmp_path, tok, capfd):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": [f"the cat {i} " * 20 for i in range(20000)]}), tmp_path / "big.parquet",
                   row_group_size=2000, compression="snappy")
    good = (tmp_path / "big.parquet").read_bytes()
    (tmp_path / "trunc.parquet").write_bytes(good[:len(good) // 2])
    assert _refused(capfd, tmp_path / "trunc.parquet", tok, tmp_path / "out") == (
        f"{tmp_path / 'trunc.parquet'}: not a readable parquet file (ArrowInvalid: Parquet magic bytes not found "
        "in footer. Either the file is corrupted or this is not a parquet file.)")
    pages = bytearray(good)  # the footer intact, a data page mangled: found while reading rows
    for i in range(len(pages) // 2, len(pages) // 2 + 3000):
        pages[i] = (pages[i] * 7 + 13) & 0xFF
    (tmp_path / "pages.parquet").write_bytes(bytes(pages))
    got = _refused(capfd, tmp_path / "pages.parquet", tok, tmp_path / "out")
    assert got.startswith(f"{tmp_path / 'pages.parquet'}: row 1 onwards cannot be read ("), got
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "x"}], []]}), tmp_path / "m.parquet")
    assert _refused(capfd, tmp_path / "m.parquet", tok, tmp_path / "out") == (
        f"{tmp_path / 'm.parquet'}: row 2: 'messages' must be a non-empty list of {{role, content}} objects")


def test_parquet_rows_take_the_column_they_fill_and_a_row_filling_both_is_ambiguous(tmp_path, tok, capfd):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    chat = [{"role": "user", "content": "the"}, {"role": "assistant", "content": "cat"}]
    pq.write_table(pa.table({"text": ["the cat", None], "messages": [None, chat]}), tmp_path / "ok.parquet")
    code, err = _data(capfd, tmp_path / "ok.parquet", tok, tmp_path / "out")
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "tokens.json").read_text())["n_documents"] == 2
    pq.write_table(pa.table({"text": ["the cat", "sat"], "messages": [None, chat]}), tmp_path / "both.parquet")
    assert _refused(capfd, tmp_path / "both.parquet", tok, tmp_path / "out2") == (
        f"{tmp_path / 'both.parquet'}: row 2: ambiguous record: it holds both 'text' (a document) and 'messages' "
        "(a chat); keep one")


@pytest.mark.parametrize(("make", "what"), [
    (lambda p: p.symlink_to(p.name), "is a broken or looping symbolic link (a symbolic link to 'b.jsonl')"),
    (lambda p: p.symlink_to("gone.jsonl"), "is a broken or looping symbolic link (a symbolic link to 'gone.jsonl')"),
    (lambda p: os.mkfifo(p), "is a FIFO, not a regular file"),
    (lambda p: p.symlink_to("/dev/zero"), "is a character device (a symbolic link to '/dev/zero'), not a regular file"),
])
def test_a_corpus_file_in_a_folder_that_is_not_a_regular_file_is_refused_by_name(tmp_path, tok, capfd, make, what):
    """Skipping it would tokenize less than the folder holds without a word; opening a FIFO would wait forever."""
    corpus = tmp_path / "corpus"
    write_jsonl(corpus / "a.jsonl", [{"text": "the cat"}])
    (corpus / "sub").mkdir()
    make(corpus / "sub" / "b.jsonl")
    assert _refused(capfd, corpus, tok, tmp_path / "out") == f"corpus file {str(corpus / 'sub' / 'b.jsonl')!r} {what}"


def test_a_corpus_folder_with_a_link_to_its_parent_is_read_once(tmp_path, tok, capfd):
    corpus = tmp_path / "corpus"
    write_jsonl(corpus / "a.jsonl", [{"text": "the cat"}])
    (corpus / "up").symlink_to("..")
    (corpus / "notes").symlink_to("notes")  # a loop without a corpus suffix: not a corpus file, not opened
    code, err = _data(capfd, corpus, tok, tmp_path / "out")
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "tokens.json").read_text())["n_documents"] == 1


def test_files_of_a_corpus_folder_that_are_not_corpus_files_are_named_in_one_note(tmp_path, tok, capfd):
    """A folder of `.JSONL`, `.json`, `.txt.gz` files beside one `.jsonl` tokenized that one alone, silently."""
    corpus = tmp_path / "corpus"
    write_jsonl(corpus / "a.jsonl", [{"text": "the cat"}])
    for name in ("B.JSONL", "c.json", "d.txt.gz"):
        (corpus / name).write_text('{"text": "a dog"}\n')
    code, err = _data(capfd, corpus, tok, tmp_path / "out")
    assert code == 0, err
    assert err.splitlines()[0] == (f"spartron: note: 3 file(s) of {corpus} are not corpus files and were not read "
                                   "(B.JSONL, c.json, d.txt.gz): spartron data reads .jsonl, .jsonl.gz, .parquet, .txt")
    meta = json.loads((tmp_path / "out" / "tokens.json").read_text())
    assert meta["corpus"]["skipped_files"] == ["B.JSONL", "c.json", "d.txt.gz"] and meta["n_documents"] == 1


def _tokenizer_with(tok: Path, tmp_path: Path, name: str, pre_tokenizer: dict) -> Path:
    data = json.loads(tok.read_text())
    data["pre_tokenizer"] = pre_tokenizer
    path = tmp_path / name / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    return path


def test_pathological_tokenizer_regexes(tmp_path, tok, capfd):
    corpus = write_jsonl(tmp_path / "a.jsonl", [{"text": "the cat"}, {"text": "a" * 200 + "!"}])
    split = {"type": "Split", "behavior": "Isolated", "invert": False}
    bad = _tokenizer_with(tok, tmp_path, "bad", {**split, "pattern": {"Regex": "(unclosed"}})
    got = _refused(capfd, corpus, bad, tmp_path / "out")
    assert got.startswith(f"tokenizer {str(bad)!r} is not a tokenizers JSON file: Oniguruma error: end pattern "
                          "with unmatched parenthesis"), got
    # catastrophic backtracking: Oniguruma's retry limit makes the Rust side panic (and print a backtrace on fd 2)
    slow = _tokenizer_with(tok, tmp_path, "slow", {**split, "pattern": {"Regex": "(a|aa)+$"}})
    assert _refused(capfd, corpus, slow, tmp_path / "out") == (
        f"{corpus}:2: tokenizer {str(slow)!r} failed on it (PanicException: Onig: Regex search error: "
        "retry-limit-in-match over)")
    chats = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "a" * 200 + "!"}]}])
    assert _refused(capfd, chats, slow, tmp_path / "out").startswith(f"{chats}:1: tokenizer {str(slow)!r} failed")


def test_an_empty_deepseek_chat_is_its_eos_alone(tmp_path, tok, capfd):
    corpus = write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "system", "content": ""}]}])
    code, err = _data(capfd, corpus, tok, tmp_path / "out", "--chat-format", "deepseek")
    assert code == 0, err
    import numpy as np

    assert np.fromfile(tmp_path / "out" / "tokens.bin", dtype=np.uint16).tolist() == [1]  # <eos>
    assert np.fromfile(tmp_path / "out" / "loss_mask.bin", dtype=np.uint8).tolist() == [0]


def test_corpus_and_output_paths(tmp_path, tok, capfd):
    (tmp_path / "loop.jsonl").symlink_to(tmp_path / "loop.jsonl")
    assert _refused(capfd, tmp_path / "loop.jsonl", tok, tmp_path / "out") == (
        f"corpus {str(tmp_path / 'loop.jsonl')!r} is a broken or looping symbolic link")
    os.mkfifo(tmp_path / "fifo.jsonl")  # opening it would wait for a writer forever
    assert _refused(capfd, tmp_path / "fifo.jsonl", tok, tmp_path / "out") == (
        f"corpus {str(tmp_path / 'fifo.jsonl')!r} is neither a regular file nor a folder")
    corpus = write_jsonl(tmp_path / "a.jsonl", [{"text": "the cat"}])
    (tmp_path / "file").write_text("x")
    code, err = _data(capfd, corpus, tok, tmp_path / "file")
    assert (code, err) == (2, f"spartron: error: output folder {str(tmp_path / 'file')!r} exists and is not a folder "
                              "(choose a new folder)\n")
    (tmp_path / "empty").mkdir()  # an existing empty folder is filled in place
    code, err = _data(capfd, corpus, tok, tmp_path / "empty")
    assert code == 0 and (tmp_path / "empty" / "tokens.json").is_file()
    assert not list(tmp_path.glob(".*partial-*"))


@pytest.mark.parametrize(("make", "target"), [
    (lambda d: (d / "empty").mkdir(), "empty"),  # would be filled: files outside the folder the user named
    (lambda d: None, "new"),  # dangling: would be made where the link points
    (lambda d: ((d / "notes").mkdir(), (d / "notes" / "n.txt").write_text("mine")), "notes"),
    (lambda d: (d / "precious.txt").write_text("mine"), "precious.txt"),
])
def test_an_output_folder_that_is_a_link_is_refused_by_the_name_given(tmp_path, tok, capfd, monkeypatch, make,
                                                                       target):
    corpus = write_jsonl(tmp_path / "a.jsonl", [{"text": "the cat"}])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    make(elsewhere)
    before = sorted(p.name for p in elsewhere.rglob("*"))
    (tmp_path / "o").symlink_to(elsewhere / target)
    monkeypatch.chdir(tmp_path)
    code, err = _data(capfd, corpus, tok, Path("o"))
    to = str(elsewhere / target)
    assert (code, err) == (2, f"spartron: error: output folder 'o' is a symbolic link (to {to!r}): `spartron data` "
                              "writes a new folder or fills an empty one, never through a link (name its target)\n")
    assert sorted(p.name for p in elsewhere.rglob("*")) == before
    assert (tmp_path / "o").is_symlink() and not list(tmp_path.glob(".o.partial-*"))


@pytest.mark.parametrize(("make", "message"), [
    (lambda o: o.write_text("mine"), "exists and is not a folder (choose a new folder)"),
    (lambda o: os.mkfifo(o), "exists and is not a folder (choose a new folder)"),
    (lambda o: (o.mkdir(), (o / "x").write_text("mine")), "exists and is not empty (choose a new folder)"),
])
def test_an_output_path_that_is_not_new_or_empty_is_named_as_given(tmp_path, tok, capfd, monkeypatch, make, message):
    corpus = write_jsonl(tmp_path / "a.jsonl", [{"text": "the cat"}])
    make(tmp_path / "o")
    monkeypatch.chdir(tmp_path)
    code, err = _data(capfd, corpus, tok, Path("o"))
    assert (code, err) == (2, f"spartron: error: output folder 'o' {message}\n")


def test_an_output_folder_named_dot_is_filled_when_empty(tmp_path, tok, capfd, monkeypatch):
    corpus = write_jsonl(tmp_path / "c" / "a.jsonl", [{"text": "the cat"}])
    (tmp_path / "o").mkdir()
    monkeypatch.chdir(tmp_path / "o")
    code, err = _data(capfd, corpus, tok, Path("."))
    assert code == 0, err
    assert sorted(os.listdir(tmp_path / "o")) == ["documents.bin", "tokenizer.json", "tokenizer_config.json",
                                                  "tokens.bin", "tokens.json"]
    monkeypatch.chdir(tmp_path)
    long = "o" * 5000
    code, err = _data(capfd, corpus, tok, Path(long))
    assert (code, err) == (2, f"spartron: error: output folder {long!r} cannot be read: File name too long\n")


def _two_file_corpus(root: Path) -> Path:
    """Two files of 200 documents: the command is stopped when it opens the second, with the first written."""
    line = json.dumps({"text": " ".join(["the cat sat on a mat"] * 40)}) + "\n"
    root.mkdir(parents=True)
    for f in range(2):
        (root / f"part-{f}.jsonl").write_text(line * 200)
    return root


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_an_interrupted_run_leaves_nothing_that_blocks_the_retry(tmp_path, tok, signum, paused_cli):
    corpus, out = _two_file_corpus(tmp_path / "corpus"), tmp_path / "out"
    argv = ["data", str(corpus), "--tokenizer", str(tok), "--out", str(out), "--eos", "<eos>"]
    paused = paused_cli(argv, at=str(corpus / "part-1.jsonl"))  # mid-write: waits until signalled
    [partial] = list(tmp_path.glob(".out.partial-*"))
    assert (partial / "tokens.bin").is_file() and not out.exists()
    proc = paused.stop(signum)
    assert not out.exists()
    if signum == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        assert list(tmp_path.glob(".out.partial-*")) == [partial]  # hidden beside it, in nobody's way
    else:
        assert proc.returncode == 128 + signum
        assert proc.stderr == (f"spartron: data: stopped by {signal.Signals(signum).name}; removed the partial output "
                               f"({out} is as it was: run the same command again)\n")
        assert not list(tmp_path.glob(".out.partial-*"))
    left = list(tmp_path.glob(".out.partial-*"))
    retry = subprocess.run([sys.executable, "-m", "spartron.launch.cli", *argv], capture_output=True, text=True,
                           timeout=120)
    assert retry.returncode == 0, retry.stderr
    assert json.loads((out / "tokens.json").read_text())["n_documents"] == 2 * 200
    notes = [line for line in retry.stderr.splitlines() if line.startswith("spartron: note:")]
    assert notes == [f"spartron: note: removed {path}, left by process {paused.proc.pid} of this "
                     "host, which is no longer running" for path in left]  # the killed run's folder (host, pid)
    assert not list(tmp_path.glob(".out.partial-*"))


def test_tokenizer_files_and_flags(tmp_path, tok, capfd):
    corpus = write_jsonl(tmp_path / "a.jsonl", [{"text": "the cat"}])
    (tmp_path / "bin.json").write_bytes(b"\x00\x01\xff")
    assert _refused(capfd, corpus, tmp_path / "bin.json", tmp_path / "out") == (
        f"tokenizer {str(tmp_path / 'bin.json')!r} is not UTF-8 text (byte 2): not a tokenizers JSON file")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(tok.read_bytes())
    (folder / "tokenizer_config.json").write_text("[1]")
    capfd.readouterr()
    code = main(["data", str(corpus), "--tokenizer", str(folder), "--out", str(tmp_path / "out")])
    assert (code, capfd.readouterr().err) == (
        2, f"spartron: error: {folder / 'tokenizer_config.json'}: not a JSON object (a tokenizer_config.json "
           "holds one)\n")
    assert _refused(capfd, corpus, tok, tmp_path / "out", "--text-key", "messages") == (
        "--text-key 'messages': name the text field of pretraining records ('messages' holds chats)")


def test_a_line_break_in_a_file_name_stays_one_line(tmp_path, tok, capfd):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x\ny.jsonl").write_text('{"text": "the cat"}\n{broken\n')
    got = _refused(capfd, tmp_path / "c", tok, tmp_path / "out")
    assert got.startswith(f"{tmp_path / 'c'}/x\\ny.jsonl:2: not valid JSON: "), got


def test_a_parquet_corpus_without_pyarrow_is_one_line_naming_the_install(tmp_path, tok, capfd, monkeypatch):
    """An optional package missing is the user's environment, not a bug: one line, no traceback (it was one)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "b.parquet").write_bytes(b"not parquet")
    for name in ("pyarrow", "pyarrow.parquet"):  # a None entry makes `import` fail, as on a machine without it
        monkeypatch.setitem(sys.modules, name, None)
    message = _refused(capfd, corpus, tok, tmp_path / "out")
    assert message.startswith(f"reading the parquet corpus file {str(corpus / 'b.parquet')!r} needs the Python "
                              "package 'pyarrow.parquet', which is not installed or failed to import")
    assert message.endswith("Install it: pip install pyarrow")
