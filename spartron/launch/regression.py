"""Regression comparison of a run's metrics.jsonl against a baseline: per-metric checks and plots.

The checks (defaults from the method of XTuner's review, see REFERENCES.md):
- step-1 loss bit-identical, when both runs say they are deterministic (CPU);
- loss: every step within a relative tolerance (2e-4);
- grad norm: every step within max(absolute tolerance 0.1, the noise floor), the noise floor being
  the largest step-wise difference between two baseline runs of the same config;
- peak allocated memory: the largest over the run within 0.2 GB (absolute);
- throughput: the median tokens/s over steps at most 5% below the baseline's (faster passes).
`compare_runs` returns a report with one line per check; `plot_runs` draws run vs baseline.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from spartron.runtime.metrics import read_metrics

GB = 1e9


@dataclass(frozen=True)
class Tolerances:
    loss_rel: float = 2e-4
    grad_norm_abs: float = 0.1
    memory_abs_bytes: float = 0.2 * GB
    throughput_rel: float = 0.05
    exact_first_step: bool = True  # only applied when both runs are deterministic


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class RegressionReport:
    run: str
    baseline: str
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def text(self) -> str:
        lines = [f"regression: {self.run}", f"  baseline: {self.baseline}"]
        lines += [f"  [{'PASS' if c.passed else 'FAIL'}] {c.name}: {c.detail}" for c in self.checks]
        lines.append(f"result: {'PASS' if self.passed else 'FAIL'} "
                     f"({sum(c.passed for c in self.checks)}/{len(self.checks)} checks passed)")
        return "\n".join(lines)


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


def grad_norm_noise_floor(baseline: list[dict], baseline2: list[dict]) -> float:
    """Largest step-wise |grad_norm| difference between two runs of the baseline config."""
    a, b = _series(baseline, "grad_norm"), _series(baseline2, "grad_norm")
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("the two baseline runs share no steps with a grad_norm")
    return max(abs(a[s] - b[s]) for s in common)


def compare(run_steps: list[dict], base_steps: list[dict], tolerances: Tolerances = Tolerances(),
            noise_floor: float = 0.0, deterministic: bool = False) -> list[Check]:
    """Checks of run vs baseline step records (as returned by read_metrics)."""
    t = tolerances
    checks: list[Check] = []
    run_steps_ids = [r["step"] for r in run_steps]
    base_ids = [r["step"] for r in base_steps]
    if run_steps_ids != base_ids:
        missing = sorted(set(base_ids) - set(run_steps_ids))
        extra = sorted(set(run_steps_ids) - set(base_ids))
        checks.append(Check("steps", False, f"run has {len(run_steps_ids)} steps, baseline {len(base_ids)}; "
                                            f"missing {missing[:10]}, extra {extra[:10]}"))
        return checks
    if not base_ids:
        return [Check("steps", False, "the baseline has no step records")]
    checks.append(Check("steps", True, f"{len(base_ids)} steps in both"))

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
        checks.append(Check("peak memory (absolute)", abs(diff) <= t.memory_abs_bytes,
                            f"run {run_mem / GB:.3f} GB vs baseline {base_mem / GB:.3f} GB "
                            f"(diff {diff / GB:+.3f} GB, tolerance {t.memory_abs_bytes / GB:g} GB)"))

    run_tps = list(_series(run_steps, "tokens_per_s").values())
    base_tps = list(_series(base_steps, "tokens_per_s").values())
    if run_tps and base_tps:
        r, b = statistics.median(run_tps), statistics.median(base_tps)
        change = r / b - 1
        checks.append(Check("throughput (median tokens/s)", change >= -t.throughput_rel,
                            f"run {r:.4g} vs baseline {b:.4g} ({change:+.2%}, "
                            f"allowed -{t.throughput_rel:.0%})"))
    return checks


def compare_runs(run_jsonl: str | Path, baseline_jsonl: str | Path, tolerances: Tolerances = Tolerances(),
                 noise_floor_from: list[str | Path] | None = None) -> RegressionReport:
    """Compare two metrics.jsonl files; noise_floor_from: a second baseline run of the same config."""
    run_headers, run_steps = read_metrics(run_jsonl)
    base_headers, base_steps = read_metrics(baseline_jsonl)
    noise = 0.0
    for other in noise_floor_from or []:
        noise = max(noise, grad_norm_noise_floor(base_steps, read_metrics(other)[1]))
    deterministic = bool(run_headers and base_headers and run_headers[0].get("deterministic")
                         and base_headers[0].get("deterministic"))
    report = RegressionReport(str(run_jsonl), str(baseline_jsonl))
    report.checks = compare(run_steps, base_steps, tolerances, noise, deterministic)
    return report


PLOTTED = (("loss", "loss", 1.0), ("grad_norm", "grad norm", 1.0), ("tokens_per_s", "tokens/s", 1.0),
           ("peak_memory_allocated_bytes", "peak allocated memory (GB)", 1 / GB))


def plot_runs(run_jsonl: str | Path, baseline_jsonl: str | Path, out_png: str | Path) -> Path:
    """A 2x2 PNG of loss, grad norm, throughput and memory per step, run vs baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = {"baseline": read_metrics(baseline_jsonl)[1], "run": read_metrics(run_jsonl)[1]}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, title, scale) in zip(axes.flat, PLOTTED, strict=True):
        for label, steps in traces.items():
            series = _series(steps, key)
            ax.plot(list(series), [v * scale for v in series.values()], label=label,
                    linestyle="--" if label == "baseline" else "-", marker=".")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
