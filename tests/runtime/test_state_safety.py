"""Saved-state safety: nothing read back runs code, damaged files are named, no broken or half-written save,
write errors name the path and the bytes needed (real write failures through RLIMIT_FSIZE), on 1 and 2 ranks.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import resource
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from saved_files import rewrite_listed  # next to this file
from torch import nn

from spartron.runtime.state import (
    COMPLETE,
    METADATA_GLOBALS,
    StateLoadError,
    StateSaveError,
    complete_steps,
    load_state,
    read_metadata_file,
    save_state,
    step_dir,
)
from spartron.testing import run_distributed

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _quiet_dcp_single_process_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _model(seed: int = 0, width: int = 4):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():  # gradients without autograd: a parent that ran backward cannot fork
        p.grad = torch.randn_like(p)  # ranks on CUDA builds of torch (autograd's device threads)
    opt.step()
    return model, opt




# ---- hostile payloads ----------------------------------------------------------------------------------
def _str(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


def global_call(module: str, qualname: str, arg: str) -> bytes:
    """A protocol-4 pickle calling module.qualname(arg): STACK_GLOBAL admits dotted qualified names."""
    return b"\x80\x04" + _str(module) + _str(qualname) + b"\x93" + _str(arg) + b"\x85R."


class _Reduce:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _payloads(marker: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (pickle bytes, the global the refusal must name); each would create `marker` if run."""
    cmd = f"touch {marker}"
    return {
        "dotted-through-dcp": (global_call("torch.distributed.checkpoint.filesystem", "os.system", cmd),
                               "torch.distributed.checkpoint.filesystem.os.system"),
        "dotted-through-metadata-class": (global_call("torch.distributed.checkpoint.metadata",
                                                      "Metadata.__init__.__globals__", cmd),
                                          "torch.distributed.checkpoint.metadata.Metadata.__init__.__globals__"),
        "os-system-reduce": (pickle.dumps(_Reduce(os.system, cmd)), "posix.system"),
        "builtins-eval-reduce": (pickle.dumps(_Reduce(eval, f"__import__('os').system('{cmd}')")), "builtins.eval"),
        "nested-in-containers": (pickle.dumps({"a": [1, {"b": (_Reduce(os.system, cmd),)}]}), "posix.system"),
        "torch-prefix": (global_call("torch", "load", str(marker)), "torch.load"),
    }


PAYLOADS = ["dotted-through-dcp", "dotted-through-metadata-class", "os-system-reduce", "builtins-eval-reduce",
            "nested-in-containers", "torch-prefix"]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_hostile_metadata_is_refused_naming_file_and_global(tmp_path, payload):
    marker = tmp_path / "pwned"
    data, name = _payloads(marker)[payload]
    model, opt = _model()
    path = save_state(tmp_path / "run", 1, model, opt, {}, {}, CPU)
    rewrite_listed(path, ".metadata", data)
    with pytest.raises(StateLoadError) as info:
        load_state(path, model, opt, CPU)
    assert str(info.value) == (f"{path}/.metadata: refusing to unpickle {name}: not one of DCP's metadata types "
                               "(nothing from the file was run)")
    assert not marker.exists()


def _torch_file(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("payload", ["os-system-reduce", "builtins-eval-reduce", "nested-in-containers",
                                     "raw-dotted-pickle"])
def test_hostile_rank_tensor_file_is_refused_naming_file(tmp_path, payload):
    marker = tmp_path / "pwned"
    cmd = f"touch {marker}"
    data = {"os-system-reduce": lambda: _torch_file({"torch_cpu": _Reduce(os.system, cmd)}),
            "builtins-eval-reduce": lambda: _torch_file(_Reduce(eval, f"__import__('os').system('{cmd}')")),
            "nested-in-containers": lambda: _torch_file({"x": [torch.zeros(1), {"y": (_Reduce(os.system, cmd),)}]}),
            "raw-dotted-pickle": lambda: global_call("torch.serialization", "os.system", cmd)}[payload]()
    model, opt = _model()
    path = save_state(tmp_path / "run", 1, model, opt, {}, {}, CPU)
    rewrite_listed(path, "rank-00000.pt", data)
    refusal = (r"refusing to unpickle (posix\.system|eval): torch's weights-only loader does not allow it"
               r"|not loadable by torch's weights-only loader \(Unsupported operand 140")  # raw: refused at its 1st op
    with pytest.raises(StateLoadError, match=rf"^{path}/rank-00000\.pt: ({refusal})"):
        load_state(path, model, opt, CPU)
    assert not marker.exists()


def _dcp_items(path: Path):
    md = read_metadata_file(path / ".metadata")
    return md, {index.fqn: info for index, info in md.storage_data.items()}


def test_hostile_dcp_byte_item_is_refused_naming_the_distcp_file(tmp_path):
    """An optimizer param_groups entry (a DCP byte item) rewritten to call os.system when unpickled."""
    marker = tmp_path / "pwned"
    model, opt = _model()
    path = save_state(tmp_path / "run", 1, model, opt, {}, {}, CPU)
    md, items = _dcp_items(path)
    fqn = next(k for k in items if k.startswith("optim.param_groups") and k.endswith(".lr"))
    info = items[fqn]
    distcp = path / info.relative_path
    evil = _torch_file(_Reduce(os.system, f"touch {marker}"))
    blob = distcp.read_bytes()
    info.offset, info.length = len(blob), len(evil)  # the item now points at the appended payload
    rewrite_listed(path, info.relative_path, blob + evil)
    rewrite_listed(path, ".metadata", pickle.dumps(md))
    with pytest.raises(StateLoadError) as info_:
        load_state(path, model, opt, CPU)
    assert str(info_.value).startswith(f"{distcp}: item {fqn}: refusing to unpickle posix.system")
    assert not marker.exists()


def test_hostile_dcp_tensor_item_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    model, opt = _model()
    path = save_state(tmp_path / "run", 1, model, opt, {}, {}, CPU)
    md, items = _dcp_items(path)
    info = items["model.0.weight"]
    distcp = path / info.relative_path
    evil = _torch_file(_Reduce(os.system, f"touch {marker}"))
    blob = distcp.read_bytes()
    info.offset, info.length = len(blob), len(evil)
    rewrite_listed(path, info.relative_path, blob + evil)
    rewrite_listed(path, ".metadata", pickle.dumps(md))
    with pytest.raises(StateLoadError, match=rf"^{distcp}: refusing to unpickle posix\.system"):
        load_state(path, model, opt, CPU)
    assert not marker.exists()


def test_a_damaged_tensor_file_is_one_line_without_torchs_unsafe_advice(tmp_path):
    model, opt = _model()
    path = save_state(tmp_path / "run", 1, model, opt, {}, {}, CPU)
    rewrite_listed(path, "rank-00000.pt", b"garbage, not a torch file")
    with pytest.raises(StateLoadError) as info:
        load_state(path, model, opt, CPU)
    assert str(info.value) == (f"{path}/rank-00000.pt: not loadable by torch's weights-only loader (Unsupported "
                               "operand 103; nothing from the file was run)")


def test_symbolic_links_in_a_saved_step_are_refused(tmp_path):
    model, opt = _model()
    run = tmp_path / "run"
    path = save_state(run, 1, model, opt, {}, {}, CPU)
    outside = tmp_path / "elsewhere"
    (path / "rank-00000.pt").rename(outside)
    (path / "rank-00000.pt").symlink_to(outside)
    with pytest.raises(StateLoadError, match=rf"^{path}/rank-00000\.pt: a symbolic link \(to {outside}\); a saved "
                                             "step holds only its own files"):
        load_state(path, model, opt, CPU)
    (path / "rank-00000.pt").unlink()
    outside.rename(path / "rank-00000.pt")
    moved = tmp_path / "moved-step"
    path.rename(moved)
    path.symlink_to(moved)
    with pytest.raises(StateLoadError, match=rf"^{path} is a symbolic link \(to {moved}\): a saved step must be a "
                                             "directory inside the run directory"):
        load_state(path, model, opt, CPU)


def test_metadata_pointing_outside_the_step_is_refused(tmp_path):
    model, opt = _model()
    path = save_state(tmp_path / "run", 1, model, opt, {}, {}, CPU)
    md, items = _dcp_items(path)
    items["model.0.weight"].relative_path = "../../secret"
    rewrite_listed(path, ".metadata", pickle.dumps(md))
    with pytest.raises(StateLoadError, match=rf"^{path}/\.metadata: not valid DCP metadata \(storage entry"):
        load_state(path, model, opt, CPU)


@pytest.mark.parametrize(("name", "content", "expected"), [
    ("rank-00000.json", b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    ("rank-00000.json", b'{"rng": "x", "rank": {}}', "RNG state does not fit this run"),
    ("rank-00000.json", b"\xff\xfe not utf-8", "not valid JSON"),
    ("meta.json", b'{"format_version": 2, "step": "1"}', "field 'step' is missing or invalid"),
    ("meta.json", b'{"step": NaN}', "not valid JSON (ValueError: non-finite number NaN)"),
    ("meta.json", b"[]", "must hold a JSON object"),
    ("meta.json", b'{"format_version": 2, "step": 1, "world_size": 1, "counters": {"tokens": "x"}, "layout": null, '
                  b'"run_id": null, "config": null}', "field 'counters' is missing or invalid"),
])
def test_malformed_json_files_are_one_line_errors_naming_the_file(tmp_path, name, content, expected):
    model, opt = _model()
    path = save_state(tmp_path / "run", 1, model, opt, {}, {"data": {}}, CPU)
    rewrite_listed(path, name, content)
    with pytest.raises(StateLoadError) as info:
        load_state(path, model, opt, CPU)
    assert str(info.value).startswith(f"{path}/{name}: ") and expected in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("marker", "expected"), [
    ('{"format_version": 2, "files": [{"path": "../../etc/passwd", "size": 1, "crc32": 0}]}',
     "'files' must list {path, size, crc32} entries with plain file names"),
    ("", "not valid JSON"),
    ('{"format_version": 1}', "saved-state format 1, this Spartron reads formats 2 and 3"),
    ('{"format_version": 2, "files": []}', "'files' must name each file once, meta.json included"),
])
def test_bad_complete_marker_is_refused_naming_it(tmp_path, marker, expected):
    model, opt = _model()
    path = save_state(tmp_path / "run", 1, model, opt, {}, {}, CPU)
    (path / COMPLETE).write_text(marker)
    with pytest.raises(StateLoadError) as info:
        load_state(path, model, opt, CPU)
    assert str(info.value).startswith(f"{path}/{COMPLETE}: ") and expected in str(info.value)


def test_metadata_allowlist_is_exactly_what_dcp_pickles(tmp_path):
    """Every global a real .metadata references (fp32 + bf16 tensors, optimizer byte items), recorded with a
    plain unpickler: the allowlist is that set plus torch's dtypes, nothing more."""
    model, opt = _model()
    model[2].to(torch.bfloat16)
    path = save_state(tmp_path / "run", 1, model, opt, {}, {}, CPU)
    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO((path / ".metadata").read_bytes())).load()
    dtypes = {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    assert seen <= METADATA_GLOBALS
    assert METADATA_GLOBALS - dtypes == seen - dtypes
    assert {("torch", "bfloat16"), ("torch", "float32")} <= seen


# ---- integrity ---------------------------------------------------------------------------------------
def _two_steps(tmp_path):
    model, opt = _model()
    run = tmp_path / "run"
    save_state(run, 1, model, opt, {}, {}, CPU)
    save_state(run, 2, model, opt, {}, {}, CPU)
    return run, model, opt


def test_steps_past_eight_digits_still_count(tmp_path):
    model, opt = _model()
    save_state(tmp_path, 123_456_789, model, opt, {}, {}, CPU)
    assert step_dir(tmp_path, 123_456_789).name == "step-123456789"
    assert complete_steps(tmp_path) == [123_456_789]


def test_complete_marker_lists_every_file_with_size_and_crc(tmp_path):
    run, _, _ = _two_steps(tmp_path)
    path = step_dir(run, 2)
    marker = json.loads((path / COMPLETE).read_text())
    names = sorted(p.name for p in path.iterdir() if p.name != COMPLETE)
    assert [f["path"] for f in marker["files"]] == names == [".metadata", "__0_0.distcp", "meta.json",
                                                              "rank-00000.json", "rank-00000.pt"]
    for entry in marker["files"]:
        data = (path / entry["path"]).read_bytes()
        assert (entry["size"], entry["crc32"]) == (len(data), zlib.crc32(data))


def test_truncated_file_names_it_and_the_newest_intact_step(tmp_path):
    run, model, opt = _two_steps(tmp_path)
    distcp = step_dir(run, 2) / "__0_0.distcp"
    size = distcp.stat().st_size
    distcp.write_bytes(distcp.read_bytes()[:100])
    with pytest.raises(StateLoadError) as info:
        load_state(step_dir(run, 2), model, opt, CPU)
    assert str(info.value) == (f"{distcp}: 100 bytes, COMPLETE records {size} (truncated or overwritten); the "
                               f"newest intact step is step-00000001: move step-00000002 out of {run} to resume "
                               "from it")


def test_flipped_byte_is_a_checksum_error_unless_checksums_are_skipped(tmp_path):
    run, model, opt = _two_steps(tmp_path)
    path = step_dir(run, 2)
    _, items = _dcp_items(path)
    info = items["model.0.weight"]
    distcp = path / info.relative_path
    blob = bytearray(distcp.read_bytes())
    blob[info.offset + info.length - 3] ^= 0x40  # inside the tensor's data: DCP itself cannot notice
    distcp.write_bytes(bytes(blob))
    (step_dir(run, 1) / "meta.json").write_text("{}")  # the older step is damaged too
    with pytest.raises(StateLoadError, match=rf"^{distcp}: CRC-32 [0-9a-f]{{8}}, COMPLETE records [0-9a-f]{{8}} "
                                             rf"\(the file is corrupted\); no intact saved step is left in {run}$"):
        load_state(path, model, opt, CPU)
    load_state(path, model, opt, CPU, verify_checksums=False)  # sizes only: the option skips the read


def test_missing_file_is_named(tmp_path):
    run, model, opt = _two_steps(tmp_path)
    (step_dir(run, 2) / "rank-00000.pt").unlink()
    with pytest.raises(StateLoadError, match=r"rank-00000\.pt: missing \(listed in COMPLETE with \d+ bytes\); "
                                             "the newest intact step is step-00000001"):
        load_state(step_dir(run, 2), model, opt, CPU)


def _corrupt_rank1_then_load(rank, world, run):
    model, opt = _model()
    save_state(run, 1, model, opt, {}, {}, CPU)
    if rank == 1:
        blob = (step_dir(run, 1) / "rank-00001.json").read_bytes()
        (step_dir(run, 1) / "rank-00001.json").write_bytes(blob.replace(b"[", b"(", 1))
    torch.distributed.barrier()
    try:
        load_state(step_dir(run, 1), model, opt, CPU)
    except StateLoadError as err:
        return str(err)
    return "loaded"


def test_two_ranks_agree_on_a_damaged_file_of_one_rank(tmp_path):
    run = tmp_path / "run"
    errors = run_distributed(_corrupt_rank1_then_load, 2, run)
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"{step_dir(run, 1)}/rank-00001.json: CRC-32 ")
    assert errors[0].endswith(f"no intact saved step is left in {run}")


def test_a_loaded_non_finite_value_is_refused(tmp_path):
    """A tensor rewritten to NaN inside the .distcp file (manifest resealed): no save writes that."""
    model, opt = _model()
    path = save_state(tmp_path / "run", 1, model, opt, {}, {}, CPU)
    blob = (path / "__0_0.distcp").read_bytes()
    original = model[0].weight.detach().numpy().tobytes()
    assert blob.count(original) == 1
    rewrite_listed(path, "__0_0.distcp", blob.replace(original, struct.pack("<f", float("nan")) + original[4:]))
    with pytest.raises(StateLoadError, match=rf"^{path}: model\.0\.weight holds non-finite values \(no save writes "
                                             r"them: the files were altered\)$"):
        load_state(path, model, opt, CPU)


def _hostile_rank1_file_then_load(rank, world, run, marker):
    model, opt = _model()
    path = save_state(run, 1, model, opt, {}, {}, CPU)
    if rank == 1:
        rewrite_listed(path, "rank-00001.pt", _torch_file({"torch_cpu": _Reduce(os.system, f"touch {marker}")}))
    torch.distributed.barrier()
    try:
        load_state(path, model, opt, CPU)
    except StateLoadError as err:
        return str(err)
    return "loaded"


def test_a_hostile_file_of_one_rank_stops_every_rank(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "pwned"
    errors = run_distributed(_hostile_rank1_file_then_load, 2, run, marker)
    assert errors == [f"{step_dir(run, 1)}/rank-00001.pt: refusing to unpickle posix.system: torch's weights-only "
                      "loader does not allow it (nothing from the file was run)"] * 2
    assert not marker.exists()


# ---- never save a broken state -----------------------------------------------------------------------
def test_non_finite_parameter_is_never_saved(tmp_path):
    model, opt = _model()
    run = tmp_path / "run"
    save_state(run, 1, model, opt, {}, {}, CPU)
    with torch.no_grad():
        model[2].bias[0] = float("inf")
    with pytest.raises(StateSaveError, match=r"^refusing to save step 2: rank 0: model\.2\.bias holds non-finite "
                                             r"values \(no state was written; the last complete step is 1\)$"):
        save_state(run, 2, model, opt, {}, {}, CPU)
    assert sorted(p.name for p in run.iterdir()) == ["step-00000001"]


def _nan_in_rank1_optimizer_state(rank, world, run):
    model, opt = _model()
    if rank == 1:
        next(iter(opt.state.values()))["exp_avg_sq"].view(-1)[0] = float("nan")
    try:
        save_state(run, 1, model, opt, {}, {}, CPU)
    except StateSaveError as err:
        return str(err)
    return "saved"


def test_non_finite_optimizer_state_on_one_rank_stops_the_save_on_every_rank(tmp_path):
    run = tmp_path / "run"
    errors = run_distributed(_nan_in_rank1_optimizer_state, 2, run)
    assert errors == ["refusing to save step 1: rank 1: optim.state.0.weight.exp_avg_sq holds non-finite values "
                      "(no state was written; the last complete step is None)"] * 2
    assert not run.exists() or list(run.iterdir()) == []


# ---- full or read-only disk ----------------------------------------------------------------------------
def _save_under_file_size_limit(rank, world, run, limit_rank):
    """Step 1 saves; then `limit_rank` may write files of at most 4 KiB (RLIMIT_FSIZE: a real EFBIG from
    write(2), as a full disk gives ENOSPC) and step 2's save fails."""
    model, opt = _model(width=64)
    save_state(run, 1, model, opt, {}, {}, CPU)
    if rank == limit_rank:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    try:
        save_state(run, 2, model, opt, {}, {}, CPU)
    except StateSaveError as err:
        return str(err)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    return "saved"


@pytest.mark.parametrize("world", [1, 2])
def test_write_error_names_the_path_and_bytes_needed_and_keeps_the_previous_step(tmp_path, world):
    run = tmp_path / "run"
    limit_rank = world - 1
    errors = run_distributed(_save_under_file_size_limit, world, run, limit_rank)
    model, opt = _model(width=64)
    needed = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    needed += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    needed *= world  # every rank's shard (here: a full replica each)
    tmp = run / ".tmp-step-00000002"
    for err in errors:
        assert err.startswith(f"saving step 2 failed: rank {limit_rank}: OSError: [Errno 27] File too large: "
                              f"'{tmp}/__{limit_rank}_0.distcp'")
        assert f"the state needs about {needed / 1024:.1f} KiB ({needed} bytes) in {run}" in err
        assert err.endswith("free there; the last complete step (1) is intact")
    assert sorted(p.name for p in run.iterdir()) == ["step-00000001"]  # the temporary directory is gone
    load_state(step_dir(run, 1), model, opt, CPU) if world == 1 else None


_SAVE_TWICE = """
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch
from torch import nn
from spartron.runtime.state import StateSaveError, complete_steps, load_state, save_state, step_dir
run, cpu = sys.argv[1], torch.device("cpu")
model = nn.Linear(128, 128)
opt = torch.optim.AdamW(model.parameters())
for p in model.parameters():
    p.grad = torch.randn_like(p)
opt.step()
for step in (1, 2):
    try:
        save_state(run, step, model, opt, {}, {}, cpu)
    except StateSaveError as err:
        print("ERROR", err)
print("LEFT", sorted(os.listdir(run)), complete_steps(run))
if complete_steps(run):
    load_state(step_dir(run, 1), model, opt, cpu)
    print("LOADED")
"""


def _on_tmpfs(tmp_path, mount: str) -> tuple[Path, list[str]]:
    """Run _SAVE_TWICE with its run directory on a tmpfs, in a private mount namespace: real ENOSPC and
    EROFS from the kernel (root ignores permissions). `mount`: shell commands given MNT, the mount point.
    Skipped where a tmpfs cannot be mounted."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o size=4k tmpfs {mnt}"],
                           capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace here: {probe.stderr.strip()}")
    script = f"{mount.replace('MNT', str(mnt))} && exec {shlex.quote(sys.executable)} -c {shlex.quote(_SAVE_TWICE)} "
    done = subprocess.run(["unshare", "--mount", "sh", "-c", script + f"{mnt}/run"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 0, done.stderr[-2000:]
    return mnt / "run", done.stdout.splitlines()


def test_a_full_disk_names_path_and_bytes_and_keeps_the_previous_step(tmp_path):
    run, lines = _on_tmpfs(tmp_path, "mount -t tmpfs -o size=320k tmpfs MNT")  # one step (~200 KiB), not two
    needed = 3 * (128 * 128 + 128) * 4 + 2 * 4  # parameters + AdamW's two moments, fp32, + its step counters
    error = next(line for line in lines if line.startswith("ERROR"))
    assert error.startswith(f"ERROR saving step 2 failed: rank 0: OSError: [Errno 28] No space left on device: "
                            f"'{run}/.tmp-step-00000002/__0_0.distcp'; ")  # not torch's "unexpected pos"
    assert f"the state needs about {needed / 1024:.1f} KiB ({needed} bytes) in {run}, " in error
    assert error.endswith("free there; the last complete step (1) is intact")
    assert lines[-2:] == ["LEFT ['step-00000001'] [1]", "LOADED"]  # the temporary directory is gone


def test_a_read_only_disk_names_the_path(tmp_path):
    run, lines = _on_tmpfs(tmp_path, "mount -t tmpfs -o size=64k tmpfs MNT && mkdir MNT/run && "
                                     "mount -o remount,ro MNT")
    tmp = f"{run}/.tmp-step-00000001"
    assert lines[0].startswith(f"ERROR saving step 1 failed: rank 0: cannot create {tmp}: OSError: [Errno 30] "
                               f"Read-only file system: '{tmp}'; the state needs about ")
    assert lines[-1] == "LEFT [] []"


def test_run_dir_that_is_a_file_is_a_save_error_naming_the_path(tmp_path):
    model, opt = _model()
    run = tmp_path / "run"
    run.write_text("not a directory")
    expected = rf"^saving step 1 failed: rank 0: cannot create {run}/\.tmp-step-00000001: FileExistsError: "
    with pytest.raises(StateSaveError, match=expected + r".*the state needs about .* bytes\) in "):
        save_state(run, 1, model, opt, {}, {}, CPU)


# ---- keep_last -----------------------------------------------------------------------------------------
def test_keep_last_removes_older_steps_only_after_the_new_one_is_complete(tmp_path):
    model, opt = _model()
    run = tmp_path / "run"
    seen = []
    for step in range(1, 5):
        save_state(run, step, model, opt, {}, {}, CPU, keep_last=2,
                   before_commit=lambda tmp: seen.append(complete_steps(run)))
    assert complete_steps(run) == [3, 4]
    assert seen == [[], [1], [1, 2], [2, 3]]  # while step N is written, the older ones are all still there

    def crash(tmp):
        raise OSError("crash before the commit")

    with pytest.raises(OSError, match="crash before the commit"):
        save_state(run, 5, model, opt, {}, {}, CPU, keep_last=1, before_commit=crash)
    assert complete_steps(run) == [3, 4]  # nothing removed for a save that did not complete
    shutil.rmtree(run / ".tmp-step-00000005")


def _write_past_limit(rank, world, path):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (10, resource.RLIM_INFINITY))
    try:
        with open(path, "wb", buffering=0) as f:
            assert f.write(struct.pack("64s", b"x")) == 10  # write(2) stops at the limit ...
            f.write(b"x")  # ... and the next one fails
    except OSError as err:
        return err.errno
    return 0


def test_file_size_limit_really_fails_writes_even_as_root(tmp_path):
    """The write-error tests rely on RLIMIT_FSIZE making write(2) fail with EFBIG (root ignores permissions)."""
    assert run_distributed(_write_past_limit, 1, tmp_path / "probe") == [27]
