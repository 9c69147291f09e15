"""`regress compare` fails on a NaN / Inf metric at any step of either run (naming metric and step), and a
metrics file it cannot compare is one line `spartron: error:` naming file, line and key, exit status 2."""

from __future__ import annotations

import json
import math

import pytest

from spartron.launch.cli import main
from spartron.launch.regression import compare_runs
from spartron.runtime.metrics import MetricsFileError


def write_run(path, bad_step=None, key="loss", value=math.nan, steps=4, val_at=(2, 4)):
    """A 4-step metrics.jsonl; at `bad_step`, `key` is set to `value` (json.dumps writes NaN / Infinity)."""
    lines = [json.dumps({"type": "header", "deterministic": True})]
    for s in range(1, steps + 1):
        record = {"type": "step", "step": s, "loss": 5.0 - 0.1 * s, "grad_norm": 1.0, "tokens_per_s": 1000.0,
                  "peak_memory_allocated_bytes": 2e9, **({"val_loss": 4.0} if s in val_at else {})}
        if s == bad_step:
            record[key] = value
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("key, value, step, shown", [
    ("loss", math.nan, 3, "loss nan at step 3"),
    ("grad_norm", math.inf, 2, "grad_norm inf at step 2"),
    ("val_loss", math.nan, 4, "val_loss nan at step 4"),
    ("tokens_per_s", -math.inf, 4, "tokens_per_s -inf at step 4"),
])
@pytest.mark.parametrize("side", ["run", "baseline"])
def test_a_nonfinite_metric_in_either_run_fails_naming_metric_and_step(tmp_path, key, value, step, shown, side):
    bad, good = write_run(tmp_path / "bad.jsonl", step, key, value), write_run(tmp_path / "good.jsonl")
    report = compare_runs(bad, good) if side == "run" else compare_runs(good, bad)
    assert not report.passed
    check = report.check("finite metrics")
    assert (check.passed, check.detail) == (False, f"{side}: {shown}")
    assert f"  [FAIL] finite metrics: {side}: {shown}" in report.text()


@pytest.mark.parametrize("key, value, shown", [
    ("lr", math.nan, "lr nan at step 2"),
    ("lm_loss", math.inf, "lm_loss inf at step 2"),
    ("mtp_losses", [0.9, math.nan], "mtp_losses[1] nan at step 2"),
    ("expert_load_per_layer", [-math.inf, 0.2, math.inf], "expert_load_per_layer[0] -inf at step 2, "
                                                          "expert_load_per_layer[2] inf at step 2"),
    ("extra", {"a": {"b": [1, [2.0, math.nan]]}}, "extra.a.b[1][1] nan at step 2"),
    ("lr", "NaN", "lr 'NaN' at step 2"),
    ("aux_loss", "-Infinity", "aux_loss '-Infinity' at step 2"),
])
@pytest.mark.parametrize("side", ["run", "baseline"])
def test_a_nonfinite_value_of_a_metric_that_is_not_compared_fails_too(tmp_path, capsys, key, value, shown, side):
    bad, good = write_run(tmp_path / "bad.jsonl", 2, key, value), write_run(tmp_path / "good.jsonl")
    argv = [str(bad), str(good)] if side == "run" else [str(good), str(bad)]
    check = compare_runs(*argv).check("finite metrics")
    assert (check.passed, check.detail) == (False, f"{side}: {shown}")
    status, out, err = _cli(["regress", "compare", *argv], capsys)
    assert (status, err) == (1, "")
    assert f"  [FAIL] finite metrics: {side}: {shown}\n" in out and "result: FAIL" in out


def test_null_and_finite_non_compared_metrics_pass(tmp_path):
    """None is what the writer records for a value it did not measure (alloc_retries on CPU): not NaN."""
    run = write_run(tmp_path / "r.jsonl", 2, "alloc_retries", None)
    run.write_text(run.read_text().replace('"step": 3,', '"step": 3, "lr": 1e-4, "mtp_losses": [0.5], "x": "fast",'))
    report = compare_runs(run, write_run(tmp_path / "b.jsonl"))
    assert report.check("finite metrics").passed and report.passed


def test_finite_runs_say_so_and_many_nonfinite_values_are_counted(tmp_path):
    good = write_run(tmp_path / "good.jsonl")
    assert compare_runs(good, good).check("finite metrics").detail == (
        "every metric is finite at every step of the run and the baseline")
    lines = good.read_text().replace('"loss": 4.', '"loss": NaN, "x": 4.')
    lines = lines.replace('"grad_norm": 1.0', '"grad_norm": NaN')
    (tmp_path / "nan.jsonl").write_text(lines)
    detail = compare_runs(tmp_path / "nan.jsonl", good).check("finite metrics").detail
    assert detail == "run: loss nan at step 1, grad_norm nan at step 1, loss nan at step 2 (and 5 more)"


def _cli(argv, capsys):
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_cli_exit_1_on_a_nan_baseline(tmp_path, capsys):
    status, out, err = _cli(["regress", "compare", str(write_run(tmp_path / "r.jsonl")),
                             str(write_run(tmp_path / "b.jsonl", 3, "grad_norm"))], capsys)
    assert status == 1 and err == ""
    assert "  [FAIL] finite metrics: baseline: grad_norm nan at step 3\n" in out and "result: FAIL" in out


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.write_text(""), "{p}: holds no step record (empty, or the run stopped before its first step): "
                                 "nothing to compare"),
    (lambda p: p.write_text(json.dumps({"type": "header"}) + "\n"),
     "{p}: holds no step record (empty, or the run stopped before its first step): nothing to compare"),
    (lambda p: p.write_text("\n" + "".join(p.read_text().splitlines(True)[1:])),
     "{p}:2: no header: not a metrics file Spartron wrote, or its first line was lost (its header says what the run "
     "was: deterministic, run id)"),
    (lambda p: p.write_text(p.read_text().replace('"loss": 4.8, ', '')),
     "{p}:3: step 2: metric 'loss' is missing"),
    (lambda p: p.write_text(p.read_text().replace('"grad_norm": 1.0, ', '', 1)),
     "{p}:2: step 1: metric 'grad_norm' is missing (other steps of this file record it)"),
    (lambda p: p.write_text(p.read_text().replace('"loss": 4.7', '"loss": "4.7"')),
     "{p}:4: step 3: metric 'loss' is not a number (got '4.7')"),
    (lambda p: p.write_text(p.read_text().replace('"val_loss": 4.0', '"val_loss": true', 1)),
     "{p}:3: step 2: metric 'val_loss' is not a number (got True)"),
    (lambda p: p.write_text(p.read_text() + '{"type": "step", "step": 5, "loss": \n'),
     "{p}:6: not a JSON record (Expecting value: line 1 column 37 (char 36))"),
])
@pytest.mark.parametrize("side", ["run", "baseline"])
def test_a_malformed_metrics_file_is_one_line_naming_file_line_and_key(tmp_path, capsys, edit, message, side):
    bad, good = write_run(tmp_path / "bad.jsonl"), write_run(tmp_path / "good.jsonl")
    edit(bad)
    argv = [str(bad), str(good)] if side == "run" else [str(good), str(bad)]
    status, out, err = _cli(["regress", "compare", *argv], capsys)
    assert (status, out, err) == (2, "", f"spartron: error: {message.format(p=bad)}\n")
    with pytest.raises(MetricsFileError):
        compare_runs(*argv)


def test_a_nonfinite_noise_floor_run_is_refused(tmp_path, capsys):
    base, noisy = write_run(tmp_path / "b.jsonl"), write_run(tmp_path / "n.jsonl", 2, "grad_norm")
    status, out, err = _cli(["regress", "compare", str(base), str(base), "--noise-floor-from", str(noisy)], capsys)
    assert (status, out) == (2, "")
    assert err == (f"spartron: error: {noisy}: the noise-floor run records non-finite metrics: grad_norm nan at "
                   "step 2\n")


def _lines(path):
    return path.read_text().splitlines()


@pytest.mark.parametrize("edit, message", [
    (lambda ls: [*ls, ls[-1]], "{p}:6: step 4 follows step 4 with no resume header between them (a duplicated or "
                               "reordered record): not one run's metrics"),
    (lambda ls: [ls[0], *reversed(ls[1:])], "{p}:3: step 3 follows step 4 with no resume header between them (a "
                                            "duplicated or reordered record): not one run's metrics"),
    (lambda ls: [ls[0], ls[1].replace('"step": 1', '"step": -1'), *ls[2:]],
     "{p}:2: step -1 is not a step number (steps count from 1)"),
    (lambda ls: [*ls, json.dumps({"type": "header", "resumed_from_step": 3}), ls[2]],
     "{p}:7: step 2 is not after step 3, the step the resume header at line 6 resumed from: not one run's metrics"),
    (lambda ls: [*ls, json.dumps({"type": "header", "resumed_from_step": 2}), ls[3], ls[3]],
     "{p}:8: step 3 follows step 3 with no resume header between them (a duplicated or reordered record): not one "
     "run's metrics"),
])
def test_step_numbers_that_do_not_count_up_are_one_line(tmp_path, capsys, edit, message):
    bad, good = write_run(tmp_path / "bad.jsonl"), write_run(tmp_path / "good.jsonl")
    bad.write_text("\n".join(edit(_lines(bad))) + "\n")
    status, out, err = _cli(["regress", "compare", str(bad), str(good)], capsys)
    assert (status, out, err) == (2, "", f"spartron: error: {message.format(p=bad)}\n")


def test_a_resume_that_reruns_steps_keeps_their_last_records(tmp_path):
    run = write_run(tmp_path / "r.jsonl")
    lines = _lines(run)
    resumed = json.dumps({"type": "header", "deterministic": True, "resumed_from_step": 2})
    run.write_text("\n".join([*lines, resumed, lines[3].replace('"grad_norm": 1.0', '"grad_norm": 1.5'), lines[4]])
                   + "\n")
    report = compare_runs(run, write_run(tmp_path / "b.jsonl"))
    assert report.check("grad norm (absolute)").detail.startswith("max abs diff 0.5 at step 3")


def test_plot_replaces_a_regular_file_and_refuses_a_link_a_fifo_or_an_unknown_format(tmp_path, capsys):
    import os

    run, base = str(write_run(tmp_path / "r.jsonl")), str(write_run(tmp_path / "b.jsonl"))
    (tmp_path / "old.png").write_text("old")
    status, out, err = _cli(["regress", "compare", run, base, "--plot", str(tmp_path / "old.png")], capsys)
    assert (status, err) == (0, "") and (tmp_path / "old.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "precious.txt").write_text("mine")
    (tmp_path / "link.png").symlink_to(tmp_path / "precious.txt")
    os.mkfifo(tmp_path / "fifo.png")
    for name, what in (("link.png", f"is a symbolic link (to {tmp_path / 'precious.txt'})"), ("fifo.png", "is a FIFO")):
        status, out, err = _cli(["regress", "compare", run, base, "--plot", str(tmp_path / name)], capsys)
        assert (status, err) == (2, f"spartron: error: --plot {str(tmp_path / name)!r} {what}: the plot replaces a "
                                    "regular file or makes a new one; choose another path\n")
    assert (tmp_path / "precious.txt").read_text() == "mine"
    status, out, err = _cli(["regress", "compare", run, base, "--plot", str(tmp_path / "p.doc")], capsys)
    assert status == 2 and err.startswith(f"spartron: error: --plot {str(tmp_path / 'p.doc')!r}: unknown image "
                                          "format '.doc' (use one of ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.jsonl", "fifo.png", "link.png", "old.png",
                                                          "precious.txt", "r.jsonl"]
