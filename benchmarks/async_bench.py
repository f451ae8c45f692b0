"""Generating while training on this machine: the trainer on one core, a built-in rollout server on the other.

    python benchmarks/async_bench.py [--steps 16] [--learn-steps 250] [--out benchmarks/results/async.md]

One run per rollout.max_staleness (0, then 1) of the CPU demo's task (examples/cpu_demo.yaml at TP = 1, its warm
start included), with `rollout.engine: builtin_remote`: the server (`python -m megatron_gtpo.rollout.remote_server
--engine builtin`) pinned to core 1, the trainer (one torchrun rank) to core 0, one thread each. Reported per
staleness, over the RL steps after the first two: the median step wall time (from one metrics row to the next) and
the trainer's phases (`time_*_s`, the wait for rollouts is `time_generate_s`), and tokens/s. With --learn-steps, a
further run at staleness 1 of that many steps checks the demo's criterion: the mean reward of the last 10 steps
minus that of the first 10 is >= 0.3. Appends a dated section to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CONFIG = os.path.join(REPO, "examples", "cpu_demo.yaml")
PHASES = ("generate", "reward", "old_logprob", "advantages", "update", "sync")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_model(root: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_gtpo.data.synthetic import tiny_model_hf_config

    path = os.path.join(root, "server_model")
    Qwen2ForCausalLM(Qwen2Config(**tiny_model_hf_config())).save_pretrained(path)
    return path


def run(root: str, model_dir: str, staleness: int, steps: int) -> list[dict]:
    """One training run against its own server; the metrics rows of its RL steps, with their arrival times."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    address = f"127.0.0.1:{_free_port()}"
    out = os.path.join(root, f"staleness{staleness}_{steps}")
    server = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-m", "megatron_gtpo.rollout.remote_server",
                               "--engine", "builtin", "--hf-dir", model_dir, "--listen", address],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    sets = [f"logging.output_dir={out}", "logging.progress_bar=false", "logging.tensorboard=false",
            "parallel.tensor=1", f"steps={steps}", "rollout.engine=builtin_remote",
            f"rollout.remote_addresses=[{address}]", f"rollout.max_staleness={staleness}", "checkpoint.save_every=0"]
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--standalone",
           "-m", "megatron_gtpo.train", "--config", CONFIG, *sum((["--set", s] for s in sets), [])]
    trainer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    rows, metrics_path = [], os.path.join(out, "metrics.jsonl")
    try:
        while trainer.poll() is None:  # time each step's row as it is written
            if os.path.exists(metrics_path):
                with open(metrics_path, encoding="utf-8") as f:
                    lines = [line for line in f if line.strip()]
                for line in lines[len(rows):]:
                    rows.append({**json.loads(line), "arrived_s": time.monotonic()})
            time.sleep(0.01)
        if trainer.returncode != 0:
            raise RuntimeError(f"staleness {staleness}: the trainer failed:\n{trainer.stdout.read()[-3000:]}")
    finally:
        server.kill()
        server.wait()
    return [r for r in rows if r["step"] >= 0]


def summary(rows: list[dict]) -> dict:
    timed = rows[2:]
    walls = [b["arrived_s"] - a["arrived_s"] for a, b in zip(timed, timed[1:])]
    return {"step_s": statistics.median(walls), "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            **{p: statistics.median(r[f"time_{p}_s"] for r in timed) for p in PHASES},
            "staleness_mean": statistics.mean(r["staleness_mean"] for r in timed
                                              if r["staleness_mean"] is not None)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--learn-steps", type=int, default=0)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "async.md"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        model_dir = _server_model(root)
        results = {n: summary(run(root, model_dir, n, args.steps)) for n in (0, 1)}
        learned = None
        if args.learn_steps:
            rewards = [r["reward_mean"] for r in run(root, model_dir, 1, args.learn_steps)]
            learned = (statistics.mean(rewards[:10]), statistics.mean(rewards[-10:]))
    lines = [f"\n## {time.strftime('%Y-%m-%d %H:%M')}\n",
             f"Command: `python benchmarks/async_bench.py --steps {args.steps} --learn-steps {args.learn_steps}`\n",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores; trainer pinned to core 0, the built-in rollout "
             f"server to core 1, one thread each; the CPU demo's task at TP = 1 (medians over RL steps 2..).\n",
             "| max_staleness | step s | tokens/s | wait for rollouts s | sync s | update s | old_logprob s | "
             "staleness |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, r in results.items():
        lines.append(f"| {n} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['generate']:.3f} | {r['sync']:.3f} "
                     f"| {r['update']:.3f} | {r['old_logprob']:.3f} | {r['staleness_mean']:.2f} |")
    lines.append(f"\nStep time at staleness 1 / staleness 0: {results[1]['step_s'] / results[0]['step_s']:.2f}.")
    if learned:
        lines.append(f"\nLearning at staleness 1 over {args.learn_steps} steps: mean reward {learned[0]:.3f} over "
                     f"the first 10 RL steps, {learned[1]:.3f} over the last 10 (rise {learned[1] - learned[0]:+.3f};"
                     f" the demo requires +0.30).")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "a", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
