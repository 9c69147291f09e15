"""Regression compare: identical runs pass, each perturbed metric fails with a clear line, plots exist."""

from __future__ import annotations

import json

import pytest

from spartron.launch.regression import Tolerances, compare_runs, comparison_figure, grad_norm_noise_floor, plot_runs


def write_run(path, steps=5, loss_scale=1.0, gn_shift=0.0, mem_shift=0.0, tps_scale=1.0, deterministic=True,
              first_loss_bump=0.0):
    lines = [json.dumps({"type": "header", "deterministic": deterministic})]
    for s in range(1, steps + 1):
        lines.append(json.dumps({
            "type": "step", "step": s,
            "loss": (5.0 - 0.1 * s) * loss_scale + (first_loss_bump if s == 1 else 0),
            "grad_norm": 1.0 + 0.01 * s + gn_shift, "tokens_per_s": (1000.0 + s) * tps_scale,
            "peak_memory_allocated_bytes": 2e9 + mem_shift}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_identical_runs_pass(tmp_path):
    report = compare_runs(write_run(tmp_path / "a.jsonl"), write_run(tmp_path / "b.jsonl"))
    assert report.passed, report.text()
    assert [c.name for c in report.checks] == ["finite metrics", "steps", "first-step loss (exact)", "loss (relative)",
                                               "grad norm (absolute)", "peak memory (absolute)",
                                               "throughput (median tokens/s)"]
    assert report.text().endswith("result: PASS (7/7 checks passed)")


@pytest.mark.parametrize("perturb, failing, phrase", [
    (dict(loss_scale=1.001), "loss (relative)", "max relative diff 0.001 at step"),
    (dict(gn_shift=0.2), "grad norm (absolute)", "max abs diff 0.2 at step"),
    (dict(mem_shift=0.3e9), "peak memory (absolute)", "run 2.300 GB vs baseline 2.000 GB (diff +0.300 GB"),
    (dict(tps_scale=0.9, deterministic=False), "throughput (median tokens/s)",
     "(-10.00%, allowed -5% = max(5%, noise floor 0.0%))"),
    (dict(first_loss_bump=1e-7), "first-step loss (exact)", "step 1: run 4.9000001"),
])
def test_perturbed_run_fails_with_a_clear_report(tmp_path, perturb, failing, phrase):
    base = write_run(tmp_path / "base.jsonl", deterministic=perturb.get("deterministic", True))
    report = compare_runs(write_run(tmp_path / "run.jsonl", **perturb), base)
    assert not report.passed
    failed = {c.name: c.detail for c in report.checks if not c.passed}
    expected = {failing} | ({"first-step loss (exact)"} if "loss_scale" in perturb else set())
    assert set(failed) == expected
    assert phrase in failed[failing]
    assert f"[FAIL] {failing}: " in report.text() and "result: FAIL" in report.text()


def test_faster_run_and_nondeterministic_first_step_pass(tmp_path):
    run = write_run(tmp_path / "r.jsonl", tps_scale=1.5, first_loss_bump=1e-7, deterministic=False)
    report = compare_runs(run, write_run(tmp_path / "b.jsonl", deterministic=False))
    assert report.passed, report.text()
    assert "first-step loss (exact)" not in [c.name for c in report.checks]


def test_noise_floor_from_second_baseline_widens_grad_norm_tolerance(tmp_path):
    base = write_run(tmp_path / "b.jsonl")
    base2 = write_run(tmp_path / "b2.jsonl", gn_shift=0.3)
    run = write_run(tmp_path / "r.jsonl", gn_shift=0.25)
    assert not compare_runs(run, base).passed
    report = compare_runs(run, base, noise_floor_from=[base2])
    assert report.passed, report.text()
    assert "noise floor 0.3" in report.text()
    from spartron.runtime.metrics import read_metrics

    assert grad_norm_noise_floor(read_metrics(base)[1], read_metrics(base2)[1]) == pytest.approx(0.3)


def test_missing_steps_fail(tmp_path):
    report = compare_runs(write_run(tmp_path / "r.jsonl", steps=3), write_run(tmp_path / "b.jsonl"))
    assert not report.passed
    assert "run has 3 steps, baseline 5; missing [4, 5]" in report.text()


def test_custom_tolerances(tmp_path):
    run, base = write_run(tmp_path / "r.jsonl", loss_scale=1.001), write_run(tmp_path / "b.jsonl")
    assert compare_runs(run, base, Tolerances(loss_rel=1e-2, exact_first_step=False)).passed


def test_plot_file_is_a_png(tmp_path):
    out = plot_runs(write_run(tmp_path / "r.jsonl", loss_scale=1.01), write_run(tmp_path / "b.jsonl"),
                    tmp_path / "plots" / "cmp.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_throughput_is_reported_not_enforced_on_cpu_unless_asked(tmp_path):
    run, base = write_run(tmp_path / "r.jsonl", tps_scale=0.5), write_run(tmp_path / "b.jsonl")
    report = compare_runs(run, base)
    assert report.passed, report.text()
    check = report.check("throughput (median tokens/s)")
    assert (check.passed, check.enforced) == (False, False)
    assert "  [WARN] throughput (median tokens/s): run 501.5 vs baseline 1003 (-50.00%, allowed -5% = max(5%, " \
           "noise floor 0.0%)); not enforced on CPU (deterministic runs share their cores)" in report.text()
    assert report.text().endswith("result: PASS (6/7 checks passed; 1 warning(s) not enforced)")
    strict = compare_runs(run, base, Tolerances(enforce_throughput_on_cpu=True))
    assert not strict.passed and "[FAIL] throughput" in strict.text()


def test_throughput_noise_floor_from_a_second_baseline_and_per_gpu(tmp_path):
    def per_gpu(path, scale):
        lines = [json.dumps({"type": "header", "deterministic": False})]
        lines += [json.dumps({"type": "step", "step": s, "loss": 1.0, "grad_norm": 1.0, "tokens_per_s": 8000.0 * scale,
                              "tokens_per_s_per_gpu": 1000.0 * scale}) for s in (1, 2, 3)]
        path.write_text("\n".join(lines) + "\n")
        return path

    base, base2, run = per_gpu(tmp_path / "b", 1.0), per_gpu(tmp_path / "b2", 0.9), per_gpu(tmp_path / "r", 0.92)
    assert not compare_runs(run, base).passed
    report = compare_runs(run, base, noise_floor_from=[base2])
    assert report.passed, report.text()
    assert report.throughput_floor == pytest.approx(0.1)
    assert "[PASS] throughput (median tokens/s per gpu): run 920 vs baseline 1000 (-8.00%, allowed -10% = max(5%, " \
           "noise floor 10.0%))" in report.text()


def test_plot_names_the_runs_and_shows_verdicts(tmp_path):
    import matplotlib.pyplot as plt

    run_dir, base_dir = tmp_path / "candidate", tmp_path / "reference"
    run_dir.mkdir(), base_dir.mkdir()
    run = write_run(run_dir / "metrics.jsonl", loss_scale=1.01)
    base = write_run(base_dir / "metrics.jsonl")
    fig = comparison_figure(run, base)
    assert [ax.get_title() for ax in fig.axes] == ["loss: FAIL", "grad norm: PASS", "tokens/s: PASS",
                                                   "peak allocated memory (GB): PASS"]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["allowed", "reference", "candidate"]
    assert fig.get_suptitle() == "candidate vs reference: FAIL (first-step loss (exact), loss (relative))"
    band = fig.axes[0].collections[0].get_paths()[0].vertices[:, 1]  # baseline loss 4.9 .. 4.5, -/+ loss_rel
    assert (band.min(), band.max()) == pytest.approx((4.5 * (1 - 2e-4), 4.9 * (1 + 2e-4)))
    plt.close(fig)


def test_validation_loss_is_compared_where_the_baseline_evaluated(tmp_path):
    def with_val(path, val, steps=(2, 4)):
        lines = [json.dumps({"type": "header", "deterministic": False})]
        lines += [json.dumps({"type": "step", "step": s, "loss": 3.0, **({"val_loss": val} if s in steps else {})})
                  for s in (1, 2, 3, 4)]
        path.write_text("\n".join(lines) + "\n")
        return path

    base = with_val(tmp_path / "b", 2.0)
    assert compare_runs(with_val(tmp_path / "same", 2.0), base).check("validation loss (relative)").passed
    worse = compare_runs(with_val(tmp_path / "w", 2.002), base)
    assert not worse.passed
    assert worse.check("validation loss (relative)").detail == ("max relative diff 0.001 at step 2 (tolerance 0.0002): "
                                                               "run 2.002 vs baseline 2")
    other = compare_runs(with_val(tmp_path / "o", 2.0, steps=(4,)), base).check("validation loss (relative)")
    assert not other.passed and other.detail == "evaluated at steps [4] in the run, [2, 4] in the baseline"


# ---- outside audit (ops): what made regress compare PASS runs it should not ----------------------------------
def _lines(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_steps_an_abandoned_attempt_wrote_past_the_resume_step_are_not_the_runs(tmp_path):
    """An attempt ran to step 5 after its last save (step 3), stopped; the resume from 3 ended at 4: step 5 is
    the abandoned attempt's (other lr), not this run's, and a 5-step baseline must not PASS against it."""
    from spartron.runtime.metrics import read_metrics

    step = lambda s, lr: {"type": "step", "step": s, "loss": 5.0 - 0.1 * s, "lr": lr}  # noqa: E731
    path = _lines(tmp_path / "m.jsonl", {"type": "header", "run_id": "a"}, *(step(s, 1e-3) for s in range(1, 6)),
                  {"type": "header", "run_id": "a", "resumed_from_step": 3}, step(4, 1e-4))
    _, steps = read_metrics(path)
    assert [(r["step"], r["lr"]) for r in steps] == [(1, 1e-3), (2, 1e-3), (3, 1e-3), (4, 1e-4)]


def test_another_learning_rate_schedule_fails(tmp_path):
    """A run stopped (SIGTERM) at step 3 of 50 against a finished 3-step run: another schedule, not the baseline."""
    def run(path, lr3):
        return _lines(path, {"type": "header"}, *({"type": "step", "step": s, "loss": 5.0, "lr": lr}
                                                  for s, lr in ((1, 1e-3), (2, 1e-3), (3, lr3))))
    report = compare_runs(run(tmp_path / "r.jsonl", 9.99e-4), run(tmp_path / "b.jsonl", 1e-4))
    failed = {c.name: c.detail for c in report.checks if not c.passed}
    assert list(failed) == ["learning rate (the same schedule)"]
    assert failed["learning rate (the same schedule)"].startswith("step 3: run 0.000999 vs baseline 0.0001")
    assert compare_runs(run(tmp_path / "r2.jsonl", 1e-4), run(tmp_path / "b2.jsonl", 1e-4)).passed


def test_less_peak_memory_passes(tmp_path):
    """--memory-abs-gb is the allowed increase: a run 0.3 GB leaner is no regression."""
    report = compare_runs(write_run(tmp_path / "r.jsonl", mem_shift=-0.3e9), write_run(tmp_path / "b.jsonl"))
    assert report.passed, report.text()


def test_a_noise_floor_run_must_be_another_run_of_the_baselines_config(tmp_path):
    from spartron.runtime.metrics import MetricsFileError

    def run(path, run_id, lr=1e-3, seed=0, gn=0.0):
        cfg = {"name": path.stem, "train": {"lr": lr, "seed": seed, "run_dir": str(path)}}
        return _lines(path, {"type": "header", "run_id": run_id, "config": cfg},
                      *({"type": "step", "step": s, "loss": 5.0, "grad_norm": 1.0 + gn, "tokens_per_s": 1e3}
                        for s in (1, 2)))

    base, candidate = run(tmp_path / "b.jsonl", "b"), run(tmp_path / "r.jsonl", "r", gn=3.0)
    with pytest.raises(MetricsFileError, match="the noise-floor run is the run under comparison"):
        compare_runs(candidate, base, noise_floor_from=[candidate])
    with pytest.raises(MetricsFileError, match=r"not a run of the baseline's config .*: train.lr differ"):
        compare_runs(candidate, base, noise_floor_from=[run(tmp_path / "o.jsonl", "o", lr=1e-2, gn=3.0)])
    second = run(tmp_path / "b2.jsonl", "b2", seed=1, gn=0.3)  # another seed, name and directory: allowed
    assert compare_runs(run(tmp_path / "r2.jsonl", "r2", gn=0.25), base, noise_floor_from=[second]).passed
