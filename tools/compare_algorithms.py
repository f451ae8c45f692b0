"""Run GRPO, DAPO, GTPO and GRPO-S on the synthetic demo task with the same seeds; write a table and a plot of
accuracy, entropy and response length over steps.

    python tools/compare_algorithms.py [--output-dir outputs/compare] [--steps 200] [--nproc 2] [--set k=v ...]

Writes <output-dir>/<algorithm>/metrics.jsonl per run, <output-dir>/comparison.md and <output-dir>/comparison.png.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from megatron_gtpo.cli import run_cli
from megatron_gtpo.config import ALGORITHMS
from megatron_gtpo.reporting import plot_runs, read_rl_metrics, window_means

DEMO_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "cpu_demo.yaml")
PANELS = (("accuracy", "accuracy"), ("entropy_mean", "mean token entropy (nats)"),
          ("response_length_mean", "mean response length (tokens)"))


def run_algorithm(name: str, out: str, args) -> None:
    sets = [f"algorithm.name={name}", f"logging.output_dir={out}", "checkpoint.resume=false",
            "checkpoint.save_every=0", "logging.tensorboard=false", *args.overrides]
    if args.steps is not None:
        sets.append(f"steps={args.steps}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "--standalone", "-m",
           "megatron_gtpo.train", "--config", args.config, *sum((["--set", s] for s in sets), [])]
    if os.path.exists(os.path.join(out, "metrics.jsonl")):
        os.remove(os.path.join(out, "metrics.jsonl"))
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def table(runs: dict[str, list[dict]], window: int) -> str:
    lines = ["| algorithm | accuracy (first -> last) | entropy (first -> last) | length (first -> last) | "
             "groups kept / step |", "|---|---|---|---|---|"]
    for name, rows in runs.items():
        cells = []
        for key in ("accuracy", "entropy_mean", "response_length_mean"):
            first, last = window_means([r[key] for r in rows], window)
            cells.append(f"{first:.3f} -> {last:.3f}")
        kept = sum(r["groups_kept"] for r in rows) / len(rows)
        lines.append(f"| {name} | {' | '.join(cells)} | {kept:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", default="outputs/compare")
    p.add_argument("--config", default=DEMO_CONFIG)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    p.add_argument("--window", type=int, default=10, help="steps averaged for the first/last columns")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args(argv)
    root = os.path.abspath(args.output_dir)
    runs = {}
    for name in args.algorithms:
        out = os.path.join(root, name)
        run_algorithm(name, out, args)
        runs[name] = read_rl_metrics(out)
    md = os.path.join(root, "comparison.md")
    text = (f"# Algorithms on the synthetic addition task\n\nSame config ({os.path.relpath(args.config)}), seeds "
            f"and layout; first/last = mean over the first/last {args.window} RL steps.\n\n"
            f"{table(runs, args.window)}\n")
    with open(md + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(md + ".tmp", md)
    png = os.path.join(root, "comparison.png")
    plot_runs(runs, png, "GRPO / DAPO / GTPO / GRPO-S on the synthetic task", panels=PANELS)
    print(text)
    print(f"table: {md}\nplot:  {png}")
    return 0


if __name__ == "__main__":
    run_cli("compare_algorithms", main)
