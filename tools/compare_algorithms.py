"""The algorithm studies: RL variants from one supervised warm start, several seeds each; held-out accuracy before
and after RL, paired differences against a reference variant, the evaluation's own sampling noise, and training
dynamics with mean and spread across seeds.

    python tools/compare_algorithms.py [--study v2] [--smoke] [--output-dir DIR] [--variants LABEL ...] [--ablations]
        [--seeds 1 2 ...] [--steps N] [--jobs 2] [--eval-samples N] [--pass-k 1 4 ...] [--heldout-problems N]
        [--noise-seeds S ...] [--report PATH] [--config PATH] [--set key=value ...]

Studies (STUDIES): `v1`, GRPO / DAPO / GTPO / GRPO-S (and, with --ablations, GTPO / GRPO-S ablations) on
scratchpad addition (examples/algorithm_study.yaml, benchmarks/results/algorithms.md); `v2`, the entropy-method
family on the arithmetic-target task (examples/algorithm_study_v2.yaml, benchmarks/results/algorithms_v2.md).
`--smoke` shrinks a study to seconds (2 RL steps, 2 seeds, 2 variants, 4 held-out problems, 4 samples): it checks
the tool, not the algorithms.

1. One warm-start-only run (`steps: 0`, warm_start.steps from the config; `seed` the first study seed, `data.seed`
   the study's `warm_start_data_seed` or else the first study seed) saves <output-dir>/warm_start/checkpoints/
   step_00000000; every RL run starts from it (`model.load`), so all variants and seeds start from the same policy.
2. Each (variant, seed) is one single-process run of `python -m megatron_gtpo.train` with `seed` and `data.seed` set
   to the seed (same prompts and first rollouts for every variant at a seed), at the same number of steps (equal
   optimizer steps), then a held-out evaluation of its final checkpoint: `--eval-samples` responses per held-out
   problem with the built-in engine at the rollout temperature, Mean@n and unbiased Pass@k (megatron_gtpo.evaluate),
   the run's seed as the sampling seed. The warm start is evaluated with each seed's sampling seed ("before"): its
   spread is the evaluation's sampling noise at the warm start; the reference variant's run at the first seed is
   also evaluated with `--noise-seeds` (the sampling noise after RL). `--jobs` runs go at once, each on one thread
   (OMP_NUM_THREADS=1); one progress line per finished run.
   Resumable: a run's `run.json` (its times, written last) marks it finished and it is not run again; a killed
   study started again with the same command continues with the unfinished runs.
3. <output-dir>/<report name> (tables: mean ± sample standard deviation across seeds; paired differences against the
   reference with 95% t-intervals; the sampling noise; the wall time) and main.png (ablations.png) with per-step
   curves, the mean across seeds with a band of ± one standard deviation. `--report PATH` also writes the tables
   into PATH below its REPORT_MARKER line (the text above it, written by hand, is kept) and the plots beside it.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from megatron_gtpo.atomic_files import write_atomically
from megatron_gtpo.cli import run_cli
from megatron_gtpo.config import load_config
from megatron_gtpo.distributed import free_local_port
from megatron_gtpo.reporting import (mean_and_spread, normalized_auc, paired_difference, plot_bands, read_rl_metrics,
                                     window_means)

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
EVAL_FILE = "heldout_eval.json"
DONE_FILE = "run.json"  # written last: the run (training and its evaluations) is finished
REPORT_MARKER = "<!-- below: written by tools/compare_algorithms.py -->"
# The training curve is the outcome reward (`accuracy`): DAPO's `reward_mean` includes its overlong penalty.
DYNAMICS = (("entropy_mean", "token entropy, all (nats)"), ("entropy_correct_mean", "token entropy, correct responses"),
            ("entropy_failed_mean", "token entropy, failed responses"),
            ("response_length_mean", "response length (tokens)"), ("clip_frac_low", "clip fraction (low)"),
            ("clip_frac_high", "clip fraction (high)"))
TOKEN_SELECTION = (("clip_cov_fraction", "Clip-Cov: fraction of tokens cut"),
                   ("kl_cov_fraction", "KL-Cov: fraction of tokens penalised"),
                   ("entropy_kept_fraction", "high-entropy fraction: tokens kept"))


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str
    algorithm: str
    overrides: tuple[str, ...] = ()

    @property
    def dirname(self) -> str:
        return "".join(c if c.isalnum() or c in "._-+" else "_" for c in self.label)


@dataclasses.dataclass(frozen=True)
class Study:
    config: str
    variants: tuple[Variant, ...]
    reference: str  # the label the paired differences are taken against
    seeds: tuple[int, ...]
    eval_samples: int
    pass_k: tuple[int, ...]
    noise_seeds: tuple[int, ...]
    report_name: str
    panels: tuple[tuple[str, str], ...]
    ablations: tuple[Variant, ...] = ()
    # The warm start's data.seed (its order of demonstrations); None: the first study seed
    warm_start_data_seed: int | None = None


# The paper's mechanisms: the entropy weight (0 removes the shaping), GTPO's normalisation scope, an entropy clip.
V1_ABLATIONS = (
    *(Variant(f"gtpo alpha2={v}", "gtpo", (f"algorithm.gtpo.alpha2={v}",)) for v in (0.0, 0.05, 0.2)),
    *(Variant(f"grpo_s beta2={v}", "grpo_s", (f"algorithm.grpo_s.beta2={v}",)) for v in (0.0, 0.05, 0.2)),
    Variant("gtpo norm_scope=group", "gtpo", ("algorithm.gtpo.norm_scope=group",)),
    Variant("gtpo entropy_clip=[0.1,2]", "gtpo", ("algorithm.gtpo.entropy_clip=[0.1,2.0]",)),
)
# The entropy bonus at 0.001: verl's former default `entropy_coeff` (DAPO itself has none).
ENTROPY_BONUS = 0.001
STUDIES = {
    "v1": Study(os.path.join(EXAMPLES, "algorithm_study.yaml"),
                tuple(Variant(a, a) for a in ("grpo", "dapo", "gtpo", "grpo_s")), "dapo", (1, 2, 3), 16, (1, 4, 16),
                (101, 102), "algorithms.md", (("accuracy", "training accuracy (outcome reward)"), *DYNAMICS),
                V1_ABLATIONS),
    "v2": Study(os.path.join(EXAMPLES, "algorithm_study_v2.yaml"),
                (Variant("grpo", "grpo"), Variant("dapo", "dapo"),
                 # DAPO's control without its overlong penalty, which GRPO, GTPO, GRPO-S, Clip-Cov and KL-Cov lack
                 Variant("dapo-no-overlong", "dapo", ("algorithm.length_penalty=none",)),
                 *(Variant(a, a) for a in ("gtpo", "grpo_s", "clip_cov", "kl_cov")),
                 Variant("dapo+entropy_frac0.2", "dapo", ("algorithm.entropy_token_fraction=0.2",)),
                 Variant(f"dapo+entropy_bonus{ENTROPY_BONUS}", "dapo", (f"algorithm.entropy_coef={ENTROPY_BONUS}",))),
                "dapo", (1, 2, 3, 4, 5), 64, (1, 4, 16, 64), (101, 102, 103, 104), "algorithms_v2.md",
                (("accuracy", "training accuracy (outcome reward)"), *DYNAMICS, *TOKEN_SELECTION),
                # Pinned: the order of demonstrations decides whether the warm start learns to keep trying (Pass@1
                # 0.12, 77 tokens) or not (0.02-0.04, 45 tokens) at 4000 steps (the table atop algorithms_v2.md).
                warm_start_data_seed=1234),
}
# --smoke: the reference and the last variant (v2: an override on DAPO), seconds per run.
SMOKE = {"steps": 2, "seeds": [1, 2], "eval_samples": 4, "pass_k": [1, 2, 4], "heldout_problems": 4,
         "noise_seeds": [101], "overrides": ["warm_start.steps=3", "data.prompts_per_step=4"]}


def _run(cmd: list[str], log_path: str, tries: int = 3) -> float:
    """One process on one thread, its own rendezvous port; output to a log file (named in the error if it fails).
    Returns its wall time in seconds. A port taken by another process between `free_local_port` and the child's bind
    is retried on a new port (`tries` in all); any other failure is raised."""
    for _ in range(tries):
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_local_port()))
        start = time.monotonic()
        with open(log_path, "w", encoding="utf-8") as log:
            res = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if res.returncode == 0:
            return time.monotonic() - start
        with open(log_path, encoding="utf-8") as log:
            tail = log.read()[-3000:]
        if "EADDRINUSE" not in tail and "address already in use" not in tail.lower():
            break
    raise RuntimeError(f"{' '.join(cmd)} failed (status {res.returncode}; log {log_path}):\n{tail}")


def _train_command(args, out: str, sets: list[str]) -> list[str]:
    sets = [f"logging.output_dir={out}", "checkpoint.resume=false", "checkpoint.save_every=0", *args.overrides,
            *sets]
    return [sys.executable, "-m", "megatron_gtpo.train", "--config", args.config,
            *(part for s in sets for part in ("--set", s))]


def _eval_command(args, checkpoint: str, outputs: list[str], seeds: list[int]) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--config", args.config,
            *(part for s in args.overrides for part in ("--set", s)), "--evaluate", checkpoint,
            "--eval-outputs", *outputs, "--eval-seeds", *map(str, seeds), "--eval-samples", str(args.eval_samples),
            "--pass-k", *map(str, args.pass_k), *(["--heldout-problems", str(args.heldout_problems)]
                                                  if args.heldout_problems else [])]


def evaluate_checkpoint(args) -> None:
    """Held-out Mean@n / Pass@k of one checkpoint, once per sampling seed (this process; the --evaluate mode)."""
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
    calls = replica_calls(len(problems), prompts_per_call=64, share=ReplicaShare())
    for seed, output in zip(args.eval_seeds, args.eval_outputs, strict=True):
        sampling = SamplingSettings(num_samples=args.eval_samples, temperature=cfg.rollout.temperature, top_p=1.0,
                                    max_new_tokens=cfg.rollout.max_new_tokens, seed=seed)
        responses = generate_responses(replica, [p.prompt_token_ids for p in problems], sampling, calls=calls,
                                       progress=False)
        results, lengths = [], []
        for problem, samples in zip(problems, responses):
            texts = [tokenizer.decode(ids) for ids in samples]
            results.append(ProblemResult(problem.id, problem.answer,
                                         tuple(task.reward(t, problem.answer) == 1.0 for t in texts),
                                         (None,) * len(texts), tuple(texts)))
            lengths += [len(ids) for ids in samples]
        summary = {**summarize(results, args.pass_k), "response_length_mean": sum(lengths) / len(lengths),
                   "sampling_seed": seed}
        write_atomically(output, json.dumps(summary, indent=1))


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path: str, value: dict) -> None:
    write_atomically(path, json.dumps(value, indent=1))


def run_study(args, variants: list[Variant]) -> None:
    """The warm start, its evaluation, then every unfinished (variant, seed) run and its evaluation."""
    root = os.path.abspath(args.output_dir)
    warm_dir = os.path.join(root, "warm_start")
    warm_ckpt = os.path.join(warm_dir, "checkpoints", "step_00000000")
    os.makedirs(warm_dir, exist_ok=True)
    if not os.path.exists(os.path.join(warm_dir, DONE_FILE)):
        print("== warm start: training", flush=True)
        pinned = args.study.warm_start_data_seed
        seeds = [f"seed={args.seeds[0]}", f"data.seed={args.seeds[0] if pinned is None else pinned}"]
        train_s = _run(_train_command(args, warm_dir, ["steps=0", *seeds]),
                       os.path.join(warm_dir, "train.log"))
        eval_s = _run(_eval_command(args, warm_ckpt, [os.path.join(warm_dir, f"seed{s}_{EVAL_FILE}")
                                                      for s in args.seeds], args.seeds),
                      os.path.join(warm_dir, "eval.log"))
        _write_json(os.path.join(warm_dir, DONE_FILE), {"train_s": train_s, "eval_s": eval_s})
        print(f"== warm start: trained in {train_s:.0f} s, evaluated with {len(args.seeds)} sampling seeds in "
              f"{eval_s:.0f} s", flush=True)
    rl_sets = [f"model.load={warm_ckpt}", "model.tiny_synthetic=false", "warm_start.steps=0", f"steps={args.steps}"]
    todo = [(v, s) for v in variants for s in args.seeds
            if not os.path.exists(os.path.join(root, v.dirname, f"seed{s}", DONE_FILE))]
    total, lock, finished = len(variants) * len(args.seeds), threading.Lock(), [0]
    print(f"== {total - len(todo)} of {total} RL runs finished already; {len(todo)} to run, {args.jobs} at once",
          flush=True)

    def rl_run(variant: Variant, seed: int) -> None:
        out = os.path.join(root, variant.dirname, f"seed{seed}")
        os.makedirs(out, exist_ok=True)
        train_s = _run(_train_command(args, out, [*rl_sets, f"algorithm.name={variant.algorithm}",
                                                  *variant.overrides, f"seed={seed}", f"data.seed={seed}"]),
                       os.path.join(out, "train.log"))
        with open(os.path.join(out, "checkpoints", "latest"), encoding="utf-8") as f:
            final = os.path.join(out, "checkpoints", f.read().strip())
        seeds = [seed, *(args.noise_seeds if (variant.label, seed) == (args.reference, args.seeds[0]) else ())]
        outputs = [os.path.join(out, EVAL_FILE if s == seed else f"noise_seed{s}_{EVAL_FILE}") for s in seeds]
        eval_s = _run(_eval_command(args, final, outputs, seeds), os.path.join(out, "eval.log"))
        _write_json(os.path.join(out, DONE_FILE), {"train_s": train_s, "eval_s": eval_s, "steps": args.steps})
        n = args.eval_samples
        after = _read_json(os.path.join(out, EVAL_FILE))[f"mean@{n}"]
        before = _read_json(os.path.join(warm_dir, f"seed{seed}_{EVAL_FILE}"))[f"mean@{n}"]
        with lock:
            finished[0] += 1
            print(f"[{total - len(todo) + finished[0]}/{total}] {variant.label} seed {seed}: {args.steps} steps in "
                  f"{train_s:.0f} s ({train_s / max(args.steps, 1):.1f} s/step incl. start), evaluated in "
                  f"{eval_s:.0f} s; held-out Mean@{n} {before:.3f} -> {after:.3f}", flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        for future in [pool.submit(rl_run, v, s) for v, s in todo]:
            future.result()


def _cell(values: list[float], digits: int = 3) -> str:
    mean, spread = mean_and_spread(values)
    return "—" if mean != mean else f"{mean:.{digits}f} ± {spread:.{digits}f}"  # NaN: not logged by this variant


def _accuracy_keys(args) -> list[tuple[str, str]]:
    return [(f"mean@{args.eval_samples}", f"Mean@{args.eval_samples}"),
            *((f"pass@{k}", f"Pass@{k}") for k in args.pass_k)]


def collect(args, variants: list[Variant]) -> tuple[dict, dict, dict]:
    """Per variant: the per-seed metric rows and per-seed scalars (held-out after, reward AUC, first / last windows,
    times); and the evaluations of the warm start per seed and of the noise checkpoint per sampling seed."""
    root = os.path.abspath(args.output_dir)
    warm_dir = os.path.join(root, "warm_start")
    curves, scalars = {}, {}
    for v in variants:
        rows_by_seed, per_seed = [], []
        for seed in args.seeds:
            out = os.path.join(root, v.dirname, f"seed{seed}")
            rows = read_rl_metrics(out)
            s = {"auc": normalized_auc([r["accuracy"] for r in rows]),
                 "after": _read_json(os.path.join(out, EVAL_FILE)), **_read_json(os.path.join(out, DONE_FILE))}
            for key, _ in (*DYNAMICS, *TOKEN_SELECTION):
                s[key] = window_means([r.get(key) for r in rows], args.window)
            rows_by_seed.append(rows)
            per_seed.append(s)
        curves[v.label], scalars[v.label] = rows_by_seed, per_seed
    noise_dir = os.path.join(root, next(v.dirname for v in variants if v.label == args.reference),
                             f"seed{args.seeds[0]}")
    evaluations = {
        "warm_start": [_read_json(os.path.join(warm_dir, f"seed{s}_{EVAL_FILE}")) for s in args.seeds],
        "noise": [_read_json(os.path.join(noise_dir, EVAL_FILE)),
                  *(_read_json(os.path.join(noise_dir, f"noise_seed{s}_{EVAL_FILE}")) for s in args.noise_seeds)],
        "warm_start_times": _read_json(os.path.join(warm_dir, DONE_FILE))}
    return curves, scalars, evaluations


def _table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|---" * len(header) + "|",
                      *("| " + " | ".join(row) + " |" for row in rows)])


def tables(args, scalars: dict, evaluations: dict) -> str:
    keys = _accuracy_keys(args)
    warm = evaluations["warm_start"]
    accuracy = [["warm start (before RL)", *(_cell([e[k] for e in warm]) for k, _ in keys), "—"]]
    accuracy += [[label, *(_cell([s["after"][k] for s in per_seed]) for k, _ in keys),
                  _cell([s["auc"] for s in per_seed])] for label, per_seed in scalars.items()]
    ref = [s["after"] for s in scalars[args.reference]]
    paired, detectable = [], []
    for label, per_seed in scalars.items():
        if label == args.reference:
            continue
        stats = [paired_difference([s["after"][k] for s in per_seed], [r[k] for r in ref]) for k, _ in keys]
        paired.append([label, *(f"{m:+.3f} [{m - h:+.3f}, {m + h:+.3f}]" for m, h, _ in stats)])
        detectable.append([label, *(f"{d:.3f}" for _, _, d in stats)])
    noise = evaluations["noise"]
    noise_rows = [[f"warm start, sampling seeds {list(args.seeds)}", *(_cell([e[k] for e in warm]) for k, _ in keys)],
                  [f"{args.reference} seed {args.seeds[0]} after RL, sampling seeds "
                   f"{[e['sampling_seed'] for e in noise]}", *(_cell([e[k] for e in noise]) for k, _ in keys)],
                  [f"{args.reference} after RL, training seeds {list(args.seeds)} (each its own sampling seed)",
                   *(_cell([r[k] for r in ref]) for k, _ in keys)]]
    dynamics = [[label, *(f"{_cell([s[key][0] for s in per_seed])} -> {_cell([s[key][1] for s in per_seed])}"
                          for key, _ in (*DYNAMICS, *TOKEN_SELECTION))] for label, per_seed in scalars.items()]
    names = [name for _, name in keys]
    return (f"### Held-out accuracy\n\nMean@n and unbiased Pass@k on the {warm[0]['num_problems']} held-out problems "
            f"({args.eval_samples} samples each); the last column is the mean height of the training outcome-reward "
            f"curve (`accuracy`). Mean ± sample standard deviation across seeds.\n\n"
            + _table(["variant", *names, "train reward AUC"], accuracy)
            + f"\n\n### Paired differences against {args.reference}\n\nPer seed, the variant's held-out value minus "
            f"{args.reference}'s at the same seed (same warm start, prompts and first rollouts); mean [95% "
            f"t-interval, {len(args.seeds) - 1} degrees of freedom].\n\n" + _table(["variant", *names], paired)
            + f"\n\nThe smallest true difference these {len(args.seeds)} pairs detect with 80% power (5% two-sided), "
            "from each variant's observed spread of the differences:\n\n" + _table(["variant", *names], detectable)
            + "\n\n### The evaluation's own sampling noise\n\nOne checkpoint evaluated with several sampling seeds "
            "(mean ± sd across them), against the spread across training seeds:\n\n"
            + _table(["evaluations", *names], noise_rows)
            + f"\n\n### Training dynamics\n\nMean over the first -> last {args.window} RL steps (then mean ± sd "
            "across seeds); — where the variant does not log the metric.\n\n"
            + _table(["variant", *(name for _, name in (*DYNAMICS, *TOKEN_SELECTION))], dynamics) + "\n")


def _times(args, scalars: dict, evaluations: dict, wall_s: float) -> str:
    warm = evaluations["warm_start_times"]
    runs = [s for per_seed in scalars.values() for s in per_seed]
    train = sum(s["train_s"] for s in runs)
    evaluation = sum(s["eval_s"] for s in runs)
    one_pass = warm["train_s"] + warm["eval_s"] + (train + evaluation) / args.jobs
    return (f"Wall time of this invocation {wall_s / 60:.1f} min on {platform.machine()} with {os.cpu_count()} CPUs "
            f"({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC). Recorded run times: warm start "
            f"{warm['train_s']:.0f} s + its evaluation {warm['eval_s']:.0f} s; {len(runs)} RL runs "
            f"{train / len(runs):.0f} s training + {evaluation / len(runs):.0f} s evaluation each on average; "
            f"{one_pass / 60:.1f} min for the whole study at {args.jobs} runs at once (the sum, a resumed study "
            "included).")


def write_report(args, variants: list[Variant], wall_s: float) -> str:
    """The tables and plots in the output directory (and with --report, below the marker of that file); returns
    the tables' text."""
    curves, scalars, evaluations = collect(args, variants)
    root = os.path.abspath(args.output_dir)
    plots = {"main.png": [v.label for v in variants if v not in args.study.ablations]}
    if args.ablations:
        plots["ablations.png"] = [v.label for v in variants if v in args.study.ablations or v.label in
                                  ("dapo", "gtpo", "grpo_s")]
    for name, labels in plots.items():
        plot_bands({k: curves[k] for k in labels}, os.path.join(root, name),
                   f"{name[:-4]}: mean ± 1 sd over seeds {list(args.seeds)}", args.study.panels)
    settings = "; ".join(f"{v.label}: {' '.join(v.overrides) or 'defaults'}" for v in variants)
    text = (f"Command: `{' '.join(['python', 'tools/compare_algorithms.py', *sys.argv[1:]])}`\n\n"
            f"Config {os.path.relpath(args.config)} with {args.overrides or 'no overrides'}; {args.steps} RL steps; "
            f"seeds {list(args.seeds)}; variants ({settings}); reference {args.reference}.\n\n"
            f"{_times(args, scalars, evaluations, wall_s)}\n\n{tables(args, scalars, evaluations)}")

    def with_plots(prefix: str) -> str:
        return text + "".join(f"\n![{name[:-4]}]({prefix}{name})\n" for name in plots)

    write_atomically(os.path.join(root, args.study.report_name), "# Algorithm study\n\n" + with_plots(""))
    if args.report:
        with open(args.report, encoding="utf-8") as f:
            head, marker, _ = f.read().partition(REPORT_MARKER)
        if not marker:
            raise ValueError(f"--report {args.report}: no line {REPORT_MARKER!r} to write the results below")
        prefix = os.path.splitext(os.path.basename(args.report))[0] + "_"
        for name in plots:
            shutil.copyfile(os.path.join(root, name), os.path.join(os.path.dirname(args.report), prefix + name))
        write_atomically(args.report, head + REPORT_MARKER + "\n\n" + with_plots(prefix))
    return text


def _arguments(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--study", choices=sorted(STUDIES), default="v2")
    p.add_argument("--smoke", action="store_true", help="a seconds-long run of the tool (2 steps, 2 seeds, 2 variants)")
    p.add_argument("--output-dir", default=None, help="default: outputs/algorithm_study_<study>")
    p.add_argument("--config", default=None, help="default: the study's")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="a config override for every run")
    p.add_argument("--variants", nargs="+", default=None, help="labels of the study's variants (default: all)")
    p.add_argument("--ablations", action="store_true", help="also run the study's ablations (v1)")
    p.add_argument("--seeds", nargs="+", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the config's)")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (one process, one thread each)")
    p.add_argument("--eval-samples", type=int, default=None, help="responses per held-out problem (n of Mean@n)")
    p.add_argument("--pass-k", nargs="+", type=int, default=None)
    p.add_argument("--heldout-problems", type=int, default=None, help="evaluate on the first N held-out problems")
    p.add_argument("--noise-seeds", nargs="+", type=int, default=None,
                   help="extra sampling seeds for the reference's first-seed checkpoint (the evaluation's noise)")
    p.add_argument("--report", default=None, help="also write the results below the marker line of this file")
    p.add_argument("--window", type=int, default=5, help="steps averaged for the first/last columns")
    p.add_argument("--evaluate", metavar="CHECKPOINT", help=argparse.SUPPRESS)  # one evaluation (worker mode)
    p.add_argument("--eval-outputs", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--eval-seeds", nargs="+", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    name, study = args.study, STUDIES[args.study]
    args.study = study
    smoke = SMOKE if args.smoke else {}
    for key in ("seeds", "eval_samples", "pass_k", "noise_seeds"):
        if getattr(args, key) is None:
            setattr(args, key, smoke.get(key, getattr(study, key)))
    args.heldout_problems = args.heldout_problems or smoke.get("heldout_problems")
    args.overrides = [*smoke.get("overrides", ()), *args.overrides]
    args.config = args.config or study.config
    args.output_dir = args.output_dir or f"outputs/algorithm_study_{name}"
    args.reference = study.reference
    if any(k > args.eval_samples for k in args.pass_k):
        p.error(f"--pass-k values must be <= --eval-samples ({args.eval_samples})")
    if args.evaluate is None:
        args.steps = args.steps or smoke.get("steps") or load_config(args.config, args.overrides).steps
        if len(args.seeds) < 2:
            p.error("--seeds: at least 2 (the paired differences' intervals)")
        labels = {v.label: v for v in study.variants}
        chosen = args.variants or ([study.reference, study.variants[-1].label] if args.smoke else list(labels))
        unknown = [label for label in chosen if label not in labels]
        if unknown:
            p.error(f"--variants: unknown {unknown}; the study's are {list(labels)}")
        if study.reference not in chosen:
            p.error(f"--variants: must include the reference {study.reference} (the paired differences)")
        args.variants = [labels[label] for label in chosen] + (list(study.ablations) if args.ablations else [])
    return args


def main(argv=None) -> int:
    args = _arguments(argv)
    if args.evaluate:
        evaluate_checkpoint(args)
        return 0
    variants = args.variants
    start = time.monotonic()
    run_study(args, variants)
    text = write_report(args, variants, time.monotonic() - start)
    print(text)
    print(f"report: {os.path.join(os.path.abspath(args.output_dir), args.study.report_name)}"
          + (f" and {args.report}" if args.report else ""))
    return 0


if __name__ == "__main__":
    run_cli("compare_algorithms", main)
