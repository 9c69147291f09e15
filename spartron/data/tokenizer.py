"""A local tokenizer (a `tokenizers` tokenizer.json, or a folder saved by transformers holding one) and
how documents and chats become token ids with their loss mask.

Every document ends with the end-of-sequence token, so packed documents keep their boundary. The
EOS token is given explicitly, else read from the folder's tokenizer_config.json (`eos_token`). A
begin-of-sequence token (`--bos`, or `bos_token` where tokenizer_config.json sets `add_bos_token`; where it
says nothing, the one special token the tokenizer's post-processor puts first, as Llama-3's folders do and
transformers' tokenizer(text) gives) starts every document when given, as models trained with one
(DeepSeek-V3, Llama) expect.

Chats are rendered turn by turn in one of CHAT_FORMATS (a role's header, its content, its turn end;
EOS in a turn end is the tokenizer's EOS id): "spartron" (default: "<|role|>\\n" headers, EOS after an
assistant turn, "\\n" after any other), "chatml" ("<|im_start|>role\\n" ... "<|im_end|>\\n") and
"deepseek" (DeepSeek-V3's: system content bare, "<｜User｜>", "<｜Assistant｜>" ... EOS). Only
assistant content and its turn end are training targets (loss mask 1); headers, system, user and tool
turns are context (mask 0). Chat templates of transformers are Jinja programs and are never run
(nothing read from disk runs); these formats are data, in this file.

Control tokens come only from the pipeline: BOS, EOS and the chat format's headers and turn ends. The text
of a document or a message is tokenized as text: a special token's string inside it ("<|im_end|>" in a user
message, "<｜end▁of▁sentence｜>" in a web page) becomes ordinary tokens, not the control token, through the
tokenizers library's `encode_special_tokens` (what transformers' `split_special_tokens=True` sets); added
tokens that are not special still match.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from spartron.configbase import ConfigError
from spartron.data.corpus import ROLES, Chat, Document
from spartron.optional import require

TOKENIZER_FILE = "tokenizer.json"
EOS = object()  # in a turn end: the tokenizer's EOS id


@dataclass(frozen=True)
class ChatFormat:
    headers: dict[str, str]  # role -> text before its content
    ends: dict[str, tuple]  # role -> what follows its content: strings and EOS


CHAT_FORMATS = {
    "spartron": ChatFormat({r: f"<|{r}|>\n" for r in ROLES}, {**{r: ("\n",) for r in ROLES}, "assistant": (EOS,)}),
    "chatml": ChatFormat({r: f"<|im_start|>{r}\n" for r in ROLES}, {r: ("<|im_end|>", "\n") for r in ROLES}),
    "deepseek": ChatFormat({"system": "", "user": "<｜User｜>", "assistant": "<｜Assistant｜>",
                            "tool": "<｜tool▁outputs▁begin｜>"},
                           {"system": (), "user": (), "assistant": (EOS,), "tool": ("<｜tool▁outputs▁end｜>",)}),
}


@dataclass
class Tokenizer:
    """A loaded tokenizer with what the token files record about it."""

    backend: object  # tokenizers.Tokenizer
    path: Path  # the tokenizer.json read
    sha256: str  # of that file's bytes: a token file names the exact tokenizer that wrote it
    vocab_size: int  # with added tokens
    eos_id: int
    bos_id: int | None = None  # starts every document when set
    chat_format: str = "spartron"  # a key of CHAT_FORMATS
    control: dict[str, list[int]] = field(default_factory=dict)  # the chat format's headers and turn ends -> ids

    def encode(self, text: str) -> list[int]:
        """The ids of corpus text, special-token strings in it tokenized as text (the backend splits them:
        load_tokenizer)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_records(self, records: list[Document | Chat]) -> list[tuple[list[int], list[int]]]:
        """encode_record of each, the documents' texts in one encode_batch (the Rust side's threads); when
        the tokenizer fails, again one record at a time, so the error names the record it fails on."""
        try:
            with rust_failures("a batch of records", self.path):
                texts = [r.text for r in records if isinstance(r, Document)]
                encoded = iter(self.backend.encode_batch(texts, add_special_tokens=False) if texts else ())
                return [self._document(next(encoded).ids) if isinstance(r, Document) else self._encode_record(r)
                        for r in records]
        except ConfigError:
            return [self.encode_record(r) for r in records]

    def encode_record(self, record: Document | Chat) -> tuple[list[int], list[int]]:
        """(ids, loss mask) of one record, EOS-terminated; a ConfigError naming the record if the tokenizer
        fails on it."""
        with rust_failures(record.where or "a record", self.path):
            return self._encode_record(record)

    def _encode_record(self, record: Document | Chat) -> tuple[list[int], list[int]]:
        if isinstance(record, Document):
            return self._document(self.encode(record.text))
        fmt = CHAT_FORMATS[self.chat_format]
        ids, mask = ([], []) if self.bos_id is None else ([self.bos_id], [0])
        for role, content in record.messages:
            header = self.control[fmt.headers[role]] if fmt.headers[role] else []
            body = self.encode(content)
            target = int(role == "assistant")
            end = [i for part in fmt.ends[role] for i in ([self.eos_id] if part is EOS else self.control[part])]
            ids += header + body + end
            mask += [0] * len(header) + [target] * (len(body) + len(end))
        # the conversation ends with EOS either way (an empty system turn alone renders to nothing in "deepseek")
        if not ids or ids[-1] != self.eos_id or not mask[-1]:
            ids.append(self.eos_id)
            mask.append(0)
        return ids, mask

    def _document(self, body: list[int]) -> tuple[list[int], list[int]]:
        ids = ([] if self.bos_id is None else [self.bos_id]) + body + [self.eos_id]
        return ids, [1] * len(ids)  # a document's first token is never a label (it starts the document)


@contextlib.contextmanager
def rust_failures(where: str, tokenizer: Path) -> Iterator[None]:
    """A failure of the tokenizers library (a pre-tokenizer regex over Oniguruma's retry limit panics in
    Rust: pyo3's PanicException, a BaseException) as one ConfigError naming the record and the tokenizer.
    File descriptor 2 goes to a temporary file meanwhile, as the Rust panic hook writes its message (and a
    backtrace) there itself; what a call that succeeds writes is passed on."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as capture:
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        except ConfigError:
            raise
        except BaseException as err:  # noqa: BLE001 - pyo3's PanicException is no Exception
            if not isinstance(err, Exception) and type(err).__name__ != "PanicException":
                raise  # Ctrl-C, SIGTERM as `spartron data` raises it
            why = " ".join(str(err).split())[:300]
            raise ConfigError(f"{where}: tokenizer {str(tokenizer)!r} failed on it ({type(err).__name__}: "
                              f"{why})") from None
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if ok and capture.tell():
                capture.seek(0)
                os.write(2, capture.read())


def _special_tokens(folder: Path) -> tuple[str | None, str | None, bool | None]:
    """(eos_token, bos_token, add_bos_token: True / False / None where unsaid) of a transformers folder's
    tokenizer_config.json."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None, None, None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ConfigError(f"{config}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{config}: not a JSON object (a tokenizer_config.json holds one)")

    def token(key: str) -> str | None:
        value = data.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return value if isinstance(value, str) else None

    add_bos = data.get("add_bos_token")
    return token("eos_token"), token("bos_token"), add_bos if isinstance(add_bos, bool) else None


def _post_processor_bos(backend) -> str | None:  # noqa: ANN001 - a tokenizers.Tokenizer
    """The one special token the tokenizer's post-processor puts before every sequence (Llama-3's folders add
    `<|begin_of_text|>` so, with no add_bos_token in tokenizer_config.json), or None."""
    plain, full = backend.encode("a", add_special_tokens=False).ids, backend.encode("a", add_special_tokens=True)
    if len(full.ids) > len(plain) and full.ids[1:1 + len(plain)] == plain and full.special_tokens_mask[0] == 1:
        return full.tokens[0]
    return None


def _control_ids(backend, chat_format: str) -> dict[str, list[int]]:  # noqa: ANN001 - a tokenizers.Tokenizer
    """The ids of the chat format's headers and turn ends, its special tokens matched: these strings are the
    control tokens the pipeline inserts (encoded before the backend is set to split special tokens)."""
    fmt = CHAT_FORMATS[chat_format]
    texts = {text for text in fmt.headers.values() if text} | {
        part for parts in fmt.ends.values() for part in parts if part is not EOS}
    return {text: backend.encode(text, add_special_tokens=False).ids for text in sorted(texts)}


def load_tokenizer(path: str | Path, eos_token: str | None = None, bos_token: str | None = None,
                   chat_format: str = "spartron") -> Tokenizer:
    """The tokenizer at `path` (tokenizer.json, or a folder holding it); ConfigError naming the path."""
    if chat_format not in CHAT_FORMATS:
        raise ConfigError(f"chat format {chat_format!r} is not one of {', '.join(CHAT_FORMATS)}")
    tokenizers = require("tokenizers", "tokenizing text (spartron data)", "pip install tokenizers")
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"tokenizer {str(path)!r}: no {TOKENIZER_FILE} there (give the file or a folder "
                          "saved by transformers' save_pretrained)")
    try:
        raw = file.read_bytes()
        backend = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except OSError as err:
        raise ConfigError(f"tokenizer {str(file)!r} cannot be read: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"tokenizer {str(file)!r} is not UTF-8 text (byte {err.start}): not a tokenizers JSON "
                          "file") from None
    except Exception as err:  # noqa: BLE001 - the Rust side raises a bare Exception for a bad file
        raise ConfigError(f"tokenizer {str(file)!r} is not a tokenizers JSON file: {err}") from None
    config_eos, config_bos, add_bos = _special_tokens(file.parent)
    if add_bos is None and bos_token is None:  # unsaid: the tokenizer's post-processor decides, as tokenizer(text)
        config_bos = _post_processor_bos(backend)
    eos, bos = eos_token or config_eos, bos_token or (config_bos if add_bos is not False else None)
    if eos is None:
        raise ConfigError(f"tokenizer {str(file)!r}: which token ends a document? Pass --eos TOKEN (no "
                          "tokenizer_config.json with an eos_token beside it)")
    ids = {}
    for what, tok in (("EOS", eos), ("BOS", bos)):
        if tok is not None:
            ids[what] = backend.token_to_id(tok)
            if ids[what] is None:
                raise ConfigError(f"tokenizer {str(file)!r}: the {what} token {tok!r} is not in its vocabulary")
    control = _control_ids(backend, chat_format)
    backend.encode_special_tokens = True  # from here on: a special token's string in corpus text is text
    return Tokenizer(backend, file, hashlib.sha256(raw).hexdigest(), backend.get_vocab_size(with_added_tokens=True),
                     ids["EOS"], ids.get("BOS"), chat_format, control)
