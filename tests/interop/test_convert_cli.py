"""`spartron convert --to-hf`: every way an export ends early (an unloadable tensor file, an exception from the
source, Ctrl-C, SIGTERM) removes its temporary folder, so nothing is left beside the export (issue 34)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import zlib

import pytest
from hf_fixtures import FailingSource, cli, loaded_model

from spartron.interop.hf import export_hf
from spartron.interop.hf.names import tensor_map
from spartron.runtime.hf_state import SavedStateSource


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("a bug")])
def test_an_exception_mid_export_removes_the_temporary_folder(hf_dir, tmp_path, error):
    model = loaded_model(hf_dir)
    out = tmp_path / "exports" / "out"
    out.parent.mkdir()
    source = FailingSource(model, 1, error)
    with pytest.raises(type(error)):
        export_hf(source, out, max_shard_bytes=4000)
    assert source.fetches == 2  # it stopped mid-export, after the temporary folder was made
    assert list(out.parent.iterdir()) == []


def test_an_unloadable_tensor_file_is_one_line_and_leaves_nothing(run_dir, tmp_path):
    step = tmp_path / "run" / "step-00000000"
    shutil.copytree(run_dir / "step-00000000", step)
    distcp = sorted(step.glob("*.distcp"))[0]
    distcp.write_bytes(b"\x80\x02garbage" + bytes(distcp.stat().st_size - 9))
    manifest = json.loads((step / "COMPLETE").read_text())  # resealed: the file list still verifies
    for entry in manifest["files"]:
        data = (step / entry["path"]).read_bytes()
        entry["size"], entry["crc32"] = len(data), zlib.crc32(data)
    (step / "COMPLETE").write_text(json.dumps(manifest))
    out = tmp_path / "exports" / "hf"
    out.parent.mkdir()
    proc = cli("convert", "--from", str(step), "--to-hf", str(out), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"spartron: error: {distcp}: not loadable by torch's weights-only loader "
                                        "(Unsupported operand 0; nothing from the file was run): nothing "
                                        "was exported"]
    assert list(out.parent.iterdir()) == []


def test_ctrl_c_while_a_saved_state_is_read_stays_an_interrupt_not_an_error(run_dir):
    """torch.distributed.checkpoint wraps whatever its reader raises, KeyboardInterrupt too: the source re-raises
    it (an HFCheckpointError would print `_Terminated` or `KeyboardInterrupt` as if the file were bad)."""
    source = SavedStateSource(run_dir)
    names = sorted({p.spartron for pieces in tensor_map(source.cfg).by_hf().values() for p in pieces})

    def interrupt(signum, frame):  # only inside torch.distributed.checkpoint's load; else try again 1 ms later
        while frame is not None and "torch/distributed/checkpoint" not in frame.f_code.co_filename:
            frame = frame.f_back
        if frame is None:
            signal.setitimer(signal.ITIMER_REAL, 0.001)
            return
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.005)
        with pytest.raises(KeyboardInterrupt):
            for _ in range(10_000):
                source.fetch(names)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_sigterm_during_an_export_removes_its_temporary_folder(run_dir, tmp_path):
    out = tmp_path / "exports" / "hf"
    out.parent.mkdir()
    command = [sys.executable, "-m", "spartron.launch.cli", "convert", "--from", str(run_dir), "--to-hf", str(out),
               "--max-shard-bytes", "1000"]
    proc = subprocess.Popen(command, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    while not list(out.parent.glob(".hf.tmp-*/*.safetensors")):  # mid-export: most of its time is in reading
        assert proc.poll() is None, "the export ended before it was stopped"  # tensors (torch wraps a signal)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert stderr.splitlines() == [f"spartron: convert: stopped by SIGTERM; removed the partial export ({out} is as "
                                   "it was: run the same command again)"]
    assert list(out.parent.iterdir()) == []
    retry = cli("convert", "--from", str(run_dir), "--to-hf", str(out), cwd=tmp_path)
    assert retry.returncode == 0 and retry.stderr == "", retry.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf"] and (out / "config.json").is_file()


def test_an_import_fills_a_run_directory_that_is_a_link_to_an_empty_folder_as_train_does(run_dir, tmp_path):
    hf = tmp_path / "hf"
    proc = cli("convert", "--from", str(run_dir), "--to-hf", str(hf), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "scratch").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "scratch")
    proc = cli("convert", "--from-hf", str(hf), "--to", "linked", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "linked").is_symlink()
    assert sorted(p.name for p in (tmp_path / "scratch").iterdir()) == ["model.toml", "step-00000000"]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("x")
    (tmp_path / "to-full").symlink_to(tmp_path / "full")
    proc = cli("convert", "--from-hf", str(hf), "--to", "to-full", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["spartron: error: to-full: exists and is not an empty directory; an imported "
                                        "state starts a new run directory"]
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["mine.txt"]
