"""Generating while training on this machine: the trainer on one core, a built-in rollout server on the other.

    python benchmarks/async_bench.py [--steps 16] [--learn-steps 250] [--out benchmarks/results/async.md]

One run per rollout.max_staleness (0, then 1), with partial rollouts off and on (2-token segments of the demo's
4-token budget), every run with the token-level rollout correction (staleness and partial rollouts need it), of the
CPU demo's task (examples/cpu_demo.yaml
at TP = 1, its warm start included), with `rollout.engine: builtin_remote`: the server (`python -m
megatron_gtpo.rollout.remote_server --engine builtin`) pinned to core 1, the trainer (one torchrun rank) to core 0,
one thread each. Reported per run, over the RL steps after the first two: the mean step wall time (from one
metrics row to the next), the trainer's phases (medians of `time_*_s`; the wait for rollouts is
`time_generate_s`), tokens/s (the tokens of the responses scored, over the wall time), the mean staleness and the
fraction of responses continued. With --learn-steps, further runs at staleness 1 (partial rollouts off, then on)
of that many steps check the demo's criterion: the mean reward of the last 10 steps minus that of the first 10 is
>= 0.3. Appends a dated section to --out.
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

import yaml

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CONFIG = os.path.join(REPO, "examples", "cpu_demo.yaml")
PHASES = ("generate", "reward", "old_logprob", "advantages", "update", "sync")
PARTIAL = ("rollout.partial_rollouts=true", "rollout.partial_segment_tokens=2")
# Staleness >= 1 and partial rollouts need the rollout correction (the config refuses them without): token-level
# weights, in every run so that the runs differ in the schedule only.
CORRECTION = "algorithm.rollout_is=token"
RUNS = ((0, False), (1, False), (0, True), (1, True))  # (max_staleness, partial rollouts)
# The learning runs at staleness 1, partial rollouts off and on.
LEARN_STEPS_PARTIAL = (False, True)
with open(CONFIG, encoding="utf-8") as _f:
    GROUP_SIZE = yaml.safe_load(_f)["rollout"]["num_responses_per_prompt"]


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


def run(root: str, model_dir: str, staleness: int, partial: bool, steps: int, *extra: str) -> list[dict]:
    """One training run against its own server (`extra`: more config overrides); the metrics rows of its RL steps,
    with their arrival times."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    address = f"127.0.0.1:{_free_port()}"
    out = os.path.join(root, f"staleness{staleness}_partial{int(partial)}_{steps}_{len(os.listdir(root))}")
    server = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-m", "megatron_gtpo.rollout.remote_server",
                               "--engine", "builtin", "--hf-dir", model_dir, "--listen", address],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    sets = [f"logging.output_dir={out}", "logging.progress_bar=false", "logging.tensorboard=false",
            "parallel.tensor=1", f"steps={steps}", "rollout.engine=builtin_remote",
            f"rollout.remote_addresses=[{address}]", f"rollout.max_staleness={staleness}", "checkpoint.save_every=0",
            CORRECTION, *(PARTIAL if partial else ()), *extra]
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--standalone",
           "-m", "megatron_gtpo.train", "--config", CONFIG, *sum((["--set", s] for s in sets), [])]
    trainer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    rows, metrics_path = [], os.path.join(out, "metrics.jsonl")
    try:
        while trainer.poll() is None:  # time each step's row as it is written
            rows += _new_rows(metrics_path, len(rows))
            time.sleep(0.01)
        rows += _new_rows(metrics_path, len(rows))  # those written just before the trainer exited
        if trainer.returncode != 0:
            raise RuntimeError(f"staleness {staleness}: the trainer failed:\n{trainer.stdout.read()[-3000:]}")
    finally:
        server.kill()
        server.wait()
    return [r for r in rows if r["step"] >= 0]


def _new_rows(metrics_path: str, seen: int) -> list[dict]:
    """The complete rows of the metrics file after the first `seen`, stamped with the time they were read (a line
    the trainer is still writing is left for the next read)."""
    if not os.path.exists(metrics_path):
        return []
    with open(metrics_path, encoding="utf-8") as f:
        lines = [line for line in f if line.endswith("\n") and line.strip()]
    return [{**json.loads(line), "arrived_s": time.monotonic()} for line in lines[seen:]]


def summary(rows: list[dict]) -> dict:
    timed = rows[2:]
    wall_s = timed[-1]["arrived_s"] - timed[0]["arrived_s"]
    # The responses scored in steps 3.. (those of the first timed row were generated before its arrival).
    tokens = sum(r["response_length_mean"] * r["groups_generated"] * GROUP_SIZE for r in timed[1:]
                 if r["groups_generated"])
    kept = [r for r in timed if r["groups_kept"]]  # staleness and continued responses are of kept groups
    return {"step_s": wall_s / (len(timed) - 1), "tokens_per_s": tokens / wall_s,
            **{p: statistics.median(r[f"time_{p}_s"] for r in timed) for p in PHASES},
            "staleness_mean": statistics.mean(r["staleness_mean"] for r in kept),
            "continued": statistics.mean(r["continued_fraction"] for r in kept)}


def reward_rise(rows: list[dict]) -> tuple[float, float]:
    """Mean reward over the first and the last 10 RL steps (steps that scored no group have none)."""
    rewards = [r["reward_mean"] for r in rows if r["reward_mean"] is not None]
    return statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--learn-steps", type=int, default=0)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "async.md"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        model_dir = _server_model(root)
        results = {key: summary(run(root, model_dir, *key, args.steps)) for key in RUNS}
        learned = {partial: reward_rise(run(root, model_dir, 1, partial, args.learn_steps))
                   for partial in LEARN_STEPS_PARTIAL} if args.learn_steps else {}
    lines = [f"\n## {time.strftime('%Y-%m-%d %H:%M')}\n",
             f"Command: `python benchmarks/async_bench.py --steps {args.steps} --learn-steps {args.learn_steps}`\n",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores; trainer pinned to core 0, the built-in rollout "
             f"server to core 1, one thread each; the CPU demo's task at TP = 1 (RL steps 2..; phases are "
             f"medians).\n",
             "| max_staleness | partial rollouts | step s | tokens/s | wait for rollouts s | sync s | update s | "
             "old_logprob s | staleness | continued |", "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (n, partial), r in results.items():
        lines.append(f"| {n} | {'on' if partial else 'off'} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{r['generate']:.3f} | {r['sync']:.3f} | {r['update']:.3f} | {r['old_logprob']:.3f} | "
                     f"{r['staleness_mean']:.2f} | {r['continued']:.2f} |")
    base = results[(0, False)]
    lines.append("\nStep time against staleness 0 without partial rollouts: "
                 + ", ".join(f"staleness {n} partial {'on' if p else 'off'} {r['step_s'] / base['step_s']:.2f}x"
                             for (n, p), r in results.items() if (n, p) != (0, False)) + ".")
    for partial, (first, last) in learned.items():
        mode = "on" if partial else "off"
        lines.append(f"\nLearning at staleness 1, partial rollouts {mode}, over {args.learn_steps} steps: mean reward "
                     f"{first:.3f} over the first 10 RL steps, {last:.3f} over the last 10 (rise {last - first:+.3f}; "
                     f"the demo requires +0.30).")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "a", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
