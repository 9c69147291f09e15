"""benchmarks/e2e.py's target check: the issue's fixed step-time targets, and selective vs the AC-none row
of the same compile setting measured in the same call."""

from benchmarks.e2e import check_targets


def test_targets_per_mode_and_selective_relative_to_none_of_the_same_compile():
    rows = [{"ac_mode": "none", "compile": False, "step_time_s": 0.200},
            {"ac_mode": "selective", "compile": False, "step_time_s": 0.230},
            {"ac_mode": "selective+offload", "compile": False, "step_time_s": 0.219},
            {"ac_mode": "full", "compile": True, "step_time_s": 0.300},
            {"ac_mode": "selective", "compile": True, "step_time_s": 0.300},
            {"ac_mode": "none", "compile": True, "error": "OOM"}]
    check_targets(rows)
    assert [(r.get("target_ms"), r.get("target_met")) for r in rows] == [
        (215.0, True), (220.00000000000003, False), (220.00000000000003, True), (270.0, False), (None, None),
        (None, None)]
