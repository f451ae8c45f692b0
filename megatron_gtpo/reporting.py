"""Reading a run's metrics.jsonl and plotting runs side by side (the demo and tools/compare_algorithms.py)."""
from __future__ import annotations

import json
import os

from megatron_gtpo.atomic_files import write_atomically

PLOTTED = (("reward_mean", "mean reward"), ("entropy_mean", "mean token entropy (nats)"),
           ("response_length_mean", "mean response length (tokens)"))


def read_rl_metrics(output_dir: str) -> list[dict]:
    """The RL steps of a run (the warm-start's row, step -1, is left out)."""
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [row for row in map(json.loads, f) if row["step"] >= 0]


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
    """One panel per metric, one line per run; written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6))
    for ax, (key, label) in zip(axes, panels):
        for name, rows in runs.items():
            values = [float("nan") if r[key] is None else r[key] for r in rows]  # null: no value that step
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
    standard deviation. Steps where a run has no value (null) are averaged over the runs that have one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, len(panels))
    rows_of_panels = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows_of_panels, columns, figsize=(4.6 * columns, 3.4 * rows_of_panels), squeeze=False)
    for ax, (key, label) in zip(axes.flat, panels):
        for name, seeds in runs.items():
            steps = sorted({r["step"] for rows in seeds for r in rows})
            by_step = [[r[key] for rows in seeds for r in rows if r["step"] == step] for step in steps]
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
