"""`spartron convert --from-hf`: the import is built in a temporary sibling folder and moved into place at
the end, so a SIGTERM, a SIGKILL or an error never leaves a half-written run directory that the retry would
refuse (issue 34)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from spartron.interop.hf import HFCheckpointError
from spartron.runtime.config import load_config
from spartron.runtime.hf_state import import_hf_run_dir


def _command(hf: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "spartron.launch.cli", "convert", "--from-hf", str(hf), "--to", str(out)]


def _stopped_mid_import(paused_cli, hf: Path, out: Path, sig: int) -> subprocess.CompletedProcess:
    """Start the import, send `sig` while it waits before its first file inside its temporary folder (which
    the step being written is), return the finished process."""
    paused = paused_cli(_command(hf, out)[3:], at=f"/.{out.name}.tmp-", cwd=out.parent)
    [tmp] = list(out.parent.glob(f".{out.name}.tmp-*"))
    assert tmp.is_dir() and not out.exists()
    return paused.stop(sig)


def _retry_succeeds(hf: Path, out: Path) -> subprocess.CompletedProcess:
    retry = subprocess.run(_command(hf, out), cwd=out.parent, capture_output=True, text=True, timeout=120)
    assert retry.returncode == 0, retry.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.toml", "step-00000000"]
    assert (out / "model.toml").read_text().startswith("[model]\n")
    return retry


def test_sigterm_mid_import_removes_the_partial_import_and_the_retry_succeeds(hf_dir, tmp_path, paused_cli):
    out = tmp_path / "runs" / "run"
    out.parent.mkdir()
    proc = _stopped_mid_import(paused_cli, hf_dir, out, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    # Stopped inside the save of step 0 (DCP catches the handler's exception there; it still ends as a stop).
    # Besides torch's warning that the save runs in one process, one line:
    assert "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("spartron")] == [
        f"spartron: convert: stopped by SIGTERM; removed the partial import ({out} is as it was: run the same "
        "command again)"]
    assert list(out.parent.iterdir()) == []
    retry = _retry_succeeds(hf_dir, out)
    assert [line for line in retry.stderr.splitlines() if line.startswith("spartron:")] == []  # no leftover note
    assert sorted(p.name for p in out.parent.iterdir()) == ["run"]


def test_the_retry_after_a_sigkill_removes_the_dead_import_s_temporary_folder(hf_dir, tmp_path, paused_cli):
    out = tmp_path / "runs" / "run"
    out.parent.mkdir()
    proc = _stopped_mid_import(paused_cli, hf_dir, out, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    [left] = list(out.parent.iterdir())
    assert re.fullmatch(r"\.run\.tmp-.+-\d+-[0-9a-f]{8}", left.name) and left.is_dir()
    retry = _retry_succeeds(hf_dir, out)
    notes = [line for line in retry.stderr.splitlines() if line.startswith("spartron:")]
    assert notes == [f"spartron: note: removed {left}, left by process {left.name.split('-')[-2]} of this host, "
                     "which is no longer running"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["run"]


def test_an_existing_empty_folder_keeps_its_inode_and_mode_and_receives_the_import(hf_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir(mode=0o700)
    os.chmod(out, 0o710)
    inode = os.stat(out).st_ino
    step, _, toml = import_hf_run_dir(hf_dir, out)
    assert (step, toml) == (out / "step-00000000", out / "model.toml")
    assert os.stat(out).st_ino == inode and os.stat(out).st_mode & 0o777 == 0o710
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert sorted(p.name for p in out.iterdir()) == ["model.toml", "step-00000000"]


def test_an_error_mid_import_leaves_nothing(hf_dir, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(HFCheckpointError, match=r"^--set model\.vocab_size: 32, the Hugging Face checkpoint has 64"):
        import_hf_run_dir(hf_dir, out, load_config(None, ["model.vocab_size=32"]), ("model.vocab_size",))
    assert list(tmp_path.iterdir()) == []


def test_missing_parents_are_made_and_a_parent_that_is_a_file_is_one_error(hf_dir, tmp_path):
    step, _, _ = import_hf_run_dir(hf_dir, tmp_path / "a" / "b" / "run")
    assert step == tmp_path / "a" / "b" / "run" / "step-00000000" and step.is_dir()
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["run"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(HFCheckpointError) as err:
        import_hf_run_dir(hf_dir, tmp_path / "file" / "run")
    assert str(err.value) == (f"{tmp_path / 'file' / 'run'}: cannot make a temporary folder beside it (File exists); "
                              "nothing was imported")
