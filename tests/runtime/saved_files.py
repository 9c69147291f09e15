"""Editing a saved step the way an attacker who can write the run directory would."""

import json
import zlib
from pathlib import Path

from spartron.runtime.state import COMPLETE


def rewrite_listed(path: Path, name: str, data: bytes) -> None:
    """Replace a saved file AND its manifest entry (size, CRC-32), so only the content checks can object."""
    (path / name).write_bytes(data)
    marker = json.loads((path / COMPLETE).read_text())
    for entry in marker["files"]:
        if entry["path"] == name:
            entry.update(size=len(data), crc32=zlib.crc32(data))
    (path / COMPLETE).write_text(json.dumps(marker))
