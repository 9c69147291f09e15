"""The bad-input audit (benchmarks/audit.py) keeps holding: its quick subset runs the real CLI here."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _audit():
    from benchmarks import audit

    return audit


def test_the_audit_has_at_least_200_distinct_cases_in_every_area():
    cases = _audit().all_cases()
    ids = [c.id for c in cases]
    assert len(set(ids)) == len(ids) >= 200
    areas = Counter(c.area for c in cases)
    assert set(areas) == {"config", "cli", "data", "state", "launch", "slurm"}
    assert min(areas.values()) >= 8


def test_quick_subset_is_clear_or_safe(tmp_path):
    audit = _audit()
    cases = [c for c in audit.all_cases() if c.quick]
    assert {c.area for c in cases} >= {"config", "cli", "data", "launch", "slurm"}
    results = audit.run_audit(cases, tmp_path, log=lambda line: None)
    bad = [(r.id, r.cls, r.detail) for r in results if r.cls not in ("clear", "accepted safely")]
    assert not bad


def test_classifier_sees_harm_tracebacks_and_silence(tmp_path):
    audit = _audit()
    case = audit.Case("probe", "config", [], ("train.lr",))
    work = tmp_path / "work"
    work.mkdir()
    stub_log = tmp_path / "stubs.log"

    def cls(rc, err, out=""):
        return audit.classify(case, rc, out, err, tmp_path, work, stub_log, {"work"})[0]

    assert cls(2, "spartron: error: invalid config: train.lr: bad\n") == "clear"
    assert cls(2, "spartron: error: invalid config: train.steps: bad\n") == "unclear"  # names another key
    assert cls(2, "spartron: error: train.lr\nsecond line\n") == "unclear"
    assert cls(1, "Traceback (most recent call last):\n  x\nValueError: train.lr\n") == "traceback"
    assert cls(0, "") == "silently accepted"
    assert cls(None, "") == "hang"
    (tmp_path / "elsewhere").write_text("x")
    assert cls(2, "spartron: error: train.lr\n") == "harmful"
    (tmp_path / "elsewhere").unlink()
    (tmp_path / "pwned").write_text("")
    assert cls(2, "spartron: error: train.lr\n") == "harmful"
