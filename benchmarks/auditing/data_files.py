"""Token files and token folders given to train.data (the first audit's cases, kept)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from benchmarks.auditing.core import Case, train, tstr, write


def data_cases() -> list[Case]:
    import numpy as np

    def tokens(name, values, dtype="uint16"):
        return write(Path(name), np.asarray(values, dtype=dtype).tobytes())

    big = np.zeros(3 << 20, dtype=np.uint16)
    big[-1] = 60_000
    mid = np.zeros(3 << 20, dtype=np.uint16)
    mid[(3 << 20) * 2 // 3] = 9_999
    out = []

    def add(cid, path, setup=None, extra=(), quick=False, timeout=90.0, names=("train.data.path",)):
        out.append(Case(f"data-{cid}", "data", train("train.data.kind=mmap", f"train.data.path={tstr(path)}", *extra),
                        names, setup=setup, quick=quick, timeout=timeout))

    add("missing", "missing.bin", quick=True)
    add("directory", ".")
    add("empty", "empty.bin", write(Path("empty.bin"), b""))
    add("odd-size", "odd.bin", write(Path("odd.bin"), b"\x01\x00\x02"))
    add("short", "short.bin", tokens("short.bin", range(10)))
    add("u16-as-u32", "u16.bin", tokens("u16.bin", [1, 2] * 200), extra=("train.data.token_dtype=uint32",))
    add("oov-tail", "tail.bin", write(Path("tail.bin"), big.tobytes()))
    add("oov-middle", "mid.bin", write(Path("mid.bin"), mid.tobytes()))
    add("oov-head", "head.bin", tokens("head.bin", [600] * 1000))
    add("u32-as-u16", "u32.bin", tokens("u32.bin", [i % 500 + 1 for i in range(4000)], dtype="uint32"))
    add("u16-big-vocab", "v.bin", tokens("v.bin", range(1000)), extra=("model.vocab_size=129280",),
        names=("train.data.token_dtype",))
    add("dev-zero", "/dev/zero")
    add("too-long", "d" * 5000)
    add("symlink-dir", "link", lambda w: (w / "link").symlink_to(w))
    return out + packed_cases()


def _token_folder(name: str, n: int = 200, edit: Callable[[dict], None] | None = None, ids: int = 2,
                  raw_meta: bytes | None = None, short: bool = False,
                  offsets: list[int] | None = None) -> Callable[[Path], None]:
    """A `spartron data` folder of n tokens (id `ids` + i % 30) in two documents, its tokens.json edited."""
    import numpy as np

    def setup(work: Path) -> None:
        d = work / name
        d.mkdir(parents=True)
        np.asarray([ids + i % 30 for i in range(n - (10 if short else 0))], dtype=np.uint16).tofile(d / "tokens.bin")
        np.asarray(offsets or [0, n // 2, n], dtype=np.int64).tofile(d / "documents.bin")
        meta = {"format": "spartron-tokens", "version": 1, "dtype": "uint16", "vocab_size": 512, "eos_id": 1,
                "bos_id": None, "tokenizer": {"sha256": "0" * 64}, "n_tokens": n, "n_documents": 2,
                "loss_mask": None, "documents": "documents.bin", "corpus": {}}
        if edit is not None:
            edit(meta)
        (d / "tokens.json").write_bytes(raw_meta if raw_meta is not None else json.dumps(meta).encode())
    return setup


def _tokenizer(work: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on a mat"], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    tok.save(str(work / "tokenizer.json"))
    (work / "corpus").mkdir()
    (work / "corpus" / "a.jsonl").write_text('{"text": "the cat"}\n')


def packed_cases() -> list[Case]:
    """train.data.kind = "packed" folders that are wrong, and `spartron data` given wrong inputs."""
    out = []

    def add(cid, setup, extra=(), names=("train.data.path", "tokens.json"), path="tok"):
        out.append(Case(f"data-packed-{cid}", "data", train("train.data.kind=packed", f"train.data.path={tstr(path)}",
                                                            *extra), names, setup=setup, timeout=90.0))

    def only_bin(w: Path) -> None:
        (w / "tok").mkdir()
        (w / "tok" / "tokens.bin").write_bytes(b"\x01\x00" * 100)

    add("no-meta", only_bin)
    add("meta-garbage", _token_folder("tok", raw_meta=b"\x00\xff{"))
    add("meta-deep", _token_folder("tok", raw_meta=b"[" * 100_000))
    add("meta-list", _token_folder("tok", raw_meta=b"[]"))
    add("offsets-falling", _token_folder("tok", offsets=[0, 150, 100]), names=("documents.bin",))
    add("documents-traversal", _token_folder("tok", edit=lambda m: m.update(documents="../../etc/passwd")))
    add("n-tokens-huge", _token_folder("tok", edit=lambda m: m.update(n_tokens=2**62)))
    add("truncated-bin", _token_folder("tok", short=True))
    add("mask-traversal", _token_folder("tok", edit=lambda m: m.update(loss_mask="../../etc/passwd")),
        names=("loss_mask",))
    add("vocab-above-model", _token_folder("tok", edit=lambda m: m.update(vocab_size=60_000)),
        names=("model.vocab_size",))
    add("ids-above-vocab", _token_folder("tok", ids=600), names=("model.vocab_size",))  # tokens.json lies
    add("val-split-too-short", _token_folder("tok", n=100), extra=("train.data.val_fraction=0.5",),
        names=("train.seq_len",))
    add("is-a-file", write(Path("tok"), b"x"))
    # outside audit (data): an evaluation reading its held-out split round again; a chat folder read flat
    add("eval-split-too-small", _token_folder("tok", n=2000), names=("train.eval_steps",),
        extra=("train.data.val_fraction=0.5", "train.eval_every=1", "train.eval_steps=50"))
    flat = train("train.data.kind=mmap", f"train.data.path={tstr('tok/tokens.bin')}")
    out.append(Case("data-mmap-chat-folder", "data", flat, ("loss mask", "train.data.kind = 'packed'"), timeout=90.0,
                    setup=_token_folder("tok", edit=lambda m: m.update(loss_mask="loss_mask.bin"))))
    add("dtype-set", _token_folder("tok"), extra=("train.data.token_dtype=uint32",), names=("train.data.token_dtype",))

    def data(cid, argv, names, setup=_tokenizer):
        out.append(Case(f"data-prepare-{cid}", "data", ["data", *argv], tuple(names), setup=setup, timeout=60.0))

    base = ["corpus", "--tokenizer", "tokenizer.json", "--eos", "<eos>", "--out"]
    data("corpus-missing", ["nope", "--tokenizer", "tokenizer.json", "--eos", "<eos>", "--out", "o"], ["nope"])
    data("tokenizer-missing", ["corpus", "--tokenizer", "none.json", "--out", "o"], ["none.json"])
    data("tokenizer-garbage", ["corpus", "--tokenizer", "corpus/a.jsonl", "--eos", "x", "--out", "o"], ["a.jsonl"])
    data("eos-hostile", ["corpus", "--tokenizer", "tokenizer.json", "--eos", "$(touch {m})", "--out", "o"], ["EOS"])
    data("no-eos", ["corpus", "--tokenizer", "tokenizer.json", "--out", "o"], ["--eos"])
    data("out-not-empty", [*base, "corpus"], ["corpus"])

    def bad_corpus(w: Path) -> None:
        _tokenizer(w)
        (w / "corpus" / "b.jsonl").write_bytes(b'{"text": "a"}\n{"messages": [{"role": "$(touch ' + b"x" + b')"}]}\n')

    data("bad-record", [*base, "o"], ["b.jsonl:2"], setup=bad_corpus)
    return out
