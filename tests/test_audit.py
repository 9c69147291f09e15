"""The adversarial audit (benchmarks/audit.py) keeps holding: its quick subset runs the real CLI here, every
surface has its own cases, and the classifier tells clear errors from tracebacks, silence, hangs and escapes."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _audit():
    from benchmarks import audit

    return audit


def test_the_audit_has_at_least_700_distinct_cases_on_every_surface_and_category():
    from benchmarks.auditing.core import CATEGORIES, SURFACES

    cases = _audit().all_cases()
    ids = [c.id for c in cases]
    assert len(set(ids)) == len(ids) >= 700
    surfaces = Counter(c.surface for c in cases)
    assert set(surfaces) == set(SURFACES)
    assert min(surfaces.values()) >= 16
    assert set(Counter(c.category for c in cases)) == set(CATEGORIES)
    plain = Counter((tuple(c.argv), tuple(sorted(c.env.items())), c.base, c.interrupt, c.fsize, c.run_script)
                    for c in cases if c.setup is None and c.first is None)
    assert max(plain.values()) == 1  # no two cases without a setup run the same command the same way


@pytest.mark.slow
def test_quick_subset_covers_every_surface_and_is_clear_or_safe(tmp_path):
    from benchmarks.auditing.core import SURFACES

    audit = _audit()
    cases = [c for c in audit.all_cases() if c.quick]
    assert {c.surface for c in cases} == set(SURFACES) - {"state"}
    start = time.perf_counter()
    results = audit.run_audit(cases, tmp_path, jobs=2, log=lambda line: None)
    bad = [(r.id, r.cls, r.detail) for r in results if r.cls not in ("clear", "accepted safely")]
    assert not bad
    assert time.perf_counter() - start < 180


def test_classifier_sees_escapes_harm_tracebacks_silence_and_hangs(tmp_path):
    from benchmarks.auditing.core import Case, classify, make_decoy, tree_hash

    case = Case("probe", "config", [], ("train.lr",))
    work = tmp_path / "work"
    work.mkdir()
    make_decoy(tmp_path)
    stub_log = tmp_path / "stubs.log"

    def cls(rc, err, out="", c=case):
        return classify(c, rc, out, err, tmp_path, work, stub_log, tree_hash(tmp_path))[0]

    before = tree_hash(tmp_path)
    assert cls(2, "spartron: error: invalid config: train.lr: bad\n") == "clear"
    assert cls(2, "spartron: error: invalid config: train.steps: bad\n") == "unclear"  # names another key
    assert cls(2, "spartron: error: train.lr\nsecond line\n") == "unclear"
    assert cls(1, "Traceback (most recent call last):\n  x\nValueError: train.lr\n") == "traceback"
    assert cls(0, "") == "silent harmful"
    assert cls(0, "", c=Case("p", "config", [], harmless=True)) == "silent harmless"
    assert cls(0, "", c=Case("p", "config", [], accept_ok=True)) == "accepted safely"
    assert cls(0, "", c=Case("p", "config", [], accept_ok=True, harm=lambda d: "broke it")) == "silent harmful"
    refused = "spartron: error: train.lr: bad\n"  # a harm that judges a success's output: a refusal is not harmed
    assert cls(2, refused, c=Case("p", "config", [], ("train.lr",), harm=lambda d: "no output")) == "silent harmful"
    assert cls(2, refused, c=Case("p", "config", [], ("train.lr",), harm=lambda d: "no output",
                                  harm_on_refusal=False)) == "clear"
    assert cls(0, "", c=Case("p", "config", [], accept_ok=True, harm=lambda d: "no output",
                             harm_on_refusal=False)) == "silent harmful"
    assert cls(None, "") == "hang"
    (tmp_path / "decoy" / "precious.txt").write_text("changed\n")  # a write through a link, seen by the hash
    result = classify(case, 2, "", "spartron: error: train.lr\n", tmp_path, work, stub_log, before)
    assert result == ("escape", "changed decoy/precious.txt outside the work folder")
    os.truncate(tmp_path / "decoy" / "notes" / "keep.md", 0)
    before = tree_hash(tmp_path)
    (tmp_path / "decoy" / "notes" / "keep.md").unlink()
    assert classify(case, 2, "", "", tmp_path, work, stub_log, before)[1] == "deleted decoy/notes/keep.md outside " \
                                                                             "the work folder"
    (tmp_path / "pwned").write_text("")
    assert cls(2, "spartron: error: train.lr\n") == "escape"


def test_information_lines_do_not_count_as_output_of_a_refusal():
    from benchmarks.auditing.core import error_lines

    err = ("spartron: step 1 running for 10 s\nspartron: checkpoint save running for 12 s\n"
           "spartron: 3 steps (steps 1-3) ...\nspartron: runs/k holds no complete saved step: starting a new run; x\n"
           "spartron: train.overwrite: removed step-00000002 from runs/base\n"
           "spartron: error: loss 8.12279 at step 1 is above train.max_loss = 1\n")
    assert error_lines(err) == ["spartron: error: loss 8.12279 at step 1 is above train.max_loss = 1"]
    assert error_lines("spartron: step 1 running for 10 s (rank 1)\n") == ["spartron: step 1 running for 10 s (rank 1)"]


def test_results_reach_a_folder_that_did_not_exist_and_collect_says_it_has_no_wall_time(tmp_path):
    """--out into a missing folder: the folder is made before the cases run (an hour-long audit once lost its
    results when the write failed at the end); --collect writes what the case folders hold, the wall not known."""
    import json
    import subprocess
    import sys

    out = tmp_path / "new" / "deeper" / "audit"
    args = [sys.executable, str(ROOT / "benchmarks" / "audit.py"), "--only", "fp8-dispatch-string",
            "--root", str(tmp_path / "cases")]
    done = subprocess.run([*args, "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(out.with_suffix(".json").read_text())["summary"]
    assert summary["cases"] == 1 and summary["counts"]["clear"] == 1 and summary["wall_seconds"] > 0
    again = tmp_path / "other" / "audit"
    done = subprocess.run([*args, "--collect", "--out", str(again)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(again.with_suffix(".json").read_text())["summary"]["wall_seconds"] is None
    assert "s of cases (collected: wall not recorded) (1 at a time)" in again.with_suffix(".md").read_text()
