"""Config validation holes closed by issue 20: strings, run names and dirs, non-finite and out-of-range
numbers, options the chosen mode ignores, DSA and micro-batch contradictions, unreadable config files,
and the checks run before ranks are spawned (spartron/runtime/preflight.py)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spartron.launch.cli import main
from spartron.runtime.config import ConfigError, RunConfig, dump_config, load_config
from spartron.runtime.preflight import check_before_launch, n_checkpoint_regions

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, list(overrides))
    return str(info.value)


# ---- strings ---------------------------------------------------------------------------------
@pytest.mark.parametrize("char, what", [("\\n", "a newline"), ("\\r", "a carriage return"),
                                        ("\\u0000", "a NUL byte")])
@pytest.mark.parametrize("key, template", [
    ("name", '"a{c}b"'), ("train.run_dir", '"/tmp/a{c}b"'), ("launch.venv", '"/v{c}x"'),
    ("launch.container", '"img{c}x"'), ("launch.env", '{{A = "x{c}y"}}'), ("launch.env", '{{"A{c}" = "x"}}'),
    ("launch.sbatch_args", '["--qos=a", "--x{c}"]'), ("ac.targets", '["aten::mm{c}"]'),
    ("train.data.path", '"/d{c}x"'),
])
def test_every_string_option_rejects_newline_cr_and_nul(key, template, char, what):
    extra = ["ac.mode=selective"] if key == "ac.targets" else []
    extra += ["train.data.kind=mmap"] if key == "train.data.path" else []
    message = _error(*extra, f"{key}={template.format(c=char)}")
    assert message.startswith(f"invalid config: {key}: must not contain {what}, got "), message


def test_every_string_field_of_every_section_is_checked():
    """The check lives in ConfigSection: a new str field anywhere is covered without code of its own."""
    from pydantic import ValidationError

    from spartron.configbase import ConfigSection

    class Probe(ConfigSection):
        label: str = "x"
        tags: list[str] = []
        table: dict[str, list[str]] = {}

    for bad in ({"label": "a\nb"}, {"tags": ["ok", "a\0"]}, {"table": {"k": ["a\rb"]}}, {"table": {"k\n": []}}):
        with pytest.raises(ValidationError, match="must not contain"):
            Probe(**bad)
    assert Probe(label="a b", tags=["x"], table={"k": ["v"]}).label == "a b"


# ---- run name and run dir --------------------------------------------------------------------
@pytest.mark.parametrize("name, message", [
    ("../../x", "must be one folder name under runs/"), ("a/b", "must be one folder name under runs/"),
    ("..", "must be one folder name under runs/"), (".", "must be one folder name under runs/"),
    ("a\\b", "must be one folder name under runs/"), (" x", "no leading or trailing spaces"),
    ("", "must be a non-empty run name"), ("   ", "must be a non-empty run name"),
    ("x" * 10_000, "must be at most 128 characters, got 10000"),
])
def test_bad_run_names_are_config_errors_naming_name(name, message):
    error = _error(f"name={json.dumps(name)}")
    assert error.startswith("invalid config: name: ") and message in error


def test_good_names_and_absolute_run_dirs_stay_allowed(tmp_path):
    assert load_config(TINY, ['name="exp-1.2_a b"']).name == "exp-1.2_a b"
    assert load_config(TINY, ['name="' + "x" * 128 + '"']).name == "x" * 128
    outside = str(tmp_path / ".." / "elsewhere")
    assert load_config(TINY, [f"train.run_dir={json.dumps(outside)}"]).train.run_dir == outside
    assert load_config(TINY, ["train.run_dir=sub/dir"]).train.run_dir == "sub/dir"


def test_relative_run_dir_may_not_climb_out_of_the_working_directory():
    assert _error("train.run_dir=../x") == (
        "invalid config: train.run_dir: a relative run directory must stay below the working directory "
        "(no '..'); give an absolute path to write elsewhere, got '../x'")
    assert "no '..'" in _error("train.run_dir=a/../../x")
    assert _error('train.run_dir=""') == ("invalid config: train.run_dir: must be a non-empty path "
                                          "(or leave it unset for runs/<name>)")


# ---- numbers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["train.lr", "train.weight_decay", "train.grad_clip", "train.min_lr_ratio",
                                 "train.peak_tflops", "parallel.timeout_s", "model.norm_eps",
                                 "model.init_std", "model.mla.rope_theta", "model.moe.route_scale",
                                 "model.moe.bias_update_rate", "model.mtp.loss_scale", "train.beta1"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_non_finite_floats_are_refused_everywhere(key, value):
    assert _error(f"{key}={value}") == f"invalid config: {key}: Input should be a finite number (got {float(value)!r})"


@pytest.mark.parametrize("override, message", [
    ("train.beta1=1.0", "train.beta1: Input should be less than 1 (got 1.0)"),
    ("train.beta2=1", "train.beta2: Input should be less than 1 (got 1)"),
    ("train.beta1=-0.1", "train.beta1: Input should be greater than or equal to 0 (got -0.1)"),
    ("model.norm_eps=-1e-6", "model.norm_eps: Input should be greater than 0 (got -1e-06)"),
    ("model.norm_eps=0", "model.norm_eps: Input should be greater than 0 (got 0)"),
    ("model.init_std=-0.02", "model.init_std: Input should be greater than 0 (got -0.02)"),
    ("model.init_std=0.0", "model.init_std: Input should be greater than 0 (got 0.0)"),
    ("model.mla.rope_theta=1", "model.mla.rope_theta: Input should be greater than 1 (got 1)"),
    ("model.moe.route_scale=0", "model.moe.route_scale: Input should be greater than 0 (got 0)"),
    ("train.seed=-1", "train.seed: Input should be greater than or equal to 0 (got -1)"),
    (f"train.seed={2**63}", f"train.seed: Input should be less than {2**63} (got {2**63})"),
])
def test_out_of_range_numbers_name_the_key(override, message):
    assert _error(override) == f"invalid config: {message}"


def test_yarn_values_must_be_positive():
    assert _error("model.mla.yarn={factor = 0.0}") == (
        "invalid config: model.mla.yarn.factor: Input should be greater than or equal to 1 (got 0.0)")


# ---- options the chosen mode ignores ---------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["train.data.path=/x.bin"], "train.data.path is set but train.data.kind = 'synthetic' reads no file"),
    (["train.data.token_dtype=uint32"], "train.data.token_dtype is set but train.data.kind = 'synthetic'"),
    (["offload.window=[0]"], "offload.window is set but offload.enabled = false"),
    (["offload.keep_last=2"], "offload.keep_last is set but offload.enabled = false"),
    (["offload.what=inputs_and_dsa_ids"], "offload.what is set but offload.enabled = false"),
    (["offload.enabled=true", "offload.pool_max_bytes=0"],
     "offload.pool_max_bytes: Input should be greater than or equal to 1 (got 0)"),
    (["offload.enabled=true", "offload.min_bytes=100", "offload.pool_max_bytes=10"],
     "offload.min_bytes 100 is above offload.pool_max_bytes 10: no tensor could be offloaded"),
    (["ac.mode=none", "ac.freq=2"], "ac.freq is set but ac.mode = 'none' makes no checkpoint regions"),
])
def test_ignored_options_are_errors(overrides, message):
    assert message in _error(*overrides)


def test_dumped_configs_with_every_default_written_still_load(tmp_path):
    """The 'ignored option' checks compare with defaults, so a dumped config (every key written) loads."""
    cfg = RunConfig()
    path = tmp_path / "dumped.toml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize("target, message", [
    ("aten::mm.bogus", "target 'aten::mm.bogus': aten::mm has no overload 'bogus' (it has default, dtype, "
                       "dtype_out, out)"),
    ("aten::mm.", "has no overload ''"),
])
def test_ac_target_overload_suffix_must_exist(target, message):
    assert message in _error("ac.mode=selective", f'ac.targets=["{target}"]')
    assert load_config(TINY, ["ac.targets=[\"aten::mm.default\", \"aten::mm.out\"]"]).ac.targets == [
        "aten::mm.default", "aten::mm.out"]


# ---- cross-field contradictions found only when the model was built --------------------------
@pytest.mark.parametrize("overrides, message", [
    (["model.dsa.index_head_dim=4"], "model.dsa.index_head_dim 4 must be >= model.mla.qk_rope_head_dim 8"),
    (["model.dsa.layers=[1, 1]"], "model.dsa.layers has duplicate indices: [1, 1]"),
    (["model.first_k_dense=4", "model.mtp.depth=0"], "model.dsa.layers = 'moe' selects no layer"),
    (["train.seq_len=512"], "train.seq_len 512 is above model.max_seq_len 256"),
    (["train.intra_layer_micro_batches=3", "train.micro_batch_size=4"],
     "train.intra_layer_micro_batches = 3 must divide train.micro_batch_size = 4"),
    (["train.intra_layer_micro_batches=2", "train.micro_batch_size=2", "model.moe.aux_loss_coeff=0.1",
      "model.moe.aux_loss_type=batch"], "needs model.moe.aux_loss_type = 'seq'"),
    (["train.intra_layer_micro_batches=200", "train.intra_layer_micro_batch_scope=experts", "train.seq_len=64"],
     "train.intra_layer_micro_batches = 200 (scope 'experts') needs at least 200 tokens per MoE layer call, "
     "but train.micro_batch_size x train.seq_len / parallel.cp = 64"),
])
def test_contradictions_are_config_errors(overrides, message):
    assert message in _error(*overrides)


def test_plan_on_a_contradictory_dsa_config_is_one_line_exit_2(capsys):
    assert main(["plan", TINY, "--set", "model.dsa.index_head_dim=4"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == ("spartron: error: invalid config: model.dsa.index_head_dim 4 must be >= "
                       "model.mla.qk_rope_head_dim 8: the indexer rotates its first qk_rope_head_dim dims\n")


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "0"], "spartron: error: --world-size must be >= 1, got 0\n"),
    (["--world-size", "-4"], "spartron: error: --world-size must be >= 1, got -4\n"),
    (["--max-groups", "0"], "spartron: error: --max-groups must be >= 1, got 0\n"),
])
def test_plan_refuses_sizes_below_one(argv, message, capsys):
    assert main(["plan", TINY, *argv]) == 2
    assert capsys.readouterr().err == message


def test_plan_at_a_world_size_the_batch_does_not_divide_prints_and_notes(capsys):
    assert main(["plan", TINY, "--world-size", "8"]) == 0
    out = capsys.readouterr()
    assert "# parallel layout:" in out.out
    assert out.err == ("spartron: note: `spartron train` on 8 ranks would refuse this config: "
                       "train.global_batch_size 4 must be divisible by dp size 8 x train.micro_batch_size 1 = 8\n")


# ---- the config file itself ------------------------------------------------------------------
def test_unreadable_config_files_are_one_line(tmp_path):
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"name = \"x\"\n\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match=r"^config file '.*binary.toml' is not UTF-8 text \(byte 11\)"):
        load_config(binary)
    with pytest.raises(ConfigError, match=r"^config file '.*' is not a regular file$"):
        load_config(tmp_path)
    nested = tmp_path / "deep.toml"
    nested.write_text("v = " + "[" * 100_000)
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(nested)


# ---- pre-spawn checks (preflight) ------------------------------------------------------------
def test_region_count_matches_the_built_model():
    from spartron.checkpointing.offload import checkpoint_regions
    from spartron.layers.model import build_model
    from spartron.layers.parallelize import apply_ac

    for extra in ([], ["ac.freq=2"], ["ac.freq=3", "model.mtp.share_weights=false"], ["model.mtp.depth=0"]):
        cfg = load_config(TINY, extra)
        model = build_model(cfg.model)
        apply_ac(model, cfg.ac)
        assert n_checkpoint_regions(cfg) == len(checkpoint_regions(model)), extra


@pytest.mark.parametrize("overrides, world, message", [
    (["train.global_batch_size=3"], 2, "train.global_batch_size 3 must be divisible by dp size 2 x "
                                       "train.micro_batch_size 1 = 2"),
    (["model.moe.dispatcher=deepep"], 1, "model.moe.dispatcher = 'deepep' needs CUDA, but this run is on CPU "
                                         "(device = 'cpu')"),
    (["model.moe.all_to_all_transport=copy_engine"], 1, "model.moe.all_to_all_transport = 'copy_engine' needs CUDA"),
    (["parallel.backend=nccl"], 1, "parallel.backend = 'nccl' needs CUDA"),
    (["offload.enabled=true", "offload.window=[0, 9]"], 1,
     "offload.window names regions [9], but the model has 5 checkpoint regions"),
    (["offload.enabled=true", "offload.keep_last=5"], 1, "offload.keep_last = 5 keeps every one of the 5"),
])
def test_checks_before_launch(overrides, world, message, tmp_path):
    cfg = load_config(TINY, overrides)
    with pytest.raises(ConfigError) as info:
        check_before_launch(cfg, world, tmp_path)
    assert message in str(info.value)


def test_run_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    for key, override in (("train.run_dir", f"train.run_dir={json.dumps(str(tmp_path / 'file'))}"),
                          ("train.run_dir", f"train.run_dir={json.dumps(str(tmp_path / 'file' / 'sub'))}")):
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: run directory .* (is not a directory|is a file)"):
            check_before_launch(load_config(TINY, [override]), 1, tmp_path)
    check_before_launch(load_config(TINY), 1, tmp_path)  # runs/tiny does not exist yet: fine


def test_cli_refuses_before_spawning_any_rank(tmp_path):
    """launch.nproc = 2 with a batch that does not divide: one line, exit 2, no logs dir (no rank ran)."""
    proc = subprocess.run([sys.executable, "-m", "spartron.launch.cli", "train", TINY, "--set", "launch.nproc=2",
                           "--set", "train.global_batch_size=3"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["spartron: error: train.global_batch_size 3 must be divisible by dp size 2 "
                                        "x train.micro_batch_size 1 = 2"]
    assert not (tmp_path / "runs").exists()


def test_cli_data_file_errors_are_one_line(tmp_path):
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    proc = subprocess.run([sys.executable, "-m", "spartron.launch.cli", "train", TINY, "--set", "train.data.kind=mmap",
                           "--set", f"train.data.path={json.dumps(str(empty))}"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (2, f"spartron: error: train.data.path '{empty}' is empty\n")


def test_region_count_of_freq_and_no_ac():
    assert n_checkpoint_regions(load_config(TINY, ["ac.freq=2"])) == math.ceil((4 + 1) / 2)
    assert n_checkpoint_regions(load_config(TINY, ["ac.mode=none"])) == 0


def test_plan_refuses_a_world_size_it_cannot_list(capsys):
    assert main(["plan", TINY, "--world-size", str(10**12)]) == 2
    assert capsys.readouterr().err == ("spartron: error: --world-size 1000000000000 is above 262144, the most ranks "
                                       "`spartron plan` lays out (every rank group is listed in memory)\n")


@pytest.mark.parametrize("argv, message", [
    (["--wait", "--wait-timeout", "-5"], "--wait-timeout must be a positive number of seconds, got -5.0"),
    (["--wait", "--wait-timeout", "nan"], "--wait-timeout must be a positive number of seconds, got nan"),
    (["--wait", "--wait-timeout", "0"], "--wait-timeout must be a positive number of seconds, got 0.0"),
    (["--wait-timeout", "10"], "--wait-timeout applies to --wait; add --wait or drop it"),
])
def test_bad_wait_timeout_is_refused_before_anything_is_submitted(argv, message, tmp_path, monkeypatch, capsys):
    """A stub sbatch on PATH records any call: there must be none."""
    stub = tmp_path / "bin" / "sbatch"
    stub.parent.mkdir()
    stub.write_text(f"#!/bin/sh\necho called >> {tmp_path / 'called'}\necho 1\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stub.parent}:/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    assert main(["sbatch", TINY, "--submit", *argv]) == 2
    assert capsys.readouterr().err == f"spartron: error: {message}\n"
    assert not (tmp_path / "called").exists() and not (tmp_path / "runs").exists()


def test_integers_beyond_64_bits_are_refused():
    assert _error("train.steps=99999999999999999999999") == (
        "invalid config: train.steps: must fit a signed 64-bit integer, got 99999999999999999999999")


def test_odd_keys_and_deep_values_stay_one_line(tmp_path):
    path = tmp_path / "odd.toml"
    path.write_text('[model]\n"a\\nb" = 1\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == "invalid config: model.'a\\nb': unknown key"
    assert _error("train.lr=" + "[" * 5000) == "override train.lr: value '[[[[[[[[[[[[[[[[[[[['... is nested too deeply"


def test_regress_tolerance_nan_is_refused_before_the_files_are_read(capsys):
    assert main(["regress", "compare", "missing-run", "missing-base", "--loss-rel", "nan"]) == 2
    assert capsys.readouterr().err == "spartron: error: --loss-rel must be >= 0, got nan\n"


@pytest.mark.parametrize("key", ["RANK", "WORLD_SIZE", "MASTER_PORT", "SLURM_PROCID"])
def test_launch_env_may_not_set_the_launchers_per_rank_variables(key):
    assert _error(f'launch.env={{{key} = "0"}}') == (
        f"invalid config: launch.env: {key} is set by the launcher (srun / the local launcher) for each rank; "
        "setting it here would give every rank the same value")


def test_a_utf8_bom_is_fine(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbfname = \"bom\"\n")
    assert load_config(path).name == "bom"


def test_a_rank_0_whose_master_port_is_taken_says_so_in_one_line(tmp_path):
    """Under torchrun / srun the master port is the launcher's (or derived from the Slurm job id): one held by
    another process (another job on the node) is one line naming MASTER_PORT, not torch's traceback."""
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        env = {"PATH": "/usr/bin:/bin", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "spartron.launch.cli", "train", TINY, "--set",
                               "parallel.timeout_s=2"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env=env)
    assert proc.returncode == 2
    assert proc.stderr == (f"spartron: error: rank 0 of 2 (torchrun) cannot listen on 127.0.0.1:{port}, the master "
                           "port: another process holds it (another job on this node, or one left behind); set "
                           "MASTER_PORT to a free port\n")


@pytest.mark.parametrize(("addr", "problem"), [
    ("nosuchhost.invalid", "the master address 'nosuchhost.invalid' \\(MASTER_ADDR\\) does not resolve: .+"),
    ("::1", "gave up after 2 s \\(parallel.timeout_s\\): nothing accepted a connection at ::1:9 \\(MASTER_ADDR, "
            "MASTER_PORT; rank 0 listens there\\): .+"),
])
def test_a_rank_that_cannot_reach_the_master_says_so_in_one_line(tmp_path, addr, problem):
    """A rank > 0 whose MASTER_ADDR does not resolve, or where nothing listens, names the variables in one line
    (c10d's own retries would log C++ stacks first)."""
    env = {"PATH": "/usr/bin:/bin", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": addr,
           "MASTER_PORT": "9", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "spartron.launch.cli", "train", TINY, "--set", "parallel.timeout_s=2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert re.fullmatch(rf"spartron: error: rank 1 of 2 \(torchrun\):? {problem}\n", proc.stderr), proc.stderr


def test_a_rank_whose_peers_never_come_says_so_in_one_line(tmp_path, master_port):
    env = {"PATH": "/usr/bin:/bin", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(master_port), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "spartron.launch.cli", "train", TINY, "--set", "parallel.timeout_s=2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert re.fullmatch(rf"spartron: error: rank 0 of 2 \(torchrun\) gave up after 2 s \(parallel.timeout_s\) waiting "
                        rf"for the other ranks at 127.0.0.1:{env['MASTER_PORT']}: .*1/2 clients joined.\n", proc.stderr)


@pytest.mark.parametrize("overrides, message", [
    (["train.data.kind=mmap", "train.data.path=/x.bin", "model.vocab_size=129280"],
     "train.data.token_dtype = 'uint16' holds ids below 65536, but model.vocab_size is 129280"),
    (["train.compile_backend=aot_eager"], "train.compile_backend = 'aot_eager' is set but train.compile = false"),
    (["model.mla.yarn={beta_fast = 1.0, beta_slow = 32.0}"],
     "model.mla.yarn.beta_fast 1.0 must be above model.mla.yarn.beta_slow 32.0"),
    (["model.mla.yarn={factor = 0.5}"], "model.mla.yarn.factor: Input should be greater than or equal to 1"),
])
def test_more_contradictions(overrides, message):
    assert message in _error(*overrides)


def test_offload_options_that_would_be_ignored():
    assert _error("offload.enabled=true", "offload.window=[0, 1]", "offload.keep_last=3") == (
        "invalid config: offload.keep_last = 3 applies to offload.window = 'all_but_last', not to the explicit "
        "window [0, 1]")
    with pytest.raises(ConfigError) as info:  # the default model has no [model.dsa]
        load_config(None, ["ac.mode=full", "offload.enabled=true", "offload.what=inputs_and_dsa_ids"])
    assert str(info.value) == ("invalid config: offload.what = 'inputs_and_dsa_ids' offloads DSA top-k ids, but the "
                               "model has no [model.dsa]: use offload.what = 'inputs'")


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "3"], "train.global_batch_size 4 must be divisible by dp size 3 x train.micro_batch_size 1 = 3"),
    (["--set", "model.moe.dispatcher=deepep"],
     "model.moe.dispatcher = 'deepep' needs CUDA, but the job runs on CPU (device = 'cpu')"),
    (["--set", "device=auto", "--set", "model.moe.all_to_all_transport=copy_engine"],
     "model.moe.all_to_all_transport = 'copy_engine' needs CUDA, but the job runs on CPU (launch.gpus_per_node = 0"),
    (["--set", "offload.enabled=true", "--set", "offload.window=[8]"], "offload.window names regions [8]"),
])
def test_sbatch_checks_the_job_before_submitting(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["sbatch", TINY, "--dry-run", *argv]) == 2
    assert capsys.readouterr().err.startswith(f"spartron: error: {message}")


def test_smoke_skips_the_training_checks(tmp_path, monkeypatch, capsys):
    """`smoke` only brings distributed up: a batch that would not divide does not stop it (or its job)."""
    monkeypatch.chdir(tmp_path)
    assert main(["sbatch", TINY, "--dry-run", "--entry", "smoke", "--nodes", "3"]) == 0
    assert "#SBATCH --nodes=3" in capsys.readouterr().out


def test_norm_eps_and_init_std_have_upper_bounds():
    assert _error("model.norm_eps=1.0") == "invalid config: model.norm_eps: Input should be less than 1 (got 1.0)"
    assert _error("model.init_std=2.0") == ("invalid config: model.init_std: Input should be less than or equal "
                                            "to 1 (got 2.0)")


@pytest.mark.parametrize("char", ["\\u0001", "\\u001b", "\\u007f", "\\u0085", "\\u2028", "\\u202e", "\\u2066"])
def test_other_control_characters_are_refused_too(char):
    """They could not be written back to TOML: the frozen config of a Slurm job would not load."""
    assert _error(f'name="a{char}b"').startswith("invalid config: name: must not contain control characters, got ")
    assert load_config(TINY, ['name="a\\tb"']).name == "a\tb"


@pytest.mark.parametrize("data, message", [
    (b"{not json\n\x00\xff", ": not UTF-8 text (byte 11): not a metrics JSONL"),
    (b'{"type": "step"}\n', ":1: a step record needs an integer 'step'"),
    (b'{"type": "step", "step": "x"}\n', ":1: a step record needs an integer 'step'"),
])
def test_regress_compare_of_a_broken_metrics_file_is_one_line(data, message, tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_bytes(data)
    assert main(["regress", "compare", str(path), str(path)]) == 2
    assert capsys.readouterr().err == f"spartron: error: {path}{message}\n"


def test_paths_too_long_for_the_os_are_one_line(tmp_path):
    long = "a" * 300
    assert _error("train.data.kind=mmap", f'train.data.path="{long}"') == (
        "invalid config: train.data.path: too long for a path: 300 bytes, longest component 300 (at most 255 per "
        "component and 4095 in all)")
    too_long = _error(f'train.run_dir="/tmp/{"b/" * 2100}"')
    assert too_long.startswith("invalid config: train.run_dir: too long for a path")
    with pytest.raises(ConfigError, match=r"^config file 'a{200}' cannot be read: File name too long$"):
        load_config("a" * 5000)
    with pytest.raises(ConfigError, match=r"train.data.path 'a{300}' cannot be read: File name too long"):
        from spartron.runtime.data import check_token_file

        check_token_file(long, "uint16", 8, 100)


def test_regress_compare_of_a_path_too_long_is_one_line(capsys):
    assert main(["regress", "compare", "r" * 5000, "b"]) == 2
    assert capsys.readouterr().err == f"spartron: error: run '{'r' * 200}': File name too long\n"


def test_an_override_may_not_replace_a_whole_table():
    """`--set train={steps=1}` would reset train.lr, seq_len, ... to their defaults without a word."""
    assert _error("train={steps = 1}") == ("override train: would replace the whole [train] table, dropping its "
                                           "other keys; set its keys one by one (train.<key>=...)")
    assert load_config(TINY, ["model.mla.yarn={factor = 4.0}"]).model.mla.yarn.factor == 4.0  # a new table is fine
    assert load_config(TINY, ["launch.env.A=x", "launch.env.B=y"]).launch.env == {"A": "x", "B": "y"}


def test_inductor_on_cpu_needs_a_compiler(monkeypatch):
    """The check looks for the compilers inductor itself tries: on Linux without CXX only g++, so a machine with
    only clang++ is refused before the first compiled step would fail."""
    from torch._inductor import config as inductor

    from spartron.runtime.preflight import check_compiler

    monkeypatch.setattr(inductor.cpp, "cxx", (None, "g++"))  # torch's Linux default when CXX was unset at import
    cfg = load_config(TINY, ["ac.mode=none", "train.compile=true"])
    message = (r"^train.compile = true with compile_backend 'inductor' on CPU needs the C\+\+ compiler torch's "
               r"inductor builds with \(g\+\+ on PATH, or another named by CXX\); install it or set "
               r"train.compile_backend = 'aot_eager'$")
    for found in (None, "clang++", "c++"):
        with pytest.raises(ConfigError, match=message):
            check_compiler(cfg, which=lambda name, found=found: "/usr/bin/" + name if name == found else None)
    check_compiler(cfg, which=lambda name: "/usr/bin/" + name if name == "g++" else None)
    monkeypatch.setattr(inductor.cpp, "cxx", (None, "/opt/llvm/bin/clang++"))  # CXX set when torch was imported
    check_compiler(cfg, which=lambda name: name if name == "/opt/llvm/bin/clang++" else None)
    with pytest.raises(ConfigError, match=r"\(/opt/llvm/bin/clang\+\+ on PATH, or another named by CXX\)"):
        check_compiler(cfg, which=lambda name: None)
    check_compiler(load_config(TINY, ["ac.mode=none", "train.compile=true", "train.compile_backend=aot_eager"]),
                   which=lambda name: None)


def test_inductor_compiler_is_g_plus_plus_on_linux_without_cxx():
    """torch's own default, read when inductor's config is imported: pins what check_compiler relies on."""
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    code = "from spartron.runtime.preflight import inductor_compilers; print(inductor_compilers())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("['clang++']" if sys.platform == "darwin" else "['g++']")


def test_local_rank_count_is_bounded_by_the_machine():
    from spartron.runtime.preflight import check_local_ranks

    check_local_ranks(64, cpus=2)
    check_local_ranks(512, cpus=128)
    with pytest.raises(ConfigError, match=r"^launch.nproc 65 is more local ranks than this machine can run \(2 cores; "
                                          r"at most 64 here\)"):
        check_local_ranks(65, cpus=2)
