"""A small JSON object read from a file nobody vouches for: a checkpoint's config.json and index (folder.py),
a safetensors header (header.py).

Why one reader: the checks are the same everywhere (opened without blocking, as a FIFO would block forever;
a regular file by fstat before a byte is read, as /dev/zero never ends; UTF-8 JSON; an object), while each
caller words its refusal its own way. So the reader says which check failed (`JSONFileError.check`) and
the caller says it in one line naming its file.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


class JSONFileError(ValueError):
    """Which check failed: "unreadable" (opening or reading; `errno` and `detail` are the OS's), "irregular"
    (not a regular file), "json" (not UTF-8 JSON; `detail` is the parser's words), "object" (JSON, but no
    object)."""

    def __init__(self, check: str, detail: str = "", errno: int | None = None) -> None:
        super().__init__(f"{check}: {detail}" if detail else check)
        self.check, self.detail, self.errno = check, detail, errno


def _unreadable(err: OSError) -> JSONFileError:
    return JSONFileError("unreadable", str(err.strerror or err), err.errno)


@contextmanager
def open_regular(path: str | Path) -> Iterator[tuple[BinaryIO, int]]:
    """`path` opened for reading, and its size: a regular file (a symbolic link to one, as in a Hugging Face
    cache folder, is followed), checked before a byte is read. An OSError inside the block (a read that
    fails) is a JSONFileError("unreadable") too."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise _unreadable(err) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # before fdopen, which refuses a folder with its own error
        os.close(fd)
        raise JSONFileError("irregular")
    with os.fdopen(fd, "rb") as f:
        try:
            yield f, st.st_size
        except OSError as err:
            raise _unreadable(err) from None


def json_object(raw: bytes) -> dict:
    """`raw` parsed as a JSON object (nothing but the parse runs)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise JSONFileError("json", str(err)) from None
    if not isinstance(data, dict):
        raise JSONFileError("object")
    return data


__all__ = ["JSONFileError", "json_object", "open_regular"]
