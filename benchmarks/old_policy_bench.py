"""What skipping the old-policy pass saves: the trainer with `data.old_policy_pass` always (A: the forward-only pass
every step) and auto (B: the update's own forward gives the old-policy values where the step batch takes one
optimizer step; docs/step_batch.md), A B A B in one run of this script, same config, seed and machine.

    .venv/bin/python benchmarks/old_policy_bench.py --config examples/cpu_demo.yaml --nproc 2 --steps 8 --skip 2 \\
        --repeats 2 --algorithms grpo gtpo --set data.mini_batches_per_step=1 --output benchmarks/results/old_policy.md
    # a larger random model on the same synthetic task (hidden 512, 8 layers, 8 heads / 2 KV groups)
    .venv/bin/python benchmarks/old_policy_bench.py ... --hidden 512 --layers 8 --heads 8 --kv-heads 2

Each run is `python -m megatron_gtpo.train` under torchrun (no checkpoints, no progress bar); its metrics.jsonl gives
the phase times of every step (time_*_s, the slowest rank's). The first --skip steps of a run are warm-up. Per
algorithm and repeat the A and B runs follow each other (A first in even repeats, B first in odd ones), so load drifts
hit both; reported: medians over the measured steps of the step time (the sum of the phases), the old_logprob and
update phases, and per repeat the ratio B / A of the median step times, with their median. The two runs of a pair
train the same: the largest relative difference of their logged metrics (phase times and throughput aside) is
reported beside (0 where the update matches the pass's bit for bit; float rounding where GTPO / GRPO-S take the
built-in engine's entropies).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MODES = ("always", "auto")  # A, B


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="trainer config (YAML)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    p.add_argument("--steps", type=int, default=8, help="RL steps per run, warm-up included")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the statistics (per run)")
    p.add_argument("--repeats", type=int, default=2, help="A B pairs per algorithm")
    p.add_argument("--algorithms", nargs="+", default=["grpo", "gtpo"])
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="trainer config override for every run (repeatable)")
    p.add_argument("--hidden", type=int, help="train a random Qwen2 of this hidden size (with --layers, --heads, "
                                              "--kv-heads) on the config's synthetic task instead of its model")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--output", help="write the results as markdown here (also printed)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    return p.parse_args(argv)


def random_model(directory: str, hidden: int, layers: int, heads: int, kv_heads: int) -> str:
    """A random Qwen2 of that shape with the synthetic tasks' vocabulary and positions, as a Hugging Face directory."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_gtpo.data.synthetic import tiny_model_hf_config

    config = {k: v for k, v in tiny_model_hf_config().items() if k not in ("architectures", "model_type")}
    config.update(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads)
    torch.manual_seed(0)
    path = os.path.join(directory, f"qwen2-h{hidden}-l{layers}")
    Qwen2ForCausalLM(Qwen2Config(**config, architectures=["Qwen2ForCausalLM"])).save_pretrained(
        path, safe_serialization=True)
    return path


def run(args, algorithm: str, mode: str, repeat: int, work_dir: str, model_sets: list[str]) -> list[dict]:
    """One trainer run; its RL steps' metrics rows."""
    out_dir = os.path.join(work_dir, f"{algorithm}-{mode}-{repeat}")
    sets = [f"algorithm.name={algorithm}", f"data.old_policy_pass={mode}", f"steps={args.steps}",
            f"logging.output_dir={out_dir}", "logging.progress_bar=false", "logging.tensorboard=false",
            "checkpoint.save_every=-1", "checkpoint.resume=false", *model_sets, *args.overrides]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", "-m",
           "megatron_gtpo.train", "--config", args.config, *sum((["--set", s] for s in sets), [])]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    with open(f"{out_dir}.log", "w", encoding="utf-8") as log:
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{algorithm} {mode}: the trainer failed ({done.returncode}); log {out_dir}.log")
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [row for row in map(json.loads, f) if row["step"] >= 0]


def step_s(row: dict) -> float:
    return sum(v for k, v in row.items() if k.startswith("time_") and k.endswith("_s"))


def largest_difference(a_rows: list[dict], b_rows: list[dict]) -> float:
    """The largest relative difference between two runs' logged numbers, phase times and throughput aside."""
    worst = 0.0
    for a, b in zip(a_rows, b_rows, strict=True):
        for key, value in a.items():
            other = b.get(key)
            numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, other))
            if key.startswith(("time_", "rollout_busy_")) or key == "tokens_per_s" or not numbers \
                    or not (math.isfinite(value) and math.isfinite(other)):
                continue
            worst = max(worst, abs(value - other) / max(abs(value), abs(other), 1e-12))
    return worst


def summarize(runs: dict, args) -> dict:
    """Per algorithm: medians per mode over the measured steps, the B / A ratio per repeat and their median."""
    out = {}
    for algorithm in args.algorithms:
        measured = {mode: [r for k in range(args.repeats) for r in runs[algorithm, mode, k][args.skip:]]
                    for mode in MODES}
        if not all(measured.values()):
            raise ValueError("no measured steps: run more --steps than --skip")
        medians = {mode: {"step": statistics.median(map(step_s, rows)),
                          "old_logprob": statistics.median(r["time_old_logprob_s"] for r in rows),
                          "update": statistics.median(r["time_update_s"] for r in rows),
                          "generate": statistics.median(r["time_generate_s"] for r in rows)}
                   for mode, rows in measured.items()}
        ratios = [statistics.median(map(step_s, runs[algorithm, "auto", k][args.skip:]))
                  / statistics.median(map(step_s, runs[algorithm, "always", k][args.skip:]))
                  for k in range(args.repeats)]
        differences = [largest_difference(runs[algorithm, "always", k], runs[algorithm, "auto", k])
                       for k in range(args.repeats)]
        out[algorithm] = {"medians": medians, "ratios": ratios, "ratio": statistics.median(ratios),
                          "difference": max(differences), "steps": len(measured["auto"])}
    return out


def report(args, summary: dict, command: str, model: str) -> str:
    ms = lambda s: f"{1000 * s:.0f}"  # noqa: E731
    load = open("/proc/loadavg", encoding="utf-8").read().split()[0] if os.path.exists("/proc/loadavg") else "n/a"
    lines = ["# The old-policy pass: always (A) against skipped where the update's forward gives it (B)", "",
             "Command (from the repository root):", "", f"    {command}", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; 1-minute "
             f"load average at the end: {load}. Model: {model}. {args.nproc} rank(s), {args.steps} steps per run, "
             f"the first {args.skip} left out, {args.repeats} A B pair(s) per algorithm.", "",
             "| algorithm | step A (ms) | step B (ms) | old_logprob A | old_logprob B | update A | update B | "
             "generate A | generate B | B / A per pair | B / A (median) | largest metric difference |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for algorithm, s in summary.items():
        a, b = s["medians"]["always"], s["medians"]["auto"]
        lines.append(f"| {algorithm} | {ms(a['step'])} | {ms(b['step'])} | {ms(a['old_logprob'])} | "
                     f"{ms(b['old_logprob'])} | {ms(a['update'])} | {ms(b['update'])} | {ms(a['generate'])} | "
                     f"{ms(b['generate'])} | {', '.join(f'{r:.3f}' for r in s['ratios'])} | {s['ratio']:.3f} | "
                     f"{s['difference']:.1e} |")
    lines += ["", "Medians over the measured steps of both runs of each mode; step = the sum of the phases "
                  "(time_*_s)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])])
    with tempfile.TemporaryDirectory() as work_dir:
        model_sets, model = [], f"the config's ({args.config})"
        if args.hidden:
            model_sets = ["model.tiny_synthetic=false", "model.hf_dir=" + random_model(
                work_dir, args.hidden, args.layers, args.heads, args.kv_heads)]
            model = (f"random Qwen2, hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} "
                     "KV groups, FFN 3 x hidden, the synthetic task's vocabulary")
        runs = {}
        for k in range(args.repeats):
            for algorithm in args.algorithms:
                for mode in (MODES if k % 2 == 0 else MODES[::-1]):
                    print(f"repeat {k}: {algorithm} {mode}", flush=True)
                    runs[algorithm, mode, k] = run(args, algorithm, mode, k, work_dir, model_sets)
        text = report(args, summarize(runs, args), command, model)
    print(text)
    if args.output:
        from megatron_gtpo.atomic_files import write_atomically

        write_atomically(args.output, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
