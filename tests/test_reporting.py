"""Summaries and plots of metrics.jsonl series (megatron_gtpo/reporting.py), steps without a value included."""
import json
import math
import statistics

import pytest

from megatron_gtpo.reporting import (holm_rejections, mean_and_spread, normalized_auc, paired_difference,
                                     paired_t_test, plot_bands, plot_runs, read_rl_metrics, t_critical, t_quantile,
                                     t_survival,
                                     window_means)


def test_window_means_leave_out_steps_without_a_value():
    assert window_means([1.0, 3.0, 5.0, 7.0, 9.0], 2) == (2.0, 8.0)
    assert window_means([1.0, None, 5.0, None, 9.0], 2) == (1.0, 9.0)  # null: e.g. entropy with no group kept
    first, last = window_means([None, 2.0], 1)
    assert math.isnan(first) and last == 2.0
    assert window_means([4.0, 6.0, 8.0], 10) == (4.0, 8.0)  # the window is clipped to half the series


@pytest.mark.slow  # matplotlib's import and a figure (make test runs it)
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


@pytest.mark.slow  # matplotlib's import and a figure (make test runs it)
def test_bands_over_seeds_are_plotted_with_missing_values(tmp_path):
    seeds = [[{"step": s, "reward_mean": 0.1 * s + seed, "entropy_mean": None if (s, seed) == (1, 0) else 1.0}
              for s in range(4)] for seed in range(3)]
    plot_bands({"a": seeds, "b": seeds[:1]}, str(tmp_path / "bands.png"), "title",
               panels=(("reward_mean", "reward"), ("entropy_mean", "entropy")))
    assert (tmp_path / "bands.png").stat().st_size > 10_000


def _t_cdf(q: float, dof: int) -> float:
    """Student's t CDF at q >= 0 by Simpson's rule over its density (float64), the tables' independent reference."""
    norm = math.gamma((dof + 1) / 2) / (math.sqrt(dof * math.pi) * math.gamma(dof / 2))
    density = [norm * (1 + (q * i / 2000) ** 2 / dof) ** (-(dof + 1) / 2) for i in range(2001)]
    weights = [1 if i in (0, 2000) else 4 if i % 2 else 2 for i in range(2001)]
    return 0.5 + q / 2000 / 3 * math.fsum(w * d for w, d in zip(weights, density))


@pytest.mark.parametrize("probability", [0.975, 0.80])
def test_t_quantiles_match_the_t_distribution(probability):
    for dof in range(1, 31):  # 3 decimals: the CDF at the tabled value is within the density times 0.0005
        assert _t_cdf(t_quantile(probability, dof), dof) == pytest.approx(probability, abs=2e-4), dof
    assert t_quantile(0.975, 100) == t_quantile(0.975, 30)  # beyond the table: the 30-df value (conservative)
    with pytest.raises(ValueError, match="probability"):
        t_quantile(0.95, 4)


def test_paired_difference_on_a_hand_computed_case():
    # differences 0.1 .. 0.5: mean 0.3, sd sqrt(0.025), se sqrt(0.025 / 5) = 0.0707; 4 dof: t 2.776 and 0.941
    mean, half_width, detectable = paired_difference([0.6, 0.7, 0.8, 0.9, 1.0], [0.5, 0.5, 0.5, 0.5, 0.5])
    assert mean == pytest.approx(0.3)
    assert half_width == pytest.approx(2.776 * math.sqrt(0.005))
    assert detectable == pytest.approx((2.776 + 0.941) * math.sqrt(0.005))
    assert paired_difference([1.0, 2.0], [1.0, 2.0]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="paired differences need"):
        paired_difference([1.0], [1.0])


@pytest.mark.parametrize("dof", [1, 2, 4, 9, 30])
def test_t_survival_matches_the_t_distribution(dof):
    for q in (0.0, 0.3, 0.883, 1.833, 2.262, 4.0, 9.0):
        assert t_survival(q, dof) == pytest.approx(1 - _t_cdf(q, dof), abs=1e-9), q
        assert t_survival(-q, dof) == pytest.approx(_t_cdf(q, dof), abs=1e-9), q
    with pytest.raises(ValueError, match="dof"):
        t_survival(1.0, 0)
    # the critical values against the tables of 3 decimals (one-sided 2.5% and 20%)
    assert t_critical(0.025, dof) == pytest.approx(t_quantile(0.975, dof), abs=6e-4)
    assert t_critical(0.20, dof) == pytest.approx(t_quantile(0.80, dof), abs=6e-4)
    assert t_survival(t_critical(0.05, dof), dof) == pytest.approx(0.05, abs=1e-9)


def test_paired_t_test_on_a_hand_computed_case():
    # differences 0.1 .. 0.5: mean 0.3, se sqrt(0.005), t = 0.3 / sqrt(0.005) = 4.243 on 4 dof
    test = paired_t_test([0.6, 0.7, 0.8, 0.9, 1.0], [0.5] * 5)
    assert test.mean == pytest.approx(0.3) and test.pairs == 5
    assert test.half_width == pytest.approx(2.776 * math.sqrt(0.005))
    assert test.t == pytest.approx(0.3 / math.sqrt(0.005)) and test.standard_error == pytest.approx(math.sqrt(0.005))
    assert test.detectable(0.025) == pytest.approx((2.776 + 0.941) * math.sqrt(0.005), abs=1e-3)  # the tables'
    assert test.detectable(0.025) == pytest.approx(paired_difference([0.6, 0.7, 0.8, 0.9, 1.0], [0.5] * 5)[2],
                                                   abs=1e-3)
    assert test.p_value == pytest.approx(1 - _t_cdf(0.3 / math.sqrt(0.005), 4), abs=1e-9)
    assert paired_t_test([0.4, 0.5], [0.5, 0.6]).p_value == 1.0  # every difference -0.1: t = -inf
    assert paired_t_test([1.0, 2.0], [1.0, 2.0]).p_value == 0.5
    reverse = paired_t_test([0.5] * 5, [0.6, 0.7, 0.8, 0.9, 1.0])
    assert reverse.t == -test.t and reverse.p_value == pytest.approx(1 - test.p_value)


def test_holm_steps_down_and_stops_at_the_first_hypothesis_kept():
    assert holm_rejections([0.02, 0.04], 0.05) == [True, True]  # 0.02 <= 0.05/2, then 0.04 <= 0.05 (Bonferroni: 1)
    assert holm_rejections([0.04, 0.02], 0.05) == [True, True]
    assert holm_rejections([0.03, 0.04], 0.05) == [False, False]  # the smallest fails 0.025: nothing rejected
    assert holm_rejections([0.03, 0.001, 0.04], 0.05) == [False, True, False]  # 0.03 > 0.05/2 stops before 0.04
    assert holm_rejections([0.049], 0.05) == [True] and holm_rejections([], 0.05) == []
