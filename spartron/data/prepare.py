"""`spartron data CORPUS --tokenizer T --out DIR`: tokenize a corpus once into a token folder."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from spartron.configbase import ConfigError
from spartron.data.corpus import Document, corpus_files, read_corpus, skipped_files
from spartron.data.tokenfile import write_token_folder
from spartron.data.tokenizer import load_tokenizer


def prepare_corpus(corpus: str | Path, tokenizer: str | Path, out: str | Path, eos_token: str | None = None,
                   text_key: str = "text", batch_records: int = 1024, bos_token: str | None = None,
                   progress: Callable[[int, int], None] | None = None, chat_format: str = "spartron") -> dict:
    """Tokenize every record of `corpus` (file or folder) with the tokenizer into the new folder `out`, in
    order, `batch_records` at a time; returns the metadata written to out/tokens.json. Empty documents
    are skipped (and counted). `progress(documents, tokens)` is called after every batch; chats are rendered
    in `chat_format` (spartron.data.tokenizer.CHAT_FORMATS). The corpus entry records "special_tokens_in_text":
    "split" (a special token's string in the text was tokenized as text); folders without it were written when
    such a string became the control token."""
    tok = load_tokenizer(tokenizer, eos_token, bos_token, chat_format)
    root = Path(corpus)
    files = corpus_files(root)
    info = {"files": [str(f.relative_to(root)) if root.is_dir() else f.name for f in files], "text_key": text_key,
            "skipped_empty": 0, "chat_format": chat_format, "special_tokens_in_text": "split",
            "skipped_files": [str(f.relative_to(root)) for f in skipped_files(root)]}

    done = [0, 0]  # documents, tokens

    def encoded(batch: list) -> list[tuple[list[int], list[int]]]:
        out = tok.encode_records(batch)
        done[0] += len(out)
        done[1] += sum(len(ids) for ids, _ in out)
        if progress is not None:
            progress(*done)
        return out

    def records() -> Iterator[tuple[list[int], list[int]]]:
        batch: list = []
        for _, record in read_corpus(root, text_key):
            if isinstance(record, Document) and not record.text:
                info["skipped_empty"] += 1  # final before the metadata is written (after the stream)
                continue
            batch.append(record)
            if len(batch) == batch_records:
                yield from encoded(batch)
                batch = []
        yield from encoded(batch)

    return write_token_folder(out, records(), vocab_size=tok.vocab_size, eos_id=tok.eos_id, bos_id=tok.bos_id,
                              tokenizer={"file": str(tok.path), "sha256": tok.sha256}, corpus=info,
                              extra=lambda folder: keep_tokenizer(tok, folder))


KEPT_TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


def keep_tokenizer(tok, folder: Path) -> dict:  # noqa: ANN001 - a spartron.data.tokenizer.Tokenizer
    """Copy the tokenizer into the token folder (what export puts beside the weights, even after the original
    moved): its tokenizer.json (the bytes whose SHA-256 tokens.json records) and the tokenizer_config.json beside
    it, or one naming its EOS / BOS tokens. Returns the tokens.json entry listing the copies."""
    raw = Path(tok.path).read_bytes()
    if hashlib.sha256(raw).hexdigest() != tok.sha256:
        raise ConfigError(f"tokenizer {str(tok.path)!r} changed while `spartron data` ran")
    config = Path(tok.path).parent / KEPT_TOKENIZER[1]
    if config.is_file():
        config_bytes = config.read_bytes()
    else:
        token = tok.backend.id_to_token
        config_bytes = json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": token(tok.eos_id),
                                   "bos_token": None if tok.bos_id is None else token(tok.bos_id)}, indent=1).encode()
    for name, data in zip(KEPT_TOKENIZER, (raw, config_bytes), strict=True):
        (folder / name).write_bytes(data)
    return {"tokenizer_copy": list(KEPT_TOKENIZER)}
