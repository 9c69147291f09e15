"""Local text corpora: jsonl (or gzipped jsonl), parquet and plain-text files, or a folder of them, read as
documents.

A record is a pretraining document (a string under `text_key`, default "text") or a chat
(`messages`: a list of {"role", "content"} with role system / user / assistant / tool). A folder
is read recursively in sorted path order, so a corpus always yields the same documents in the same
order; a linked folder inside it is not descended (no loop), and an entry with a corpus suffix that is not a
regular file (a FIFO, a device, a broken or looping link) is refused by name rather than skipped. A record
holding both a document and a chat is refused as ambiguous. Nothing read here is executed: JSON through
`json`, parquet through pyarrow (optional: a clear error names the package when a .parquet file is met
without it), text as UTF-8.
"""

from __future__ import annotations

import gzip
import json
import os
import stat
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from spartron.configbase import ConfigError
from spartron.optional import require

SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet", ".txt")


def _kind(path: Path) -> str | None:
    """The corpus suffix a file name ends with (".jsonl.gz" before ".jsonl"), or None."""
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if path.name.endswith(s)), None)
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Document:
    """Plain text: every token is a training target."""

    text: str
    where: str = field(default="", compare=False)  # file:line (or file: row n) for errors about this record


@dataclass(frozen=True)
class Chat:
    """(role, content) turns: only the assistant turns are training targets (SFT)."""

    messages: tuple[tuple[str, str], ...]
    where: str = field(default="", compare=False)


def corpus_files(path: str | Path) -> list[Path]:
    """The corpus files of a file or a folder (recursive, sorted); a ConfigError naming the path if none."""
    path = Path(path)
    try:
        exists, is_link = path.exists(), path.is_symlink()
    except OSError as err:  # a name too long
        raise ConfigError(f"corpus {str(path)[:200]!r} cannot be read: {err.strerror or err}") from None
    if not exists:
        raise ConfigError(f"corpus {str(path)!r} " + ("is a broken or looping symbolic link" if is_link else
                                                      "does not exist"))
    if not path.is_file() and not path.is_dir():
        raise ConfigError(f"corpus {str(path)!r} is neither a regular file nor a folder")
    if path.is_file():
        if _kind(path) is None:
            raise ConfigError(f"corpus {str(path)!r}: unknown file type {path.suffix!r} (read: {', '.join(SUFFIXES)})")
        return [path]
    files = []
    for p in sorted(path.rglob("*")):  # rglob lists a linked folder but does not descend into it (no loop)
        if _kind(p) is None or p.is_dir():
            continue
        if not p.is_file():  # opening a FIFO waits forever, a device never ends: refused, not skipped
            raise ConfigError(_not_regular(p))
        files.append(p)
    if not files:
        raise ConfigError(f"corpus folder {str(path)!r} holds no {', '.join(SUFFIXES)} file")
    return files


def skipped_files(path: str | Path) -> list[Path]:
    """The files of a corpus folder that are not corpus files (another suffix: `.JSONL`, `.json`, `.zst`, a
    README), which corpus_files leaves out: `spartron data` names them."""
    path = Path(path)
    if not path.is_dir():
        return []
    return [p for p in sorted(path.rglob("*")) if _kind(p) is None and p.is_file()]


def _not_regular(path: Path) -> str:
    """Why a corpus file inside a folder cannot be read: a broken or looping link, or not a regular file."""
    link = f" (a symbolic link to {os.readlink(path)!r})" if path.is_symlink() else ""
    try:
        mode = path.stat().st_mode
    except OSError:
        return f"corpus file {str(path)!r} is a broken or looping symbolic link{link}"
    kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode) else
            "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "an unknown kind of entry")
    return f"corpus file {str(path)!r} is {kind}{link}, not a regular file"


def parse_record(record: object, text_key: str, where: str) -> Document | Chat:
    """A jsonl line or parquet row as a Document or a Chat; a ConfigError naming `where` otherwise."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if "messages" in record and text_key in record:
        raise ConfigError(f"{where}: ambiguous record: it holds both {text_key!r} (a document) and 'messages' "
                          "(a chat); keep one")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        turns = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ConfigError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
            if m["role"] not in ROLES:
                raise ConfigError(f"{where}: messages[{i}].role {m['role']!r} is not one of {', '.join(ROLES)}")
            _check_unicode(m["content"], f"{where}: messages[{i}].content")
            turns.append((m["role"], m["content"]))
        return Chat(tuple(turns), where)
    text = record.get(text_key)
    if not isinstance(text, str):
        raise ConfigError(f"{where}: a record needs a string {text_key!r} or a list 'messages'")
    _check_unicode(text, f"{where}: {text_key!r}")
    return Document(text, where)


def _check_unicode(text: str, what: str) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer (nor UTF-8) can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ConfigError(f"{what} holds a lone surrogate {text[err.start]!r} at character {err.start} "
                          "(not Unicode text)") from None


def _jsonl(path: Path, text_key: str) -> Iterator[Document | Chat]:
    try:
        with (gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb")) as f:
            for lineno, raw in enumerate(f, 1):
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8").strip()
                except UnicodeDecodeError as err:
                    raise ConfigError(f"{where}: not UTF-8 text (byte {err.start})") from None
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError) as err:  # ValueError: also an integer of > 4300 digits
                    raise ConfigError(f"{where}: not valid JSON: {err}") from None
                yield parse_record(record, text_key, where)
    except (OSError, EOFError, zlib.error) as err:  # gzip: a bad or truncated stream
        why = getattr(err, "strerror", None) or err
        raise ConfigError(f"corpus file {str(path)!r} cannot be read: {why}") from None


def _parquet(path: Path, text_key: str) -> Iterator[Document | Chat]:
    pq = require("pyarrow.parquet", f"reading the parquet corpus file {str(path)!r}", "pip install pyarrow")
    try:
        file = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several kinds for a file that is not parquet
        why = " ".join(str(err).split())
        raise ConfigError(f"{path}: not a readable parquet file ({type(err).__name__}: {why})") from None
    columns = [c for c in (text_key, "messages") if c in file.schema_arrow.names]
    if not columns:
        names = ", ".join(file.schema_arrow.names)
        raise ConfigError(f"{path}: no {text_key!r} or 'messages' column (columns: {names})")
    row = 0
    batches = file.iter_batches(columns=columns)
    while True:
        try:
            batch = next(batches, None)
            records = [] if batch is None else batch.to_pylist()
        except Exception as err:  # noqa: BLE001 - a corrupt page: pyarrow's OSError, ArrowInvalid, ...
            why = " ".join(str(err).split())
            raise ConfigError(f"{path}: row {row + 1} onwards cannot be read ({type(err).__name__}: {why})") from None
        if batch is None:
            return
        for record in records:
            row += 1
            record = {key: value for key, value in record.items() if value is not None}  # the other column's row
            yield parse_record(record, text_key, f"{path}: row {row}")


def _text(path: Path) -> Iterator[Document]:
    try:
        yield Document(path.read_bytes().decode("utf-8-sig"), str(path))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise ConfigError(f"corpus file {str(path)!r} cannot be read: {err.strerror or err}") from None


def read_corpus(path: str | Path, text_key: str = "text") -> Iterator[tuple[Path, Document | Chat]]:
    """(file, record) for every record of the corpus, files in sorted order, records in file order."""
    for file in corpus_files(path):
        kind = _kind(file)
        records = (_jsonl(file, text_key) if kind in (".jsonl", ".jsonl.gz") else
                   _parquet(file, text_key) if kind == ".parquet" else _text(file))
        for record in records:
            yield file, record
