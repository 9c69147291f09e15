"""Generated sbatch scripts are inert: every string that reaches one, from the config or a CLI flag, is
refused or quoted, even when the config's own validation was bypassed (defence in depth).

Each accepted script is checked three ways: `bash -n` parses it; run with stub `srun`, `sbatch`,
`scontrol` and `scancel` on PATH (each logs its argv), it creates no marker file; and its bash trace
(`set -x`) shows it ran nothing but its own fixed builtins and those stubs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from shell_payloads import MULTI_LINE, SINGLE_LINE  # next to this file

from spartron.launch.cli import main
from spartron.launch.slurm import SlurmError, render_job, time_limit_s, write_job
from spartron.runtime.config import RunConfig, load_config
from spartron.runtime.safe_open import UnsafeEntryError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")

HOSTILE = SINGLE_LINE + MULTI_LINE
MULTILINE = ("\n", "\r")

# What a rendered script may run: its own builtins, variables and the Slurm stubs.
ALLOWED = {"set", "unset", "export", "source", "echo", "trap", "[", "wait", "exit", "sleep", "forward_term", ":",
           "break", "srun", "sbatch", "scontrol", "scancel"}
TRAP_BODY = {"forward_term", "echo", "[", "scancel"}
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")  # `export K=v` is traced as `export K=v` and `K=v`
TRACE_MARK = "\x1e"

_STUB = """#!/bin/sh
{python} -c 'import json, os, sys; open(os.environ["STUB_LOG"], "a").write(json.dumps({{"cmd": "{name}", \
"argv": sys.argv[1:], "env": dict(os.environ)}}) + "\\n")' "$@"
{extra}
"""


def _hostile(marker: Path, single_line: bool = False) -> list[str]:
    values = [h.format(m=marker) for h in HOSTILE]
    return [v for v in values if not any(c in v for c in MULTILINE)] if single_line else values


def _stubs(tmp_path: Path, srun_extra: str = "") -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("srun", "sbatch", "scontrol", "scancel"):
        stub = bin_dir / name
        stub.write_text(_STUB.format(python=shlex.quote(sys.executable), name=name,
                                     extra=srun_extra if name == "srun" else ""))
        stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _run(script: str, tmp_path: Path, srun_extra: str = "",
         environ: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """bash -n, then bash -x with the stubs first on PATH (and `environ`, the submitting shell's variables
    that sbatch's --export=ALL passes on); returns the run and the stubs' calls, and asserts that the trace
    holds only allowed commands."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "job.sh"
    path.write_text(script)
    parsed = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    log = tmp_path / "stubs.jsonl"
    log.unlink(missing_ok=True)
    env = {**(environ or {}), "PATH": f"{_stubs(tmp_path, srun_extra)}:/usr/bin:/bin", "STUB_LOG": str(log),
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"}
    # bash ignores PS4 from the environment when run as root: set it, then trace the sourced script
    tracer = f"PS4=$'+{TRACE_MARK}'; set -x; source \"$1\""
    proc = subprocess.run(["bash", "-c", tracer, "bash", str(path)], env=env, capture_output=True, text=True,
                          timeout=60)
    records = list(re.finditer(rf"^(\++){TRACE_MARK}(.*?)(?=^\++{TRACE_MARK}|\Z)", proc.stderr, re.S | re.M))
    assert records, proc.stderr
    for record in records:
        # "+": the tracer's own `source`; "++": the script's commands; "+++": the SIGTERM trap's function
        level, command = record.groups()
        words = shlex.split(command.rstrip("\n"), posix=True) if command.strip() else []
        first = words[0] if words else ""
        if level == "+++":
            assert first in TRAP_BODY or first.startswith("term="), f"a nested command ran: {record.group(0)!r}"
        else:
            assert level in ("+", "++"), f"a nested command ran (command substitution?): {record.group(0)!r}"
            assert first in ALLOWED or ASSIGNMENT.match(first), f"the script ran {command!r}"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    return proc, calls


def _bypass(cfg: RunConfig, **launch) -> RunConfig:
    """cfg with launch values set WITHOUT validation (model_copy(update=...) validates nothing)."""
    return cfg.model_copy(update={"launch": cfg.launch.model_copy(update=launch)})


def _fake_venv(tmp_path: Path) -> Path:
    """A venv whose activate script is empty (the real one runs commands the trace would list)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "activate").write_text("")
    return venv


def _base(tmp_path: Path) -> RunConfig:
    return load_config(TINY, [f'train.run_dir="{tmp_path}/run"', 'launch.job_name="job"',
                              f'launch.venv="{_fake_venv(tmp_path)}"'])


# ---- config strings rendered into the script --------------------------------------------------
def test_hostile_run_name_stays_inside_its_comment_line(tmp_path):
    """The issue's case: launch.job_name and an absolute run_dir set, so the name reaches only the header
    comment. Without validation a newline there would start a command line."""
    marker = tmp_path / "pwned"
    for value in _hostile(marker):
        cfg = _base(tmp_path).model_copy(update={"name": value})
        job = render_job(cfg, tmp_path)
        assert job.script.splitlines()[1] == f"# spartron train: {json.dumps(value)} (generated by `spartron sbatch`)"
        proc, calls = _run(job.script, tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert [c["cmd"] for c in calls] == ["srun"]
        plain = render_job(_base(tmp_path).model_copy(update={"name": "plain"}), tmp_path)
        # every directive and line kept (the frozen config's name is its content's hash: the name differs)
        assert (job.script.replace(str(job.config_path), "CONFIG").splitlines()[2:]
                == plain.script.replace(str(plain.config_path), "CONFIG").splitlines()[2:])
    assert not marker.exists()


def test_hostile_env_values_reach_the_ranks_verbatim_and_run_nothing(tmp_path):
    marker = tmp_path / "pwned"
    values = {f"V{i}": v for i, v in enumerate(_hostile(marker, single_line=True))}
    job = render_job(_bypass(_base(tmp_path), env=values), tmp_path)
    for key, value in values.items():
        assert f"export {key}={shlex.quote(value)}" in job.script
    proc, calls = _run(job.script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [c["cmd"] for c in calls] == ["srun"]
    assert {k: calls[0]["env"][k] for k in values} == values
    assert calls[0]["argv"][-3:] == ["spartron.launch.cli", "train", str(job.config_path)]
    assert not marker.exists()
    (tmp_path / "frozen.toml").write_text(job.config_text)  # the frozen config carries them back
    assert load_config(tmp_path / "frozen.toml").launch.env == values


def test_hostile_venv_and_container_are_quoted(tmp_path):
    marker = tmp_path / "pwned"
    for i, value in enumerate(_hostile(marker, single_line=True)):
        venv = tmp_path / f"venv{i}" / value.replace("/", "_")
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "activate").write_text("")
        job = render_job(_bypass(_base(tmp_path), venv=str(venv)), tmp_path)
        proc, calls = _run(job.script, tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert calls[0]["argv"][1] == str(venv / "bin" / "python")  # srun runs the venv's interpreter
        job = render_job(_bypass(_base(tmp_path), container=value), tmp_path)
        proc, calls = _run(job.script, tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert calls[0]["argv"][1] == f"--container-image={value}"
    assert not marker.exists()


@pytest.mark.parametrize(("key", "good"), [
    ("partition", "gpu"), ("account", "acct"), ("qos", "high"), ("job_name", "job"), ("time", "01:00:00"),
    ("venv", "/opt/venv"), ("container", "img.sqsh")])
def test_unvalidated_multiline_or_charset_breaking_values_are_refused_at_render(tmp_path, key, good):
    """Bypassing the config's checks does not help: render_job validates the [launch] section again."""
    render_job(_bypass(_base(tmp_path), **{key: good}), tmp_path)  # the key itself renders
    for value in _hostile(tmp_path / "pwned"):
        if key in ("venv", "container") and not any(c in value for c in MULTILINE):
            continue  # quoted: run above
        with pytest.raises(SlurmError, match=rf"^launch\.{key}: "):
            render_job(_bypass(_base(tmp_path), **{key: value}), tmp_path)


def test_unvalidated_env_keys_values_sbatch_args_and_numbers_are_refused_at_render(tmp_path):
    marker = tmp_path / "pwned"
    for value in _hostile(marker):
        with pytest.raises(SlurmError, match=r"^launch\.env: (environment variable name|must not contain)"):
            render_job(_bypass(_base(tmp_path), env={value: "x"}), tmp_path)
        with pytest.raises(SlurmError, match=r"^launch\.sbatch_args: "):
            render_job(_bypass(_base(tmp_path), sbatch_args=["--qos=" + value]), tmp_path)
        if any(c in value for c in MULTILINE):
            with pytest.raises(SlurmError, match=r"^launch\.env: must not contain a (newline|carriage return)"):
                render_job(_bypass(_base(tmp_path), env={"K": value}), tmp_path)
    for key in ("nodes", "cpus_per_task", "gpus_per_node", "signal_before_s"):
        with pytest.raises(SlurmError, match=rf"^launch\.{key}: "):
            render_job(_bypass(_base(tmp_path), **{key: f"1; touch {marker}"}), tmp_path)
    assert not marker.exists()


def test_hostile_paths_cannot_reach_a_directive(tmp_path):
    """train.run_dir, the run name (default run dir runs/<name>, default job name) and the working
    directory all land in #SBATCH directives: letters, digits and ._/+=@:,~- only."""
    for value in _hostile(tmp_path / "pwned"):
        cfg = _base(tmp_path)
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"run_dir": f"/tmp/{value}"})})
        with pytest.raises(SlurmError, match="cannot go into an #SBATCH directive"):
            render_job(cfg, tmp_path)
        cfg = load_config(TINY).model_copy(update={"name": value})
        with pytest.raises(SlurmError, match="cannot be a Slurm job name"):
            render_job(cfg, tmp_path)
        with pytest.raises(SlurmError, match="cannot be a Slurm job name|cannot go into an #SBATCH directive"):
            render_job(cfg.model_copy(update={"launch": cfg.launch.model_copy(update={"job_name": "j"})}),
                       tmp_path)
        workdir = tmp_path / "w" / value.replace("/", "_")
        workdir.mkdir(parents=True)
        with pytest.raises(SlurmError, match="working directory .* cannot go into an #SBATCH directive"):
            render_job(_base(tmp_path), workdir)


# ---- CLI flags that reach the script ----------------------------------------------------------
@pytest.mark.parametrize("flag", ["--partition", "--account", "--qos", "--time", "--job-name"])
def test_hostile_string_flags_are_one_line_errors_and_write_nothing(flag, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    key = flag[2:].replace("-", "_")
    for value in _hostile(tmp_path / "pwned"):
        assert main(["sbatch", TINY, "--dry-run", flag, value]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"spartron: error: invalid config: launch.{key}: ") and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("flag", ["--nodes", "--gpus-per-node", "--cpus-per-task"])
def test_hostile_number_flags_are_one_line_errors(flag, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for value in _hostile(tmp_path / "pwned"):
        assert main(["sbatch", TINY, "--dry-run", flag, value]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"spartron: error: argument {flag}: invalid int value") and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("key", ["name", "train.run_dir", "launch.venv", "launch.container", "launch.env"])
def test_hostile_set_overrides_are_refused_or_render_inert(key, tmp_path, capsys, monkeypatch):
    """Through `--set`: a value is refused in one line (exit 2) or the printed script is inert."""
    marker = tmp_path / "pwned"
    monkeypatch.chdir(tmp_path)
    rendered = 0
    for value in _hostile(marker):
        text = json.dumps("/abs/" + value if key == "train.run_dir" else value)
        setting = f"launch.env={{K = {text}}}" if key == "launch.env" else f"{key}={text}"
        venv = [] if key == "launch.venv" else ["--set", f'launch.venv="{_fake_venv(tmp_path)}"']
        status = main(["sbatch", TINY, "--dry-run", "--set", setting, "--set", 'launch.job_name="j"', *venv])
        out, err = capsys.readouterr()
        if status == 2:
            assert err.startswith("spartron: error: ") and err.count("\n") == 1 and not out
            continue
        assert status == 0, err
        rendered += 1
        proc, calls = _run(out, tmp_path / "run")
        assert not marker.exists()
    if key in ("launch.container", "launch.env"):
        assert rendered > 0  # quoting, not only refusal, is exercised
    assert not marker.exists()


# ---- preemption: SIGTERM to the batch shell, requeue ------------------------------------------
def test_requeue_and_signal_render_as_directives():
    cfg = load_config(TINY, ["launch.requeue=true", "launch.signal_before_s=300"])
    directives = [line for line in render_job(cfg, Path("/tmp")).script.splitlines() if line.startswith("#SBATCH")]
    assert directives[-3:] == ["#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --signal=B:TERM@300"]
    plain = render_job(load_config(TINY), Path("/tmp")).script
    assert "#SBATCH --requeue" not in plain and "#SBATCH --signal" not in plain
    assert "scontrol requeue" not in plain and "trap forward_term TERM" in plain  # the trap is always there


def test_requeue_needs_resume(tmp_path):
    with pytest.raises(SlurmError, match=r"^launch\.requeue = true needs train\.resume = true"):
        render_job(load_config(TINY, ["launch.requeue=true", "train.resume=false"]), tmp_path)


# srun that sends SIGTERM to the batch shell (its parent), then "saves" and exits as the ranks would
_TERM_PARENT = f"kill -TERM $PPID; sleep 1; exit {75}"


@pytest.mark.parametrize("requeue", [True, False])
def test_sigterm_to_the_batch_shell_is_forwarded_to_the_steps_then_requeues(tmp_path, requeue):
    cfg = _base(tmp_path).model_copy(update={"launch": _base(tmp_path).launch.model_copy(update={"requeue": requeue})})
    proc, calls = _run(render_job(cfg, tmp_path).script, tmp_path, srun_extra=_TERM_PARENT)
    assert proc.returncode == 75, proc.stderr
    expected = [("srun", None), ("scancel", ["--signal=TERM", "7"])]
    expected += [("scontrol", ["requeue", "7"])] if requeue else []
    assert [(c["cmd"], None if c["cmd"] == "srun" else c["argv"]) for c in calls] == expected
    assert "spartron: the batch shell got SIGTERM; forwarding it to the ranks" in proc.stdout


def test_ranks_stopping_without_a_shell_sigterm_do_not_requeue(tmp_path):
    """`scancel -s TERM` signals the steps only: they save and exit 75; the job ends, not requeued."""
    cfg = _base(tmp_path).model_copy(update={"launch": _base(tmp_path).launch.model_copy(update={"requeue": True})})
    proc, calls = _run(render_job(cfg, tmp_path).script, tmp_path, srun_extra="exit 75")
    assert proc.returncode == 75
    assert [c["cmd"] for c in calls] == ["srun"]
    assert signal.SIGTERM == 15  # the trap is for TERM (what Slurm and scancel send)


def test_hostile_entry_flag_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for value in _hostile(tmp_path / "pwned"):
        assert main(["sbatch", TINY, "--dry-run", "--entry", value]) == 2
        err = capsys.readouterr().err
        assert err.startswith("spartron: error: argument --entry: invalid choice") and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == []


def test_hostile_config_file_path_never_reaches_the_script(tmp_path, capsys, monkeypatch):
    """The job runs its frozen copy (<run dir>/slurm/config-<hash>.toml), never the path the user gave."""
    marker = tmp_path / "pwned"
    monkeypatch.chdir(tmp_path)
    venv = _fake_venv(tmp_path)
    for i, value in enumerate(_hostile(marker)):
        config = tmp_path / f"c{i}" / value.replace("/", "_") / "run.toml"
        config.parent.mkdir(parents=True)
        config.write_text(Path(TINY).read_text())
        assert main(["sbatch", str(config), "--dry-run", "--set", f'launch.venv="{venv}"']) == 0
        script = capsys.readouterr().out
        assert value.replace("/", "_") not in script
        proc, calls = _run(script, tmp_path / "run")
        assert proc.returncode == 0, proc.stderr
        assert re.fullmatch(re.escape(str(tmp_path / "runs" / "tiny" / "slurm")) + r"/config-[0-9a-f]{16}\.toml",
                            calls[0]["argv"][-1])
    assert not marker.exists()


@pytest.mark.parametrize(("text", "seconds"), [
    ("30", 1800), ("30:15", 1815), ("01:02:03", 3723), ("2-3", 183600), ("2-03:04", 183840),
    ("1-00:00:01", 86401), ("UNLIMITED", None), ("infinite", None)])
def test_time_limit_seconds(text, seconds):
    assert time_limit_s(text) == seconds


def test_a_signal_at_or_before_the_job_start_is_refused(tmp_path):
    with pytest.raises(SlurmError, match=r"^launch\.signal_before_s = 300 is not below launch\.time = 00:05:00 "
                                         r"\(300 s\): the job would be told to stop as it starts$"):
        render_job(load_config(TINY, ['launch.time="00:05:00"', "launch.signal_before_s=300"]), tmp_path)
    render_job(load_config(TINY, ['launch.time="00:05:01"', "launch.signal_before_s=300"]), tmp_path)
    render_job(load_config(TINY, ['launch.time="UNLIMITED"', "launch.signal_before_s=300"]), tmp_path)


@pytest.mark.parametrize(("which", "make"), [
    ("config", lambda p, target: p.symlink_to(target)),
    ("script", lambda p, target: p.symlink_to(target)),
    ("slurm", lambda p, target: p.symlink_to(target.parent)),
])
def test_job_files_are_never_written_through_a_link_in_the_run_directory(tmp_path, which, make):
    """A link left in <run dir>/slurm (by a user, a copy tool or an attacker) would make sbatch overwrite the
    file it points to: refused by name, the target unchanged."""
    job = render_job(_base(tmp_path), tmp_path)
    entry = {"config": job.config_path, "script": job.script_path, "slurm": job.config_path.parent}[which]
    entry = entry.relative_to(job.run_dir)
    precious = tmp_path / "elsewhere" / "precious.txt"
    precious.parent.mkdir()
    precious.write_text("mine")
    (job.run_dir / entry).parent.mkdir(parents=True)
    make(job.run_dir / entry, precious)
    with pytest.raises(UnsafeEntryError) as err:
        write_job(job)
    assert str(err.value) == (f"{job.run_dir / entry} is a symbolic link (to {os.readlink(job.run_dir / entry)}): a "
                              "run reads and writes only regular files and folders inside its run directory; remove it")
    assert precious.read_text() == "mine" and sorted(os.listdir(precious.parent)) == ["precious.txt"]


def test_each_submission_s_config_and_script_are_immutable_files_of_their_own(tmp_path):
    """F1: every rank (a requeued job's too) reads the frozen config when it starts, so a second submission
    into the same run directory (here with another train.lr) writes files of its own, named by content, and
    the first job's script still names its config, unchanged; the same submission again rewrites nothing, and
    a file whose content no longer matches its name is refused, never overwritten."""
    first = render_job(_base(tmp_path), tmp_path)
    second = render_job(_base(tmp_path).model_copy(update={"train": _base(tmp_path).train.model_copy(
        update={"lr": 5e-3})}), tmp_path)
    write_job(first)
    write_job(second)
    write_job(first)  # the same submission again: the same names, nothing rewritten
    names = sorted(os.listdir(first.run_dir / "slurm"))
    assert names == sorted(p.name for p in (first.config_path, first.script_path, second.config_path,
                                            second.script_path))
    assert [re.sub("[0-9a-f]{16}", "H", n) for n in names] == ["config-H.toml"] * 2 + ["job-H.sbatch"] * 2
    assert first.config_path.read_text() == first.config_text and "lr = 0.001\n" in first.config_text
    assert second.config_path.read_text() == second.config_text and "lr = 0.005\n" in second.config_text
    assert f"-m spartron.launch.cli train {first.config_path} &" in first.script_path.read_text()
    assert f"-m spartron.launch.cli train {second.config_path} &" in second.script_path.read_text()
    first.config_path.write_text(first.config_text.replace("lr = 0.001", "lr = 0.002"))
    with pytest.raises(SlurmError) as err:
        write_job(first)
    assert str(err.value) == (f"{first.config_path} exists with other content than this submission's (it is "
                              "named by its content, and a submitted job may read it): move it away")
    assert "lr = 0.002" in first.config_path.read_text()


def test_the_submitting_shell_s_launcher_variables_never_reach_the_tasks(tmp_path):
    """F2: sbatch passes the submitting shell's environment on (--export=ALL); torchrun's RANK / WORLD_SIZE
    / MASTER_* there would beat SLURM_* in rank discovery and make every task rank 0 of 1. The script unsets
    them before srun; other variables pass."""
    leaked = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29577", "KEEP_ME": "yes"}
    script = render_job(_base(tmp_path), tmp_path).script
    assert "unset GROUP_RANK LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT RANK WORLD_SIZE" in script.splitlines()
    proc, calls = _run(script, tmp_path, environ=leaked)
    assert proc.returncode == 0, proc.stderr
    (srun,) = calls
    assert [k for k in leaked if k in srun["env"]] == ["KEEP_ME"]


# ---- submission: refusals before anything is written, and what `--wait` reports ------------------------
@pytest.mark.parametrize(("arg", "message"), [
    ("--signal=USR1@120", "'--signal=USR1@120' sets the signal Slurm sends before the time limit: set "
                          "launch.signal_before_s instead (it renders --signal=B:TERM@<seconds>; the ranks save a "
                          "complete step on SIGTERM)"),
    ("--sig=B:TERM@60", "'--sig=B:TERM@60' sets the signal Slurm sends before the time limit: set "
                        "launch.signal_before_s instead (it renders --signal=B:TERM@<seconds>; the ranks save a "
                        "complete step on SIGTERM)"),
    ("--array=0-1", "'--array=0-1' makes an array job, whose tasks would all share one run directory: submit one "
                    "`spartron sbatch` per run, each with its own name or train.run_dir"),
])
def test_signal_and_array_in_sbatch_args_are_refused_naming_the_key(arg, message, tmp_path, capsys, monkeypatch):
    """F3 / F5: a USR1 warning signal would kill the ranks without a save (they save on SIGTERM; the script
    traps TERM), and an array's tasks would share one run directory. sbatch takes abbreviations (`--sig`)."""
    monkeypatch.chdir(tmp_path)
    assert main(["sbatch", TINY, "--dry-run", "--set", f'launch.sbatch_args=["--comment=ok", "{arg}"]']) == 2
    assert capsys.readouterr().err == f"spartron: error: invalid config: launch.sbatch_args: {message}\n"
    assert os.listdir(tmp_path) == []
    with pytest.raises(SlurmError, match=r"^launch\.sbatch_args: " + re.escape(message) + "$"):
        render_job(_bypass(_base(tmp_path), sbatch_args=[arg]), tmp_path)


def _sbatch_stubs(tmp_path: Path, scontrol_line: str) -> Path:
    """sbatch that queues job 42 (logging its call), scontrol that shows it ended as `scontrol_line` says."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", f'echo "$@" >> {tmp_path}/sbatch.calls; echo 42'),
                       ("scontrol", f"echo '{scontrol_line}'")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_submitting_into_a_run_directory_a_run_holds_is_refused_before_anything_is_written(tmp_path, capsys,
                                                                                        monkeypatch):
    """F1: a job training in the run directory holds its lock; a second `spartron sbatch` there is refused
    before it writes or queues anything (the running job's files stay as they are)."""
    from spartron.runtime.rundir import RunDirLock

    work = tmp_path / "work"
    run_dir = work / "runs" / "tiny"
    run_dir.mkdir(parents=True)
    lock = RunDirLock(run_dir)
    assert lock.acquire() is None
    monkeypatch.chdir(work)
    monkeypatch.setenv("PATH", f"{_sbatch_stubs(tmp_path, 'JobState=COMPLETED ExitCode=0:0')}:{os.environ['PATH']}")
    try:
        assert main(["sbatch", TINY, "--submit"]) == 2
    finally:
        lock.release()
    assert capsys.readouterr().err == (
        f"spartron: error: {run_dir} is in use by another run (pid {os.getpid()} on {socket.gethostname()}, "
        f"lock {run_dir}/.lock): wait for it to end or stop it, or give this run another directory\n")
    assert os.listdir(run_dir) == [".lock"] and not (tmp_path / "sbatch.calls").exists()


_LEAK_LOG = ("spartron: attempt (Slurm restart count) 0\n"
             "spartron: error: rank 0 of 1 (torchrun) cannot listen on 127.0.0.1:29577, the master port\n"
             "srun: error: n2: task 1: Exited with exit code 2\n"
             "srun: launch/slurm: _step_signal: Terminating StepId=42.0\n"
             "spartron: SIGTERM: saved step 1 of 6 and stopped\n"
             "srun: error: n1: task 0: Exited with exit code 75\n")
_STOP_LOG = ("spartron: attempt (Slurm restart count) 0\n"
             "srun: error: n1: task 0: Exited with exit code 75\nsrun: error: n2: task 1: Exited with exit code 75\n")


@pytest.mark.parametrize(("log", "scontrol", "rc", "first"), [
    (_LEAK_LOG, "JobState=FAILED ExitCode=75:0", 2, "rank 1 on n2: Exited with exit code 2"),
    (_STOP_LOG + "spartron: attempt (Slurm restart count) 1\nsrun: error: n2: task 1: Exited with exit code 3\n"
     "srun: error: n1: task 0: Killed\n", "JobState=FAILED ExitCode=0:15", 3, "rank 1 on n2: Exited with exit code 3"),
    ("spartron: attempt (Slurm restart count) 0\nsrun: error: n1: tasks 0-1: Killed\n", "JobState=FAILED ExitCode=1:0",
     137, "ranks 0-1 on n1: Killed"),
    (_STOP_LOG, "JobState=FAILED ExitCode=75:0", 75, None),
])
def test_wait_reports_a_peer_s_failure_as_the_root_cause_not_as_a_stop(log, scontrol, rc, first, tmp_path, capsys,
                                                                      monkeypatch):
    """F2 / F7: when one task fails, srun's --kill-on-bad-exit SIGTERMs the others, which save and exit 75:
    the job's status is then 75 (or 143), but it did not stop to be resumed. `--wait` shows the logs and the
    first task srun saw fail in the last attempt, and exits with that task's status; only when the first to
    end had saved and stopped (75) is the job reported as stopped."""
    work = tmp_path / "work"
    slurm_dir = work / "runs" / "tiny" / "slurm"
    slurm_dir.mkdir(parents=True)
    (slurm_dir / "42.err").write_text(log)
    monkeypatch.chdir(work)
    monkeypatch.setenv("PATH", f"{_sbatch_stubs(tmp_path, 'JobId=42 ' + scontrol)}:{os.environ['PATH']}")
    assert main(["sbatch", TINY, "--submit", "--wait"]) == rc
    out, err = capsys.readouterr()
    status = "75" if "75:0" in scontrol else ("143" if ":15" in scontrol else "1")
    assert out.splitlines()[1] == f"spartron: job 42 FAILED with exit status {status}; run dir {slurm_dir.parent}"
    if first is None:
        assert out.splitlines()[2:] == ["spartron: the ranks got SIGTERM, saved a complete step and stopped "
                                        "(status 75); submit again to resume from it"] and err == ""
    else:
        assert "saved a complete step" not in out and f"---- last lines of {slurm_dir}/42.err ----" in err
        assert err.splitlines()[-1] == f"spartron: the first to fail, as srun saw it: {first}"
