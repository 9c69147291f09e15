"""Entries of a run directory, opened and created without following symbolic links.

Why: a run directory can hold entries that a user, a copy tool or an attacker put there (a `.lock`,
`metrics.jsonl` or `logs/rank1.log` linked to a file elsewhere, a FIFO, a step folder linked into another
run). A run writes, truncates and removes only what really lies inside its directory: a path below the run
directory is walked one component at a time with O_NOFOLLOW, each relative to its parent's descriptor (an
entry swapped for a link between a check and the open is still refused), and a file is used only if it is a
regular file (with one name when written). The open is non-blocking, so a FIFO under a file's name is
refused instead of hanging the run. The run directory itself may be a link (a user's choice of disk).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_HINT = "a run reads and writes only regular files and folders inside its run directory; remove it"


class UnsafeEntryError(OSError):
    """An entry of a run directory that is a symbolic link, not a regular file or folder, or a hard link."""


def _what(path: Path) -> str:
    """How the entry at `path` differs from a regular file or folder (lstat: links are not followed)."""
    try:
        st = os.lstat(path)
    except OSError as err:
        return f"cannot be inspected ({err.strerror or err})"
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"is a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "is a symbolic link"
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file"))
    return "is " + next((name for test, name in kinds if test(st.st_mode)), "not a regular file")


def describe(path: Path) -> str:
    """'is a symbolic link (to X)', 'is a FIFO', ...: what the entry at `path` is, links not followed."""
    return _what(path)


def refusal(path: Path, what: str | None = None, hint: str = _HINT) -> UnsafeEntryError:
    """The one-line error for a hostile entry: '<path> <what it is>: <hint>'."""
    return UnsafeEntryError(f"{path} {what or _what(path)}: {hint}")


def _walk(root: Path, parts: tuple[str, ...], create: bool) -> int:
    """A descriptor of root/parts..., every component below root opened with O_NOFOLLOW (created if asked)."""
    if create:
        root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    here = root
    try:
        for name in parts:
            here = here / name
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                nxt = _open_dir_at(fd, name, here)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise refusal(here) from None
                raise
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dir_at(fd: int, name: str, path: Path) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise refusal(path) from None
        raise


def _parts(relative: str | Path) -> tuple[str, ...]:
    parts = Path(relative).parts
    if not parts or Path(relative).is_absolute() or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"not a plain relative path inside a run directory: {relative!r}")
    return parts


def open_file(root: Path, relative: str | Path, flags: int, mode: int = 0o644) -> int:
    """os.open of root/relative that never follows a link below root and returns a descriptor only of a
    regular file (one with a single name when opened for writing). With O_CREAT the missing folders are
    created (also without following links). UnsafeEntryError names the entry; other OSErrors as os.open's."""
    root, parts = Path(root), _parts(relative)
    path = root.joinpath(*parts)
    parent = _walk(root, parts[:-1], create=bool(flags & os.O_CREAT))
    try:
        try:
            fd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=parent)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENOTDIR):
                raise refusal(path) from None
            raise
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        writing = flags & (os.O_WRONLY | os.O_RDWR)
        if not stat.S_ISREG(st.st_mode):
            raise refusal(path)
        if writing and st.st_nlink > 1:
            raise refusal(path, f"is a hard link (one of {st.st_nlink} names of one file)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dir(root: Path, relative: str | Path) -> Path:
    """Create root/relative (and the folders above it, below root) unless it exists as a real folder;
    UnsafeEntryError if any component below root is a link or not a folder. Returns the path."""
    root, parts = Path(root), _parts(relative)
    os.close(_walk(root, parts, create=True))
    return root.joinpath(*parts)


def check_entry(path: Path, kind: str) -> None:
    """UnsafeEntryError unless `path` is absent or really is a `kind` ('file' or 'dir'), not a link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    ok = stat.S_ISREG(st.st_mode) if kind == "file" else stat.S_ISDIR(st.st_mode)
    if not ok:
        raise refusal(path)


def remove_tree(path: Path) -> None:
    """Remove a folder of the run directory and what it holds; a link (or anything but a folder) there is
    refused, never followed. shutil.rmtree itself does not follow links inside the folder (fd-based)."""
    check_entry(path, "dir")
    if os.path.lexists(path):
        shutil.rmtree(path)
