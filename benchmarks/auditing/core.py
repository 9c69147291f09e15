"""What an audit case is, how one runs through the real `spartron` CLI, and how its outcome is classified.

Each case runs in `<root>/<id>/work` (its cwd). Next to it lies `<root>/<id>/decoy`, a tree the case may point
links at (a user's other run, a precious file); everything in `<root>/<id>` outside `work` is hashed before and
after the case, so a write, truncation or deletion through a link, a `..` or a payload is seen as an escape.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")
TINY_HF = str(ROOT / "configs" / "tiny-hf.toml")
CLASSES = ("clear", "accepted safely", "unclear", "traceback", "silent harmful", "silent harmless", "hang", "escape")
GOOD = ("clear", "accepted safely")
SURFACES = ("config", "cli", "plan", "data", "tokenize", "hf-import", "hf-export", "convert", "rundir", "state",
            "eval", "regress", "launch", "slurm", "rehearse")
CATEGORIES = ("paths", "concurrent", "dtypes", "sizes", "nonfinite", "corrupt", "partial", "signals", "values",
              "injection")
CATEGORY_TITLES = {"paths": "hostile paths and symlinks", "concurrent": "concurrent runs",
                   "dtypes": "odd dtypes and shapes", "sizes": "hostile sizes", "nonfinite": "NaN/Inf",
                   "corrupt": "truncation and corruption", "partial": "partial writes",
                   "signals": "signals and faults mid-operation", "values": "plain bad values",
                   "injection": "shell injection"}
INFO_PREFIXES = ("spartron: launching", "spartron: note:", "spartron: resumed", "spartron: skipping",
                 "spartron: submitted", "spartron: job ", "spartron: warning:", "spartron: wrote",
                 "spartron: train.overwrite: removed", "spartron: total time", "spartron: run ")
# Informational lines that name a run-time value: the heartbeat on a slow machine ("spartron: step 2 running for
# 10 s"), the end-of-run summary ("spartron: 3 steps (steps 1-3) ..."), a new run's metrics rotation.
INFO_PATTERNS = (re.compile(r"^spartron: .+ running for \d+ s$"), re.compile(r"^spartron: \d+ steps \(steps "),
                 re.compile(r"^spartron: .+ holds no complete saved step: starting a new run"))
MEMORY_LIMIT = 8 << 30  # address space of every process a case starts
RUNNER_FILES = {"work", "stdout", "stderr", "result.json", "script.sh", "script.out", "stubs.log", "first.out"}

STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "$STUB_LOG"
case "$(basename "$0")" in
  sbatch) echo 4242 ;;
  scontrol) echo "JobId=4242 JobState=COMPLETED ExitCode=0:0" ;;
  sacct) echo "COMPLETED|0:0" ;;
esac
exit 0
"""

Ready = Callable[[Path], bool]


@dataclass
class Case:
    id: str
    surface: str
    argv: list[str]  # after `spartron`; {dir} work folder, {m} marker, {tiny}/{tinyhf} presets, {decoy}
    names: tuple[str, ...] = ()  # the error must name one of these (a dotted key, a flag, a path part)
    category: str = "values"
    setup: Callable[[Path], None] | None = None  # prepares the work folder (after the base is copied in)
    base: tuple[str, ...] = ()  # prepared inputs copied into work: "state", "hfrun", "hf", "tok"
    timeout: float = 60.0
    accept_ok: bool = False  # exit 0 is right for this input (then `check`/`expect_out` must hold)
    harmless: bool = False  # accepting it would be wrong but changes nothing (silent harmless, not harmful)
    fault: str | None = None  # a fault case: the report must contain this text
    run_script: bool = False  # slurm: execute the rendered script (stdout) with the stubs
    forbid_submit: bool = False  # a stub sbatch call is a failure (validated before submission)
    expect_out: str | None = None  # text the output must contain for `clear` / `accepted safely`
    quick: bool = False
    note: str = ""
    env: dict[str, str] = field(default_factory=dict)  # extra environment (a launcher's variables)
    harm: Callable[[Path], str | None] | None = None  # silent-harm check on the case folder (None: no harm)
    harm_on_refusal: bool = True  # False: `harm` checks what a successful command left (run at exit 0 only)
    first: list[str] | None = None  # a concurrent run started before the case's command
    first_ready: Ready | None = None  # the case's command starts once this holds for the work folder
    interrupt: tuple[int, Ready] | None = None  # (signal, when): sent to the command's process group
    fsize: int | None = None  # RLIMIT_FSIZE of the command (a full disk: writes past it fail with EFBIG)
    retry: list[str] | None = None  # after an interrupted or limited command: run this, which must succeed
    skip_hash: tuple[str, ...] = ()  # entries of the case folder a case may legitimately change

    @property
    def area(self) -> str:  # the older name, kept for callers of the first audit
        return self.surface


@dataclass
class Result:
    id: str
    surface: str
    category: str
    cls: str
    rc: int | None
    seconds: float
    detail: str
    one_line: bool = False
    argv: list[str] = field(default_factory=list)
    report: bool = False  # a non-zero exit that is a report by design (a rank fault, a regress FAIL verdict)


# ------------------------------------------------------------------------------------------ helpers
def sets(*items: str) -> list[str]:
    out = []
    for item in items:
        out += ["--set", item]
    return out


def plan(*overrides: str) -> list[str]:
    return ["plan", "{tiny}", *sets(*overrides)]


def train(*overrides: str, preset: str = "{tiny}") -> list[str]:
    return ["train", preset, *sets("train.steps=1", "train.progress=false", "train.peak_tflops=1.0", *overrides)]


def tstr(value: str) -> str:
    """A TOML basic string literal for an override value."""
    import json

    return json.dumps(value)


def write(path: Path | str, data: bytes) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_bytes(data)
    return setup


def chain(*setups: Callable[[Path], None] | None) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        for one in setups:
            if one is not None:
                one(work)
    return setup


def decoy(work: Path) -> Path:
    return work.parent / "decoy"


def exists(rel: str) -> Ready:
    return lambda work: (work / rel).exists()


def new_entry(*known: str) -> Ready:
    """Something other than `known` appeared in the work folder (an output's temporary folder)."""
    return lambda work: any(p.name not in known for p in work.iterdir())


def seconds_later(seconds: float) -> Ready:
    """Ready `seconds` after its first poll (the command's start): a signal while the process still starts."""
    import time

    first: list[float] = []

    def ready(work: Path) -> bool:
        first.append(time.monotonic())
        return first[-1] - first[0] >= seconds
    return ready


def has_records(rel: str, n: int) -> Ready:
    """A metrics file with at least n step records."""
    def ready(work: Path) -> bool:
        try:
            return (work / rel).read_text(errors="replace").count('"type": "step"') >= n
        except OSError:
            return False
    return ready


# ---------------------------------------------------------------------------------- decoy and hashes
def make_decoy(case_dir: Path) -> None:
    d = case_dir / "decoy"
    (d / "run" / "step-00000001").mkdir(parents=True)
    (d / "run" / "step-00000001" / "COMPLETE").write_text('{"files": []}\n')
    (d / "run" / "metrics.jsonl").write_text('{"type": "header"}\n')
    (d / "run" / ".lock").write_text("")
    (d / "empty").mkdir()
    (d / "precious.txt").write_text("precious\n")
    (d / "notes").mkdir()
    (d / "notes" / "keep.md").write_text("# mine\n")


def tree_hash(case_dir: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Every entry of the case folder outside work: its type, mode and content (links not followed)."""
    out: dict[str, str] = {}
    for top in sorted(os.listdir(case_dir)):
        if top in RUNNER_FILES or top in skip:
            continue
        for path in [case_dir / top, *sorted((case_dir / top).rglob("*"))] if not (case_dir / top).is_symlink() \
                else [case_dir / top]:
            try:
                st = path.lstat()
            except OSError:
                continue
            rel = str(path.relative_to(case_dir))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "link:" + os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                out[rel] = f"file:{oct(st.st_mode)}:" + hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                out[rel] = f"other:{oct(st.st_mode)}"
    return out


def _diff(before: dict[str, str], after: dict[str, str]) -> str | None:
    for key in sorted(set(before) | set(after)):
        if key not in after:
            return f"deleted {key} outside the work folder"
        if key not in before:
            return f"created {key} outside the work folder"
        if before[key] != after[key]:
            return f"changed {key} outside the work folder"
    return None


# ------------------------------------------------------------------------------------------ classify
def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.startswith(INFO_PREFIXES)
            and not any(pattern.match(line) for pattern in INFO_PATTERNS)
            and "UserWarning" not in line and not line.startswith("  return func(")]


def classify(case: Case, rc: int | None, out: str, err: str, case_dir: Path, work: Path,
             stub_log: Path, before: set[str] | dict[str, str]) -> tuple[str, str]:
    pwned = list(case_dir.rglob("pwned*")) + list(work.glob("*touch*"))
    if pwned:
        return "escape", f"payload ran: {pwned[0].name}"
    if isinstance(before, dict):
        if why := _diff(before, tree_hash(case_dir, case.skip_hash)):
            return "escape", why
    else:  # the first audit's check: new names in the case folder
        new = sorted(set(os.listdir(case_dir)) - before - RUNNER_FILES)
        if new:
            return "escape", f"wrote outside the work folder: {new}"
    if case.forbid_submit and stub_log.is_file() and "sbatch" in stub_log.read_text():
        return "silent harmful", "submitted a job before refusing the input"
    if rc is None:
        return "hang", "timeout"
    if case.harm is not None and (rc == 0 or case.harm_on_refusal) and (why := case.harm(case_dir)):
        return "silent harmful", why
    text = out + err
    if case.fault:
        if rc != 0 and case.fault in err:
            return "clear", f"exit {rc}; report names {case.fault!r}"
        return ("silent harmful" if rc == 0 else "unclear"), f"exit {rc}; no {case.fault!r} in the report"
    if "Traceback (most recent call last)" in text:
        last = [line for line in text.splitlines() if line.strip()][-1][:200]
        return "traceback", last
    if rc == 0:
        if case.accept_ok and (case.expect_out is None or case.expect_out in text):
            return "accepted safely", "exit 0" + (f", output names {case.expect_out!r}" if case.expect_out else "")
        if case.accept_ok:
            return "silent harmful", f"exit 0 without {case.expect_out!r} in the output"
        return ("silent harmless" if case.harmless else "silent harmful"), "exit 0"
    if case.expect_out is not None and case.expect_out in text:
        return "clear", f"exit {rc}; output says {case.expect_out!r}"
    lines = error_lines(err)
    if len(lines) == 1 and lines[0].startswith("spartron: error:"):
        if not case.names or any(name in lines[0] for name in case.names):
            return "clear", lines[0][:300]
        return "unclear", f"does not name {case.names}: {lines[0][:250]}"
    return "unclear", f"exit {rc}, {len(lines)} lines: " + " | ".join(lines[-3:])[:300]


# ------------------------------------------------------------------------------------------- running
def env_for(stub_dir: Path, stub_log: Path) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    for key in [k for k in env if k.startswith("SLURM_")]:
        env.pop(key)
    env["PATH"] = f"{stub_dir}:{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["STUB_LOG"] = str(stub_log)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def fmt(arg: str, work: Path, marker: Path) -> str:
    return (arg.replace("{tinyhf}", TINY_HF).replace("{tiny}", TINY).replace("{dir}", str(work))
            .replace("{decoy}", str(work.parent / "decoy")).replace("{m}", str(marker)))


def stubs(root: Path) -> Path:
    stub_dir = root / "_stubs"
    stub_dir.mkdir(parents=True, exist_ok=True)
    for name in ("sbatch", "srun", "scontrol", "sacct", "scancel", "squeue"):
        path = stub_dir / name
        path.write_text(STUB)
        path.chmod(0o755)
    return stub_dir


def _spartron(argv: list[str], work: Path, env: dict[str, str], fsize: int | None = None) -> subprocess.Popen:
    def limit() -> None:  # a hostile size must fail in the case, not take the machine's memory
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        # as at a terminal: an audit started in the background (`nohup ... &`) has SIGINT ignored, which its
        # children would inherit, and Ctrl-C cases would then test nothing
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.Popen([sys.executable, "-m", "spartron.launch.cli", *argv], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=limit)


def _wait(proc: subprocess.Popen, timeout: float) -> tuple[int | None, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
    except subprocess.TimeoutExpired:
        _killpg(proc)
        out, err = proc.communicate()
        return None, out.decode(errors="replace"), err.decode(errors="replace")


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def _poll_until(ready: Ready, work: Path, proc: subprocess.Popen | None, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ready(work):
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def kill_leftovers(work: Path) -> None:
    """Processes of a timed-out case (their own session) found by their cwd and killed."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if Path(f"/proc/{pid}/cwd").resolve() == work.resolve():
                os.kill(int(pid), 9)
        except (OSError, ValueError):
            pass


def run_case(case: Case, root: Path, stub_dir: Path, bases: dict[str, Path]) -> Result:
    case_dir = root / case.id
    if case_dir.exists():
        shutil.rmtree(case_dir)
    work = case_dir / "work"
    work.mkdir(parents=True)
    for part in case.base:
        src = bases[part]
        shutil.copytree(src, work / src.name if part in ("hf", "tok") else work, symlinks=True, dirs_exist_ok=True)
    make_decoy(case_dir)
    marker = case_dir / "pwned"
    argv = [fmt(a, work, marker) for a in case.argv]
    shown = [a.replace("{tinyhf}", "configs/tiny-hf.toml").replace("{tiny}", "configs/tiny.toml")
             .replace("{m}", "<marker>").replace("{dir}", "<work>").replace("{decoy}", "<decoy>") for a in case.argv]
    shown = [f"{k}={v}" for k, v in case.env.items()] + shown
    if case.setup is not None:
        try:
            case.setup(work)
        except Exception as err:  # noqa: BLE001 - a broken case is reported, the audit goes on
            return Result(case.id, case.surface, case.category, "unclear", None, 0.0,
                          f"AUDIT SETUP FAILED: {type(err).__name__}: {err}"[:300], False, shown)
    before = tree_hash(case_dir, case.skip_hash)
    stub_log = case_dir / "stubs.log"
    env = {**env_for(stub_dir, stub_log), **case.env}
    start = time.perf_counter()
    first = None
    notes: list[str] = []
    if case.first is not None:
        first = _spartron([fmt(a, work, marker) for a in case.first], work, env)
        if case.first_ready is not None and not _poll_until(case.first_ready, work, first, 240.0):
            notes.append("the first run never got ready")
    proc = _spartron(argv, work, env, case.fsize)
    if case.interrupt is not None:
        signum, when = case.interrupt
        if _poll_until(when, work, proc, case.timeout):
            try:
                os.killpg(proc.pid, signum)
            except OSError:
                pass
        else:
            notes.append(f"ended before signal {signum}")
    rc, out, err = _wait(proc, case.timeout)
    if rc is None:
        kill_leftovers(work)
    if first is not None:
        frc, fout, ferr = _wait(first, 300.0)
        (case_dir / "first.out").write_text(fout + ferr)
        if frc != 0 and rc is not None:
            last = (error_lines(ferr) or ["(no output)"])[-1][:160]
            rc_note = "hung" if frc is None else f"exit {frc}"
            notes.append(f"the first run {rc_note}: {last}")
    if case.retry is not None and rc == 0:
        notes.append("finished before the interruption: no retry")
    elif case.retry is not None and rc is not None:
        interrupted = (rc, out, err)
        if "Traceback (most recent call last)" in out + err:
            notes.append("the interrupted command printed a traceback")
        rc, out, err = _wait(_spartron([fmt(a, work, marker) for a in case.retry], work, env), case.timeout)
        notes.append(f"interrupted exit {interrupted[0]}, retry exit {rc}")
    if case.run_script and rc == 0:
        script = case_dir / "script.sh"
        script.write_text(out)
        try:
            subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, timeout=30,
                           start_new_session=True)
        except subprocess.TimeoutExpired:
            rc = None
        bad = [line for line in (stub_log.read_text().splitlines() if stub_log.is_file() else [])
               if not line.startswith("srun ")]
        if bad:
            return Result(case.id, case.surface, case.category, "escape", rc, time.perf_counter() - start,
                          f"script called {bad[0][:120]}", False, shown)
    seconds = time.perf_counter() - start
    cls, detail = classify(case, rc, out, err, case_dir, work, stub_log, before)
    if cls in GOOD and any(n.startswith("the first run") for n in notes):
        cls = "silent harmful"  # the concurrent run it should have left alone failed
        detail = next(n for n in notes if n.startswith("the first run"))
    elif cls in GOOD and "the interrupted command printed a traceback" in notes:
        cls, detail = "traceback", "the interrupted command printed a traceback"
    if notes:
        detail = f"{detail} [{'; '.join(notes)}]"
    detail = detail.replace(str(case_dir), "<case>")  # the table does not depend on where it ran
    lines = error_lines(err)
    one_line = rc not in (0, None) and len(lines) == 1 and lines[0].startswith("spartron: error:")
    (case_dir / "stdout").write_text(out)
    (case_dir / "stderr").write_text(err)
    report = case.fault is not None or case.expect_out == "[FAIL]"
    result = Result(case.id, case.surface, case.category, cls, rc, seconds, detail, one_line, shown, report)
    (case_dir / "result.json").write_text(json.dumps(result.__dict__))  # a long audit's progress, case by case
    return result
