"""`spartron convert --to-hf` at the seams (issue 34): it reads a run directory under the reader lock `spartron
eval` takes (never while a run trains there), and makes its output folder's missing parents, as mkdir -p, but
refuses a parent that is a file or a link loop in one line. `--from-hf --config F`: each key F's [model] sets that the
checkpoint's replaces is a note."""

from __future__ import annotations

import os
import socket

from spartron.launch.cli import main
from spartron.runtime.config import load_config
from spartron.runtime.rundir import RunDirLock


def test_convert_refuses_a_run_directory_a_run_is_training(run_dir, tmp_path, capsys):
    trainer = RunDirLock(run_dir)
    assert trainer.acquire() is None
    try:
        capsys.readouterr()
        assert main(["convert", "--from", str(run_dir), "--to-hf", str(tmp_path / "hf")]) == 2
    finally:
        trainer.release()
    assert capsys.readouterr().err == (
        f"spartron: error: {run_dir} is being trained by another run (pid {os.getpid()} on {socket.gethostname()}, "
        f"lock {run_dir}/.lock): reading its steps now could race a save or train.keep_last; wait for the run to "
        "end, or copy the step elsewhere and evaluate the copy\n")
    assert not (tmp_path / "hf").exists()
    assert main(["convert", "--from", str(run_dir), "--to-hf", str(tmp_path / "hf")]) == 0  # the lock is released
    reader = RunDirLock(run_dir)  # ... also by the export: a run may take the directory again
    assert reader.acquire() is None
    reader.release()


def test_convert_makes_the_missing_parents_of_its_output(run_dir, tmp_path, capsys):
    out = tmp_path / "a" / "b" / "out"
    assert main(["convert", "--from", str(run_dir), "--to-hf", str(out)]) == 0
    assert (out / "config.json").is_file() and sorted(os.listdir(tmp_path / "a")) == ["b"]
    assert sorted(os.listdir(out.parent)) == ["out"]


def test_convert_refuses_a_parent_that_is_a_file_or_a_link_loop(run_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    capsys.readouterr()
    assert main(["convert", "--from", str(run_dir), "--to-hf", str(tmp_path / "file" / "b" / "out")]) == 2
    assert capsys.readouterr().err == (f"spartron: error: {tmp_path / 'file' / 'b'}: cannot make the export's parent "
                                       "folder (Not a directory)\n")
    assert main(["convert", "--from", str(run_dir), "--to-hf", str(tmp_path / "loop" / "b" / "out")]) == 2
    assert capsys.readouterr().err == (f"spartron: error: {tmp_path / 'loop' / 'b'}: cannot make the export's parent "
                                       "folder (Too many levels of symbolic links)\n")
    assert (tmp_path / "file").read_text() == "x" and sorted(os.listdir(tmp_path)) == ["file", "loop"]


def test_import_notes_each_model_key_of_the_config_the_checkpoint_replaces(hf_dir, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('[model]\ndim = 64\nn_layers = 2\n\n[model.moe]\ntop_k = 2\nn_routed_experts = 8\n')
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(hf_dir), "--to", str(tmp_path / "run"), "--config", str(config)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("spartron: note: ")]
    assert notes == [  # n_layers and top_k equal the checkpoint's: no note
        f"spartron: note: model.dim = 64 in {config} is replaced by the checkpoint's 32 ({hf_dir}/config.json "
        "decides the model)",
        f"spartron: note: model.moe.n_routed_experts = 8 in {config} is replaced by the checkpoint's 4 "
        f"({hf_dir}/config.json decides the model)"]


def test_import_keeps_the_spartron_only_keys_the_config_sets(hf_dir, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('[model]\ndim = 64\n\n[model.moe]\ndispatcher = "local"\nbias_update_rate = 0.5\n')
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(hf_dir), "--to", str(tmp_path / "run"), "--config", str(config),
                 "--set", "model.moe.grouped_mm='loop'"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("spartron: note: ")]
    assert notes == [f"spartron: note: model.dim = 64 in {config} is replaced by the checkpoint's 32 ({hf_dir}/"
                     "config.json decides the model)"]  # how Spartron runs the function is the config's: no note
    saved = load_config(str(tmp_path / "run" / "model.toml"))
    moe = saved.model.moe
    assert (moe.dispatcher, moe.bias_update_rate, moe.grouped_mm) == ("local", 0.5, "loop")
    assert saved.model.dim == 32
