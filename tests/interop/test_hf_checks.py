"""Hugging Face import checks before it acts: config.json field by field (types, bounds), the machine's
memory before anything is allocated, every tensor's dtype and shape from the shards' own headers (checked
by Spartron: header length, JSON, offsets against the file size and the shape), and a shard that lacks a
tensor the index names. Every refusal names the file / tensor / field; through the CLI it is one line and
exit status 2."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_fixtures import TINY_HF, FailingSource, cli, loaded_model
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from benchmarks.auditing import stfile
from spartron.interop.hf import HFCheckpointError, HFConfigError, export_hf, import_hf
from spartron.interop.hf.header import HeaderError, read_header
from spartron.layers.costs import count_parameters
from spartron.layers.model import build_model
from spartron.runtime.hf_state import check_memory

WQ = "model.layers.1.self_attn.q_a_proj.weight"


def _copy(hf_dir: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    out = tmp_path / name
    shutil.copytree(hf_dir, out)
    return out


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


# ---- config.json -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("key", "value", "why"), [
    ("hidden_size", 2**40, "1099511627776: must be an integer in 1..65536"),
    ("num_hidden_layers", 100000, "100000: must be an integer in 1..1024"),
    ("hidden_size", "32", "'32': must be an integer in 1..65536"),
    ("hidden_size", True, "True: must be an integer in 1..65536"),
    ("hidden_size", 32.0, "32.0: must be an integer in 1..65536"),
    ("vocab_size", -1, "-1: must be an integer in 1..4194304"),
    ("q_lora_rank", [24], "[24]: must be an integer in 0..65536 or null"),
    ("rope_theta", float("nan"), "nan: must be a finite number in [1, 1e+12]"),
    ("routed_scaling_factor", "2.5", "'2.5': must be a number"),
    ("tie_word_embeddings", 0, "0: must be true or false"),
    ("rope_scaling", "yarn", "'yarn': must be a JSON object or null"),
    ("hidden_act", 7, "7: must be a string"),
])
def test_config_fields_are_checked_for_type_and_bounds_first(hf_dir, tmp_path, key, value, why):
    path = _copy(hf_dir, tmp_path)
    _edit_config(path, **{key: value})
    with pytest.raises(HFConfigError) as info:
        import_hf(path)
    assert str(info.value) == f"Hugging Face config.json: 1 setting(s) cannot be honoured: {key}: {why}"


def test_nested_rope_fields_are_checked(hf_dir, tmp_path):
    path = _copy(hf_dir, tmp_path)
    _edit_config(path, rope_scaling={"type": "yarn", "factor": "4", "original_max_position_embeddings": 1.5})
    with pytest.raises(HFConfigError) as info:
        import_hf(path)
    assert str(info.value) == ("Hugging Face config.json: 2 setting(s) cannot be honoured: "
                               "rope_scaling.original_max_position_embeddings: 1.5: must be an integer in "
                               "1..16777216; rope_scaling.factor: '4': must be a number")


def test_hostile_config_is_one_line_through_the_cli(hf_dir, tmp_path):
    path = _copy(hf_dir, tmp_path)
    _edit_config(path, hidden_size=2**40)
    proc = cli("convert", "--from-hf", str(path), "--to", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["spartron: error: Hugging Face config.json: 1 setting(s) cannot be "
                                        "honoured: hidden_size: 1099511627776: must be an integer in 1..65536"]
    assert not (tmp_path / "run").exists()


# ---- memory ----------------------------------------------------------------------------------------
def test_the_size_estimate_is_checked_against_the_machine_before_allocating(hf_dir, tmp_path):
    path = _copy(hf_dir, tmp_path)
    _edit_config(path, vocab_size=4_000_000, hidden_size=65536)  # in bounds, ~0.5 T parameters
    from spartron.interop.hf.convert import hf_model_config

    cfg = hf_model_config(path)
    n = count_parameters(cfg).total
    with pytest.raises(HFCheckpointError) as info:
        check_memory(cfg, "converting X", available=2**30)
    assert str(info.value) == (f"converting X: the model's {n:,} parameters with AdamW need "
                               f"{16 * n / 2**30:.1f} GiB, this machine has 1.0 GiB available")
    check_memory(cfg, "converting X", available=16 * n)  # exactly enough
    proc = cli("convert", "--from-hf", str(path), "--to", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith(f"spartron: error: converting {path}: the model's {n:,} parameters with AdamW "
                                  f"need {16 * n / 2**30:.1f} GiB, this machine has ")
    assert not (tmp_path / "run").exists()


# ---- tensor dtypes and shapes ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, torch.uint8, torch.float64])
def test_non_float_weights_are_refused_by_name(hf_dir, tmp_path, dtype):
    path = _copy(hf_dir, tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors[WQ] = tensors[WQ].to(dtype)
    save_file(tensors, str(path / "model.safetensors"))
    names = {torch.int8: "I8", torch.int32: "I32", torch.bool: "BOOL", torch.uint8: "U8", torch.float64: "F64"}
    with pytest.raises(HFCheckpointError) as info:
        import_hf(path)
    assert str(info.value) == (f"{path / 'model.safetensors'}: {WQ} is {names[dtype]}; Spartron imports float32, "
                               "bfloat16 or float16 weights (dequantize or convert it first)")


def test_an_int8_weight_is_one_line_through_the_cli(hf_dir, tmp_path):
    path = _copy(hf_dir, tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors[WQ] = tensors[WQ].to(torch.int8)
    save_file(tensors, str(path / "model.safetensors"))
    proc = cli("convert", "--from-hf", str(path), "--to", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"spartron: error: {path / 'model.safetensors'}: {WQ} is I8; Spartron "
                                        "imports float32, bfloat16 or float16 weights (dequantize or convert it "
                                        "first)"]


def test_float16_and_bfloat16_weights_are_accepted(hf_dir, tmp_path):
    reference = load_file(hf_dir / "model.safetensors")
    for dtype in (torch.float16, torch.bfloat16):
        path = _copy(hf_dir, tmp_path, str(dtype))
        save_file({n: t.to(dtype) if "e_score" not in n else t for n, t in reference.items()},
                  str(path / "model.safetensors"))
        cfg, load = import_hf(path)
        model = build_model(cfg)
        load(model)
        weight = model.layers["1"].attn.wq_a.weight
        assert torch.equal(weight, reference[WQ].to(dtype).to(weight.dtype))


def test_a_shape_other_than_the_configs_is_refused_before_any_tensor_is_read(hf_dir, tmp_path):
    path = _copy(hf_dir, tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors[WQ] = tensors[WQ][:, :-1].contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(HFCheckpointError) as info:
        import_hf(path)
    assert str(info.value) == f"{path / 'model.safetensors'}: {WQ} has shape [24, 31], its config.json gives [24, 32]"


# ---- the files themselves --------------------------------------------------------------------------
def _last_tensor(header: dict) -> str:
    return max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])


def test_a_truncated_shard_names_the_file_and_the_tensor_it_cuts(hf_dir, tmp_path):
    path = _copy(hf_dir, tmp_path)
    shard = path / "model.safetensors"
    header, body = stfile.read(shard)
    shard.write_bytes(shard.read_bytes()[:-10])
    last = _last_tensor(header)
    end = header[last]["data_offsets"]
    with pytest.raises(HFCheckpointError) as info:
        import_hf(path)
    assert str(info.value) == (f"{shard}: tensor {last!r}: data_offsets {end} run past the file's {len(body) - 10} "
                               "data bytes (truncated?)")
    shard.write_bytes(b"\x01\x02\x03")
    with pytest.raises(HFCheckpointError, match=r"truncated \(3 bytes: not even the 8-byte header length\)$"):
        import_hf(path)


@pytest.mark.parametrize("damage", ["length", "json", "offsets", "dtype", "overlap"])
def test_a_corrupt_header_names_the_file(hf_dir, tmp_path, damage):
    path = _copy(hf_dir, tmp_path)
    shard = path / "model.safetensors"
    header, body = stfile.read(shard)
    size = shard.stat().st_size
    n = size - 8 - len(body)
    if damage == "length":
        shard.write_bytes((2**40).to_bytes(8, "little") + shard.read_bytes()[8:])
        expected = f"{shard}: header length {2**40} does not fit the file ({size} bytes; corrupt or truncated)"
    elif damage == "json":
        shard.write_bytes(n.to_bytes(8, "little") + b"{" + b" " * (n - 1) + body)
        expected = None
    elif damage == "offsets":
        header[WQ]["data_offsets"][1] -= 4
        stfile.write_raw(shard, header, body)
        begin, end = header[WQ]["data_offsets"]
        expected = (f"{shard}: tensor {WQ!r}: shape [24, 32] of F32 is 3072 bytes, its data_offsets {[begin, end]} "
                    f"hold {end - begin}")
    elif damage == "dtype":
        header[WQ]["dtype"] = "Q4"
        stfile.write_raw(shard, header, body)
        expected = f"{shard}: tensor {WQ!r}: unknown dtype 'Q4'"
    else:
        other = next(x for x in header if x not in ("__metadata__", WQ) and header[x]["data_offsets"][0] > 0
                     and header[x]["data_offsets"][1] - header[x]["data_offsets"][0] == 3072)
        header[other]["data_offsets"] = list(header[WQ]["data_offsets"])  # two tensors on the same bytes
        stfile.write_raw(shard, header, body)
        expected = None
    with pytest.raises(HFCheckpointError) as info:
        import_hf(path)
    message = str(info.value)
    assert message.startswith(f"{shard}: ") and "\n" not in message
    if expected is not None:
        assert message == expected
    elif damage == "json":
        assert message.startswith(f"{shard}: the header is not valid JSON")
    else:
        assert "(overlapping or a gap)" in message


def test_a_header_is_read_only_from_a_regular_file_and_never_waits_on_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "fifo.safetensors")  # opened without blocking: refused at once, as config.json's FIFO is
    (tmp_path / "dir.safetensors").mkdir()
    for name, why in (("fifo", "not a regular file"), ("dir", "not a regular file"),
                      ("gone", "cannot be read (No such file or directory)")):
        with pytest.raises(HeaderError) as info:
            read_header(tmp_path / f"{name}.safetensors")
        assert str(info.value) == f"{tmp_path / name}.safetensors: {why}"
    stfile.write_raw(tmp_path / "list.safetensors", [], b"")  # JSON, but no object
    with pytest.raises(HeaderError) as info:
        read_header(tmp_path / "list.safetensors")
    assert str(info.value) == f"{tmp_path / 'list.safetensors'}: the header is not a JSON object"


def test_a_shard_that_lacks_a_tensor_the_index_names(hf_dir, tmp_path):
    path = _copy(hf_dir, tmp_path)
    tensors = load_file(path / "model.safetensors")
    first = {n: t for i, (n, t) in enumerate(sorted(tensors.items())) if i % 2 == 0 and n != WQ}
    second = {n: t for n, t in tensors.items() if n not in first}
    (path / "model.safetensors").unlink()
    save_file(first, str(path / "a.safetensors"))
    save_file({n: t for n, t in second.items() if n != WQ}, str(path / "b.safetensors"))
    weight_map = {**{n: "a.safetensors" for n in first}, **{n: "b.safetensors" for n in second}}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert WQ in second
    with pytest.raises(HFCheckpointError) as info:
        import_hf(path)
    assert str(info.value) == (f"{path / 'b.safetensors'}: holds no tensor {WQ!r}, which "
                               "model.safetensors.index.json maps to it")


def test_symlinked_shards_of_a_hugging_face_cache_folder_are_accepted(hf_dir, tmp_path):
    """HF's cache: snapshots/<rev>/model.safetensors -> ../../blobs/<sha>. The index stays confined to plain
    names inside the folder; a link there is the cache's layout, and its file is checked like any other."""
    blobs, snap = tmp_path / "cache" / "blobs", tmp_path / "cache" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in hf_dir.iterdir():
        shutil.copy(f, blobs / f.name)
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    cfg, load = import_hf(snap)
    load(build_model(cfg))
    assert read_header(snap / "model.safetensors")[WQ].shape == (24, 32)


# ---- export ----------------------------------------------------------------------------------------
def test_export_is_atomic_and_leaves_nothing_on_failure(hf_dir, tmp_path):
    model = loaded_model(hf_dir)
    out = tmp_path / "parent" / "out"
    out.parent.mkdir()
    with pytest.raises(HFCheckpointError) as info:
        export_hf(FailingSource(model, 3, OSError(28, "No space left on device")), out, max_shard_bytes=4000)
    assert str(info.value) == ("reading the tensors of model-00004-of-00032.safetensors failed: No space left on "
                               "device (nothing was exported)")
    assert list(out.parent.iterdir()) == []  # no partial shards, no temporary folder: the retry just works
    with torch.no_grad():
        model.layers["1"].attn.wq_a.weight[3, 5] = float("nan")
    with pytest.raises(HFCheckpointError) as info:
        export_hf(model, out, max_shard_bytes=4000)
    assert str(info.value) == (f"{WQ} (Spartron's layers.1.attn.wq_a.weight) holds non-finite values: nothing was "
                               "exported")
    assert list(out.parent.iterdir()) == []
    (out.parent / "file").write_text("x")
    # a parent that is a file: one line, and nothing is made (missing parents are made, as `mkdir -p` does)
    with pytest.raises(HFCheckpointError, match=r"/file/out: cannot make the export's parent folder \(File exists\)|"
                                                r"/file: cannot make the export's parent folder"):
        export_hf(model, out.parent / "file" / "out")
    assert sorted(p.name for p in out.parent.iterdir()) == ["file"]


def test_export_into_an_empty_folder_with_normal_permissions_never_through_a_link(hf_dir, tmp_path):
    model = loaded_model(hf_dir)
    out = tmp_path / "empty"
    out.mkdir()
    old = os.umask(0o022)
    try:
        export_hf(model, out, max_shard_bytes=20_000)
    finally:
        os.umask(old)
    files = sorted(out.iterdir())
    assert len(files) > 3 and {oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {"0o644"}
    assert oct(stat.S_IMODE(out.stat().st_mode)) == "0o755"
    with pytest.raises(HFCheckpointError) as info:
        export_hf(model, out)
    assert str(info.value) == f"{out}: exists and is not an empty directory (an export writes a new one)"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    with pytest.raises(HFCheckpointError) as info:
        export_hf(model, tmp_path / "link")
    assert str(info.value) == f"{tmp_path / 'link'}: is a symbolic link (an export writes a new folder, not through " \
                              "a link)"
    assert list(elsewhere.iterdir()) == []


def test_mtp_layers_are_omitted_unless_asked_for_so_transformers_reports_no_unexpected_keys(hf_dir, tmp_path):
    cfg = import_hf(hf_dir)[0]
    model = build_model(cfg.model_copy(update={"mtp": cfg.mtp.model_copy(update={"depth": 1})}), seed=1)
    out = export_hf(model, tmp_path / "plain")
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0
    _, info = DeepseekV3ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert [list(info[k]) for k in ("unexpected_keys", "missing_keys", "mismatched_keys")] == [[], [], []]
    kept = export_hf(model, tmp_path / "mtp", with_mtp=True)
    assert json.loads((kept / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert import_hf(kept)[0].mtp.depth == 1 and import_hf(out)[0].mtp.depth == 0
    _, info = DeepseekV3ForCausalLM.from_pretrained(kept, output_loading_info=True)
    assert info["unexpected_keys"] and all(k.startswith("model.layers.2.") for k in info["unexpected_keys"])


def test_export_refusals_are_one_line_through_the_cli(hf_dir, run_dir, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    proc = cli("convert", "--from", str(run_dir), "--to-hf", str(tmp_path / "full"), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"spartron: error: {tmp_path / 'full'}: exists and is not an empty directory "
                                        "(an export writes a new one)"]
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    def full_disk():  # files may not grow past 30 kB: a write fails with EFBIG like a full disk's ENOSPC
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, 30_000))

    out = tmp_path / "exports" / "hf"
    out.parent.mkdir()
    proc = subprocess.run([sys.executable, "-m", "spartron.launch.cli", "convert", "--from", str(run_dir),
                           "--to-hf", str(out), "--max-shard-bytes", "40000"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, preexec_fn=full_disk)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    assert re.fullmatch(f"spartron: error: writing {re.escape(str(out))} failed at model-00001-of-"
                        r"\d{5}.safetensors: File too large \(nothing was exported\)\n", proc.stderr)
    assert list(out.parent.iterdir()) == []  # no partial shards, no temporary folder
    proc = cli("convert", "--from-hf", str(hf_dir), "--to", str(tmp_path / "r2"), "--with-mtp", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "spartron: error: --with-mtp goes with --to-hf DIR (an import keeps the MTP layers the checkpoint holds)"]


def _train_rank(rank, world, cfg):
    from spartron.runtime.trainer import train

    return train(cfg).records[-1]["step"]


def test_export_includes_the_runs_tokenizer_even_after_the_original_moved(hf_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    from spartron.launch.cli import main
    from spartron.runtime.config import config_from_dict
    from spartron.testing import run_distributed

    sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
    from text_corpus import make_tokenizer, text_folder

    tok = make_tokenizer(tmp_path / "tok" / "tokenizer.json")
    text_folder(tmp_path / "corpus", n_docs=30)
    tokens = tmp_path / "tokens"
    assert main(["data", str(tmp_path / "corpus"), "--tokenizer", str(tok), "--out", str(tokens), "--eos",
                 "<eos>"]) == 0
    assert json.loads((tokens / "tokens.json").read_text())["tokenizer_copy"] == ["tokenizer.json",
                                                                                   "tokenizer_config.json"]
    cfg = config_from_dict({"device": "cpu", "model": import_hf(hf_dir)[0].model_dump(mode="json"),
                            "train": {"steps": 1, "seq_len": 16, "global_batch_size": 2, "progress": False,
                                      "peak_tflops": 1.0, "save_every": 1, "run_dir": str(tmp_path / "run"),
                                      "data": {"kind": "packed", "path": str(tokens)}}})
    assert run_distributed(_train_rank, 1, cfg, timeout=180) == [1]
    shutil.move(tmp_path / "tok", tmp_path / "moved")
    capsys.readouterr()
    assert main(["convert", "--from", str(tmp_path / "run"), "--to-hf", str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out.endswith("with its tokenizer\n")
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(tmp_path / "moved" / "tokenizer.json"))
    assert theirs("the cat sat on a mat")["input_ids"] == ours.encode("the cat sat on a mat").ids
    assert theirs.eos_token == "<eos>"
    # config.json names the EOS the run's data ended documents with: generate() stops there (not at id 1)
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf_config["eos_token_id"], hf_config["bos_token_id"]) == (ours.token_to_id("<eos>"), None)


# ---- the checkpoint folder itself ------------------------------------------------------------------
def test_a_from_hf_path_that_is_no_checkpoint_folder_says_what_it_is(tmp_path, capsys):
    from spartron.launch.cli import main

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"\x80")
    (tmp_path / "dangling").symlink_to("gone")
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "model.safetensors").mkdir()
    expected = {
        "missing": "does not exist (a Hugging Face checkpoint folder is expected)",
        "fifo": "is a FIFO, not a folder (a Hugging Face checkpoint is a folder holding config.json and "
                "model.safetensors or model.safetensors.index.json)",
        "file": "is a regular file, not a folder (a Hugging Face checkpoint is a folder holding config.json and "
                "model.safetensors or model.safetensors.index.json)",
        "dangling": "is a dangling symbolic link (to 'gone'), not a folder (a Hugging Face checkpoint is a folder "
                    "holding config.json and model.safetensors or model.safetensors.index.json)",
        "loop": "is a looping symbolic link (to 'loop'), not a folder (a Hugging Face checkpoint is a folder "
                "holding config.json and model.safetensors or model.safetensors.index.json)",
        "empty": "a folder without a Hugging Face safetensors checkpoint (neither model.safetensors.index.json "
                 "nor model.safetensors in it)",
        "pickled": "a folder without a Hugging Face safetensors checkpoint (neither model.safetensors.index.json "
                   "nor model.safetensors in it); its pytorch_model.bin is not read (a pickle can run code): save "
                   "the model as safetensors",
    }
    for name, why in expected.items():
        assert main(["convert", "--from-hf", str(tmp_path / name), "--to", str(tmp_path / "run")]) == 2
        assert capsys.readouterr().err.splitlines() == [f"spartron: error: {tmp_path / name}: {why}"]
    assert main(["convert", "--from-hf", str(tmp_path / "odd"), "--to", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"spartron: error: {tmp_path / 'odd' / 'model.safetensors'}: a folder, not a file"]
    assert not (tmp_path / "run").exists()


def test_a_killed_exports_temporary_folder_is_removed_by_the_retry(run_dir, tmp_path):
    out = tmp_path / "exports" / "hf"
    out.parent.mkdir()
    command = [sys.executable, "-m", "spartron.launch.cli", "convert", "--from", str(run_dir), "--to-hf",
               str(out), "--max-shard-bytes", "1000"]
    proc = subprocess.Popen(command, cwd=tmp_path, stderr=subprocess.DEVNULL)
    while not list(out.parent.glob(".hf.tmp-*")):  # made before the first shard is written
        assert proc.poll() is None, "the export ended before it was killed"
    proc.kill()
    assert proc.wait(timeout=60) == -9
    left = list(out.parent.glob(".hf.tmp-*"))
    assert len(left) == 1 and not out.exists()
    assert re.fullmatch(rf"\.hf\.tmp-[A-Za-z0-9._]+-{proc.pid}-[0-9a-f]{{8}}", left[0].name)
    retry = cli("convert", "--from", str(run_dir), "--to-hf", str(out), cwd=tmp_path)
    assert retry.returncode == 0, retry.stderr
    assert retry.stderr.splitlines() == [f"spartron: note: removed {left[0]}, left by process {proc.pid} of this "
                                         "host, which is no longer running"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf"] and (out / "config.json").is_file()


# ---- what the audit found: values, shards against the index, JSON files that are no files, field names ----------
def _poison(path: Path, name: str, value: float) -> None:
    tensors = load_file(path / "model.safetensors")
    tensors[name].view(-1)[3] = value
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(("name", "value"), [("model.embed_tokens.weight", float("nan")),
                                             ("model.layers.1.mlp.experts.3.up_proj.weight", float("inf")),
                                             ("model.layers.1.mlp.gate.e_score_correction_bias", float("nan"))])
def test_a_non_finite_value_is_refused_as_it_is_read_naming_the_hf_tensor_and_file(hf_dir, tmp_path, name, value):
    path = _copy(hf_dir, tmp_path)
    _poison(path, name, value)
    cfg, load = import_hf(path)  # headers only: the values are checked as each tensor is read
    with pytest.raises(HFCheckpointError) as info:
        load(build_model(cfg))
    assert str(info.value) == (f"{path / 'model.safetensors'}: {name} holds non-finite values (NaN or Inf): "
                               "nothing is imported from a checkpoint with them")


def test_train_init_from_refuses_a_non_finite_tensor_naming_the_key_file_and_tensor(hf_dir, tmp_path):
    from spartron.runtime.config import ConfigError, RunConfig
    from spartron.runtime.init_from import init_from_factory

    path = _copy(hf_dir, tmp_path)
    _poison(path, "model.embed_tokens.weight", float("nan"))
    cfg = RunConfig.model_validate({"model": import_hf(path)[0].model_dump(mode="json"),
                                    "train": {"init_from": f"hf:{path}"}})
    build = init_from_factory(cfg, lambda run_cfg, groups: build_model(run_cfg.model))
    with pytest.raises(ConfigError) as info:
        build(cfg, None)
    assert str(info.value) == (f"train.init_from {str(path)!r}: {path / 'model.safetensors'}: "
                               "model.embed_tokens.weight holds non-finite values (NaN or Inf): nothing is imported "
                               "from a checkpoint with them")


def _two_shards(path: Path, extra_in_a: dict[str, torch.Tensor] | None = None) -> None:
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    a = {n: tensors[n] for n in names[: len(names) // 2]}
    b = {n: tensors[n] for n in names[len(names) // 2:]}
    (path / "model.safetensors").unlink()
    save_file({**a, **(extra_in_a or {})}, str(path / "a.safetensors"))
    save_file(b, str(path / "b.safetensors"))
    weight_map = {**{n: "a.safetensors" for n in a}, **{n: "b.safetensors" for n in b}}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_a_shard_must_hold_exactly_what_the_index_maps_to_it(hf_dir, tmp_path):
    extra = "model.layers.1.mlp.experts.99.up_proj.weight"
    path = _copy(hf_dir, tmp_path, "extra")
    _two_shards(path, {extra: torch.zeros(4)})
    with pytest.raises(HFCheckpointError) as info:
        import_hf(path)
    assert str(info.value) == (f"{path / 'a.safetensors'}: holds {extra!r}, which model.safetensors.index.json "
                               "does not list (a tensor its config.json does not explain)")
    path = _copy(hf_dir, tmp_path, "twice")
    norm = "model.norm.weight"
    _two_shards(path, {norm: torch.ones(32)})
    assert json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][norm] == "b.safetensors"
    with pytest.raises(HFCheckpointError) as info:
        import_hf(path)
    assert str(info.value) == (f"{path / 'a.safetensors'}: holds {norm!r} too, which model.safetensors.index.json "
                               f"maps to {path / 'b.safetensors'} (a tensor present twice)")
    path = _copy(hf_dir, tmp_path, "rope")  # what transformers itself skips on load is no weight: accepted
    _two_shards(path, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    cfg, load = import_hf(path)
    load(build_model(cfg))


def test_config_json_is_read_only_from_a_small_regular_file(hf_dir, tmp_path):
    for name, make, why in (
            ("fifo", lambda p: os.mkfifo(p), "is a FIFO, not a regular file"),
            ("zero", lambda p: p.symlink_to("/dev/zero"), "is a character device, not a regular file"),
            ("dir", lambda p: p.mkdir(), "is a folder, not a regular file"),
            ("big", lambda p: p.write_bytes(b"{}" + b" " * 2**20),
             f"{2**20 + 2} bytes, larger than the {2**20} a JSON file of a Hugging Face checkpoint may be here")):
        path = _copy(hf_dir, tmp_path, name)
        (path / "config.json").unlink()
        make(path / "config.json")
        with pytest.raises(HFCheckpointError) as info:
            import_hf(path)
        assert str(info.value) == f"{path / 'config.json'}: {why}"
    path = _copy(hf_dir, tmp_path, "cli")
    (path / "config.json").unlink()
    os.mkfifo(path / "config.json")
    proc = cli("convert", "--from-hf", str(path), "--to", str(tmp_path / "run"), cwd=tmp_path)
    assert (proc.returncode, proc.stderr.splitlines()) == (
        2, [f"spartron: error: {path / 'config.json'}: is a FIFO, not a regular file"])
    path = _copy(hf_dir, tmp_path, "linked")  # a link to a regular file (a Hugging Face cache) is read
    (path / "config.json").rename(tmp_path / "config.json")
    (path / "config.json").symlink_to(tmp_path / "config.json")
    import_hf(path)


@pytest.mark.parametrize(("changes", "why"), [
    ({"num_experts_per_tok": 9}, "1 setting(s) cannot be honoured: num_experts_per_tok: 9: must be <= "
                                 "n_routed_experts (4)"),
    ({"first_k_dense_replace": 99}, "1 setting(s) cannot be honoured: first_k_dense_replace: 99: must be <= "
                                    "num_hidden_layers (2)"),
    ({"num_attention_heads": 3}, "1 setting(s) cannot be honoured: num_key_value_heads: 2: must equal "
                                 "num_attention_heads (3): MLA has one KV head per attention head"),
    ({"n_group": 3}, "1 setting(s) cannot be honoured: n_group: 3: must divide n_routed_experts (4)"),
    ({"n_group": 2, "topk_group": 1, "num_experts_per_tok": 3},
     "1 setting(s) cannot be honoured: num_experts_per_tok: 3: exceeds the experts of topk_group (1) groups of 2"),
    ({"topk_group": 2}, "1 setting(s) cannot be honoured: topk_group: 2: must be <= n_group (1)"),
    ({"qk_rope_head_dim": 7}, "1 setting(s) cannot be honoured: qk_rope_head_dim: 7: must be even (RoPE rotates "
                              "pairs)"),
    ({"hidden_size": None, "v_head_dim": None}, "2 setting(s) cannot be honoured: hidden_size: missing (a required "
     "field: it decides the tensors' shapes); v_head_dim: missing (a required field: it decides the tensors' "
     "shapes)"),
])
def test_config_json_is_checked_across_fields_in_its_own_terms_before_mapping(hf_dir, tmp_path, changes, why):
    path = _copy(hf_dir, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config.update({k: v for k, v in changes.items() if v is not None})
    for key in (k for k, v in changes.items() if v is None):
        config.pop(key)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFConfigError) as info:
        import_hf(path)
    assert str(info.value) == f"Hugging Face config.json: {why}"


def test_a_mapped_config_spartron_refuses_names_the_config_json_field():
    from spartron.interop.hf.config_map import HF_FIELD_OF

    assert HF_FIELD_OF["top_k"] == "num_experts_per_tok" and HF_FIELD_OF["first_k_dense"] == "first_k_dense_replace"
    hf = {**DeepseekV3Config(**TINY_HF).to_dict(), "index_n_heads": 2, "index_head_dim": 4, "index_topk": 8,
          "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"]}
    hf.pop("rope_interleave", None)
    from spartron.interop.hf import model_config_from_hf

    with pytest.raises(HFConfigError) as info:
        model_config_from_hf(hf)
    assert str(info.value) == ("Hugging Face config.json maps to an invalid Spartron config (from config.json's "
                               "index_head_dim, qk_rope_head_dim): model.dsa.index_head_dim 4 must be >= "
                               "model.mla.qk_rope_head_dim 8: the indexer rotates its first qk_rope_head_dim dims")


def test_plan_runs_trains_init_from_check(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[train]\ninit_from = "hf:nope"\n')
    proc = cli("plan", str(config), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert proc.stderr.splitlines() == [f"spartron: error: train.init_from 'nope': {Path('nope')}: does not exist "
                                        "(a Hugging Face checkpoint folder is expected)"]


def test_convert_refuses_what_its_direction_does_not_use_and_where_it_would_write_through_a_link(hf_dir, tmp_path,
                                                                                                 capsys):
    from spartron.launch.cli import main

    def refused(*argv: str) -> list[str]:
        assert main(["convert", *argv]) == 2
        return capsys.readouterr().err.splitlines()

    hf, run = str(hf_dir), str(tmp_path / "run")
    assert refused("--from-hf", hf, "--to", run, "--max-shard-bytes", "100") == [
        "spartron: error: --max-shard-bytes goes with --to-hf DIR (an import writes a saved state, not shards)"]
    for flag, value in (("--config", "x.toml"), ("--set", "train.lr=1.0")):
        assert refused("--from", run, "--to-hf", str(tmp_path / "out"), flag, value) == [
            f"spartron: error: {flag} goes with --from-hf (an export writes the saved step's own [model]; it reads "
            "no run config)"]
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")  # to nothing (a link to an empty folder is accepted)
    assert refused("--from-hf", hf, "--to", str(tmp_path / "link")) == [
        f"spartron: error: {tmp_path / 'link'}: is a symbolic link to nothing (to {str(tmp_path / 'elsewhere')!r}); "
        "an imported state starts a new run directory or fills an empty one"]
    assert not (tmp_path / "elsewhere").exists()
    long = "o" * 5000
    assert refused("--from-hf", hf, "--to", str(tmp_path / long)) == [
        f"spartron: error: {str(tmp_path / long)[:200]}: cannot be used as a run directory (File name too long)"]
    assert refused("--from-hf", hf, "--to", run, "--set", "model.dim=16") == [
        "spartron: error: --set model.dim: 16, the Hugging Face checkpoint has 32 (an import takes the checkpoint's "
        "[model])"]
    assert not (tmp_path / "run").exists()


def test_an_export_never_writes_into_the_run_directory_it_reads(run_dir, tmp_path, capsys):
    from spartron.launch.cli import main

    capsys.readouterr()
    for target in (run_dir / "step-00000000" / "hf", run_dir / "hf"):
        assert main(["convert", "--from", str(run_dir), "--to-hf", str(target)]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"spartron: error: {target}: inside the run directory {run_dir} the step is read from (an export writes a "
            "folder outside any run directory)"]
        assert not target.exists()
    assert main(["convert", "--from", str(run_dir), "--to-hf", str(tmp_path / "out")]) == 0


def test_an_exported_fp32_master_run_imports_again_without_rounding(hf_dir, tmp_path):
    cfg = import_hf(hf_dir)[0].model_copy(update={"dtype": "bfloat16", "master_dtype": "float32"})
    model = build_model(cfg)  # stored in float32: the masters
    export_hf(model, tmp_path / "hf")
    again, load = import_hf(tmp_path / "hf")
    back = build_model(again)
    load(back)
    assert again.dtype == "float32"
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(not torch.equal(v, v.bfloat16().float()) for v in ours.values())  # bits bf16 would round away
