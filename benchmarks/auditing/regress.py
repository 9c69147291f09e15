"""`spartron regress compare` given NaN/Inf at a later step of either run, malformed metrics, torn files, FIFOs
and links; the metrics are edits of a real run's metrics.jsonl (the state base)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from benchmarks.auditing.core import Case, decoy

SRC = "runs/base/metrics.jsonl"


def _records(work: Path) -> list[dict]:
    return [json.loads(line) for line in (work / SRC).read_text().splitlines() if line.strip()]


def _files(run: Callable[[list[dict]], list] | None = None, base: Callable[[list[dict]], list] | None = None,
           raw_run: Callable[[str], str] | None = None) -> Callable[[Path], None]:
    """run.jsonl and base.jsonl from the real metrics, each edited (records, or the text)."""
    def setup(work: Path) -> None:
        for name, fn in (("run.jsonl", run), ("base.jsonl", base)):
            records = _records(work)
            records = fn(records) if fn is not None else records
            text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
            if name == "run.jsonl" and raw_run is not None:
                text = raw_run(text)
            (work / name).write_text(text)
    return setup


def _at(step: int, key: str, value) -> Callable[[list[dict]], list]:  # noqa: ANN001 - any JSON value
    def fn(records: list[dict]) -> list:
        for r in records:
            if r.get("type") == "step" and r["step"] == step:
                if value is _DROP:
                    r.pop(key, None)
                else:
                    r[key] = value
        return records
    return fn


_DROP = object()
CMP = ["regress", "compare", "run.jsonl", "base.jsonl"]


def cases() -> list[Case]:
    out: list[Case] = []

    def add(cid, setup, names, category="values", argv=CMP, **kw):
        out.append(Case(f"regress-{cid}", "regress", argv, tuple(names), category=category, setup=setup,
                        base=("state",), timeout=kw.pop("timeout", 60.0), **kw))

    add("identical", _files(), (), accept_ok=True, expect_out="result: PASS", quick=True)
    for key in ("loss", "grad_norm", "lr", "lm_loss", "val_loss"):
        for vname, value in (("nan", float("nan")), ("inf", float("inf")), ("neginf", float("-inf"))):
            for side in ("run", "base"):
                if key in ("lr", "lm_loss") and vname == "neginf":
                    continue
                setup = _files(**{side: _at(2, key, value)})
                add(f"{key}-{vname}-step2-{side}", setup, ["[FAIL]"], category="nonfinite", expect_out="[FAIL]",
                    quick=(key, vname, side) == ("loss", "nan", "base"))
    for cid, key, value in (("loss-str", "loss", "x"), ("loss-null", "loss", None), ("loss-bool", "loss", True),
                            ("loss-list", "loss", [1.0]), ("loss-missing", "loss", _DROP),
                            ("grad-missing", "grad_norm", _DROP), ("step-str", "step", "2"),
                            ("step-missing", "step", _DROP), ("tokens-str", "tokens_per_s_per_gpu", "fast")):
        add(f"{cid}-run", _files(run=_at(2, key, value)), ["run.jsonl"], category="dtypes")
    add("steps-duplicate", _files(run=lambda r: r + [r[-1]]), ["run.jsonl", "step"], category="corrupt")
    add("steps-reversed", _files(run=lambda r: [r[0], *reversed(r[1:])]), ["run.jsonl", "step"], category="corrupt",
        harmless=True)
    add("step-negative", _files(run=_at(2, "step", -2)), ["run.jsonl", "step"], category="values")
    add("run-shorter", _files(run=lambda r: r[:-1]), ["[FAIL]"], expect_out="[FAIL]")
    add("two-headers", _files(run=lambda r: [r[0], *r]), ["run.jsonl", "header"], category="concurrent")
    add("no-header", _files(run=lambda r: r[1:]), ["run.jsonl", "header"], category="partial", harmless=True)
    add("record-list", _files(run=lambda r: [*r, [1, 2]]), ["run.jsonl"], category="corrupt")
    add("record-garbage", _files(raw_run=lambda t: t + "{not json\n"), ["run.jsonl"], category="corrupt")
    add("torn-last-line", _files(raw_run=lambda t: t[:-40]), ["run.jsonl"], category="partial")
    add("binary", _files(raw_run=lambda t: "\x00\x01\xff" * 10), ["run.jsonl"], category="corrupt")
    add("nan-literal-step1", _files(raw_run=lambda t: t.replace('"loss": ', '"loss": NaN, "x": ', 1)),
        ["[FAIL]", "run.jsonl"], category="nonfinite", expect_out="[FAIL]")
    add("huge-number", _files(run=_at(2, "loss", 1.7e308)), ["[FAIL]"], category="sizes",
        expect_out="[FAIL]")
    add("fifo", lambda w: (os.mkfifo(w / "run.jsonl"), (w / "base.jsonl").write_text((w / SRC).read_text())),
        ["run.jsonl"], category="paths", timeout=40.0)
    add("dev-zero", lambda w: ((w / "run.jsonl").symlink_to("/dev/zero"), (w / "base.jsonl").write_text(
        (w / SRC).read_text())), ["run.jsonl", "/dev/zero"], category="paths", timeout=40.0)
    add("dir-without-metrics", lambda w: (w / "empty").mkdir(), ["empty", "metrics.jsonl"], category="paths",
        argv=["regress", "compare", "empty", "runs/base"])
    add("metrics-is-dir", lambda w: ((w / "r").mkdir(), (w / "r" / "metrics.jsonl").mkdir()), ["metrics.jsonl"],
        category="paths", argv=["regress", "compare", "r", "runs/base"])
    add("run-link-outside", lambda w: (w / "linked").symlink_to(decoy(w) / "run"), ["linked", "metrics.jsonl"],
        category="paths", argv=["regress", "compare", "linked", "runs/base"])
    add("plot-over-file", _files(), (), category="paths", accept_ok=True,
        argv=[*CMP, "--plot", "plot.png"], note="the plot goes where the user says")
    add("plot-into-decoy-link", lambda w: (_files()(w), (w / "plot.png").symlink_to(decoy(w) / "precious.txt")),
        ["plot.png"], category="paths", argv=[*CMP, "--plot", "plot.png"])
    for flag in ("--loss-rel", "--grad-norm-abs", "--memory-abs-gb", "--throughput-rel"):
        add(f"{flag[2:]}-inf", _files(), [flag], argv=[*CMP, flag, "inf"], category="nonfinite")
    add("noise-floor-garbage", lambda w: (_files()(w), (w / "g.jsonl").write_text("{x\n")), ["g.jsonl"],
        argv=[*CMP, "--noise-floor-from", "g.jsonl"], category="corrupt")
    add("noise-floor-nan", lambda w: (_files()(w), (w / "n.jsonl").write_text((w / "run.jsonl").read_text().replace(
        '"grad_norm": ', '"grad_norm": NaN, "g": '))), ["n.jsonl", "[FAIL]"],
        argv=[*CMP, "--noise-floor-from", "n.jsonl"], category="nonfinite", expect_out="[FAIL]")
    return out
