"""The algorithm studies: RL variants from one supervised warm start, several seeds each; held-out accuracy before
and after RL, paired differences against a reference variant, the evaluation's own sampling noise, and training
dynamics with mean and spread across seeds.

    python tools/compare_algorithms.py [--study v3] [--smoke] [--output-dir DIR] [--variants LABEL ...] [--ablations]
        [--seeds 1 2 ...] [--steps N] [--jobs 2] [--eval-samples N] [--pass-k 1 4 ...] [--heldout-problems N]
        [--noise-seeds S ...] [--report PATH] [--config PATH] [--set key=value ...] [--warm-start DIR]

Studies (STUDIES): `v1`, GRPO / DAPO / GTPO / GRPO-S (and, with --ablations, GTPO / GRPO-S ablations) on
scratchpad addition (examples/algorithm_study.yaml, benchmarks/results/algorithms.md); `v2`, the entropy-method
family on the arithmetic-target task (examples/algorithm_study_v2.yaml, benchmarks/results/algorithms_v2.md); `v3`,
the pre-registered test of v2's lead: GRPO-S and GTPO against DAPO without its overlong penalty, 10 fresh seeds,
150 steps, from the warm start shipped in examples/warm_starts/ (examples/algorithm_study_v3.yaml,
benchmarks/results/algorithms_v3.md). `--smoke` shrinks a study to seconds (2 RL steps, 2 seeds, 2 variants, 4
held-out problems, 4 samples): it checks the tool, not the algorithms.

1. The warm start every RL run starts from, so all variants and seeds start from the same policy. A study with a
   shipped one (v3: `ShippedWarmStart`) checks the SHA-256 of its files first and refuses, in one line, to run from
   anything else (`--warm-start DIR`: a copy of it, checked the same way); the others train one: a warm-start-only
   run (`steps: 0`, warm_start.steps from the config; `seed` the first study seed, `data.seed` the study's
   `warm_start_data_seed` or else the first study seed) saving <output-dir>/warm_start/checkpoints/step_00000000.
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
   reference with 95% t-intervals; with the study's pre-registered hypotheses (v3), their one-sided paired t-tests,
   Holm-corrected per family, and the verdicts by the rule (`hypothesis_tests`); the sampling noise; the wall time)
   and main.png (ablations.png) with per-step curves, the mean across seeds with a band of ± one standard deviation.
   `--report PATH` also writes the tables into PATH below its REPORT_MARKER line (the text above it, written by hand,
   is kept) and the plots beside it.
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
from typing import NamedTuple

from megatron_gtpo.atomic_files import write_atomically
from megatron_gtpo.checkpoint.manifest import sha256_of
from megatron_gtpo.cli import run_cli
from megatron_gtpo.config import load_config
from megatron_gtpo.distributed import free_local_port
from megatron_gtpo.reporting import (holm_rejections, mean_and_spread, normalized_auc, paired_difference,
                                     paired_t_test, plot_bands, read_rl_metrics, window_means)

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
EXAMPLES = os.path.join(REPO, "examples")
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
class ShippedWarmStart:
    """A warm start shipped in the repository, a Hugging Face directory (config.json, model.safetensors) at `path`
    (from the repository root), pinned by the SHA-256 of each of its files: the study runs from these bytes and from
    nothing else (`verify_warm_start`). The artifact, not the recipe that made it, fixes the warm start: retrained,
    the same recipe can land elsewhere (the kernels' bits decide between its modes)."""

    path: str
    sha256: tuple[tuple[str, str], ...]  # (file name, hex digest), every file of the directory
    made_by: str  # how it was produced (the report names it)


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """A pre-registered hypothesis: `variant` - the study's reference > 0 on the held-out `endpoint` ("pass": Pass@n,
    "mean": Mean@n, n the samples per problem), tested one-sided by the paired t-test over the seeds, Holm-corrected
    within its `family` at HYPOTHESIS_ALPHA."""

    name: str
    family: str  # "primary" (confirmatory) or "secondary"
    variant: str
    endpoint: str


HYPOTHESIS_ALPHA = 0.05  # family-wise, one-sided


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
    warm_start: ShippedWarmStart | None = None  # set: no warm start is trained, the study runs from this one
    hypotheses: tuple[Hypothesis, ...] = ()  # set: the report tests them as pre-registered


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
# Study v3's warm start: trained once with study v2's config (seed 1, data.seed 2, 6000 steps, linear decay to lr 0,
# one thread), a run that landed in the mode that retries after a failed attempt; the commands, the other warm starts
# measured and the rule that chose this one: benchmarks/results/algorithms_v3.md, "Warm start".
V3_WARM_START = ShippedWarmStart(
    "examples/warm_starts/arithmetic_target",
    (("config.json", "7d32d98b95520526c03167f7aff0d89748088bf9a7e852909bd6630bdc21644c"),
     ("generation_config.json", "83c08dbde19cd5cbfad63413542542248892da229df0f6d4d5b8b390b86a9fb4"),
     ("model.safetensors", "d2c79cf685ead14abe8ba517e29a30e0dfa3049d43c7be46265cbb5796a7021f")),
    "trained with study v2's config at data.seed 2, 6000 steps, warm_start.final_lr 0, one thread, then converted "
    "by tools/convert_megatron_to_hf.py")
V3_HYPOTHESES = (Hypothesis("H1", "primary", "grpo_s", "pass"), Hypothesis("H2", "primary", "grpo_s", "mean"),
                 Hypothesis("H3", "secondary", "gtpo", "pass"), Hypothesis("H4", "secondary", "gtpo", "mean"))
STUDIES["v3"] = Study(
    os.path.join(EXAMPLES, "algorithm_study_v3.yaml"),
    # the control first; GRPO-S last, the variant --smoke runs beside the control
    (Variant("dapo-no-overlong", "dapo", ("algorithm.length_penalty=none",)), Variant("gtpo", "gtpo"),
     Variant("grpo_s", "grpo_s")),
    "dapo-no-overlong", tuple(range(11, 21)), 64, (1, 4, 16, 64), (101, 102, 103, 104), "algorithms_v3.md",
    (("accuracy", "training accuracy (outcome reward)"), *DYNAMICS), warm_start=V3_WARM_START,
    hypotheses=V3_HYPOTHESES)
# --smoke: the reference and the last variant (v2: an override on DAPO), seconds per run.
SMOKE = {"steps": 2, "seeds": [1, 2], "eval_samples": 4, "pass_k": [1, 2, 4], "heldout_problems": 4,
         "noise_seeds": [101], "overrides": ["warm_start.steps=3", "data.prompts_per_step=4"]}


class Timed(NamedTuple):
    wall_s: float
    cpu_s: float  # the process's user + system time: its wall time on an idle core, whatever else shares the machine


def _run(cmd: list[str], log_path: str, tries: int = 3) -> Timed:
    """One process on one thread, its own rendezvous port; output to a log file (named in the error if it fails).
    Returns its wall and CPU seconds. A port taken by another process between `free_local_port` and the child's bind
    is retried on a new port (`tries` in all); any other failure is raised."""
    for _ in range(tries):
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_local_port()))
        start = time.monotonic()
        with open(log_path, "w", encoding="utf-8") as log:
            child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            _, status, usage = os.wait4(child.pid, 0)  # this child's own resource usage (other runs go at once)
            child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode == 0:
            return Timed(time.monotonic() - start, usage.ru_utime + usage.ru_stime)
        with open(log_path, encoding="utf-8") as log:
            tail = log.read()[-3000:]
        if "EADDRINUSE" not in tail and "address already in use" not in tail.lower():
            break
    raise RuntimeError(f"{' '.join(cmd)} failed (status {child.returncode}; log {log_path}):\n{tail}")


def _times_record(train: Timed | None, evaluation: Timed) -> dict:
    """run.json's times: wall seconds (train_s, eval_s) and CPU seconds (train_cpu_s, eval_cpu_s)."""
    train = train or Timed(0.0, 0.0)
    return {"train_s": train.wall_s, "eval_s": evaluation.wall_s, "train_cpu_s": train.cpu_s,
            "eval_cpu_s": evaluation.cpu_s}


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


def verify_warm_start(path: str, shipped: ShippedWarmStart) -> None:
    """Returns when the directory `path` holds exactly the shipped warm start's files, byte for byte (their SHA-256);
    otherwise ValueError in one line: the study refuses to run from another warm start."""
    refusal = (f"study RL runs start only from the warm start shipped as {shipped.path} (its SHA-256 is pinned in "
               "tools/compare_algorithms.py); refusing to go on from another one")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"warm start {path}: no such directory; {refusal}")
    pinned = dict(shipped.sha256)
    names = sorted(os.listdir(path))
    if names != sorted(pinned):
        raise ValueError(f"warm start {path} holds {names}, not the files {sorted(pinned)}; {refusal}")
    for name, digest in shipped.sha256:
        found = sha256_of(os.path.join(path, name))
        if found != digest:
            raise ValueError(f"warm start {path}: {name} has SHA-256 {found}, not {digest}; {refusal}")


def _prepare_warm_start(args, warm_dir: str) -> list[str]:
    """The warm start every RL run starts from, and its evaluation with each seed's sampling seed ("before"): the
    study's shipped one, verified first (`--warm-start`: a copy of it), or one trained here once. Returns the RL
    runs' model settings."""
    shipped, done = args.study.warm_start, os.path.join(warm_dir, DONE_FILE)
    if shipped is not None:
        model = os.path.abspath(args.warm_start or os.path.join(REPO, shipped.path))
        verify_warm_start(model, shipped)
        earlier = _read_json(done).get("sha256") if os.path.exists(done) else dict(shipped.sha256)
        if earlier != dict(shipped.sha256):
            raise ValueError(f"--output-dir {os.path.dirname(warm_dir)} holds runs from another warm start "
                             f"({DONE_FILE} of warm_start/: {earlier}); use another output directory")
        sets = [f"model.hf_dir={model}", "model.tiny_synthetic=false"]
    else:
        model = os.path.join(warm_dir, "checkpoints", "step_00000000")
        sets = [f"model.load={model}", "model.tiny_synthetic=false"]
    os.makedirs(warm_dir, exist_ok=True)
    if os.path.exists(done):
        return sets
    train = None
    if shipped is None:
        print("== warm start: training", flush=True)
        pinned = args.study.warm_start_data_seed
        seeds = [f"seed={args.seeds[0]}", f"data.seed={args.seeds[0] if pinned is None else pinned}"]
        train = _run(_train_command(args, warm_dir, ["steps=0", *seeds]), os.path.join(warm_dir, "train.log"))
    evaluation = _run(_eval_command(args, model, [os.path.join(warm_dir, f"seed{s}_{EVAL_FILE}")
                                                  for s in args.seeds], args.seeds), os.path.join(warm_dir, "eval.log"))
    _write_json(done, {**_times_record(train, evaluation),
                       **({"sha256": dict(shipped.sha256), "path": model} if shipped else {})})
    print(f"== warm start: {f'trained in {train.wall_s:.0f} s' if train else 'verified'}, evaluated with "
          f"{len(args.seeds)} sampling seeds in {evaluation.wall_s:.0f} s", flush=True)
    return sets


def run_study(args, variants: list[Variant]) -> None:
    """The warm start (verified or trained) and its evaluation, then every unfinished (variant, seed) run and its
    evaluation."""
    root = os.path.abspath(args.output_dir)
    warm_dir = os.path.join(root, "warm_start")
    rl_sets = [*_prepare_warm_start(args, warm_dir), "warm_start.steps=0", f"steps={args.steps}"]
    todo = [(v, s) for v in variants for s in args.seeds
            if not os.path.exists(os.path.join(root, v.dirname, f"seed{s}", DONE_FILE))]
    total, lock, finished = len(variants) * len(args.seeds), threading.Lock(), [0]
    print(f"== {total - len(todo)} of {total} RL runs finished already; {len(todo)} to run, {args.jobs} at once",
          flush=True)

    def rl_run(variant: Variant, seed: int) -> None:
        out = os.path.join(root, variant.dirname, f"seed{seed}")
        os.makedirs(out, exist_ok=True)
        train = _run(_train_command(args, out, [*rl_sets, f"algorithm.name={variant.algorithm}",
                                                  *variant.overrides, f"seed={seed}", f"data.seed={seed}"]),
                       os.path.join(out, "train.log"))
        with open(os.path.join(out, "checkpoints", "latest"), encoding="utf-8") as f:
            final = os.path.join(out, "checkpoints", f.read().strip())
        seeds = [seed, *(args.noise_seeds if (variant.label, seed) == (args.reference, args.seeds[0]) else ())]
        outputs = [os.path.join(out, EVAL_FILE if s == seed else f"noise_seed{s}_{EVAL_FILE}") for s in seeds]
        evaluation = _run(_eval_command(args, final, outputs, seeds), os.path.join(out, "eval.log"))
        _write_json(os.path.join(out, DONE_FILE), {**_times_record(train, evaluation), "steps": args.steps})
        n = args.eval_samples
        after = _read_json(os.path.join(out, EVAL_FILE))[f"mean@{n}"]
        before = _read_json(os.path.join(warm_dir, f"seed{seed}_{EVAL_FILE}"))[f"mean@{n}"]
        with lock:
            finished[0] += 1
            print(f"[{total - len(todo) + finished[0]}/{total}] {variant.label} seed {seed}: {args.steps} steps in "
                  f"{train.wall_s:.0f} s ({train.wall_s / max(args.steps, 1):.1f} s/step incl. start; "
                  f"{train.cpu_s:.0f} CPU s), evaluated in {evaluation.wall_s:.0f} s ({evaluation.cpu_s:.0f} CPU s); "
                  f"held-out Mean@{n} {before:.3f} -> {after:.3f}", flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        for future in [pool.submit(rl_run, v, s) for v, s in todo]:
            future.result()


def _cell(values: list[float], digits: int = 3) -> str:
    mean, spread = mean_and_spread(values)
    return "—" if mean != mean else f"{mean:.{digits}f} ± {spread:.{digits}f}"  # NaN: not logged by this variant


def _dynamics_columns(args) -> list[tuple[str, str]]:
    """The training-dynamics table's metrics: the study's plotted ones but the training accuracy (its AUC is a column
    of the accuracy table)."""
    return [(key, name) for key, name in args.study.panels if key != "accuracy"]


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
            for key, _ in _dynamics_columns(args):
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
                          for key, _ in _dynamics_columns(args))] for label, per_seed in scalars.items()]
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
            + _table(["variant", *(name for _, name in _dynamics_columns(args))], dynamics) + "\n")


def hypothesis_tests(args, scalars: dict) -> str:
    """The pre-registered analysis (Study.hypotheses): per hypothesis the per-seed differences variant - reference of
    its held-out endpoint, their mean with its two-sided 95% t-interval, the one-sided paired t-test, Holm's procedure
    within its family at HYPOTHESIS_ALPHA (family-wise), and the verdict by the rule: "supported" where Holm rejects
    "difference <= 0", else "not supported" (adding "the reference is better" where the 95% interval lies below 0).
    Hypotheses whose variant did not run (--variants, --smoke) are listed as not tested."""
    n, ref = args.eval_samples, [s["after"] for s in scalars[args.reference]]
    endpoints = {"pass": (f"pass@{n}", f"Pass@{n}"), "mean": (f"mean@{n}", f"Mean@{n}")}
    families: dict[str, list] = {}
    for h in args.study.hypotheses:
        key = endpoints[h.endpoint][0]
        test = paired_t_test([s["after"][key] for s in scalars[h.variant]], [r[key] for r in ref]) \
            if h.variant in scalars else None
        families.setdefault(h.family, []).append((h, test))
    rows, per_seed, verdicts = [], [], []
    for family, members in families.items():
        tested = [(h, test) for h, test in members if test is not None]
        rejected = dict(zip([h.name for h, _ in tested], holm_rejections([t.p_value for _, t in tested],
                                                                          HYPOTHESIS_ALPHA)))
        by_p = sorted(tested, key=lambda item: item[1].p_value)
        for h, test in members:
            contrast = f"{h.variant} - {args.reference}"
            name = endpoints[h.endpoint][1]
            if test is None:
                rows.append([h.name, family, contrast, name, *["—"] * 7, "not tested (variant not run)"])
                continue
            level = HYPOTHESIS_ALPHA / (len(tested) - [x for x, _ in by_p].index(h))
            verdict = "supported" if rejected[h.name] else "not supported" + (
                "; the reference is better (95% interval below 0)" if test.mean + test.half_width < 0 else "")
            rows.append([h.name, family, contrast, name, str(test.pairs),
                         f"{test.mean:+.4f} [{test.mean - test.half_width:+.4f}, {test.mean + test.half_width:+.4f}]",
                         f"{test.t:+.2f} ({test.pairs - 1})", f"{test.p_value:.4f}", f"{level:.4f}",
                         f"{test.detectable(HYPOTHESIS_ALPHA / len(tested)):.4f}",
                         "yes" if rejected[h.name] else "no", verdict])
            key = endpoints[h.endpoint][0]
            per_seed.append([h.name, *(f"{s['after'][key] - r[key]:+.3f}" for s, r in zip(scalars[h.variant], ref))])
            verdicts.append(f"{h.name} ({family}, {contrast} on {name} > 0): **{verdict}**.")
    header = ["hypothesis", "family", "difference", "endpoint", "pairs", "mean [95% interval]", "t (df)",
              "one-sided p", "Holm level", "detectable at 80%", "H0 rejected", "verdict"]
    return (f"### Pre-registered tests\n\nPer hypothesis: the per-seed paired differences of the held-out endpoint "
            f"(variant - {args.reference} at the same seed), their mean with its two-sided 95% t-interval, the "
            f"one-sided paired t-test of mean > 0 (t = mean / (sd / sqrt(n)), n - 1 degrees of freedom), Holm's "
            f"procedure within each family at family-wise alpha = {HYPOTHESIS_ALPHA} (one-sided; the level each "
            "p-value is compared with, in the order of the p-values, stopping at the first not rejected), and the "
            "smallest true difference this spread detects with 80% power at the family's first Holm level. "
            "Verdict: supported where H0 (difference <= 0) is rejected, else not supported.\n\n"
            + _table(header, rows) + "\n\nThe per-seed differences (seeds " + f"{list(args.seeds)}):\n\n"
            + _table(["hypothesis", *(f"seed {s}" for s in args.seeds)], per_seed) + "\n\n"
            + "\n".join(f"- {v}" for v in verdicts) + "\n")


def _times(args, scalars: dict, evaluations: dict, wall_s: float) -> str:
    warm = evaluations["warm_start_times"]
    runs = [s for per_seed in scalars.values() for s in per_seed]
    train = sum(s["train_s"] for s in runs)
    evaluation = sum(s["eval_s"] for s in runs)
    one_pass = warm["train_s"] + warm["eval_s"] + (train + evaluation) / args.jobs
    made = "shipped" if args.study.warm_start else f"{warm['train_s']:.0f} s"
    text = (f"Wall time of this invocation {wall_s / 60:.1f} min on {platform.machine()} with {os.cpu_count()} CPUs "
            f"({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC). Recorded run times: warm start "
            f"{made} + its evaluation {warm['eval_s']:.0f} s; {len(runs)} RL runs "
            f"{train / len(runs):.0f} s training + {evaluation / len(runs):.0f} s evaluation each on average; "
            f"{one_pass / 60:.1f} min for the whole study at {args.jobs} runs at once (the sum, a resumed study "
            "included).")
    if all("train_cpu_s" in s for s in (warm, *runs)):  # recorded since the CPU times were
        cpu = [s["train_cpu_s"] + s["eval_cpu_s"] for s in runs]
        idle = warm["train_cpu_s"] + warm["eval_cpu_s"] + sum(cpu) / args.jobs
        text += (f" CPU time (one thread each, whatever else shared the machine): {sum(cpu) / len(cpu):.0f} s per "
                 f"RL run with its evaluation; {idle / 60:.1f} min for the whole study on {args.jobs} idle cores.")
    return text


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
    shipped = args.study.warm_start
    warm = "" if shipped is None else (
        f"Warm start: {shipped.path} ({', '.join(f'{name} SHA-256 {digest}' for name, digest in shipped.sha256)}; "
        f"verified before any run), {shipped.made_by}.\n\n")
    text = (f"Command: `{' '.join(['python', 'tools/compare_algorithms.py', *sys.argv[1:]])}`\n\n"
            f"Config {os.path.relpath(args.config)} with {args.overrides or 'no overrides'}; {args.steps} RL steps; "
            f"seeds {list(args.seeds)}; variants ({settings}); reference {args.reference}.\n\n{warm}"
            f"{_times(args, scalars, evaluations, wall_s)}\n\n"
            + (hypothesis_tests(args, scalars) + "\n" if args.study.hypotheses else "")
            + tables(args, scalars, evaluations))

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
    p.add_argument("--warm-start", default=None, help="a copy of the study's shipped warm start (v3; its SHA-256 is "
                                                      "checked) instead of the repository's")
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
    if args.warm_start and study.warm_start is None:
        p.error(f"--warm-start: study {name} trains its own warm start; only a study with a shipped one takes it")
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
