"""One RL step side by side with a peer: TRL's `GRPOTrainer` against megatron_gtpo (GRPO and GTPO) on one CPU, the
same model directory, prompts, reward, sampling, group size, lengths, learning rate and thread count, A B A B.

    make setup-peers      # once: .venv-peers, this package with TRL 1.16 (setup.py's "peers" extra) and the CPU torch
    .venv-peers/bin/python benchmarks/peer_bench.py [--rounds 5] [--warmup 1] [--rows trl trl_defaults grpo gtpo]
        [--work-dir runs/peer_bench] [--output benchmarks/results/peers.md]

TRL lives in a venv of its own so that the main install and `make test` never see it; both sides run in that venv
(the same torch, transformers and tokenizers). Rows:
  trl           TRL's GRPOTrainer set to match: fp32 (bf16 off), no gradient checkpointing, loss_type "grpo" (the
                per-sequence token mean, averaged over sequences: our GRPO's seq-mean-token-mean; LOSS_TYPES), our
                GRPO's clip range, group-std reward scaling, a constant learning rate, beta 0 (no KL)
  trl_defaults  TRL with its own defaults for everything but the workload: bf16 mixed precision, gradient
                checkpointing, loss_type "dapo", a linear learning-rate decay
  grpo, gtpo    megatron_gtpo's trainer (python -m megatron_gtpo.train's main, unchanged) with the built-in engine, one
                process, TP 1; GTPO with dynamic sampling off, so that every step generates the same 16 x 8 responses
                (GTPO does strictly more work than GRPO: entropy-shaped advantages)
The workload (Workload; both sides' settings are built from it, `ours_overrides` and `trl_settings`): a random-init
Qwen2-shaped model (transformers' own initialisation, seed 0: near-uniform logits, so almost every response runs the
full length) saved once with a byte-level BPE tokenizer trained here on the bundled MATH-500 text (nothing is
downloaded); the 16 shortest MATH-500 problems (by characters: 72-88 tokens with the markup; long prompts make both
sides' steps minutes long on 2 cores) in Qwen2.5's chat markup with the boxed-answer instruction, the same text and
token ids on both sides (plain prompts: neither side adds markup); 8 responses each, temperature 1, no top-p / top-k, at
most 64 new tokens, stopping at the tokenizer's EOS; one optimizer step per batch (micro-batches of --micro-batch
sequences accumulated: TRL's per_device_train_batch_size x gradient_accumulation_steps = 128, one generation per
optimizer step, so TRL takes its old log-probs from the update's own forward); Adam at lr 1e-6, gradient clipping 1.0,
no weight decay, no KL term. The reward, on both sides: `coin_reward`, a deterministic binary reward of the response
text (its CRC-32 parity, special tokens removed) standing in for a verifier: it costs microseconds and marks about half
the responses correct on a random model, so almost every group carries signal; the reward's cost is not what is
compared.

Fairness: each row runs in a process of its own (spawned, OMP_NUM_THREADS / MKL_NUM_THREADS and
torch.set_num_threads set to --threads), all started at once and held at a gate between steps; the driver lets one
step of one row run at a time, rotating the order each round (A B C D, B C D A, ...), so that the rows' steps of a
round are measured minutes apart and load drifts hit all alike. The first --warmup rounds are dropped. Per step:
  step          wall time from the gate's opening to the step's end (everything between two steps: generation,
                scoring, the passes, the optimizer, logging)
  generation    ours: the trainer's time_generate_s (the built-in engine: prompt ids in, sampled response ids out,
                KV cache, all 128 rows at once); TRL: GRPOTrainer._generate_single_turn (left-padded prompt ids in,
                transformers' generate with its KV cache on all 128 rows at once, the EOS mask, response ids out)
  rest          step - generation
  tokens/s      response tokens generated in the step / step time (and / generation time)
  peak RSS      the process's peak resident memory (getrusage) at the end of the measured steps
and the phases: ours from metrics.jsonl (time_reward_s, time_old_logprob_s, time_advantages_s, time_update_s,
time_sync_s), TRL's from its methods (scoring: _generate_and_score_completions less the generation, i.e. decoding, the
reward, advantages; forward: compute_loss; backward + optimizer + the rest: what is left). Ratios (targets: GRPO
step <= 0.85x TRL's, GTPO step <= 1.0x TRL's GRPO step) are per round, between steps of one round, and their median
over the rounds is reported.

Resumable: every measured round is appended to <work dir>/records-<run id>.jsonl as it ends (the run id: the settings
and the commit); a rerun with the same settings at the same commit starts fresh workers, warms them up and adds rounds
until --rounds are recorded (--fresh starts over). The model directory and prompts are built once in <work dir>/assets
and reused while the workload's shape is unchanged. --output gets (or has replaced) this run's section, with the
command, the machine's load (uptime at start and end, the 1-minute load average of every step) and the versions.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))  # tests/tokenizer_dirs.py, tests/tiny_models.py: the tiny builders

ROWS = {
    "trl": "TRL GRPOTrainer, matched (fp32, loss grpo, no checkpointing)",
    "trl_defaults": "TRL GRPOTrainer, its defaults (bf16, loss dapo, gradient checkpointing)",
    "grpo": "megatron_gtpo GRPO (built-in engine, TP 1)",
    "gtpo": "megatron_gtpo GTPO (built-in engine, TP 1)",
}
# (numerator row, denominator row, target of the step-time ratio or None)
RATIOS = (("grpo", "trl", 0.85), ("gtpo", "trl", 1.0), ("grpo", "trl_defaults", None),
          ("gtpo", "trl_defaults", None), ("trl_defaults", "trl", None))
# Our token losses' aggregation -> TRL's loss_type that computes the same loss for an optimizer step whose
# micro-batches hold equally many sequences: "grpo" averages each sequence's token mean over the micro-batch and
# divides by the accumulation steps (= the mean over the step's sequences); "dapo" divides the token sum by the step's
# valid tokens.
LOSS_TYPES = {"seq-mean-token-mean": "grpo", "token-mean": "dapo"}
OUR_PHASES = ("generate", "reward", "old_logprob", "advantages", "update", "sync")
TRL_PHASES = ("generate", "score", "forward")


@dataclass(frozen=True)
class Workload:
    """What both sides run: the model's shape, the batch, the sampling, the optimizer and the threads."""

    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 1408
    vocab: int = 8192  # the BPE's target size; the model's vocabulary is the tokenizer's actual size
    prompts: int = 16
    group: int = 8
    max_new_tokens: int = 64
    micro_batch: int = 32
    lr: float = 1e-6
    grad_clip: float = 1.0
    threads: int = 2
    seed: int = 0

    @property
    def sequences(self) -> int:
        return self.prompts * self.group

    def check(self) -> None:
        if self.sequences % self.micro_batch:
            raise SystemExit(f"peer_bench: --micro-batch {self.micro_batch} must divide the step's "
                             f"{self.prompts} x {self.group} = {self.sequences} sequences (TRL accumulates equal "
                             f"micro-batches)")


# ------------------------------------------------------------------------------------------- both sides' settings


def grpo_loss_settings() -> dict:
    """Our GRPO's loss settings from the algorithm registry (the only place they are written)."""
    from megatron_gtpo.algorithms.registry import ALGORITHMS, Algorithm

    return ALGORITHMS[Algorithm.GRPO].loss_defaults


def ours_overrides(w: Workload, algorithm: str, *, model_dir: str, prompts_path: str, output_dir: str,
                   steps: int) -> list[str]:
    """`--set` overrides of megatron_gtpo.train (on the default config) for `algorithm` under workload `w`."""
    return [f"{key}={value}" for key, value in {
        "steps": steps, "seed": w.seed, "model.hf_dir": model_dir, "model.dtype": "float32",
        "model.recompute_activations": "false", "parallel.tensor": 1, "parallel.pipeline": 1,
        "rollout.engine": "builtin", "rollout.num_responses_per_prompt": w.group, "rollout.temperature": 1.0,
        "rollout.top_p": 1.0, "rollout.top_k": 0, "rollout.max_new_tokens": w.max_new_tokens,
        "algorithm.name": algorithm, "algorithm.kl_coef": 0.0, "algorithm.dynamic_sampling": "false",
        "optim.lr": w.lr, "optim.lr_decay_style": "constant", "optim.warmup_steps": 0, "optim.weight_decay": 0.0,
        "optim.grad_clip": w.grad_clip, "data.source": "jsonl", "data.path": prompts_path,
        "data.prompt_field": "prompt", "data.answer_field": "answer", "data.template": "plain",
        "data.prompts_per_step": w.prompts, "data.micro_batch_size": w.micro_batch, "data.mini_batches_per_step": 1,
        "data.epochs_per_step": 1, "data.seed": w.seed, "warm_start.steps": 0, "checkpoint.save_every": -1,
        "checkpoint.resume": "false", "logging.output_dir": output_dir, "logging.tensorboard": "false",
        "logging.progress_bar": "false"}.items()]


def trl_settings(w: Workload, *, matched: bool, output_dir: str, steps: int) -> dict:
    """GRPOConfig's keyword arguments for workload `w`: the workload always; with `matched`, also fp32, our GRPO's
    loss (LOSS_TYPES) and clip range, group-std scaling, a constant learning rate and no gradient checkpointing;
    otherwise TRL's defaults for those."""
    settings = dict(
        output_dir=output_dir, max_steps=steps, seed=w.seed, data_seed=w.seed, use_cpu=True, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        num_generations=w.group, per_device_train_batch_size=w.micro_batch,
        gradient_accumulation_steps=w.sequences // w.micro_batch, num_iterations=1,
        max_completion_length=w.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, learning_rate=w.lr,
        max_grad_norm=w.grad_clip, weight_decay=0.0, warmup_steps=0, beta=0.0, use_vllm=False,
        model_init_kwargs={"dtype": "float32"})
    if matched:
        loss = grpo_loss_settings()
        settings.update(bf16=False, fp16=False, gradient_checkpointing=False,
                        loss_type=LOSS_TYPES[loss["loss_agg_mode"]], epsilon=loss["clip"].eps_low,
                        epsilon_high=loss["clip"].eps_high, scale_rewards="group", lr_scheduler_type="constant")
    return settings


def coin_reward(text: str, special_tokens: tuple[str, ...]) -> float:
    """1.0 or 0.0 from the CRC-32 parity of `text` without `special_tokens` (TRL decodes without them, our trainer
    with them): the same reward for the same response on both sides."""
    for token in special_tokens:
        text = text.replace(token, "")
    return float(zlib.crc32(text.encode("utf-8")) & 1)


# ------------------------------------------------------------------------------------------------- the assets


def build_assets(directory: str, w: Workload) -> dict:
    """The model directory (random-init Qwen2 with its tokenizer) and the prompts file under `directory`, built once
    for the workload's shape and reused while it is unchanged. Returns their paths and sizes."""
    from megatron_gtpo.atomic_files import write_atomically

    shape = {"builder": 3, **{k: getattr(w, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate",
                                                          "vocab", "prompts", "seed")}}
    marker = os.path.join(directory, "assets.json")
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            built = json.load(f)
        if built["shape"] == shape:
            return built
    import torch
    import transformers
    from tiny_models import tiny_config
    from tokenizer_dirs import SPECIAL_TOKENS, build_hf_tokenizer_dir

    from megatron_gtpo.data.datasets import EVAL_SETS_DIR, load_dataset
    from megatron_gtpo.data.templates import DATA_TEMPLATES
    from megatron_gtpo.data.tokenizer import load_tokenizer

    model_dir, prompts_path = os.path.join(directory, "model"), os.path.join(directory, "prompts.jsonl")
    records = load_dataset("math500")
    with open(os.path.join(EVAL_SETS_DIR, "math500.jsonl"), encoding="utf-8") as f:  # problems and solutions
        corpus = [json.loads(line)[key] for line in f if line.strip() for key in ("problem", "solution", "answer")]
    build_hf_tokenizer_dir(model_dir, vocab_size=w.vocab, corpus=corpus)
    tokenizer = load_tokenizer(model_dir)
    config = tiny_config("qwen2", vocab_size=tokenizer.vocab_size, hidden_size=w.hidden,
                         intermediate_size=w.intermediate, num_layers=w.layers, num_heads=w.heads,
                         num_kv_heads=w.kv_heads, max_positions=1024)
    if (config.eos_token_id, config.pad_token_id) != (tokenizer.eos_token_id, tokenizer.pad_token_id):
        raise RuntimeError(f"the model's EOS / pad ids {config.eos_token_id} / {config.pad_token_id} are not the "
                           f"tokenizer's {tokenizer.eos_token_id} / {tokenizer.pad_token_id}")
    torch.manual_seed(w.seed)
    transformers.Qwen2ForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)
    # Again, as both sides load it: with the model's config.json beside it, transformers reads the tokenizer as a
    # Qwen2 tokenizer (its own pre-tokenizer), which splits some prompts into other tokens.
    tokenizer = load_tokenizer(model_dir)
    template = DATA_TEMPLATES["chat"]  # rendered here: both sides then read plain prompts
    lines = [json.dumps({"id": r.id, "prompt": template.render(r.problem, tokenizer), "answer": r.answer})
             for r in sorted(records, key=lambda r: len(r.problem))[:w.prompts]]
    write_atomically(prompts_path, "\n".join(lines) + "\n")
    lengths = [len(tokenizer.encode(json.loads(line)["prompt"])) for line in lines]
    built = {"shape": shape, "model_dir": model_dir, "prompts_path": prompts_path, "model_vocab": tokenizer.vocab_size,
             "prompt_tokens": lengths, "special_tokens": list(SPECIAL_TOKENS)}
    write_atomically(marker, json.dumps(built, indent=1))
    return built


# ------------------------------------------------------------------------------------------------- the workers


class Gate:
    """A worker's side of the driver's turns: `open` says the worker is ready and waits for its first turn,
    `step_done` sends a step's record and waits for the next turn (not after the last step)."""

    def __init__(self, conn, steps: int):
        self.conn, self.steps = conn, steps
        self.started = 0.0
        self.seconds: dict[str, float] = {}
        self.tokens = 0

    def open(self) -> None:
        self.conn.send(("ready", None))
        self._wait()

    def _wait(self) -> None:
        if self.conn.recv() == "stop":
            os._exit(0)  # nothing to save: a benchmark run writes no checkpoint
        self.seconds, self.tokens = {}, 0
        self.started = time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def step_done(self, step: int, seconds: dict[str, float], tokens: float) -> None:
        import resource

        wall_s = time.perf_counter() - self.started
        self.conn.send(("step", {"step": step, "wall_s": wall_s, "phases": seconds, "tokens": tokens,
                                 "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                                 "load1": os.getloadavg()[0]}))
        if step + 1 < self.steps:
            self._wait()


def _start_worker(log_path: str, threads: int):
    """The worker's output to its log file; the thread count before torch runs anything."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    import torch

    torch.set_num_threads(threads)


def _timed(gate: Gate, phase: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            gate.add(phase, time.perf_counter() - start)
    return wrapper


def trl_worker(conn, spec: dict) -> None:
    _start_worker(spec["log"], spec["threads"])
    try:
        import datasets
        import trl
        from transformers import AutoTokenizer, TrainerCallback

        gate = Gate(conn, spec["steps"])
        specials = tuple(spec["special_tokens"])

        def coin(completions, **kwargs):
            return [coin_reward(text, specials) for text in completions]

        with open(spec["prompts_path"], encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
        trainer = trl.GRPOTrainer(model=spec["model_dir"], reward_funcs=coin, args=trl.GRPOConfig(**spec["settings"]),
                                  train_dataset=dataset,
                                  processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]))
        generate = trainer._generate_single_turn

        def generate_counted(*args, **kwargs):
            start = time.perf_counter()
            completion_ids, logprobs = generate(*args, **kwargs)
            gate.add("generate", time.perf_counter() - start)
            gate.tokens += sum(len(ids) for ids in completion_ids)
            return completion_ids, logprobs

        trainer._generate_single_turn = generate_counted
        trainer._generate_and_score_completions = _timed(gate, "generate_and_score",
                                                         trainer._generate_and_score_completions)
        trainer.compute_loss = _timed(gate, "forward", trainer.compute_loss)

        class Turns(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                gate.open()

            def on_step_end(self, args, state, control, **kwargs):
                seconds = dict(gate.seconds)
                seconds["score"] = seconds.pop("generate_and_score", 0.0) - seconds.get("generate", 0.0)
                gate.step_done(state.global_step - 1, seconds, gate.tokens)

        trainer.add_callback(Turns())
        trainer.train()
    except BaseException:
        import traceback

        conn.send(("error", traceback.format_exc()))
        raise


def ours_worker(conn, spec: dict) -> None:
    _start_worker(spec["log"], spec["threads"])
    try:
        import megatron_gtpo.training.trainer as trainer_module
        from megatron_gtpo.train import main
        from megatron_gtpo.training.metrics import MetricsLogger

        gate = Gate(conn, spec["steps"])
        specials = tuple(spec["special_tokens"])
        build_task, train, log = trainer_module.build_task, trainer_module.Trainer.train, MetricsLogger.log

        def build_task_with_coin(cfg):
            task = build_task(cfg)
            task.rewards = lambda texts, references: [coin_reward(text, specials) for text in texts]
            return task

        def gated_train(trainer):
            gate.open()
            train(trainer)

        def gated_log(logger, step, metrics):
            log(logger, step, metrics)
            if step >= 0:  # an RL step's line
                seconds = {phase: metrics.get(f"time_{phase}_s", 0.0) for phase in OUR_PHASES}
                gate.step_done(step, seconds, metrics["tokens_per_s"] * sum(seconds.values()))

        trainer_module.build_task, trainer_module.Trainer.train, MetricsLogger.log = \
            build_task_with_coin, gated_train, gated_log
        main(spec["train_argv"])
    except BaseException:
        import traceback

        conn.send(("error", traceback.format_exc()))
        raise


# ------------------------------------------------------------------------------------------------- the driver


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Workload()
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (one step of every row each)")
    p.add_argument("--warmup", type=int, default=1, help="rounds dropped at each start of the workers")
    for field in dataclasses.fields(Workload):
        p.add_argument(f"--{field.name.replace('_', '-')}", type=type(getattr(defaults, field.name)),
                       default=getattr(defaults, field.name))
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "peer_bench"))
    p.add_argument("--output", help="write (or replace) this run's section in this markdown file")
    p.add_argument("--fresh", action="store_true", help="drop the rounds recorded for these settings")
    p.add_argument("--step-timeout", type=float, default=1800.0, help="seconds one step of one row may take")
    return p.parse_args(argv)


def git_commit() -> str:
    def git(*args):
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return commit + (" (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")


def run_id(args, w: Workload, commit: str) -> str:
    settings = {"workload": dataclasses.asdict(w), "rows": args.rows, "warmup": args.warmup, "commit": commit}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def read_rounds(path: str, rows: list[str]) -> list[dict]:
    """The complete rounds recorded in `path` (a round: {row: record}); a line cut by a crash is dropped."""
    rounds: dict[int, dict] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.endswith("\n"):
                    record = json.loads(line)
                    rounds.setdefault(record["round"], {})[record["row"]] = record
    return [rounds[i] for i in sorted(rounds) if set(rounds[i]) == set(rows)]


def start_workers(args, w: Workload, assets: dict, work_dir: str, steps: int) -> dict:
    import multiprocessing as mp

    spawn = mp.get_context("spawn")
    workers = {}
    for row in args.rows:
        out = os.path.join(work_dir, row)
        spec = {"log": out + ".log", "threads": w.threads, "steps": steps, "special_tokens": assets["special_tokens"],
                "model_dir": assets["model_dir"], "prompts_path": assets["prompts_path"]}
        if row.startswith("trl"):
            spec["settings"] = trl_settings(w, matched=row == "trl", output_dir=out, steps=steps)
            target = trl_worker
        else:
            overrides = ours_overrides(w, row, model_dir=assets["model_dir"], prompts_path=assets["prompts_path"],
                                       output_dir=out, steps=steps)
            spec["train_argv"] = [a for o in overrides for a in ("--set", o)]
            target = ours_worker
        conn, child = spawn.Pipe()
        process = spawn.Process(target=target, args=(child, spec), name=f"peer_bench {row}")
        process.start()
        workers[row] = (conn, process, spec["log"])
    return workers


def receive(row: str, worker, timeout: float, expected: str):
    conn, process, log = worker
    deadline = time.monotonic() + timeout
    while not conn.poll(1.0):
        if not process.is_alive() or time.monotonic() > deadline:
            reason = f"exited with {process.exitcode}" if not process.is_alive() else f"took over {timeout:g} s"
            raise RuntimeError(f"peer_bench: the {row} worker {reason}; its log: {log}\n{_tail(log)}")
    kind, payload = conn.recv()
    if kind == "error":
        raise RuntimeError(f"peer_bench: the {row} worker failed (log {log}):\n{payload}")
    if kind != expected:
        raise RuntimeError(f"peer_bench: the {row} worker sent {kind!r}, expected {expected!r}")
    return payload


def _tail(path: str, chars: int = 4000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def stop_workers(workers: dict) -> None:
    for conn, process, _ in workers.values():
        if process.is_alive():
            try:
                conn.send("stop")
            except OSError:
                pass
    for _, process, _ in workers.values():
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    w = Workload(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Workload)})
    w.check()
    if any(row.startswith("trl") for row in args.rows):
        try:
            import trl  # noqa: F401
        except ImportError:
            print("peer_bench: TRL is not installed in this Python; run `make setup-peers` and then "
                  ".venv-peers/bin/python benchmarks/peer_bench.py", file=sys.stderr)
            return 2
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the workers inherit it before torch starts
        os.environ[name] = str(w.threads)
    commit = git_commit()
    rid = run_id(args, w, commit)
    work_dir = os.path.abspath(args.work_dir)
    os.makedirs(work_dir, exist_ok=True)
    records_path = os.path.join(work_dir, f"records-{rid}.jsonl")
    if args.fresh and os.path.exists(records_path):
        os.remove(records_path)
    done = read_rounds(records_path, args.rows)
    command = "python benchmarks/peer_bench.py " + " ".join(shlex.quote(a) for a in argv)
    context = {"command": command, "commit": commit, "run_id": rid, "uptime_start": _uptime(),
               "versions": _versions(args.rows), "machine": _machine()}
    assets = build_assets(os.path.join(work_dir, "assets"), w)
    missing = args.rounds - len(done)
    if missing > 0:
        print(f"peer_bench: {len(done)} of {args.rounds} rounds recorded (run {rid}); {args.warmup} warm-up + "
              f"{missing} to go, rows {' '.join(args.rows)}; logs in {work_dir}", file=sys.stderr, flush=True)
        workers = start_workers(args, w, assets, work_dir, steps=args.warmup + missing)
        try:
            for row, worker in workers.items():
                receive(row, worker, args.step_timeout, "ready")
            next_round = max((r[args.rows[0]]["round"] for r in done), default=-1) + 1
            for i in range(args.warmup + missing):
                k = i % len(args.rows)
                records = {}
                for row in args.rows[k:] + args.rows[:k]:
                    workers[row][0].send("go")
                    records[row] = receive(row, workers[row], args.step_timeout, "step")
                    print(f"peer_bench: round {i + 1}/{args.warmup + missing}: {row} {records[row]['wall_s']:.1f} s",
                          file=sys.stderr, flush=True)
                if i < args.warmup:
                    continue
                with open(records_path, "a", encoding="utf-8") as f:
                    for row, record in records.items():
                        f.write(json.dumps({"round": next_round, "row": row, **record}) + "\n")
                next_round += 1
                done = read_rounds(records_path, args.rows)
                if args.output:
                    write_section(args.output, rid, report(args, w, assets, done, context))
        finally:
            stop_workers(workers)
    context["uptime_end"] = _uptime()
    text = report(args, w, assets, done, context)
    print(text)
    if args.output:
        write_section(args.output, rid, text)
    return 0


# ------------------------------------------------------------------------------------------------- the report


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _versions(rows: list[str]) -> str:
    from importlib.metadata import PackageNotFoundError, version

    names = ["torch", "transformers", "megatron-core"] + (["trl", "accelerate"] if any(
        r.startswith("trl") for r in rows) else [])
    found = []
    for name in names:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return f"Python {platform.python_version()}, " + ", ".join(found)


def _machine() -> str:
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def summarize(rounds: list[dict], row: str) -> dict:
    """Medians over the rounds of one row's step records."""
    records = [r[row] for r in rounds]
    median = lambda values: statistics.median(values)  # noqa: E731
    phases = sorted({p for r in records for p in r["phases"]})
    return {"step_s": median([r["wall_s"] for r in records]),
            "generate_s": median([r["phases"]["generate"] for r in records]),
            "rest_s": median([r["wall_s"] - r["phases"]["generate"] for r in records]),
            "tokens": median([r["tokens"] for r in records]),
            "tokens_per_s": median([r["tokens"] / r["wall_s"] for r in records]),
            "generate_tokens_per_s": median([r["tokens"] / r["phases"]["generate"] for r in records]),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in records),
            "phases": {p: median([r["phases"].get(p, 0.0) for r in records]) for p in phases},
            "other_s": median([r["wall_s"] - sum(r["phases"].get(p, 0.0) for p in
                                                 (OUR_PHASES if row in ("grpo", "gtpo") else TRL_PHASES))
                               for r in records])}


def ratios(rounds: list[dict], numerator: str, denominator: str, key) -> list[float]:
    return [key(r[numerator]) / key(r[denominator]) for r in rounds]


def report(args, w: Workload, assets: dict, rounds: list[dict], context: dict) -> str:
    lengths = assets["prompt_tokens"]
    lines = [f"## {time.strftime('%Y-%m-%d')}, commit {context['commit']} (run {context['run_id']})", "",
             "Command (from the repository root, in the venv of `make setup-peers`):", "",
             f"    .venv-peers/bin/{context['command']}", "",
             f"Machine: {context['machine']}, shared with other developers' work; {context['versions']}.",
             f"Load (uptime) at the start: `{context['uptime_start']}`"
             + (f"; at the end: `{context['uptime_end']}`" if "uptime_end" in context else "") + ".", ""]
    if len(rounds) < args.rounds:
        lines += [f"PARTIAL: {len(rounds)} of {args.rounds} rounds recorded; the section is rewritten after each.", ""]
    lines += [f"Workload: random-init Qwen2 (hidden {w.hidden}, {w.layers} layers, {w.heads} heads / {w.kv_heads} KV, "
              f"FFN {w.intermediate}, vocabulary {assets['model_vocab']}, fp32), {w.prompts} prompts of "
              f"{min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}) x {w.group} responses, "
              f"temperature 1, up to {w.max_new_tokens} new tokens, micro-batches of {w.micro_batch} sequences, one "
              f"optimizer step per batch, lr {w.lr:g}, no KL, {w.threads} threads per process, one process per row. "
              f"{len(rounds)} measured rounds (one step of each row per round, the order rotated each round) after "
              f"{args.warmup} warm-up round(s); medians over the rounds.", ""]
    if not rounds:
        return "\n".join(lines + ["No round recorded yet.", ""])
    summaries = {row: summarize(rounds, row) for row in args.rows}
    lines += ["| row | step (s) | generation (s) | rest (s) | response tokens / step | tokens/s (step) | "
              "tokens/s (generation) | peak RSS (MiB) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row, s in summaries.items():
        lines.append(f"| {ROWS[row]} | {s['step_s']:.2f} | {s['generate_s']:.2f} | {s['rest_s']:.2f} | "
                     f"{s['tokens']:.0f} | {s['tokens_per_s']:.1f} | {s['generate_tokens_per_s']:.1f} | "
                     f"{s['peak_rss_mib']:.0f} |")
    lines += ["", "Ratios of step times within each round (median over rounds; the rounds' values in brackets):", "",
              "| ratio | step | generation | rest | target | verdict |", "|---|---:|---:|---:|---:|---|"]
    for numerator, denominator, target in RATIOS:
        if numerator not in summaries or denominator not in summaries:
            continue
        cells = []
        for key in (lambda r: r["wall_s"], lambda r: r["phases"]["generate"],
                    lambda r: r["wall_s"] - r["phases"]["generate"]):
            values = ratios(rounds, numerator, denominator, key)
            cells.append(f"{statistics.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})")
        step = statistics.median(ratios(rounds, numerator, denominator, lambda r: r["wall_s"]))
        verdict = "" if target is None else ("met" if step <= target else "MISSED")
        lines.append(f"| {numerator} / {denominator} | {' | '.join(cells)} | "
                     f"{'' if target is None else f'<= {target:g}'} | {verdict} |")
    ours = [row for row in args.rows if row in ("grpo", "gtpo")]
    if ours:
        lines += ["", "Our phases (s, median; metrics.jsonl's time_*_s; other: the step's wall time outside them):",
                  "", "| row | " + " | ".join(OUR_PHASES) + " | other |", "|---|" + "---:|" * (len(OUR_PHASES) + 1)]
        for row in ours:
            s = summaries[row]
            lines.append(f"| {row} | " + " | ".join(f"{s['phases'].get(p, 0.0):.2f}" for p in OUR_PHASES)
                         + f" | {s['other_s']:.2f} |")
    peers = [row for row in args.rows if row.startswith("trl")]
    if peers:
        lines += ["", "TRL's phases (s, median): generate (_generate_single_turn), score (the rest of "
                      "_generate_and_score_completions: tokenizing, decoding, the reward, advantages), forward "
                      "(compute_loss over the micro-batches), other (backward, optimizer, the rest):", "",
                  "| row | " + " | ".join(TRL_PHASES) + " | other |", "|---|" + "---:|" * (len(TRL_PHASES) + 1)]
        for row in peers:
            s = summaries[row]
            lines.append(f"| {row} | " + " | ".join(f"{s['phases'].get(p, 0.0):.2f}" for p in TRL_PHASES)
                         + f" | {s['other_s']:.2f} |")
    loads = [r[row]["load1"] for r in rounds for row in args.rows]
    lines += ["", f"1-minute load average at the steps' ends: {min(loads):.2f}-{max(loads):.2f} (median "
                  f"{statistics.median(loads):.2f}).", ""]
    if statistics.median(loads) > 1.5 * (os.cpu_count() or 1):
        lines += [f"OVERSUBSCRIBED: the median load ({statistics.median(loads):.1f}) is far above the {os.cpu_count()} "
                  "cores: ratios measured under such load need not hold on a quiet machine (each process gets a "
                  "small, uneven share of the cores). Rerun when the load is below the core count.", ""]
    return "\n".join(lines)


HEADER = """# Side by side with TRL: one RL step on one CPU

benchmarks/peer_bench.py (its docstring says what each row and column holds and how the sides are matched): TRL's
GRPOTrainer and megatron_gtpo's trainer on the same random-init Qwen2-shaped model, prompts, reward, sampling and
thread count, one process each, their steps interleaved. Targets, as ratios within one run: our GRPO step <= 0.85x
TRL's (matched), our GTPO step <= 1.0x TRL's GRPO step. One section per run (date, commit), newest last.
"""


def write_section(path: str, rid: str, text: str) -> None:
    """Replace this run's section of `path` (marked by its run id), or append it; the file starts with HEADER."""
    from megatron_gtpo.atomic_files import write_atomically

    begin, end = f"<!-- peer_bench run {rid} -->", f"<!-- end of peer_bench run {rid} -->"
    content = open(path, encoding="utf-8").read() if os.path.exists(path) else HEADER
    section = f"{begin}\n{text.rstrip()}\n{end}\n"
    if begin in content and end in content:
        head, rest = content.split(begin, 1)
        content = head + section + rest.split(end, 1)[1].lstrip("\n")
    else:
        content = content.rstrip("\n") + "\n\n" + section
    write_atomically(path, content)


if __name__ == "__main__":
    sys.exit(main())
