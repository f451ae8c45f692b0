"""Reading a run's metrics.jsonl and plotting runs side by side (the demo and tools/compare_algorithms.py)."""
from __future__ import annotations

import json
import os

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
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
