"""Corrupt and hostile saved steps (the first audit's cases, kept)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

from benchmarks.auditing.core import Case, train


def state_cases() -> list[Case]:
    """Corrupt and hostile saved steps; each case gets a copy of a real 2-step run (save_every 1)."""
    resume = train("train.steps=3", "train.save_every=1", "name=base")
    out = []

    def add(cid, mutate, names=("step-",), argv=None, accept_ok=False, expect_out=None, quick=False):
        out.append(Case(f"state-{cid}", "state", argv or resume, tuple(names), setup=mutate, timeout=120.0,
                        accept_ok=accept_ok, expect_out=expect_out, quick=quick))

    def step2(w: Path) -> Path:
        return w / "runs" / "base" / "step-00000002"

    def file_op(pattern: str, op: Callable[[Path], None]) -> Callable[[Path], None]:
        def mutate(w: Path) -> None:
            for path in sorted(step2(w).glob(pattern))[:1]:
                op(path)
        return mutate

    truncate = lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])  # noqa: E731
    empty = lambda p: p.write_bytes(b"")  # noqa: E731
    garbage = lambda p: p.write_bytes(os.urandom(max(64, p.stat().st_size)))  # noqa: E731

    def flip(p: Path) -> None:
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))

    for pattern in (".metadata", "*.distcp", "meta.json", "rank-00000.json", "rank-00000.pt", "COMPLETE"):
        for oname, op in (("truncate", truncate), ("empty", empty), ("garbage", garbage), ("flip", flip)):
            if pattern == "COMPLETE" and oname == "flip":
                continue
            add(f"{pattern.strip('*.')}-{oname}", file_op(pattern, op), names=("step-00000002", pattern.strip("*")),
                quick=False)
    # the same garbage with the COMPLETE manifest rewritten to match (whoever can write the files can):
    # the loaders themselves must refuse
    for pattern in (".metadata", "*.distcp", "meta.json", "rank-00000.json", "rank-00000.pt"):
        add(f"{pattern.strip('*.')}-garbage-resealed", _resealed(file_op(pattern, garbage)),
            names=("step-00000002", pattern.strip("*")))
    # hostile pickles (manifest resealed): each would create the marker when unpickled
    for target in (".metadata", "rank-00000.pt"):
        for hname in ("reduce-system", "dotted-global", "nested", "builtins-eval"):
            add(f"hostile-{target.strip('.')}-{hname}", _hostile_pickle(target, hname),
                names=("step-00000002", target))
    add("missing-distcp", file_op("*.distcp", lambda p: p.unlink()), names=("step-00000002", ".distcp"))
    add("missing-rank-json", file_op("rank-00000.json", lambda p: p.unlink()), names=("step-00000002", "rank-00000"))
    add("rank-json-nan", file_op("rank-00000.json", lambda p: p.write_text('{"data": {"position": NaN}}')),
        names=("step-00000002", "rank-00000.json"))
    add("meta-future-version", file_op("meta.json", lambda p: p.write_text(
        json.dumps({**json.loads(p.read_text()), "format_version": 99}))), names=("step-00000002", "meta.json"))
    add("shape-change", None, names=("model.dim",), argv=train("train.steps=3", "train.save_every=1", "name=base",
                                                              "model.dim=32"))
    add("optimizer-change", None, names=("train.optimizer", "train.beta1"),
        argv=train("train.steps=3", "train.save_every=1", "name=base", "train.beta1=0.8"))
    add("layout-change", None, names=("step-00000002",),  # saved states are layout-free: the resume reshards
        argv=train("train.steps=3", "train.save_every=1", "name=base", "launch.nproc=2"), accept_ok=True,
        expect_out="resumed from step 2")
    add("steps-done", None, names=("train.steps", "step 2"), argv=train("train.steps=2", "name=base"))
    add("fresh-over-old", None, names=("resume", "runs/base", "step"),
        argv=train("train.steps=3", "name=base", "train.resume=false"))
    add("incomplete-newest", lambda w: (step2(w) / "COMPLETE").unlink(), names=("step-00000002",),
        accept_ok=True, expect_out="step-00000002")
    add("symlinked-step", lambda w: _replace_with_link(step2(w)), names=("step-00000002", "symlink", "link"),
        accept_ok=True, expect_out="resumed from step 2")  # a linked step is the user's layout: read, not written
    add("metrics-garbage", lambda w: (w / "runs" / "base" / "metrics.jsonl").write_bytes(b"\x00\xff{garbage"),
        names=("metrics.jsonl",), accept_ok=True)

    def metrics_link(w: Path) -> None:  # metrics.jsonl links to a file outside the run: it must not change
        outside = w.parent / "outside-metrics"
        outside.write_text("precious\n")
        (w / "runs" / "base" / "metrics.jsonl").unlink()
        (w / "runs" / "base" / "metrics.jsonl").symlink_to(outside)

    def outside_unchanged(case_dir: Path) -> str | None:
        outside = case_dir / "outside-metrics"
        ok = outside.is_file() and outside.read_text() == "precious\n"
        return None if ok else "wrote through the metrics.jsonl link to a file outside the run"

    out.append(Case("state-metrics-symlink", "state", resume, ("metrics.jsonl",), setup=metrics_link, timeout=120.0,
                    accept_ok=True, harm=outside_unchanged))
    add("next-step-is-file", lambda w: (w / "runs" / "base" / "step-00000003").write_text("x"),
        names=("step-00000003",), accept_ok=False)
    add("huge-step-number", lambda w: shutil.copytree(step2(w), w / "runs" / "base" / "step-99999999999"),
        names=("step-99999999999", "train.steps"))
    return out


def _replace_with_link(step: Path) -> None:
    outside = step.parents[3] / "outside-step"  # <root>/<id>/outside-step: a write there would be harmful
    shutil.move(str(step), str(outside))
    step.symlink_to(outside)


class _Reduce:
    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _hostile_pickle(target: str, kind: str) -> Callable[[Path], None]:
    def mutate(work: Path) -> None:
        marker = str(work.parent / "pwned")
        step = work / "runs" / "base" / "step-00000002"
        command = f"touch {marker}"
        if kind == "reduce-system":
            payload = pickle.dumps(_Reduce(os.system, (command,)), protocol=4)
        elif kind == "builtins-eval":
            payload = pickle.dumps(_Reduce(eval, (f"__import__('os').system({command!r})",)), protocol=4)
        elif kind == "nested":
            payload = pickle.dumps({"state": [1, (2, _Reduce(os.system, (command,)))]}, protocol=4)
        else:  # a dotted qualified name reached through an allowed module: torch -> os.system
            payload = (b"\x80\x04\x8c\x05torch\x94\x8c\x09os.system\x94\x93\x94\x8c" + bytes([len(command)])
                       + command.encode() + b"\x94\x85\x94R\x94.")
        if target == "rank-00000.pt":
            import io
            import zipfile

            buf = io.BytesIO()  # a torch zip archive whose data.pkl is the payload
            with zipfile.ZipFile(buf, "w") as z:
                z.writestr("archive/data.pkl", payload)
                z.writestr("archive/version", "3\n")
            payload = buf.getvalue()
        for path in sorted(step.glob(target)) or [step / target]:
            path.write_bytes(payload)
        _reseal(step)
    return mutate


def _reseal(step: Path) -> None:
    """Rewrite the COMPLETE manifest's sizes and CRC-32s to match the files as they are now."""
    import zlib

    marker = step / "COMPLETE"
    try:
        manifest = json.loads(marker.read_text())
    except (OSError, ValueError):
        return
    for entry in manifest.get("files", []):
        path = step / entry["path"]
        if path.is_file():
            entry["size"], entry["crc32"] = path.stat().st_size, zlib.crc32(path.read_bytes())
    marker.write_text(json.dumps(manifest))


def _resealed(mutate: Callable[[Path], None]) -> Callable[[Path], None]:
    def both(work: Path) -> None:
        mutate(work)
        _reseal(work / "runs" / "base" / "step-00000002")
    return both
