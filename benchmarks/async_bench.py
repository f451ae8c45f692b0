"""Generating while training on this machine: staleness 0 against 1, partial rollouts and weight updates during
generation, on two tasks, and the learning they give.

    python benchmarks/async_bench.py [--steps 16] [--tasks demo long] [--no-drain] [--learn-steps 250]
                                     [--seeds 7 8 9] [--learn NAME ...]
                                     [--out benchmarks/results/async.md] [--runs FILE]

The runs (every one of examples/cpu_demo.yaml at TP = 1, its warm start included, with the token-level rollout
correction `algorithm.rollout_correction.rollout_is: token`, which staleness and partial rollouts need, so that the runs
differ in the schedule only):
- disaggregated: `rollout.engine: builtin_remote`, the rollout server (`python -m megatron_gtpo.rollout.remote_server
  --engine builtin`) pinned to core 1, the trainer (one torchrun rank) to core 0, one thread each; at
  rollout.schedule.max_staleness 0 and 1, partial rollouts off and on, and with --no-drain at staleness 1 with
  `rollout.schedule.update_during_generation: true` (partial rollouts off and on), and at staleness 1 with one further
  loader batch in each batch asked for ahead (`rollout.schedule.oversample_batches: 1`: fewer of dynamic sampling's
  rounds generated on the spot), and at staleness 1 with 1 and 3 further rounds kept asked for ahead
  (`rollout.schedule.rounds_ahead`; 3 is the demo's algorithm.max_resample_rounds: the server generates them while the
  trainer trains) on the fixed schedule, and 3 asked whenever the server is idle (`rollout.schedule.ahead_schedule:
  when_idle`), also with --no-drain;
- colocated: `rollout.engine: builtin` at staleness 0, the trainer generating on its own ranks, pinned to cores 0
  and 1 with two threads (OMP_NUM_THREADS=2): what a user of this machine runs.
Tasks: `demo`, the demo's (responses of at most 4 tokens, 2-token segments), and `long`, the demo's task with a
32-token budget after a 5-step warm start (the policy has not yet learned to stop at once: most responses are a few
tokens, a tail runs to 15-30; 8-token segments).
Reported per run, over the RL steps after the first two: the mean step wall time (from one metrics row to the next),
tokens/s (`tokens_generated`, every token of the step's engine answers, over the wall time), the server's busy
fraction (its generation seconds, `rollout_busy_s`, over the same wall time; colocated: the share spent generating),
the means per step of
`tokens_generated`, `groups_kept`, `sampling_rounds`, `rounds_served_ahead` (0 without rounds ahead),
`optimizer_steps`, `groups_from_carry` and `groups_dropped_stale`, the trainer's phases (medians of `time_*_s`; the
wait for rollouts is `time_generate_s`), the mean staleness and the fraction of responses continued; per task the
response lengths (`response_length_mean`, `response_length_max`, `response_clip_ratio`).
With --learn-steps, learning runs of the demo's task (disaggregated; --learn: by default staleness 0, staleness 1
with partial rollouts off and on; also staleness 1 with `rollout.schedule.oversample_batches: 1` and with
`rollout.schedule.rounds_ahead: 3`, fixed and when idle) for each of --seeds (the
config's `seed`: the model's initialisation and the sampling seeds): the reward rise (the mean reward of the last 10
RL steps minus that of the first 10; the demo requires >= 0.3 over its 250 steps) and, averaged over the seeds, the
figures of the runs above (step time, phases, rounds...). Appends a dated section to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from megatron_gtpo.distributed import free_local_port

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CONFIG = os.path.join(REPO, "examples", "cpu_demo.yaml")
PHASES = ("generate", "reward", "old_logprob", "advantages", "update", "sync")
# Staleness >= 1 and partial rollouts need the rollout correction (the config refuses them without): token-level
# weights, in every run so that the runs differ in the schedule only.
CORRECTION = "algorithm.rollout_correction.rollout_is=token"
NO_DRAIN = "rollout.schedule.update_during_generation=true"
# Per task: its overrides of the demo's config, and the segment of its partial rollouts.
TASKS = {"demo": ((), 2), "long": (("rollout.max_new_tokens=32", "warm_start.steps=5"), 8)}
# Learning no worse: staleness 1's mean reward rise at least the on-policy baseline's minus this (a sixth of the
# demo's required +0.30; set before the runs).
TOLERANCE = 0.05


@dataclass(frozen=True)
class Run:
    staleness: int
    partial: bool = False
    no_drain: bool = False
    colocated: bool = False
    oversample: int = 0  # rollout.schedule.oversample_batches
    ahead: int = 0  # rollout.schedule.rounds_ahead
    when_idle: bool = False  # rollout.schedule.ahead_schedule: when_idle

    @property
    def label(self) -> str:
        where = "colocated" if self.colocated else "disaggregated"
        return (f"{where}, staleness {self.staleness}" + (", partial" if self.partial else "")
                + (", no drain" if self.no_drain else "")
                + (f", oversample {self.oversample}" if self.oversample else "")
                + (f", {self.ahead} rounds ahead" if self.ahead else "") + (" when idle" if self.when_idle else ""))

    def overrides(self, segment: int) -> list[str]:
        return [f"rollout.schedule.max_staleness={self.staleness}",
                *(("rollout.schedule.partial_rollouts=true", f"rollout.schedule.partial_segment_tokens={segment}")
                  if self.partial else ()), *((NO_DRAIN,) if self.no_drain else ()),
                *((f"rollout.schedule.oversample_batches={self.oversample}",) if self.oversample else ()),
                *((f"rollout.schedule.rounds_ahead={self.ahead}",) if self.ahead else ()),
                *(("rollout.schedule.ahead_schedule=when_idle",) if self.when_idle else ())]


TIMED = (Run(0, colocated=True), Run(0), Run(1), Run(0, partial=True), Run(1, partial=True), Run(1, oversample=1),
         Run(1, ahead=1), Run(1, ahead=3), Run(1, ahead=3, when_idle=True))
TIMED_NO_DRAIN = (Run(1, no_drain=True), Run(1, partial=True, no_drain=True), Run(1, ahead=3, no_drain=True),
                  Run(1, ahead=3, when_idle=True, no_drain=True))
# The learning runs (--learn), by name; the first three by default. A run's rewards do not depend on the machine's
# speed (the schedule is fixed), so the rises of separate invocations compare; their step times do not.
LEARNING = {"staleness0": Run(0), "staleness1": Run(1), "staleness1_partial": Run(1, partial=True),
            "staleness1_oversample": Run(1, oversample=1), "staleness1_ahead": Run(1, ahead=3),
            "staleness1_ahead_when_idle": Run(1, ahead=3, when_idle=True)}


def _server_model(root: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_gtpo.data.synthetic import tiny_model_hf_config

    path = os.path.join(root, "server_model")
    Qwen2ForCausalLM(Qwen2Config(**tiny_model_hf_config())).save_pretrained(path)
    return path


def train(root: str, model_dir: str, spec: Run, steps: int, extra: list[str]) -> list[dict]:
    """One training run (against its own server when disaggregated; `extra`: more config overrides); the metrics
    rows of its RL steps, with their arrival times."""
    env = dict(os.environ, OMP_NUM_THREADS="2" if spec.colocated else "1", PYTHONPATH=REPO)
    out = os.path.join(root, f"run_{len(os.listdir(root))}")
    sets = [f"logging.output_dir={out}", "logging.progress_bar=false", "logging.tensorboard=false",
            "parallel.tensor=1", f"steps={steps}", "checkpoint.save_every=0", CORRECTION, *extra]
    server = None
    if spec.colocated:
        cores, sets = "0,1", sets + ["rollout.engine=builtin"]
    else:
        address = f"127.0.0.1:{free_local_port()}"
        server = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-m", "megatron_gtpo.rollout.remote_server",
                                   "--engine", "builtin", "--hf-dir", model_dir, "--listen", address],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        cores, sets = "0", sets + ["rollout.engine=builtin_remote", f"rollout.remote.addresses=[{address}]"]
    cmd = ["taskset", "-c", cores, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
           "--standalone", "-m", "megatron_gtpo.train", "--config", CONFIG, *sum((["--set", s] for s in sets), [])]
    trainer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    rows, metrics_path = [], os.path.join(out, "metrics.jsonl")
    try:
        while trainer.poll() is None:  # time each step's row as it is written
            rows += _new_rows(metrics_path, len(rows))
            time.sleep(0.01)
        rows += _new_rows(metrics_path, len(rows), final=True)  # those written just before the trainer exited
        if trainer.returncode != 0:
            raise RuntimeError(f"{spec.label}: the trainer failed:\n{trainer.stdout.read()[-3000:]}")
    finally:
        if server is not None:
            server.kill()
            server.wait()
    return [r for r in rows if r["step"] >= 0]


def _new_rows(metrics_path: str, seen: int, *, final: bool = False) -> list[dict]:
    """The complete rows of the metrics file after the first `seen`, stamped with the time they were read. A line the
    trainer is still writing (no newline yet, or not yet JSON: a long row is appended in several writes) and those
    after it are left for the next read, unless `final` (the trainer has exited: then it is an error)."""
    if not os.path.exists(metrics_path):
        return []
    with open(metrics_path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    rows = []
    for line in lines[seen:]:
        try:
            rows.append({**json.loads(line), "arrived_s": time.monotonic()})
        except json.JSONDecodeError:
            if final:
                raise
            break
    return rows


def summary(rows: list[dict]) -> dict:
    timed = rows[2:]
    wall_s = timed[-1]["arrived_s"] - timed[0]["arrived_s"]
    # The tokens of steps 3.. (those of the first timed row were generated before its arrival).
    tokens = sum(r["tokens_generated"] for r in timed[1:])
    kept = [r for r in timed if r["groups_kept"]]  # staleness and continued responses are of kept groups
    scored = [r for r in timed if r["groups_generated"]]  # lengths are of the groups rewarded in the step

    def mean(key, of=timed):
        return statistics.mean(r[key] for r in of)

    return {"step_s": wall_s / (len(timed) - 1), "tokens_per_s": tokens / wall_s,
            **{key: mean(key) for key in ("tokens_generated", "groups_kept", "sampling_rounds", "optimizer_steps",
                                          "groups_from_carry", "groups_dropped_stale")},
            "rounds_served_ahead": statistics.mean(r.get("rounds_served_ahead", 0) for r in timed),
            # The server's generation seconds over the wall time of the same steps (3..: as tokens/s).
            "busy": sum(r["rollout_busy_s"] for r in timed[1:]) / wall_s,
            **{p: statistics.median(r[f"time_{p}_s"] for r in timed) for p in PHASES},
            "staleness_mean": mean("staleness_mean", kept), "continued": mean("continued_fraction", kept),
            "length_mean": mean("response_length_mean", scored),
            "length_max_median": statistics.median(r["response_length_max"] for r in scored),
            "length_max": max(r["response_length_max"] for r in scored),
            "clip_ratio": mean("response_clip_ratio", scored)}


def reward_rise(rows: list[dict]) -> float:
    """The mean reward over the last 10 RL steps minus that over the first 10 (steps that scored no group have
    none)."""
    rewards = [r["reward_mean"] for r in rows if r["reward_mean"] is not None]
    return statistics.mean(rewards[-10:]) - statistics.mean(rewards[:10])


def _timed_table(task: str, results: dict[Run, dict]) -> list[str]:
    base = results[Run(0)]
    lines = [f"\nTask `{task}`: {args_text(task)}.\n",
             "| run | step s | x staleness 0 | server busy | tokens/s | tokens / step | groups kept | rounds | "
             "served ahead | "
             "optimizer steps | from carry | dropped stale | wait for rollouts s | sync s | update s | old_logprob s | "
             "reward s | staleness | continued |", "|:---|" + "---:|" * 18]
    for spec, r in results.items():
        lines.append(f"| {spec.label} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} | {r['busy']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {r['tokens_generated']:.0f} | {r['groups_kept']:.1f} | "
                     f"{r['sampling_rounds']:.2f} | {r['rounds_served_ahead']:.2f} | {r['optimizer_steps']:.1f} | "
                     f"{r['groups_from_carry']:.1f} | "
                     f"{r['groups_dropped_stale']:.1f} | {r['generate']:.3f} | {r['sync']:.3f} | {r['update']:.3f} | "
                     f"{r['old_logprob']:.3f} | {r['reward']:.3f} | {r['staleness_mean']:.2f} | "
                     f"{r['continued']:.2f} |")
    lengths = ", ".join(f"{spec.label}: mean {r['length_mean']:.2f}, per-step max median {r['length_max_median']:.0f}"
                        f", max {r['length_max']:.0f}, at the budget {r['clip_ratio']:.3f}"
                        for spec, r in results.items() if not spec.partial)
    lines.append(f"\nResponse lengths in tokens (whole responses scored in the step): {lengths}.")
    return lines


def args_text(task: str) -> str:
    overrides, segment = TASKS[task]
    return (f"overrides {', '.join(f'`{o}`' for o in overrides)}" if overrides else "the demo's config") + \
        f", partial rollouts of {segment}-token segments"


def _learning_table(learned: dict[Run, dict[int, tuple[float, dict]]], steps: int) -> list[str]:
    seeds = sorted(next(iter(learned.values())))

    def mean(per_seed, key):
        return statistics.mean(v[1][key] for v in per_seed.values())

    lines = [f"\nLearning, task `demo`, {steps} steps, disaggregated (reward rise: mean reward of the last 10 RL "
             f"steps minus the first 10; the demo requires +0.30 over 250 steps):\n",
             "| run | " + " | ".join(f"rise, seed {s}" for s in seeds) + " | mean rise | step s | tokens/s | rounds | "
             "from carry | dropped stale | wait for rollouts s | sync s | update s | old_logprob s |",
             "|:---|" + "---:|" * (len(seeds) + 10)]
    for spec, per_seed in learned.items():
        lines.append(f"| {spec.label} | " + " | ".join(f"{per_seed[s][0]:+.3f}" for s in seeds)
                     + f" | {statistics.mean(v[0] for v in per_seed.values()):+.3f} | "
                     + " | ".join(f"{mean(per_seed, key):{form}}" for key, form in (
                         ("step_s", ".3f"), ("tokens_per_s", ".0f"), ("sampling_rounds", ".2f"),
                         ("groups_from_carry", ".2f"), ("groups_dropped_stale", ".2f"), ("generate", ".3f"),
                         ("sync", ".3f"), ("update", ".3f"), ("old_logprob", ".3f"))) + " |")
    if Run(0) not in learned:
        return lines
    base = statistics.mean(v[0] for v in learned[Run(0)].values())
    base_s = mean(learned[Run(0)], "step_s")
    for spec, per_seed in learned.items():
        if spec.staleness:
            rise = statistics.mean(v[0] for v in per_seed.values())
            step_s = mean(per_seed, "step_s")
            lines.append(f"\n{spec.label}: mean rise {rise:+.3f} against staleness 0's {base:+.3f}: learning "
                         f"{'no worse' if rise >= base - TOLERANCE else 'worse'} (tolerance {TOLERANCE}); step time "
                         f"{step_s / base_s:.2f}x staleness 0's.")
    return lines


def _finished_runs(path: str | None) -> dict[str, object]:
    """The results of `--runs`, by their key (as JSON text)."""
    if path is None or not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return {json.dumps(record["key"]): record["result"] for record in map(json.loads, f) if record}


def _record_run(path: str | None, done: dict[str, object], key: list, result) -> None:
    """`result` of the run `key` into `done` and, as it ends, into `--runs`."""
    done[json.dumps(key)] = result
    if path is not None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "result": result}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--no-drain", action="store_true",
                   help="also the runs with rollout.schedule.update_during_generation")
    p.add_argument("--learn-steps", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="+", default=[7, 8, 9])
    p.add_argument("--learn", nargs="+", choices=list(LEARNING), default=list(LEARNING)[:3])
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "async.md"))
    p.add_argument("--runs", help="a JSON-lines file of the finished runs, appended as each ends; runs already in it "
                                  "are not run again (a benchmark cut short resumes where it stopped)")
    args = p.parse_args()
    done = _finished_runs(args.runs)
    specs = TIMED + (TIMED_NO_DRAIN if args.no_drain else ())
    timed: dict[str, dict[Run, dict]] = {}
    learned: dict[Run, dict[int, tuple[float, dict]]] = {}
    with tempfile.TemporaryDirectory() as root:
        model_dir = _server_model(root)
        for task in args.tasks:
            overrides, segment = TASKS[task]
            timed[task] = {}
            for spec in specs:
                key = ["timed", task, spec.label, args.steps]
                if json.dumps(key) not in done:
                    _record_run(args.runs, done, key, summary(train(root, model_dir, spec, args.steps,
                                                                    [*overrides, *spec.overrides(segment)])))
                timed[task][spec] = done[json.dumps(key)]
                print(task, spec.label, json.dumps(timed[task][spec]), flush=True)
        for seed in args.seeds if args.learn_steps else ():  # seed by seed: the runs of a seed side by side
            for spec in (LEARNING[name] for name in args.learn):
                key = ["learning", seed, spec.label, args.learn_steps]
                if json.dumps(key) not in done:
                    rows = train(root, model_dir, spec, args.learn_steps,
                                 [f"seed={seed}", *spec.overrides(TASKS["demo"][1])])
                    _record_run(args.runs, done, key, (reward_rise(rows), summary(rows)))
                learned.setdefault(spec, {})[seed] = tuple(done[json.dumps(key)])
                print("learning", seed, spec.label, json.dumps(learned[spec][seed]), flush=True)
    command = " ".join(["python benchmarks/async_bench.py", *sys.argv[1:]])
    lines = [f"\n## {time.strftime('%Y-%m-%d %H:%M')}\n", f"Command: `{command}`\n",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores. Disaggregated: trainer pinned to core 0, the "
             f"built-in rollout server to core 1, one thread each; colocated: the trainer pinned to cores 0-1 with "
             f"OMP_NUM_THREADS=2. The CPU demo at TP = 1; RL steps 2.. (phases are medians, the other columns means "
             f"per step).\n"]
    for task, results in timed.items():
        lines += _timed_table(task, results)
    if learned:
        lines += _learning_table(learned, args.learn_steps)
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "a", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
