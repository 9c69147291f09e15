"""Temporary sibling folders of an atomic write, named for their owner, and removal of the ones a killed
writer left behind.

Why: `spartron convert --to-hf` and `spartron data` write into a hidden folder beside their output and
rename it at the end. A SIGKILL skips every cleanup, so the folder stays (the retry still works, it makes a
new one). Its name says which process made it, `.<out>.<kind>-<host>-<pid>-<hex>`, so a retry removes
what a process of THIS host that is no longer running left; a folder of another host (a shared file
system) or of a live process is never touched, nor anything that is not a real folder of the current
user (a link under such a name is not followed).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import stat
from pathlib import Path

_NAME_CHARS = 100  # of the output's name: the temporary's name stays far below the file system's 255


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "_"


def _prefix(out: Path, kind: str) -> str:
    return f".{out.name[:_NAME_CHARS]}.{kind}-{_host()}-"


def make_sibling(out: Path, kind: str) -> Path:
    """A new folder beside `out` (same file system: the final rename is atomic), the umask's permissions,
    named `.<out>.<kind>-<host>-<pid>-<hex>`. OSError as os.mkdir's."""
    for _ in range(100):
        tmp = out.parent / f"{_prefix(out, kind)}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{out.parent}: no free name for a temporary folder")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        return True
    return True


def remove_stale(out: Path, kind: str) -> list[str]:
    """Remove the temporary siblings of `out` that a process of this host which is no longer running left
    (real folders of the current user only; links and other entries are left alone, never followed).
    Returns one `spartron: note:` line per folder removed."""
    pattern = re.compile(re.escape(_prefix(out, kind)) + r"(\d{1,10})-[0-9a-f]{8}$")
    try:
        names = sorted(os.listdir(out.parent))
    except OSError:
        return []
    notes = []
    for name in names:
        match = pattern.match(name)
        if not match or int(match.group(1)) == os.getpid() or _alive(int(match.group(1))):
            continue
        path = out.parent / name
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            shutil.rmtree(path)  # fd-based: nothing inside is followed through a link
        except OSError:
            continue
        notes.append(f"spartron: note: removed {path}, left by process {match.group(1)} of this host, which "
                     "is no longer running")
    return notes
