"""The tiny CPU GTPO demo (what `make demo` runs).

A tiny Qwen2-shaped model (built in code, random init) learns single-digit addition ("a+b=" -> the digits of a+b,
then EOS) with GTPO, on 2 gloo processes at tensor parallel size 2, after a short supervised warm-start that is
part of the run and reported. At the end it checks that the mean reward rose by at least --min-rise from the start
of RL, writes a PNG plot of reward, entropy and response length per step, and prints where everything is.

    python examples/cpu_demo.py [--steps N] [--output-dir DIR] [--algorithm gtpo|grpo_s|dapo|grpo] [--set k=v ...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from megatron_gtpo.reporting import plot_runs, read_rl_metrics, window_means

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "cpu_demo.yaml")
WINDOW = 10  # steps averaged at the start and end of RL when measuring the rise


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", default="outputs/cpu_demo")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the config's)")
    p.add_argument("--algorithm", default="gtpo")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--min-rise", type=float, default=0.3, help="required rise of the mean reward")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args(argv)

    out = os.path.abspath(args.output_dir)
    overrides = [f"logging.output_dir={out}", f"algorithm.name={args.algorithm}", "checkpoint.resume=false",
                 *([f"steps={args.steps}"] if args.steps is not None else []), *args.overrides]
    metrics_path = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics_path):
        os.remove(metrics_path)  # a fresh demo run, not a resume
    cmd = [sys.executable, "-m", "megatron_gtpo.launch", f"--nproc_per_node={args.nproc}", "--standalone",
           "-m", "megatron_gtpo.train", "--config", CONFIG, *sum((["--set", o] for o in overrides), [])]
    print("running:", " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.monotonic()
    if subprocess.run(cmd, env=env).returncode != 0:
        print("demo: training failed", file=sys.stderr)
        return 1

    rows = read_rl_metrics(out)
    start, end = window_means([r["reward_mean"] for r in rows], WINDOW)
    png = os.path.join(out, "demo.png")
    plot_runs({args.algorithm: rows}, png, f"{args.algorithm.upper()} on the synthetic addition task (CPU)")
    with open(metrics_path, encoding="utf-8") as f:
        warm = [r for r in map(json.loads, f) if r["step"] < 0]
    if warm:
        print(f"supervised warm-start: {warm[0]['warm_start_steps']} steps "
              f"(mean NLL per answer token {warm[0]['sft_loss']:.3f})")
    print(f"mean reward over the first {WINDOW} RL steps: {start:.3f}; over the last {WINDOW}: {end:.3f} "
          f"(rise {end - start:+.3f}, required {args.min_rise:+.2f})")
    print(f"wall time: {(time.monotonic() - started) / 60:.1f} min (warm-start, RL and checkpoints)")
    print(f"metrics: {metrics_path}\nplot:    {png}\ncheckpoints: {os.path.join(out, 'checkpoints')}")
    if end - start < args.min_rise:
        print("demo: the mean reward did not rise enough", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
