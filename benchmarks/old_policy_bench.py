"""What skipping the old-policy pass saves: steps with `data.old_policy_pass` always (A: the forward-only pass every
step) and auto (B: the update's own forward gives the old-policy values where the step batch takes one optimizer
step; docs/step_batch.md) alternate inside one trainer run, A B A B, same config, seed and machine.

    .venv/bin/python benchmarks/old_policy_bench.py --config examples/cpu_demo.yaml --nproc 2 --steps 22 --skip 2 \\
        --algorithms grpo gtpo --set data.mini_batches_per_step=1 --output benchmarks/results/old_policy.md
    # a larger random model on the same synthetic task (hidden 512, 8 layers, 8 heads / 2 KV groups)
    .venv/bin/python benchmarks/old_policy_bench.py ... --hidden 512 --layers 8 --heads 8 --kv-heads 2

Each run is the trainer's own main under torchrun (this file as the worker: it only sets data.old_policy_pass before
each step, A on one parity of the step number and B on the other, the parity swapped in every other repeat), without
checkpoints or progress bar; its metrics.jsonl gives the phase times of every step (time_*_s, the slowest rank's).
The first --skip steps of a run are warm-up. Steps 2k and 2k + 1 after them make a pair, run seconds apart, so load
drifts on a shared machine hit both alike. Reported per algorithm: medians over the pairs of the step time (the sum
of the phases) and of the old_logprob and update phases in A and B, and the median over the pairs of the ratio of
step times B / A. Both modes train the same (tests/test_training_old_policy.py), so the steps differ in where the
old-policy values come from only.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
WORKER_FLAG = "--worker-a-parity"


def _worker(a_parity: int, train_argv: list[str]) -> int:
    """The trainer's main, each step's data.old_policy_pass set by its parity: always (A) on `a_parity`; the built-in
    engine records its sampling entropies (GTPO / GRPO-S) in the B steps only, as in a run of that mode."""
    from megatron_gtpo.train import main
    from megatron_gtpo.training.trainer import Trainer

    collect = Trainer.collect_experience
    recorded = {}  # whether the run's engine records entropies (as built, in auto)

    def alternating(trainer, step, *args, **kwargs):
        a = step % 2 == a_parity
        trainer.cfg.data.old_policy_pass = "always" if a else "auto"
        if hasattr(trainer.engine, "record_entropies"):
            recorded.setdefault("entropies", trainer.engine.record_entropies)
            trainer.engine.record_entropies = recorded["entropies"] and not a
        return collect(trainer, step, *args, **kwargs)

    Trainer.collect_experience = alternating
    return main(train_argv)


def parse_args(argv=None):
    from throughput import trainer_runs_parser  # benchmarks/, this script's directory

    p = trainer_runs_parser(__doc__.split("\n\n")[0], steps=22, algorithms=["grpo", "gtpo"],
                            repeats_help="runs per algorithm, A on even steps in every other one")
    p.add_argument("--hidden", type=int, help="train a random Qwen2 of this hidden size (with --layers, --heads, "
                                              "--kv-heads) on the config's synthetic task instead of its model")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--output", help="write the results as markdown here (also printed)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    args = p.parse_args(argv)
    if args.skip % 2 or (args.steps - args.skip) % 2 or args.steps - args.skip < 2:
        p.error("--skip and --steps - --skip must be even, and leave at least one pair of steps")
    return args


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


def run(args, algorithm: str, repeat: int, work_dir: str, model_sets: list[str]) -> list[dict]:
    """One trainer run, A on even steps in even repeats; its RL steps' metrics rows, each with its "mode"."""
    out_dir = os.path.join(work_dir, f"{algorithm}-{repeat}")
    sets = [f"algorithm.name={algorithm}", f"steps={args.steps}", f"logging.output_dir={out_dir}",
            "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.save_every=-1",
            "checkpoint.resume=false", *model_sets, *args.overrides]
    a_parity = repeat % 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           os.path.abspath(__file__), WORKER_FLAG, str(a_parity), "--config", args.config,
           *sum((["--set", s] for s in sets), [])]
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO + (os.pathsep + os.environ["PYTHONPATH"] if "PYTHONPATH" in os.environ else ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    with open(f"{out_dir}.log", "w", encoding="utf-8") as log:
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{algorithm}: the trainer failed ({done.returncode}); log {out_dir}.log")
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [row for row in map(json.loads, f) if row["step"] >= 0]
    return [dict(row, mode="A" if row["step"] % 2 == a_parity else "B") for row in rows]


def step_s(row: dict) -> float:
    return sum(v for k, v in row.items() if k.startswith("time_") and k.endswith("_s"))


def summarize(rows: list[dict]) -> dict:
    """Medians over the pairs (consecutive measured steps) of one algorithm's runs."""
    pairs = []
    for first in range(0, len(rows) - 1, 2):
        by_mode = {row["mode"]: row for row in rows[first:first + 2]}
        pairs.append((by_mode["A"], by_mode["B"]))
    median = lambda values: statistics.median(list(values))  # noqa: E731
    ratios = [step_s(b) / step_s(a) for a, b in pairs]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"pairs": len(pairs), "ratio": median(ratios), "quartiles": (quartiles[0], quartiles[2]),
            **{f"{what}_{mode}": median(key(pair[i]) for pair in pairs)
               for what, key in (("step", step_s), ("generate", lambda r: r["time_generate_s"]),
                                 ("old_logprob", lambda r: r["time_old_logprob_s"]),
                                 ("update", lambda r: r["time_update_s"]))
               for i, mode in enumerate("AB")}}


def report(args, summaries: dict, command: str, model: str) -> str:
    ms = lambda s: f"{1000 * s:.0f}"  # noqa: E731
    load = open("/proc/loadavg", encoding="utf-8").read().split()[0] if os.path.exists("/proc/loadavg") else "n/a"
    lines = ["Command (from the repository root):", "", f"    {command}", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; 1-minute "
             f"load average at the end: {load}. Model: {model}. {args.nproc} rank(s), {args.repeats} run(s) of "
             f"{args.steps} steps per algorithm, the first {args.skip} left out, A and B alternating step by step.", "",
             "| algorithm | pairs | step A (ms) | step B (ms) | generate A | generate B | old_logprob A | "
             "old_logprob B | update A | update B | step B / A (median over pairs) | its quartiles |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for algorithm, s in summaries.items():
        lines.append(f"| {algorithm} | {s['pairs']} | {ms(s['step_A'])} | {ms(s['step_B'])} | {ms(s['generate_A'])} | "
                     f"{ms(s['generate_B'])} | {ms(s['old_logprob_A'])} | {ms(s['old_logprob_B'])} | "
                     f"{ms(s['update_A'])} | {ms(s['update_B'])} | {s['ratio']:.3f} | "
                     f"{s['quartiles'][0]:.3f}-{s['quartiles'][1]:.3f} |")
    lines += ["", "Medians over the pairs; step = the sum of the phases (time_*_s)."]
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
        summaries = {}
        for algorithm in args.algorithms:
            rows = []
            for repeat in range(args.repeats):
                print(f"{algorithm}, run {repeat}", flush=True)
                rows += run(args, algorithm, repeat, work_dir, model_sets)[args.skip:]
            summaries[algorithm] = summarize(rows)
        text = report(args, summaries, command, model)
    print(text)
    if args.output:
        from megatron_gtpo.atomic_files import write_atomically

        write_atomically(args.output, text)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == WORKER_FLAG:
        sys.exit(_worker(int(sys.argv[2]), sys.argv[3:]))
    sys.exit(main())
