"""Reading a run's metrics.jsonl, summarising and plotting runs side by side (the trainer's last line, `python -m
megatron_gtpo.plot`, the demo and tools/compare_algorithms.py)."""
from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

from megatron_gtpo.atomic_files import write_atomically
from megatron_gtpo.progress import format_duration

METRICS_FILE = "metrics.jsonl"
PLOTTED = (("reward_mean", "mean reward"), ("entropy_mean", "mean token entropy (nats)"),
           ("response_length_mean", "mean response length (tokens)"))
# A run at a glance: what `python -m megatron_gtpo.plot` draws; step_time_s is the sum of the step's phase times.
RUN_PANELS = (("reward_mean", "mean reward"), ("accuracy", "accuracy (outcome reward)"),
              ("entropy_mean", "mean token entropy (nats)"), ("response_length_mean", "mean response length (tokens)"),
              ("step_time_s", "step time (s)"))
SUMMARY_WINDOW = 10  # steps averaged at the start and at the end of a run in its summary line


def read_rl_metrics(output_dir: str) -> list[dict]:
    """The RL steps of a run (the warm-start's row, step -1, is left out), each with its `step_time_s` (the sum of
    its phases' `time_*_s`). A last line without its newline (a row still being written) is left for next time."""
    with open(os.path.join(output_dir, METRICS_FILE), encoding="utf-8") as f:
        lines = f.read().split("\n")
    rows = [json.loads(line) for line in lines[:-1] if line.strip()]  # lines[-1]: after the last newline
    return [{**row, "step_time_s": step_time_s(row)} for row in rows if row["step"] >= 0]


def step_time_s(row: dict) -> float | None:
    """A step's wall time: the sum of its phases' times (`time_<phase>_s`); None when it logged none."""
    phases = [v for k, v in row.items() if k.startswith("time_") and k.endswith("_s") and v is not None]
    return sum(phases) if phases else None


def run_summary_line(rows: list[dict], window: int = SUMMARY_WINDOW) -> str:
    """A run's RL steps in one line: how many, their time, and how reward, accuracy, token entropy and response
    length moved (the means of the first and of the last `window` steps, `window_means`)."""
    if not rows:
        return "no RL step logged"
    seconds = sum(t for t in (step_time_s(r) for r in rows) if t is not None)
    moved = []
    for key, name in (("reward_mean", "reward"), ("accuracy", "accuracy"), ("entropy_mean", "entropy"),
                      ("response_length_mean", "response length")):
        values = [r.get(key) for r in rows]
        if any(v is not None for v in values):
            first, last = window_means(values, window)
            moved.append(f"{name} {first:.3g} -> {last:.3g}")
    shown = max(1, min(window, len(rows) // 2))
    return (f"{len(rows)} RL steps ({rows[0]['step']}-{rows[-1]['step']}) in {format_duration(seconds)} "
            f"({seconds / len(rows):.3g} s/step); {', '.join(moved)} (mean of the first -> last {shown} steps)")


def window_means(values: list[float | None], window: int) -> tuple[float, float]:
    """Mean of the first and of the last `window` values (window clipped to half the series). A None (a metric with
    no value that step, written as null: e.g. entropies when dynamic sampling kept no group) is left out of its
    window's mean; a window without values has mean NaN."""
    window = max(1, min(window, len(values) // 2))

    def mean(part):
        known = [v for v in part if v is not None]
        return sum(known) / len(known) if known else float("nan")

    return mean(values[:window]), mean(values[-window:])


def plot_runs(runs: dict[str, list[dict]], path: str, title: str, panels=PLOTTED) -> None:
    """One panel per metric (three to a row), one line per run; written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, len(panels))
    rows_of_panels = -(-len(panels) // columns)
    fig, grid = plt.subplots(rows_of_panels, columns, figsize=(4.4 * columns, 3.6 * rows_of_panels), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[len(panels):]:
        ax.axis("off")
    for ax, (key, label) in zip(axes, panels):
        for name, rows in runs.items():
            values = [float("nan") if r.get(key) is None else r[key] for r in rows]  # null: no value that step
            ax.plot([r["step"] for r in rows], values, lw=1.2, label=name)
        ax.set_xlabel("RL step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes[0].legend()
    _save_atomically(fig, title, path, dpi=110)


def mean_and_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1 in the denominator; 0.0 for a single value) of the known values
    (None and NaN left out: a metric without a value at some step); (NaN, NaN) when none is known."""
    known = [v for v in values if v is not None and v == v]
    if not known:
        return float("nan"), float("nan")
    mean = sum(known) / len(known)
    if len(known) == 1:
        return mean, 0.0
    return mean, (sum((v - mean) ** 2 for v in known) / (len(known) - 1)) ** 0.5


# Student's t quantiles for 1..30 degrees of freedom (standard tables, 3 decimals): two-sided 95% (0.975) and 80%
# power (0.80). Beyond 30 the 30-df values: wider than the exact ones, so intervals stay conservative.
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
          2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_T_80 = (1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873, 0.870, 0.868, 0.866,
         0.865, 0.863, 0.862, 0.861, 0.860, 0.859, 0.858, 0.858, 0.857, 0.856, 0.856, 0.855, 0.855, 0.854, 0.854)


def t_quantile(probability: float, dof: int) -> float:
    """Student's t quantile at `probability` (0.975 or 0.80) for `dof` >= 1 degrees of freedom (the tables above)."""
    table = {0.975: _T_975, 0.80: _T_80}.get(probability)
    if table is None or dof < 1:
        raise ValueError(f"t_quantile: probability 0.975 or 0.80 and dof >= 1, got {probability}, {dof}")
    return table[min(dof, len(table)) - 1]


def _regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) for a, b > 0 and 0 <= x <= 1: the continued fraction (modified Lentz), on the side of x where it
    converges fast (I_x(a, b) = 1 - I_{1-x}(b, a))."""
    if x <= 0.0 or x >= 1.0:
        return max(0.0, min(1.0, x))
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _regularized_incomplete_beta(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    return math.exp(log_front) * fraction / a


def t_survival(t: float, dof: int) -> float:
    """P(T > t) for Student's t with `dof` >= 1 degrees of freedom: a one-sided p-value."""
    if dof < 1:
        raise ValueError(f"t_survival: dof >= 1, got {dof}")
    tail = 0.5 * _regularized_incomplete_beta(dof / 2, 0.5, dof / (dof + t * t))
    return tail if t >= 0 else 1.0 - tail


def t_critical(alpha: float, dof: int) -> float:
    """The t with P(T_dof > t) = alpha (0 < alpha < 1), by bisection on t_survival to 1e-10."""
    if not 0 < alpha < 1:
        raise ValueError(f"t_critical: alpha in (0, 1), got {alpha}")
    low, high = -1e3, 1e3
    while high - low > 1e-10:
        middle = (low + high) / 2
        low, high = (middle, high) if t_survival(middle, dof) > alpha else (low, middle)
    return (low + high) / 2


class PairedTest(NamedTuple):
    """A one-sided paired t-test of mean(values - reference) > 0 over n pairs: the mean difference, its standard error
    sd / sqrt(n), t = mean / standard error, and the one-sided p-value P(T_{n-1} >= t)."""

    mean: float
    standard_error: float
    t: float
    p_value: float
    pairs: int

    @property
    def half_width(self) -> float:
        """Of the two-sided 95% t-interval of the mean difference."""
        return t_quantile(0.975, self.pairs - 1) * self.standard_error

    def detectable(self, alpha: float, power: float = 0.8) -> float:
        """The smallest true mean difference a one-sided test at level `alpha` detects with `power`, at this spread:
        (t_{1-alpha} + t_{power}) * standard error, n - 1 degrees of freedom."""
        dof = self.pairs - 1
        return (t_critical(alpha, dof) + t_critical(1 - power, dof)) * self.standard_error


def paired_t_test(values: list[float], reference: list[float]) -> PairedTest:
    """PairedTest of values[i] - reference[i] (n >= 2 pairs). All differences equal: t is +-inf (p 0 or 1) unless the
    mean is 0 (t 0, p 0.5)."""
    if len(values) != len(reference) or len(values) < 2:
        raise ValueError(f"paired differences need two equal-length lists of >= 2 values, got {len(values)} and "
                         f"{len(reference)}")
    mean, spread = mean_and_spread([v - r for v, r in zip(values, reference)])
    n = len(values)
    standard_error = spread / n ** 0.5
    if standard_error > 0:
        t = mean / standard_error
    else:
        t = math.copysign(math.inf, mean) if mean != 0 else 0.0
    p_value = 0.5 if t == 0 else (0.0 if t == math.inf else 1.0 if t == -math.inf else t_survival(t, n - 1))
    return PairedTest(mean, standard_error, t, p_value, n)


def holm_rejections(p_values: list[float], alpha: float) -> list[bool]:
    """Holm's step-down procedure at family-wise level `alpha`: the k-th smallest p-value (k = 1..m) is compared with
    alpha / (m - k + 1); every hypothesis up to the first that fails is rejected, none after it."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    rejected = [False] * len(p_values)
    for k, i in enumerate(order):
        if p_values[i] > alpha / (len(p_values) - k):
            break
        rejected[i] = True
    return rejected


def paired_difference(values: list[float], reference: list[float]) -> tuple[float, float, float]:
    """Paired differences values[i] - reference[i] (e.g. one seed each): (their mean, the half-width of its 95%
    t-interval, the smallest true mean difference this many pairs detect with 80% power at the 5% two-sided level).
    The last two are (t_0.975 [+ t_0.80]) * sd / sqrt(n) with n - 1 degrees of freedom; n >= 2 pairs."""
    test = paired_t_test(values, reference)
    dof = test.pairs - 1
    return test.mean, test.half_width, (t_quantile(0.975, dof) + t_quantile(0.80, dof)) * test.standard_error


def normalized_auc(values: list[float]) -> float:
    """Area under a per-step curve (trapezoids, unit step) divided by its length in steps: the curve's mean height,
    comparable across runs of the same length (a single value is its own height)."""
    if not values:
        raise ValueError("normalized_auc needs at least one value")
    if len(values) == 1:
        return float(values[0])
    return sum((a + b) / 2 for a, b in zip(values, values[1:])) / (len(values) - 1)


def plot_bands(runs: dict[str, list[list[dict]]], path: str, title: str, panels=PLOTTED) -> None:
    """One panel per metric; per label, the mean over its runs (seeds) at each step with a band of ± one sample
    standard deviation. Steps where a run has no value (null, or a metric its algorithm does not log) are averaged
    over the runs that have one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, len(panels))
    rows_of_panels = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows_of_panels, columns, figsize=(4.6 * columns, 3.4 * rows_of_panels), squeeze=False)
    for ax, (key, label) in zip(axes.flat, panels):
        for name, seeds in runs.items():
            steps = sorted({r["step"] for rows in seeds for r in rows})
            by_step = [[r.get(key) for rows in seeds for r in rows if r["step"] == step] for step in steps]
            stats = [mean_and_spread(values) for values in by_step]
            means = [m for m, _ in stats]
            line, = ax.plot(steps, means, lw=1.2, label=name)
            ax.fill_between(steps, [m - s for m, s in stats], [m + s for m, s in stats], color=line.get_color(),
                            alpha=0.15, lw=0)
        ax.set_xlabel("RL step")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    _save_atomically(fig, title, path, dpi=80)


def _save_atomically(fig, title: str, path: str, *, dpi: int) -> None:
    """Title, layout, then the PNG written under a temporary name and renamed (never a half-written plot)."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    try:
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    finally:
        plt.close(fig)
