"""Regression comparison of a run's metrics.jsonl against a baseline: per-metric checks and plots.

The checks (defaults from the method of XTuner's review, see REFERENCES.md):
- step-1 loss bit-identical, when both runs say they are deterministic (CPU);
- loss: every step within a relative tolerance (2e-4); the validation loss too, at the steps both runs
  evaluated (train.eval_every), when the baseline has one;
- grad norm: every step within max(absolute tolerance 0.1, the noise floor), the noise floor being
  the largest step-wise difference between two baseline runs of the same config;
- peak allocated memory: the largest over the run within 0.2 GB (absolute);
- throughput: the median tokens/s per GPU over steps at most max(5%, the throughput noise floor) below
  the baseline's (faster passes). The throughput noise floor is measured like the grad-norm one: the
  largest relative difference of median tokens/s per GPU between the baseline and each second baseline
  run of the same config (`noise_floor_from`). On CPU (both runs deterministic, i.e. the ranks share a
  few cores with everything else on the machine) the throughput check is reported but not enforced
  unless `Tolerances.enforce_throughput_on_cpu`: a loaded CI host changes tokens/s by more than any
  useful tolerance while loss, grad norm and memory stay exact.
A NaN or Inf in any metric of a step record (compared or not: lr, lm_loss, mtp losses, expert load...), at any
step of either run, fails the comparison (a tolerance check would skip it: NaN compares false with everything;
a NaN lr or auxiliary loss means the run is not the one the loss curve suggests). A metrics file that cannot
be compared (not JSON, no step record, a compared metric missing from a step or not a number) is a
MetricsFileError naming the file, line and key: the CLI prints it as one line, exit status 2.
`compare_runs` returns a report with one line per check; `plot_runs` draws run vs baseline with the
tolerance band and the verdict of each panel's check.
"""

from __future__ import annotations

import json
import math
import os
import stat
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from spartron.configbase import ConfigError
from spartron.runtime.metrics import MetricsFileError, read_metrics
from spartron.runtime.safe_open import describe

GB = 1e9
# The metrics a comparison reads. Every step record holds "loss"; the per-step ones, once a file records them
# at any step, at every step; "val_loss" only at the steps that evaluated (train.eval_every).
REQUIRED_METRICS = ("loss",)
PER_STEP_METRICS = ("grad_norm", "tokens_per_s", "tokens_per_s_per_gpu", "peak_memory_allocated_bytes")
COMPARED_METRICS = REQUIRED_METRICS + PER_STEP_METRICS + ("val_loss",)
# Strings that float() reads as NaN / Inf (any case, a sign before): a writer other than json.dumps may use them.
_NONFINITE_WORDS = ("nan", "inf", "infinity")


@dataclass(frozen=True)
class Tolerances:
    loss_rel: float = 2e-4
    grad_norm_abs: float = 0.1
    memory_abs_bytes: float = 0.2 * GB
    throughput_rel: float = 0.05
    exact_first_step: bool = True  # only applied when both runs are deterministic
    enforce_throughput_on_cpu: bool = False  # deterministic (CPU) runs: throughput is reported, not enforced


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str
    enforced: bool = True  # False: reported (WARN when out of tolerance) but the report can still pass


@dataclass
class RegressionReport:
    run: str
    baseline: str
    checks: list[Check] = field(default_factory=list)
    noise_floor: float = 0.0  # grad norm, absolute
    throughput_floor: float = 0.0  # median tokens/s per GPU, relative

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed or not c.enforced for c in self.checks)

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def text(self) -> str:
        lines = [f"regression: {self.run}", f"  baseline: {self.baseline}"]
        lines += [f"  [{verdict(c)}] {c.name}: {c.detail}" for c in self.checks]
        warnings = sum(not c.passed and not c.enforced for c in self.checks)
        note = f"; {warnings} warning(s) not enforced" if warnings else ""
        lines.append(f"result: {'PASS' if self.passed else 'FAIL'} "
                     f"({sum(c.passed for c in self.checks)}/{len(self.checks)} checks passed{note})")
        return "\n".join(lines)


def verdict(check: Check) -> str:
    """PASS, FAIL, or WARN for an out-of-tolerance check that is not enforced."""
    return "PASS" if check.passed else "FAIL" if check.enforced else "WARN"


def _series(steps: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in steps if r.get(key) is not None}


def _worst_step(run: dict[int, float], base: dict[int, float], rel: bool) -> tuple[int, float]:
    worst = (-1, 0.0)
    for step in sorted(base):
        diff = abs(run[step] - base[step])
        if rel:
            diff /= max(abs(base[step]), 1e-12)
        if diff > worst[1] or worst[0] < 0:
            worst = (step, diff)
    return worst


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_run(path: str | Path) -> tuple[list[dict], list[dict]]:
    """read_metrics, then every kept step record checked for the compared metrics: MetricsFileError naming
    the file, the line and the key when a file holds no step, does not start with its header (not written by
    Spartron, or its first line lost), lacks a metric or records one as a non-number, or the step numbers do not
    count up from 1 (a step again with no resume header before it).
    Non-finite numbers are kept: the comparison fails on them (`compare`)."""
    headers, steps = read_metrics(path)
    if not steps:
        raise MetricsFileError(f"{path}: holds no step record (empty, or the run stopped before its first step): "
                               "nothing to compare")
    lines = {}  # step -> line number of its kept (last) record
    previous, resume_line = 0, None  # the last step since the latest header; the line of a resume header
    started = False  # a record was read: the first one must be the header
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        record = json.loads(line) if line.strip() else None
        if record is not None and not started and not _is_header(record):
            raise MetricsFileError(f"{path}:{number}: no header: not a metrics file Spartron wrote, or its first "
                                   "line was lost (its header says what the run was: deterministic, run id)")
        started = started or record is not None
        if isinstance(record, dict) and record.get("type") == "header":
            resumed = record.get("resumed_from_step")
            previous = resumed if isinstance(resumed, int) and not isinstance(resumed, bool) else 0
            resume_line = number if previous else None
        elif isinstance(record, dict) and record.get("type") == "step":
            step = record["step"]
            if step < 1:
                raise MetricsFileError(f"{path}:{number}: step {step} is not a step number (steps count from 1)")
            if step <= previous and resume_line is not None:  # a resume re-runs only the steps after its save
                raise MetricsFileError(f"{path}:{number}: step {step} is not after step {previous}, the step the "
                                       f"resume header at line {resume_line} resumed from: not one run's metrics")
            if step <= previous:  # a run writes each step once after its header
                raise MetricsFileError(f"{path}:{number}: step {step} follows step {previous} with no resume header "
                                       "between them (a duplicated or reordered record): not one run's metrics")
            previous, lines[step], resume_line = step, number, None
    recorded = {key for key in PER_STEP_METRICS if any(r.get(key) is not None for r in steps)}
    for record in steps:
        where = f"{path}:{lines[record['step']]}: step {record['step']}"
        for key in REQUIRED_METRICS + tuple(sorted(recorded)):
            if record.get(key) is None:
                raise MetricsFileError(f"{where}: metric {key!r} is missing" + (
                    "" if key in REQUIRED_METRICS else " (other steps of this file record it)"))
        for key in COMPARED_METRICS:
            if record.get(key) is not None and not _is_number(record[key]):
                raise MetricsFileError(f"{where}: metric {key!r} is not a number (got {record[key]!r:.60})")
    return headers, steps


def _is_header(record: object) -> bool:
    return isinstance(record, dict) and record.get("type") == "header"


def _nonfinite_values(value: object, path: str) -> list[tuple[str, object]]:
    """(dotted path, value) of every NaN / Inf number inside `value` (a metric: a number, or lists and objects
    of them, e.g. mtp_losses[1]); a string float() reads as NaN / Inf ("NaN", "inf") counts as one too."""
    if isinstance(value, dict):
        return [bad for key, item in value.items() for bad in _nonfinite_values(item, f"{path}.{key}")]
    if isinstance(value, list):
        return [bad for i, item in enumerate(value) for bad in _nonfinite_values(item, f"{path}[{i}]")]
    if isinstance(value, str) and value.strip().lower().lstrip("+-") in _NONFINITE_WORDS:
        return [(path, value)]
    if _is_number(value) and not math.isfinite(value):
        return [(path, value)]
    return []


def nonfinite(steps: list[dict]) -> list[str]:
    """'<metric> <value> at step <s>' for every metric of a step record (compared or not: lr, lm_loss,
    mtp_losses[i], expert load, ...) that is NaN or Inf, in step order; the writer (json.dumps) records them
    as the literals NaN / Infinity / -Infinity, which json.loads reads back as floats."""
    return [f"{path} {value!r} at step {record['step']}" for record in steps
            for key, item in record.items() if key not in ("type", "step")
            for path, value in _nonfinite_values(item, key)]


def _finite_check(runs: dict[str, list[dict]]) -> Check:
    found = {name: nonfinite(steps) for name, steps in runs.items()}
    bad = [f"{name}: {', '.join(items[:3])}" + (f" (and {len(items) - 3} more)" if len(items) > 3 else "")
           for name, items in found.items() if items]
    return Check("finite metrics", not bad, "; ".join(bad) if bad else
                 f"every metric is finite at every step of the {' and the '.join(runs)}")


def throughput_key(*runs: list[dict]) -> str:
    """tokens_per_s_per_gpu when every run records it, else tokens_per_s (older metrics files)."""
    return "tokens_per_s_per_gpu" if all(_series(r, "tokens_per_s_per_gpu") for r in runs) else "tokens_per_s"


def throughput_noise_floor(baseline: list[dict], baseline2: list[dict]) -> float:
    """Relative difference of median tokens/s per GPU between two runs of the baseline config."""
    key = throughput_key(baseline, baseline2)
    a, b = _series(baseline, key), _series(baseline2, key)
    if not a or not b:
        raise MetricsFileError(f"the baseline and its noise-floor run do not both record {key}")
    return abs(statistics.median(b.values()) / statistics.median(a.values()) - 1)


def grad_norm_noise_floor(baseline: list[dict], baseline2: list[dict]) -> float:
    """Largest step-wise |grad_norm| difference between two runs of the baseline config."""
    a, b = _series(baseline, "grad_norm"), _series(baseline2, "grad_norm")
    common = sorted(set(a) & set(b))
    if not common:
        raise MetricsFileError("the baseline and its noise-floor run share no step with a grad_norm")
    return max(abs(a[s] - b[s]) for s in common)


def compare(run_steps: list[dict], base_steps: list[dict], tolerances: Tolerances = Tolerances(),
            noise_floor: float = 0.0, deterministic: bool = False,
            throughput_floor: float = 0.0) -> list[Check]:
    """Checks of run vs baseline step records (as returned by read_metrics)."""
    t = tolerances
    checks: list[Check] = [_finite_check({"run": run_steps, "baseline": base_steps})]
    run_steps_ids = [r["step"] for r in run_steps]
    base_ids = [r["step"] for r in base_steps]
    if run_steps_ids != base_ids:
        missing = sorted(set(base_ids) - set(run_steps_ids))
        extra = sorted(set(run_steps_ids) - set(base_ids))
        checks.append(Check("steps", False, f"run has {len(run_steps_ids)} steps, baseline {len(base_ids)}; "
                                            f"missing {missing[:10]}, extra {extra[:10]}"))
        return checks
    if not base_ids:
        return [*checks, Check("steps", False, "the baseline has no step records")]
    checks.append(Check("steps", True, f"{len(base_ids)} steps in both"))
    run_lr, base_lr = _series(run_steps, "lr"), _series(base_steps, "lr")
    if run_lr and base_lr:  # the schedule (train.lr, warmup, steps): another one is another run, not a regression
        other = [s for s in base_lr if s in run_lr and not math.isclose(run_lr[s], base_lr[s], rel_tol=1e-9)]
        checks.append(Check("learning rate (the same schedule)", not other,
                            f"step {other[0]}: run {run_lr[other[0]]:.6g} vs baseline {base_lr[other[0]]:.6g} (another "
                            "train.lr, warmup or train.steps: compare runs of one config)" if other else
                            "the same lr at every step"))

    run_loss, base_loss = _series(run_steps, "loss"), _series(base_steps, "loss")
    first = base_ids[0]
    if t.exact_first_step and deterministic:
        same = run_loss[first] == base_loss[first]
        checks.append(Check("first-step loss (exact)", same,
                            f"step {first}: run {run_loss[first]!r} vs baseline {base_loss[first]!r}"))
    step, worst = _worst_step(run_loss, base_loss, rel=True)
    checks.append(Check("loss (relative)", worst <= t.loss_rel,
                        f"max relative diff {worst:.3g} at step {step} (tolerance {t.loss_rel:g}): "
                        f"run {run_loss[step]:.6g} vs baseline {base_loss[step]:.6g}"))

    run_val, base_val = _series(run_steps, "val_loss"), _series(base_steps, "val_loss")
    if base_val:  # train.eval_every: the same held-out set at the same steps, same tolerance as the loss
        if sorted(run_val) != sorted(base_val):
            checks.append(Check("validation loss (relative)", False,
                                f"evaluated at steps {sorted(run_val)[:10]} in the run, {sorted(base_val)[:10]} "
                                "in the baseline"))
        else:
            step, worst = _worst_step(run_val, base_val, rel=True)
            checks.append(Check("validation loss (relative)", worst <= t.loss_rel,
                                f"max relative diff {worst:.3g} at step {step} (tolerance {t.loss_rel:g}): "
                                f"run {run_val[step]:.6g} vs baseline {base_val[step]:.6g}"))

    run_gn, base_gn = _series(run_steps, "grad_norm"), _series(base_steps, "grad_norm")
    if base_gn:
        tol = max(t.grad_norm_abs, noise_floor)
        step, worst = _worst_step(run_gn, base_gn, rel=False)
        checks.append(Check("grad norm (absolute)", worst <= tol,
                            f"max abs diff {worst:.3g} at step {step} (tolerance {tol:.3g} = max(abs "
                            f"{t.grad_norm_abs:g}, noise floor {noise_floor:.3g}))"))

    run_mem = max(_series(run_steps, "peak_memory_allocated_bytes").values(), default=None)
    base_mem = max(_series(base_steps, "peak_memory_allocated_bytes").values(), default=None)
    if run_mem is not None and base_mem is not None:
        diff = run_mem - base_mem
        checks.append(Check("peak memory (absolute)", diff <= t.memory_abs_bytes,  # an increase: less passes
                            f"run {run_mem / GB:.3f} GB vs baseline {base_mem / GB:.3f} GB "
                            f"(diff {diff / GB:+.3f} GB, tolerance {t.memory_abs_bytes / GB:g} GB)"))

    key = throughput_key(run_steps, base_steps)
    run_tps, base_tps = list(_series(run_steps, key).values()), list(_series(base_steps, key).values())
    if run_tps and base_tps:
        r, b = statistics.median(run_tps), statistics.median(base_tps)
        change, allowed = r / b - 1, max(t.throughput_rel, throughput_floor)
        enforced = t.enforce_throughput_on_cpu or not deterministic
        why = "" if enforced else "; not enforced on CPU (deterministic runs share their cores)"
        checks.append(Check(f"throughput (median {key.replace('_', ' ').replace('tokens per s', 'tokens/s')})",
                            change >= -allowed,
                            f"run {r:.4g} vs baseline {b:.4g} ({change:+.2%}, allowed -{allowed:.0%} = max("
                            f"{t.throughput_rel:.0%}, noise floor {throughput_floor:.1%})){why}", enforced))
    return checks


def compare_runs(run_jsonl: str | Path, baseline_jsonl: str | Path, tolerances: Tolerances = Tolerances(),
                 noise_floor_from: list[str | Path] | None = None) -> RegressionReport:
    """Compare two metrics.jsonl files; noise_floor_from: a second baseline run of the same config."""
    run_headers, run_steps = load_run(run_jsonl)
    base_headers, base_steps = load_run(baseline_jsonl)
    noise = tps_noise = 0.0
    for other in noise_floor_from or []:
        other_headers, other_steps = load_run(other)
        check_noise_floor_run(other, other_headers, baseline_jsonl, base_headers, run_jsonl, run_headers)
        bad = nonfinite(other_steps)
        if bad:  # a NaN floor would widen nothing (max ignores it) and hide that the baseline config diverges
            raise MetricsFileError(f"{other}: the noise-floor run records non-finite metrics: {', '.join(bad[:3])}")
        noise = max(noise, grad_norm_noise_floor(base_steps, other_steps))
        tps_noise = max(tps_noise, throughput_noise_floor(base_steps, other_steps))
    deterministic = bool(run_headers and base_headers and run_headers[0].get("deterministic")
                         and base_headers[0].get("deterministic"))
    report = RegressionReport(str(run_jsonl), str(baseline_jsonl))
    report.checks = compare(run_steps, base_steps, tolerances, noise, deterministic, tps_noise)
    report.noise_floor, report.throughput_floor = noise, tps_noise
    return report


def check_noise_floor_run(path: str | Path, headers: list[dict], baseline: str | Path, base_headers: list[dict],
                          run: str | Path, run_headers: list[dict]) -> None:
    """A noise-floor run is a second run of the baseline's config (its model, data, schedule and batch; another
    seed, name or run directory): the candidate itself, or a run of another config, would widen the
    tolerances to whatever that difference is. MetricsFileError naming what differs."""
    def run_id(h: list[dict]) -> str | None:
        return h[0].get("run_id") if h else None

    if run_id(headers) is not None and run_id(headers) == run_id(run_headers):
        raise MetricsFileError(f"{path}: the noise-floor run is the run under comparison ({run}): it would set the "
                               "tolerances to the regression itself; give a second run of the baseline's config")
    mine, theirs = (h[0].get("config") if h else None for h in (headers, base_headers))
    if not isinstance(mine, dict) or not isinstance(theirs, dict):
        return  # older files without their config: nothing to compare
    # what a second run may set otherwise: where it runs and writes, its seed, how it reports
    free = {"name", "run_dir", "seed", "resume", "overwrite", "progress", "launch", "observe"}

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            if k in free:
                continue
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    a, b = flat(mine), flat(theirs)
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if differ:
        raise MetricsFileError(f"{path}: the noise-floor run is not a run of the baseline's config ({baseline}): "
                               f"{', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''} differ")


def run_label(path: str | Path, headers: list[dict]) -> str:
    """A run's name in a legend: its config's name and its run directory (or file)."""
    path = Path(path)
    where = path.parent.name if path.name == "metrics.jsonl" else path.name
    name = headers[0].get("name") if headers else None
    return f"{name} ({where})" if name and name != where else where


_VERDICT_COLOR = {"PASS": "tab:green", "FAIL": "tab:red", "WARN": "tab:orange"}


def plot_runs(run_jsonl: str | Path, baseline_jsonl: str | Path, out_png: str | Path,
              tolerances: Tolerances = Tolerances(), report: RegressionReport | None = None) -> Path:
    """Write `comparison_figure` as a PNG (or the format the name's suffix says). The file is written under a
    new name beside `out_png` and renamed over it: an existing regular file is replaced, and a link, FIFO or
    folder at that name is refused (ConfigError naming it), never written through."""
    import matplotlib.pyplot as plt

    out = Path(out_png)
    _check_plot_path(out)
    fig = comparison_figure(run_jsonl, baseline_jsonl, tolerances, report)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, dpi=100, format=out.suffix[1:].lower() or "png")
        os.replace(tmp, out)
    except OSError as err:
        raise ConfigError(f"--plot {str(out)!r} cannot be written: {err.strerror or err}") from None
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out


def _check_plot_path(out: Path) -> None:
    """ConfigError unless `out` is absent or a regular file, and its suffix names a format matplotlib writes."""
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    if out.suffix and out.suffix[1:].lower() not in formats:
        raise ConfigError(f"--plot {str(out)!r}: unknown image format {out.suffix!r} (use one of "
                          f"{', '.join('.' + f for f in sorted(formats))})")
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    except OSError as err:  # a name too long, a parent that is a file
        raise ConfigError(f"--plot {str(out)[:200]!r} cannot be written: {err.strerror or err}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"--plot {str(out)!r} {describe(out)}: the plot replaces a regular file or makes a new "
                          "one; choose another path")


def comparison_figure(run_jsonl: str | Path, baseline_jsonl: str | Path, tolerances: Tolerances = Tolerances(),
                      report: RegressionReport | None = None):  # noqa: ANN201 - a matplotlib Figure
    """2x2 panels of loss, grad norm, tokens/s per GPU and peak memory per step: the baseline with the
    band its check allows around it, the run, each panel titled with its check's verdict, the runs
    named in the legend. `report`: the comparison to show (computed here when not given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = tolerances
    report = report or compare_runs(run_jsonl, baseline_jsonl, t)
    (run_headers, run_steps), (base_headers, base_steps) = read_metrics(run_jsonl), read_metrics(baseline_jsonl)
    labels = run_label(run_jsonl, run_headers), run_label(baseline_jsonl, base_headers)
    if labels[0] == labels[1]:
        labels = (f"run: {labels[0]}", f"baseline: {labels[1]}")
    tps = throughput_key(run_steps, base_steps)
    gn_tol = max(t.grad_norm_abs, report.noise_floor)
    tps_tol = max(t.throughput_rel, report.throughput_floor)
    # (record key, title, scale, the check it shows, band around the baseline value v: (low, high); None:
    # the throughput check compares medians, so its band runs from the allowed drop up to the baseline's median)
    panels = (
        ("loss", "loss", 1.0, "loss (relative)", lambda v: (v - t.loss_rel * abs(v), v + t.loss_rel * abs(v))),
        ("grad_norm", "grad norm", 1.0, "grad norm (absolute)", lambda v: (v - gn_tol, v + gn_tol)),
        (tps, "tokens/s per GPU" if tps.endswith("per_gpu") else "tokens/s", 1.0, "throughput (", None),
        ("peak_memory_allocated_bytes", "peak allocated memory (GB)", 1 / GB, "peak memory (absolute)",
         lambda v: (v - t.memory_abs_bytes, v + t.memory_abs_bytes)),
    )
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (key, title, scale, check_name, band) in zip(axes.flat, panels, strict=True):
        base, run = _series(base_steps, key), _series(run_steps, key)
        check = next((c for c in report.checks if c.name.startswith(check_name)), None)
        if base:
            steps = list(base)
            if band is None:
                median = statistics.median(base.values())
                low, high = [median * (1 - tps_tol)] * len(steps), [median] * len(steps)
            else:
                low, high = zip(*(band(v) for v in base.values()), strict=True)
            ax.fill_between(steps, [v * scale for v in low], [v * scale for v in high], color="tab:blue", alpha=0.15,
                            label="allowed" if band is not None else f"allowed (median -{tps_tol:.0%})")
            ax.plot(steps, [v * scale for v in base.values()], linestyle="--", marker=".", color="tab:blue",
                    label=labels[1])
        if run:
            ax.plot(list(run), [v * scale for v in run.values()], marker=".", color="tab:red", label=labels[0])
        state = verdict(check) if check is not None else "not checked"
        ax.set_title(f"{title}: {state}", color=_VERDICT_COLOR.get(state, "black"), fontweight="bold")
        ax.set_xlabel("step")
        ax.legend(fontsize="small")
    failed = [c.name for c in report.checks if not c.passed and c.enforced]
    fig.suptitle(f"{labels[0]} vs {labels[1]}: " + (f"FAIL ({', '.join(failed)})" if failed else "PASS"))
    fig.tight_layout()
    return fig
