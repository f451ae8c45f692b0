"""Plot and summarise finished (or running) training runs from their metrics.jsonl.

    python -m megatron_gtpo.plot RUN [RUN ...] [--output PNG] [--labels NAME ...] [--window N]

RUN is a run's output directory (`logging.output_dir`, holding metrics.jsonl) or its metrics.jsonl. One PNG draws,
per RL step, the mean reward, the accuracy (the outcome reward), the mean token entropy, the mean response length
and the step time (the sum of the step's phase times), one line per run (reporting.RUN_PANELS); one line per run
summarises it (reporting.run_summary_line: steps, time, and each of those metrics over its first and last --window
steps). --output: default <RUN>/metrics.png for one run, runs.png in the current directory for several; --labels
names the runs in the legend (default: their directories' names).
"""
from __future__ import annotations

import os

from megatron_gtpo.cli import ArgumentParser, run_cli
from megatron_gtpo.reporting import METRICS_FILE, RUN_PANELS, SUMMARY_WINDOW, plot_runs, read_rl_metrics, \
    run_summary_line


def run_directory(run: str) -> str:
    """The output directory of RUN (a directory holding metrics.jsonl, or that file); FileNotFoundError naming
    RUN otherwise."""
    directory = os.path.dirname(run) if os.path.basename(run) == METRICS_FILE else run
    if not os.path.isfile(os.path.join(directory, METRICS_FILE)):
        found = "does not exist" if not os.path.exists(run) else f"holds no {METRICS_FILE}"
        raise FileNotFoundError(f"{run!r} {found}: give a run's output directory (logging.output_dir) or its "
                                f"{METRICS_FILE}")
    return directory


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m megatron_gtpo.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN", help=f"a run's output directory or its {METRICS_FILE}")
    p.add_argument("--output", help="the PNG to write (default: RUN/metrics.png for one run, runs.png for several)")
    p.add_argument("--labels", nargs="+", metavar="NAME", help="the runs' names in the legend, one per RUN")
    p.add_argument("--window", type=int, default=SUMMARY_WINDOW,
                   help=f"steps averaged at the start and end of each run in its summary (default {SUMMARY_WINDOW})")
    args = p.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.runs):
        p.error(f"--labels names {len(args.labels)} runs, and {len(args.runs)} are given")
    if args.window < 1:
        p.error(f"--window must be >= 1, got {args.window}")
    directories = [run_directory(run) for run in args.runs]
    labels = args.labels or _names(directories)
    runs = {}
    for label, directory in zip(labels, directories):
        rows = read_rl_metrics(directory)
        if not rows:
            raise ValueError(f"{os.path.join(directory, METRICS_FILE)} holds no RL step yet")
        runs[label] = rows
        print(f"{label}: {run_summary_line(rows, args.window)}")
    output = args.output or (os.path.join(directories[0], "metrics.png") if len(runs) == 1 else "runs.png")
    plot_runs(runs, output, ", ".join(runs) if len(runs) <= 3 else f"{len(runs)} runs", panels=RUN_PANELS)
    print(f"wrote {output}")
    return 0


def _names(directories: list[str]) -> list[str]:
    """Each run's directory name, or its whole path where two runs share a name."""
    names = [os.path.basename(os.path.normpath(d)) or d for d in directories]
    return [name if names.count(name) == 1 else os.path.normpath(d) for name, d in zip(names, directories)]


if __name__ == "__main__":
    run_cli("megatron_gtpo.plot", main)
