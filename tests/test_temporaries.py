"""A retry removes the temporary sibling a killed writer of this host left, and nothing else: not another
host's, not a live process's, not a link under such a name (never followed), not the output itself."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from spartron.temporaries import make_sibling, remove_stale


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_a_dead_local_writers_folder_is_removed(tmp_path):
    out = tmp_path / "out"
    mine = make_sibling(out, "tmp")
    host = mine.name.split("-")[1]
    assert mine.name.startswith(".out.tmp-") and mine.name.split("-")[2] == str(os.getpid())
    assert host == "".join(c if c.isalnum() or c == "." else "_" for c in socket.gethostname())[:64]
    dead = _dead_pid()
    stale = tmp_path / f".out.tmp-{host}-{dead}-0123abcd"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "model.safetensors").write_bytes(b"x")
    elsewhere = tmp_path / f".out.tmp-otherhost-{dead}-0123abcd"  # a shared file system: another host's
    elsewhere.mkdir()
    live = tmp_path / f".out.tmp-{host}-1-0123abcd"  # pid 1 is always running
    live.mkdir()
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    link = tmp_path / f".out.tmp-{host}-{dead}-89abcdef"
    link.symlink_to(target)
    partial = tmp_path / f".out.partial-{host}-{dead}-0123abcd"  # another kind: another tool's
    partial.mkdir()
    assert remove_stale(out, "tmp") == [f"spartron: note: removed {stale}, left by process {dead} of this host, "
                                        "which is no longer running"]
    assert not os.path.lexists(stale)
    assert elsewhere.is_dir() and live.is_dir() and mine.is_dir() and partial.is_dir()
    assert link.is_symlink() and (target / "keep.txt").read_text() == "mine"
    assert remove_stale(out, "tmp") == []
    assert remove_stale(tmp_path / "missing" / "out", "tmp") == []
