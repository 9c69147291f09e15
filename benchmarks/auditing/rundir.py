"""A hostile or shared run directory: its entries (.lock, logs, metrics, TensorBoard, steps) as links to files
outside, FIFOs or the wrong kind of file, a second run or an overwrite while the first trains, keep_last pruning
a step that links into another run, and kills mid-run followed by a resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

from benchmarks.auditing.core import Case, decoy, has_records, seconds_later, train

RUN = "runs/base"
LIVE = "runs/live"


def _entry(rel: str, make: Callable[[Path, Path], None]) -> Callable[[Path], None]:
    """Replace `runs/base/<rel>` (created if missing) using make(path, decoy)."""
    def setup(work: Path) -> None:
        path = work / RUN / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        make(path, decoy(work))
    return setup


def _link_to(target: str) -> Callable[[Path, Path], None]:
    return lambda path, d: path.symlink_to(d / target)


KINDS: dict[str, Callable[[Path, Path], None]] = {
    "link-file": _link_to("precious.txt"),
    "link-dir": _link_to("notes"),
    "link-dangling": _link_to("created-by-spartron"),
    "fifo": lambda path, d: os.mkfifo(path),
    "dir": lambda path, d: path.mkdir(),
}


def _metrics_ok(run: str, steps: int) -> Callable[[Path], str | None]:
    """The run's metrics.jsonl: one header per run and one record per step, as one run writes them."""
    def check(case_dir: Path) -> str | None:
        path = case_dir / "work" / run / "metrics.jsonl"
        try:
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as err:
            return f"{run}/metrics.jsonl unreadable: {err}"
        headers = sum(r.get("type") == "header" for r in records)
        steps_seen = [r["step"] for r in records if r.get("type") == "step"]
        if headers != 1 or steps_seen != list(range(1, steps + 1)):
            return f"{run}/metrics.jsonl has {headers} headers and steps {steps_seen[:6]}... (one run of {steps})"
        return None
    return check


def _steps_intact(run: str, steps: list[int]) -> Callable[[Path], str | None]:
    def check(case_dir: Path) -> str | None:
        missing = [s for s in steps if not (case_dir / "work" / run / f"step-{s:08d}" / "COMPLETE").is_file()]
        return f"{run} lost saved steps {missing}" if missing else None
    return check


def hostile_entries() -> list[Case]:
    out: list[Case] = []
    resume = train("train.steps=3", "train.save_every=1", "name=base")
    fresh = train("train.steps=1", "name=base", "train.overwrite=true", "train.resume=false")
    nproc = train("train.steps=3", "train.save_every=1", "name=base", "launch.nproc=2")
    tb = train("train.steps=3", "train.save_every=1", "name=base", "observe.tensorboard=true")
    entries = {".lock": resume, "metrics.jsonl": resume, "logs/rank1.log": nproc, "logs": nproc,
               "tensorboard": tb, "step-00000003": resume, "step-00000002/COMPLETE": resume,
               "step-00000002/meta.json": resume}
    for rel, argv in entries.items():
        for kind, make in KINDS.items():
            if kind == "dir" and rel in ("logs", "tensorboard"):
                continue  # a folder is what they are
            name = rel.replace("/", "-").strip(".")
            # an empty folder under a newer step's name is an incomplete step: skipped with a note, then replaced
            # by the save of that step (the other kinds there are refused)
            empty_step = (rel, kind) == ("step-00000003", "dir")
            out.append(Case(f"rundir-{name}-{kind}", "rundir", argv, (rel.split("/")[-1], rel),
                            category="paths", setup=_entry(rel, make), base=("state",), timeout=150.0,
                            quick=(rel, kind) == (".lock", "link-file"), accept_ok=empty_step,
                            expect_out="skipped incomplete step directories: step-00000003" if empty_step else None))
    for kind in ("link-file", "link-dir", "fifo"):  # the same entries under an overwrite
        for rel in (".lock", "metrics.jsonl", "step-00000002"):
            name = rel.strip(".")
            # train.overwrite removes a hostile step ENTRY (never its target: the decoy's hash checks that) and
            # says so; a hostile .lock or metrics.jsonl it must not write through is refused
            step = rel == "step-00000002"
            out.append(Case(f"rundir-overwrite-{name}-{kind}", "rundir", fresh, (rel,), category="paths",
                            setup=_entry(rel, KINDS[kind]), base=("state",), timeout=150.0, accept_ok=step,
                            expect_out="train.overwrite: removed" if step else None))
    # the run directory itself, and runs/
    out.append(Case("rundir-run-is-link", "rundir", train("train.run_dir=\"linked\""), ("linked",), category="paths",
                    setup=lambda w: (w / "linked").symlink_to(decoy(w) / "run"), timeout=150.0))
    out.append(Case("rundir-run-link-new-folder", "rundir", train("train.run_dir=\"linked\""), ("linked",),
                    category="paths", accept_ok=True, skip_hash=("scratch",),
                    setup=lambda w: ((w.parent / "scratch").mkdir(), (w / "linked").symlink_to(w.parent / "scratch")),
                    note="a run directory that is a link to an empty scratch folder is the user's layout"))
    out.append(Case("rundir-runs-is-file", "rundir", train("name=x"), ("runs",), category="paths",
                    setup=lambda w: (w / "runs").write_text("x")))
    out.append(Case("rundir-run-is-fifo", "rundir", train("name=x"), ("runs/x", "x"), category="paths",
                    setup=lambda w: ((w / "runs").mkdir(), os.mkfifo(w / "runs" / "x")), timeout=60.0))
    out.append(Case("rundir-lock-stale", "rundir", resume, (), category="partial", base=("state",), accept_ok=True,
                    setup=lambda w: (w / RUN / ".lock").write_text("pid 999999 host gone\n"), timeout=150.0,
                    expect_out="resumed from step 2", note="a lock nobody holds (flock) is free"))
    out.append(Case("rundir-user-file-overwrite", "rundir", fresh, (), category="paths", base=("state",),
                    accept_ok=True, setup=lambda w: (w / RUN / "notes.md").write_text("mine\n"),
                    harm=lambda d: None if (d / "work" / RUN / "notes.md").is_file() else
                    "train.overwrite deleted a file it did not write (notes.md)", timeout=150.0))

    def linked_old_step(work: Path) -> None:  # an old step that is a link into another run, pruned by keep_last
        other = decoy(work) / "other-run"
        shutil.copytree(work / RUN / "step-00000001", other / "step-00000001")
        shutil.rmtree(work / RUN / "step-00000001")
        (work / RUN / "step-00000001").symlink_to(other / "step-00000001")

    out.append(Case("rundir-keep-last-linked-step", "rundir",
                    train("train.steps=4", "train.save_every=1", "name=base", "train.keep_last=1"),
                    ("step-00000001",), category="paths", base=("state",), setup=linked_old_step, accept_ok=True,
                    timeout=150.0, note="pruning may drop the link, never the linked run's files (hashed)"))
    return out


def concurrent_cases() -> list[Case]:
    out: list[Case] = []
    long = train("train.steps=12", "train.save_every=2", "name=live")
    ready = has_records(f"{LIVE}/metrics.jsonl", 1)
    both = lambda case_dir: _metrics_ok(LIVE, 12)(case_dir) or _steps_intact(LIVE, [2, 4, 6, 8, 10, 12])(case_dir)  # noqa

    def add(cid, argv, names, category="concurrent", **kw):
        out.append(Case(f"rundir-live-{cid}", "rundir", argv, tuple(names), category=category, first=long,
                        first_ready=ready, timeout=kw.pop("timeout", 150.0), harm=kw.pop("harm", both), **kw))

    add("second-train", train("train.steps=12", "train.save_every=2", "name=live"), [".lock", "runs/live", "another"],
        quick=False)
    add("second-train-resume", train("train.steps=14", "name=live", "train.resume=true"), [".lock", "runs/live",
                                                                                          "another"])
    add("overwrite", train("train.steps=1", "name=live", "train.overwrite=true", "train.resume=false"),
        [".lock", "runs/live", "another"])
    add("second-train-2-ranks", train("train.steps=12", "name=live", "launch.nproc=2"), [".lock", "runs/live",
                                                                                       "another"])
    add("eval", ["eval", "{tiny}", "--step", LIVE, *_plain()], [".lock", "runs/live", "another"], accept_ok=True,
        note="an eval reads a complete step; it must not break the live run")
    add("smoke", ["smoke", "{tiny}", "--set", "name=live"], [".lock", "runs/live", "another"])
    add("convert-into", ["convert", "--from-hf", "hf", "--to", LIVE, "--config", "{tinyhf}"], ["runs/live"],
        base=("hf",))
    add("export", ["convert", "--from", LIVE, "--to-hf", "out"], [".lock", "runs/live"], accept_ok=True,
        note="an export reads a complete step")
    return out


def _plain() -> list[str]:
    return ["--set", "train.progress=false"]


def interrupted_runs() -> list[Case]:
    """A run killed mid-training (or mid-save), then resumed: the resume must find a complete step and go on."""
    out: list[Case] = []
    # long enough that the signal, sent once step 2 is logged, lands mid-run: 6 steps could finish first, and so
    # did 20 once under a full audit's load (session 17)
    run = train("train.steps=60", "train.save_every=1", "name=k")
    resume = train("train.steps=61", "train.save_every=10", "name=k")
    for signame in ("SIGTERM", "SIGINT", "SIGKILL"):
        for when, ready in (("after-step-2", has_records("runs/k/metrics.jsonl", 2)),
                            ("during-save", lambda w: any((w / "runs" / "k").glob("step-*")))):
            out.append(Case(f"rundir-{signame.lower()}-{when}-then-resume", "rundir", run, (), category="signals",
                            interrupt=(getattr(signal, signame), ready), retry=resume, accept_ok=True,
                            expect_out="resumed from step" if when == "after-step-2" else None, timeout=150.0))
    # Slurm's --signal (or a forwarded SIGTERM) can reach the ranks while they still import torch, a second after
    # their start: held until the handler is in place, it stops the run after step 1, saved, and the resume goes on
    for nproc in (1, 2):
        start = train("train.steps=60", "train.save_every=10", "name=k", f"launch.nproc={nproc}")
        out.append(Case(f"rundir-sigterm-while-starting-{nproc}-rank-then-resume", "rundir", start, (),
                        category="signals", interrupt=(signal.SIGTERM, seconds_later(1.0)), retry=resume,
                        accept_ok=True, expect_out="resumed from step", timeout=150.0))
    for cid, nproc, limit in (("disk-full-1-rank", 1, 200_000), ("disk-full-2-ranks", 2, 200_000),
                              ("disk-full-metrics", 1, 3_000)):
        out.append(Case(f"rundir-{cid}-then-resume", "rundir",
                        train("train.steps=4", "train.save_every=1", "name=k", f"launch.nproc={nproc}"),
                        ("step-", "runs/k", "metrics.jsonl", "No space", "File too large"), category="partial",
                        fsize=limit, retry=train("train.steps=8", "train.save_every=1", "name=k"), accept_ok=True,
                        timeout=150.0))
    return out


def cases() -> list[Case]:
    return hostile_entries() + concurrent_cases() + interrupted_runs()
