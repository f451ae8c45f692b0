"""The algorithm study: GRPO, DAPO, GTPO and GRPO-S (and ablations of GTPO / GRPO-S) from one supervised warm start,
several seeds each, on the scratchpad-addition task; held-out accuracy before and after RL, training dynamics, with
mean and spread across seeds.

    python tools/compare_algorithms.py [--output-dir outputs/algorithm_study] [--seeds 1 2 3] [--ablations]
        [--algorithms grpo dapo gtpo grpo_s] [--steps N] [--jobs 2] [--eval-samples 16] [--pass-k 1 4 16]
        [--config examples/algorithm_study.yaml] [--set key=value ...]

1. One warm-start-only run (`steps: 0`, warm_start.steps from the config) saves <output-dir>/warm_start/checkpoints/
   step_00000000; every RL run starts from it (`model.load`), so all algorithms and seeds start from the same policy.
2. Each (variant, seed) is one single-process run of `python -m megatron_gtpo.train` with `seed` and `data.seed` set
   to the seed (same prompts and first rollouts for every algorithm at a seed), then a held-out evaluation of its
   final checkpoint: `--eval-samples` responses per held-out problem with the built-in engine at the rollout
   temperature, Mean@n and unbiased Pass@k (megatron_gtpo.evaluate). The warm start is evaluated once per seed (the
   evaluation's sampling seed). `--jobs` runs go at once, each on one thread (OMP_NUM_THREADS=1).
   A run whose evaluation file exists is not run again: an interrupted study resumes.
3. <output-dir>/algorithms.md (tables: mean ± sample standard deviation across seeds) and main.png / ablations.png
   (per-step curves, the mean across seeds with a band of ± one standard deviation).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from megatron_gtpo.atomic_files import write_atomically
from megatron_gtpo.cli import run_cli
from megatron_gtpo.algorithms import ALGORITHM_NAMES
from megatron_gtpo.config import load_config
from megatron_gtpo.reporting import mean_and_spread, normalized_auc, plot_bands, read_rl_metrics, window_means

STUDY_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "algorithm_study.yaml")
EVAL_FILE = "heldout_eval.json"
# The training curve is the outcome reward (`accuracy`): DAPO's `reward_mean` includes its overlong penalty.
PANELS = (("accuracy", "training accuracy (outcome reward)"), ("entropy_mean", "token entropy, all (nats)"),
          ("entropy_correct_mean", "token entropy, correct responses"),
          ("entropy_failed_mean", "token entropy, failed responses"),
          ("response_length_mean", "response length (tokens)"), ("clip_frac_high", "clip fraction (high)"))
DYNAMICS = ("entropy_mean", "entropy_correct_mean", "entropy_failed_mean", "response_length_mean", "clip_frac_low",
            "clip_frac_high")


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str
    algorithm: str
    overrides: tuple[str, ...] = ()

    @property
    def dirname(self) -> str:
        return "".join(c if c.isalnum() or c in "._-" else "_" for c in self.label)


# The paper's mechanisms: the entropy weight (0 removes the shaping), GTPO's normalisation scope, an entropy clip.
ABLATIONS = (
    *(Variant(f"gtpo alpha2={v}", "gtpo", (f"algorithm.alpha2={v}",)) for v in (0.0, 0.05, 0.2)),
    *(Variant(f"grpo_s beta2={v}", "grpo_s", (f"algorithm.beta2={v}",)) for v in (0.0, 0.05, 0.2)),
    Variant("gtpo norm_scope=group", "gtpo", ("algorithm.norm_scope=group",)),
    Variant("gtpo entropy_clip=[0.1,2]", "gtpo", ("algorithm.entropy_clip=[0.1,2.0]",)),
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], log_path: str) -> None:
    """One process on one thread, its own rendezvous port; output to a log file (named in the error if it fails)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(_free_port()))
    with open(log_path, "w", encoding="utf-8") as log:
        res = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if res.returncode != 0:
        with open(log_path, encoding="utf-8") as log:
            tail = log.read()[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} failed (status {res.returncode}; log {log_path}):\n{tail}")


def _train_command(args, out: str, sets: list[str]) -> list[str]:
    sets = [f"logging.output_dir={out}", "checkpoint.resume=false", "checkpoint.save_every=0", *args.overrides,
            *sets]
    return [sys.executable, "-m", "megatron_gtpo.train", "--config", args.config,
            *(part for s in sets for part in ("--set", s))]


def _eval_command(args, checkpoint: str, output: str, seed: int) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--config", args.config,
            *(part for s in args.overrides for part in ("--set", s)), "--evaluate", checkpoint, "--eval-output", output,
            "--eval-seed", str(seed), "--eval-samples", str(args.eval_samples),
            "--pass-k", *map(str, args.pass_k), *(["--heldout-problems", str(args.heldout_problems)]
                                                  if args.heldout_problems else [])]


def evaluate_checkpoint(args) -> None:
    """Held-out Mean@n / Pass@k of one checkpoint (this process; the --evaluate mode)."""
    from megatron_gtpo.data.synthetic_tasks import SYNTHETIC_TASKS
    from megatron_gtpo.evaluation.passk import ProblemResult, summarize
    from megatron_gtpo.evaluation.replicas import ReplicaShare, build_builtin_replica
    from megatron_gtpo.evaluation.run import SamplingSettings, generate_responses, replica_calls

    cfg = load_config(args.config, args.overrides)
    task = SYNTHETIC_TASKS[cfg.data.task]
    if task.heldout_problems is None:
        raise ValueError(f"data.task: {cfg.data.task} has no held-out split to evaluate on")
    problems = task.heldout_problems()[:args.heldout_problems or None]
    tokenizer = task.tokenizer()
    replica = build_builtin_replica(argparse.Namespace(model=args.evaluate, tp=1, pp=1, dtype="float32",
                                                     max_batch_rows=None, max_batch_tokens=None), tokenizer)
    sampling = SamplingSettings(num_samples=args.eval_samples, temperature=cfg.rollout.temperature, top_p=1.0,
                                max_new_tokens=cfg.rollout.max_new_tokens, seed=args.eval_seed)
    calls = replica_calls(len(problems), prompts_per_call=64, share=ReplicaShare())
    responses = generate_responses(replica, [p.prompt_token_ids for p in problems], sampling, calls=calls,
                                   progress=False)
    results, lengths = [], []
    for problem, samples in zip(problems, responses):
        texts = [tokenizer.decode(ids) for ids in samples]
        results.append(ProblemResult(problem.id, problem.answer,
                                     tuple(task.reward(t, problem.answer) == 1.0 for t in texts),
                                     (None,) * len(texts), tuple(texts)))
        lengths += [len(ids) for ids in samples]
    summary = {**summarize(results, args.pass_k), "response_length_mean": sum(lengths) / len(lengths)}
    write_atomically(args.eval_output, json.dumps(summary, indent=1))


def run_study(args, variants: list[Variant]) -> dict:
    """Warm start, then every (variant, seed) run and its evaluation; returns the wall times."""
    root = os.path.abspath(args.output_dir)
    warm_dir = os.path.join(root, "warm_start")
    warm_ckpt = os.path.join(warm_dir, "checkpoints", "step_00000000")
    os.makedirs(warm_dir, exist_ok=True)
    start = time.monotonic()
    if not os.path.isdir(warm_ckpt):
        print("== warm start", flush=True)
        _run(_train_command(args, warm_dir, ["steps=0", f"seed={args.seeds[0]}", f"data.seed={args.seeds[0]}"]),
             os.path.join(warm_dir, "train.log"))
    warm_s = time.monotonic() - start
    rl_sets = [f"model.load={warm_ckpt}", "model.tiny_synthetic=false", "warm_start.steps=0",
               *([f"steps={args.steps}"] if args.steps is not None else [])]

    def warm_eval(seed: int) -> None:
        out = os.path.join(warm_dir, f"seed{seed}_{EVAL_FILE}")
        if not os.path.exists(out):
            _run(_eval_command(args, warm_ckpt, out, seed), os.path.join(warm_dir, f"seed{seed}_eval.log"))

    def rl_run(variant: Variant, seed: int) -> None:
        out = os.path.join(root, variant.dirname, f"seed{seed}")
        if os.path.exists(os.path.join(out, EVAL_FILE)):
            return
        os.makedirs(out, exist_ok=True)
        t0 = time.monotonic()
        _run(_train_command(args, out, [*rl_sets, f"algorithm.name={variant.algorithm}", *variant.overrides,
                                        f"seed={seed}", f"data.seed={seed}"]), os.path.join(out, "train.log"))
        with open(os.path.join(out, "checkpoints", "latest"), encoding="utf-8") as f:
            final = os.path.join(out, "checkpoints", f.read().strip())
        _run(_eval_command(args, final, os.path.join(out, EVAL_FILE), seed), os.path.join(out, "eval.log"))
        print(f"== {variant.label} seed {seed}: {time.monotonic() - t0:.0f} s", flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(warm_eval, s) for s in args.seeds]
        futures += [pool.submit(rl_run, v, s) for v in variants for s in args.seeds]
        for future in futures:
            future.result()
    return {"warm_start_s": warm_s, "total_s": time.monotonic() - start}


def _cell(values: list[float], digits: int = 3) -> str:
    mean, spread = mean_and_spread(values)
    return f"{mean:.{digits}f} ± {spread:.{digits}f}"


def collect(args, variants: list[Variant]) -> tuple[dict, dict]:
    """Per variant: the per-seed metric rows, and per-seed scalars (held-out before/after, reward AUC, windows)."""
    root = os.path.abspath(args.output_dir)
    curves, scalars = {}, {}
    for v in variants:
        rows_by_seed, per_seed = [], []
        for seed in args.seeds:
            out = os.path.join(root, v.dirname, f"seed{seed}")
            rows = read_rl_metrics(out)
            with open(os.path.join(out, EVAL_FILE), encoding="utf-8") as f:
                after = json.load(f)
            with open(os.path.join(root, "warm_start", f"seed{seed}_{EVAL_FILE}"), encoding="utf-8") as f:
                before = json.load(f)
            s = {"auc": normalized_auc([r["accuracy"] for r in rows]), "before": before, "after": after}
            for key in DYNAMICS:
                s[key] = window_means([r.get(key) for r in rows], args.window)
            rows_by_seed.append(rows)
            per_seed.append(s)
        curves[v.label], scalars[v.label] = rows_by_seed, per_seed
    return curves, scalars


def _first_last(per_seed: list[dict], key: str, digits: int = 3) -> str:
    return f"{_cell([s[key][0] for s in per_seed], digits)} -> {_cell([s[key][1] for s in per_seed], digits)}"


def tables(args, scalars: dict) -> str:
    n, ks = args.eval_samples, args.pass_k
    acc = [f"| variant | Mean@{n} before | Mean@{n} after | "
           + " | ".join(f"Pass@{k} before | Pass@{k} after" for k in ks) + " | train reward AUC |",
           "|---" * (3 + 2 * len(ks) + 1) + "|"]
    dyn = ["| variant | entropy (first -> last) | entropy correct (last) | entropy failed (last) | "
           "length (first -> last) | clip low (mean of last) | clip high (mean of last) |", "|---" * 7 + "|"]
    for label, per_seed in scalars.items():
        cells = [_cell([s["before"][f"mean@{n}"] for s in per_seed]),
                 _cell([s["after"][f"mean@{n}"] for s in per_seed])]
        for k in ks:
            cells += [_cell([s["before"][f"pass@{k}"] for s in per_seed]),
                      _cell([s["after"][f"pass@{k}"] for s in per_seed])]
        acc.append(f"| {label} | {' | '.join(cells)} | {_cell([s['auc'] for s in per_seed])} |")

        dyn.append(f"| {label} | {_first_last(per_seed, 'entropy_mean')} | "
                   f"{_cell([s['entropy_correct_mean'][1] for s in per_seed])} | "
                   f"{_cell([s['entropy_failed_mean'][1] for s in per_seed])} | "
                   f"{_first_last(per_seed, 'response_length_mean', 1)} | "
                   f"{_cell([s['clip_frac_low'][1] for s in per_seed], 4)} | "
                   f"{_cell([s['clip_frac_high'][1] for s in per_seed], 4)} |")
    return ("Held-out accuracy (Mean@n, unbiased Pass@k) before RL (the shared warm start) and after, and the area "
            "under the training outcome-reward curve (`accuracy`; its mean height over the RL steps):\n\n"
            + "\n".join(acc)
            + f"\n\nTraining dynamics; first / last = mean over the first / last {args.window} RL steps:\n\n"
            + "\n".join(dyn) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", default="outputs/algorithm_study")
    p.add_argument("--config", default=STUDY_CONFIG)
    p.add_argument("--set", dest="overrides", action="append", default=[], help="a config override for every run")
    p.add_argument("--algorithms", nargs="+", default=["grpo", "dapo", "gtpo", "grpo_s"], choices=ALGORITHM_NAMES)
    p.add_argument("--ablations", action="store_true", help="also run the GTPO / GRPO-S ablations")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the config's)")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (one process, one thread each)")
    p.add_argument("--eval-samples", type=int, default=16, help="responses per held-out problem (n of Mean@n)")
    p.add_argument("--pass-k", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--heldout-problems", type=int, default=None, help="evaluate on the first N held-out problems")
    p.add_argument("--window", type=int, default=5, help="steps averaged for the first/last columns")
    p.add_argument("--evaluate", metavar="CHECKPOINT", help=argparse.SUPPRESS)  # one evaluation (worker mode)
    p.add_argument("--eval-output", help=argparse.SUPPRESS)
    p.add_argument("--eval-seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if any(k > args.eval_samples for k in args.pass_k):
        p.error(f"--pass-k values must be <= --eval-samples ({args.eval_samples})")
    if args.evaluate:
        evaluate_checkpoint(args)
        return 0
    variants = [Variant(a, a) for a in args.algorithms] + (list(ABLATIONS) if args.ablations else [])
    times = run_study(args, variants)
    curves, scalars = collect(args, variants)
    root = os.path.abspath(args.output_dir)
    main_labels = [v.label for v in variants if not v.overrides]
    plot_bands({k: curves[k] for k in main_labels}, os.path.join(root, "main.png"),
               "GRPO / DAPO / GTPO / GRPO-S (mean ± 1 sd over seeds)", PANELS)
    if args.ablations:
        plot_bands({k: v for k, v in curves.items() if k not in main_labels or k in ("dapo", "gtpo", "grpo_s")},
                   os.path.join(root, "ablations.png"), "Ablations (mean ± 1 sd over seeds)", PANELS)
    text = (f"# Algorithm study\n\nConfig {os.path.relpath(args.config)} with {args.overrides or 'no overrides'}; "
            f"seeds {args.seeds}; {len(variants)} variants; wall time {times['total_s'] / 60:.1f} min "
            f"(warm start {times['warm_start_s']:.0f} s) with {args.jobs} runs at once. Cells: mean ± sample "
            f"standard deviation across seeds.\n\n{tables(args, scalars)}")
    md = os.path.join(root, "algorithms.md")
    write_atomically(md, text)
    print(text)
    print(f"table: {md}\nplots: {os.path.join(root, 'main.png')}")
    return 0


if __name__ == "__main__":
    run_cli("compare_algorithms", main)
