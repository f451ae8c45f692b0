"""Summaries and plots of metrics.jsonl series (megatron_gtpo/reporting.py), steps without a value included."""
import json
import math

from megatron_gtpo.reporting import plot_runs, read_rl_metrics, window_means


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
