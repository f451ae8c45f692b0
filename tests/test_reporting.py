"""Summaries and plots of metrics.jsonl series (megatron_gtpo/reporting.py), steps without a value included."""
import json
import math
import statistics

import pytest

from megatron_gtpo.reporting import (mean_and_spread, normalized_auc, plot_bands, plot_runs, read_rl_metrics,
                                     window_means)


def test_window_means_leave_out_steps_without_a_value():
    assert window_means([1.0, 3.0, 5.0, 7.0, 9.0], 2) == (2.0, 8.0)
    assert window_means([1.0, None, 5.0, None, 9.0], 2) == (1.0, 9.0)  # null: e.g. entropy with no group kept
    first, last = window_means([None, 2.0], 1)
    assert math.isnan(first) and last == 2.0
    assert window_means([4.0, 6.0, 8.0], 10) == (4.0, 8.0)  # the window is clipped to half the series


def test_runs_with_missing_values_are_read_and_plotted(tmp_path):
    rows = [{"step": -1, "sft_loss": 2.0}] + [{"step": s, "reward_mean": 0.1 * s, "entropy_mean": None if s == 1
                                               else 1.0, "response_length_mean": 3.0} for s in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    read = read_rl_metrics(str(tmp_path))
    assert [r["step"] for r in read] == [0, 1, 2, 3]
    plot_runs({"run": read}, str(tmp_path / "plot.png"), "title")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_mean_and_spread_is_the_mean_and_sample_standard_deviation_of_the_known_values():
    assert mean_and_spread([1.0, 2.0, 3.0]) == (2.0, 1.0)
    values = [0.13, 0.42, 0.27, 0.31]
    mean, spread = mean_and_spread(values)
    assert mean == pytest.approx(statistics.fmean(values)) and spread == pytest.approx(statistics.stdev(values))
    assert mean_and_spread([5.0]) == (5.0, 0.0)
    assert mean_and_spread([1.0, None, float("nan"), 3.0]) == (2.0, math.sqrt(2.0))
    assert all(math.isnan(x) for x in mean_and_spread([None]))


def test_normalized_auc_is_the_trapezoid_area_per_step():
    assert normalized_auc([0.0, 1.0]) == 0.5
    assert normalized_auc([0.0, 1.0, 1.0]) == 0.75  # (0.5 + 1) / 2 steps
    assert normalized_auc([0.2, 0.2, 0.2, 0.2]) == pytest.approx(0.2)
    assert normalized_auc([0.4]) == 0.4
    with pytest.raises(ValueError):
        normalized_auc([])


def test_bands_over_seeds_are_plotted_with_missing_values(tmp_path):
    seeds = [[{"step": s, "reward_mean": 0.1 * s + seed, "entropy_mean": None if (s, seed) == (1, 0) else 1.0}
              for s in range(4)] for seed in range(3)]
    plot_bands({"a": seeds, "b": seeds[:1]}, str(tmp_path / "bands.png"), "title",
               panels=(("reward_mean", "reward"), ("entropy_mean", "entropy")))
    assert (tmp_path / "bands.png").stat().st_size > 10_000
