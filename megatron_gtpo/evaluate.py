"""Evaluation: sample responses on AIME / MATH-500 style datasets and report Mean@n and Pass@k.

    python -m megatron_gtpo.evaluate --model HF_DIR --datasets aime24 aime25 math500 \\
        --num-samples 32 --temperature 1.0 --output-dir runs/eval

Steps: records (bundled eval sets or any jsonl/parquet) -> prompt token ids (chat or plain template) ->
`engine.generate` (n samples per prompt) -> decode -> math verification in worker processes -> per-problem
correctness -> metrics per dataset, written atomically to <output-dir>/eval_results.json and .csv, and every
response (problem id, sample index, response text, extracted answer, correct) to eval_responses.jsonl; the summary is
printed as a table.

A trainer checkpoint of a synthetic task (the CPU demo's, data.source: synthetic) is evaluated on that task: its
held-out split where it has one, else its problems, prompted and graded as the run was (its tokenizer is the task's,
built in code; --max-new-tokens defaults to the run's response length); the text datasets, templates and
--tokenizer do not apply to it.

The engines and how ranks map onto them: megatron_gtpo/evaluation/replicas.py; the calls and seeds: evaluation/run.py;
Mean@n and Pass@k: evaluation/passk.py; the report files: evaluation/report.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Sequence

from megatron_gtpo.cli import ArgumentParser, run_cli
from megatron_gtpo.data import EVAL_SET_NAMES, PROMPT_STYLES, load_dataset, load_tokenizer, tokenize_prompts
from megatron_gtpo.distributed.parallel import read_launch_env
from megatron_gtpo.evaluation.replicas import build_replica
from megatron_gtpo.evaluation.report import RESPONSES_JSONL, RESULTS_CSV, RESULTS_JSON, format_summary, write_report
from megatron_gtpo.evaluation.run import SamplingSettings, evaluate_dataset
from megatron_gtpo.rewards import DEFAULT_TIMEOUT_S, RewardPool, verify_math_answer

ENGINES = ("builtin", "vllm")
DTYPES = ("bfloat16", "float32")
DEFAULT_DTYPE = {"builtin": "float32", "vllm": "bfloat16"}
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # evaluation has each GPU to itself
DEFAULT_MAX_NEW_TOKENS = 8192
DEFAULT_PROMPT_STYLE = "boxed"


def _default_ks(num_samples: int) -> list[int]:
    powers_of_two = [2**i for i in range(num_samples.bit_length()) if 2**i <= num_samples]
    return sorted(set(powers_of_two) | {num_samples})


def _dataset_source(spec: str) -> tuple[str, str]:
    """"aime24" -> ("aime24", "aime24"); "gsm8k=/data/gsm8k_test.jsonl" -> ("gsm8k", "/data/gsm8k_test.jsonl")."""
    name, separator, source = spec.partition("=")
    if not separator:
        return spec, spec
    if not name or not source:
        raise ValueError(f"a dataset is NAME or NAME=PATH, got {spec!r}")
    return name, source


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m megatron_gtpo.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="Hugging Face directory or megatron_gtpo checkpoint directory to evaluate (a trainer's "
                             "checkpoints folder or its `latest`: the newest checkpoint)")
    parser.add_argument("--engine", choices=ENGINES, default="builtin",
                        help="builtin: megatron generation (CPU, small models); vllm: vLLM replicas (GPU)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help=f"weights and activations (default: {DEFAULT_DTYPE['builtin']} for builtin, "
                             f"{DEFAULT_DTYPE['vllm']} for vllm)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (built-in engine)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size (built-in engine)")
    parser.add_argument("--max-batch-rows", type=int,
                        help="built-in engine: at most this many rows (problem x sample) per batch (default: all)")
    parser.add_argument("--max-batch-tokens", type=int,
                        help="built-in engine: at most this many KV-cache token slots per batch, rows x (longest "
                             "prompt + --max-new-tokens) (default: no cap)")
    parser.add_argument("--vllm-tp", type=int, default=1,
                        help="vllm: tensor parallel size of each replica (GPUs per replica; one rank per replica)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                        help="vllm: fraction of each GPU for weights, activations and KV cache")
    parser.add_argument("--vllm-kv-cache-bytes", type=int,
                        help="vllm: KV-cache bytes per worker instead of the memory fraction (required on CPU)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="vllm: no CUDA graphs / compilation (starts faster, decodes slower)")
    parser.add_argument("--max-model-len", type=int,
                        help="vllm: longest prompt + response it must hold (default: the model's positions)")
    parser.add_argument("--tokenizer", help="HF tokenizer directory or SentencePiece .model (default: --model's, "
                                             "or the tokenizer a checkpoint copied along)")
    parser.add_argument("--datasets", nargs="+",
                        help=f"bundled names {EVAL_SET_NAMES} or NAME=PATH.jsonl|.parquet (default: all bundled; a "
                             f"synthetic task's checkpoint: its task)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--num-samples", type=int, default=16, help="responses per problem (n)")
    parser.add_argument("--ks", type=lambda text: [int(k) for k in text.split(",")],
                        help="comma-separated k of Pass@k (default: powers of two up to n, and n)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int,
                        help=f"default {DEFAULT_MAX_NEW_TOKENS}; a synthetic task's checkpoint: its run's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-style", choices=sorted(PROMPT_STYLES),
                        help="instructions around the problem: boxed (\\boxed{} answer, the default) or dapo "
                             "(Answer: line)")
    parser.add_argument("--suffix", help="replace the prompt style's text after the problem")
    parser.add_argument("--system-prompt", help="system turn of the chat template")
    parser.add_argument("--plain", action="store_true", help="plain text prompt instead of the chat template")
    parser.add_argument("--prompts-per-call", type=int, default=256,
                        help="at most this many prompts per engine.generate call (fewer where every replica needs a "
                             "share; the calls decide the seeds)")
    parser.add_argument("--num-reward-workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--reward-timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    args = parser.parse_args(argv)
    if args.num_samples < 1:
        parser.error(f"--num-samples must be >= 1, got {args.num_samples}")
    for flag in ("max_batch_rows", "max_batch_tokens", "vllm_kv_cache_bytes", "max_model_len", "max_new_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.vllm_tp < 1 or not 0 < args.gpu_memory_utilization <= 1:
        parser.error(f"--vllm-tp must be >= 1 and --gpu-memory-utilization in (0, 1], got {args.vllm_tp} and "
                     f"{args.gpu_memory_utilization}")
    builtin_only = [f for f, v in (("--max-batch-rows", args.max_batch_rows), ("--max-batch-tokens",
                                   args.max_batch_tokens), ("--tp", args.tp != 1), ("--pp", args.pp != 1)) if v]
    vllm_only = [f for f, v in (("--vllm-tp", args.vllm_tp != 1), ("--vllm-kv-cache-bytes", args.vllm_kv_cache_bytes),
                                ("--enforce-eager", args.enforce_eager), ("--max-model-len", args.max_model_len),
                                ("--gpu-memory-utilization",
                                 args.gpu_memory_utilization != DEFAULT_GPU_MEMORY_UTILIZATION)) if v]
    if args.engine == "vllm" and builtin_only:
        parser.error(f"{', '.join(builtin_only)} belong to the built-in engine; vLLM uses --vllm-tp and its own "
                     "batching")
    if args.engine == "builtin" and vllm_only:
        parser.error(f"{', '.join(vllm_only)} belong to --engine vllm")
    if args.engine == "vllm" and args.temperature == 0 and args.num_samples > 1:
        parser.error(f"vLLM samples greedily (--temperature 0) only with --num-samples 1, got {args.num_samples}")
    args.dtype = args.dtype or DEFAULT_DTYPE[args.engine]
    args.ks = args.ks or _default_ks(args.num_samples)
    if any(not 1 <= k <= args.num_samples for k in args.ks):
        parser.error(f"every k in --ks must be in [1, --num-samples={args.num_samples}], got {args.ks}")
    return args


def main(argv: Sequence[str] | None = None, *, replica_factory=build_replica) -> dict | None:
    """Run the evaluation CLI; returns the summary it wrote (on rank 0; None on the others).
    `replica_factory(args, tokenizer)` builds this rank's engine (evaluation/replicas.py)."""
    args = parse_args(argv)
    from megatron_gtpo.checkpoint.sources import ModelSource

    source = ModelSource.detect(args.model, what="--model")  # first: a wrong path is named as such
    args.model = source.path  # a checkpoints folder or `latest`: the checkpoint it names
    if source.synthetic_task:
        problems, tokenizer, reward, template = _synthetic_task_problems(args, source)
    else:
        problems, tokenizer, reward, template = _text_problems(args, source)
    sampling = SamplingSettings(args.num_samples, args.temperature, args.top_p, args.max_new_tokens, args.seed)
    replica = replica_factory(args, tokenizer)
    import torch.distributed as dist

    # Each replica generates and grades its share; rank 0 gathers everything, speaks and writes.
    speaks = not dist.is_initialized() or dist.get_rank() == 0
    results = {}
    reward_pool = RewardPool(reward, num_workers=args.num_reward_workers, timeout_s=args.reward_timeout_s)
    try:
        with reward_pool:
            for name, samples in problems.items():
                if speaks:
                    print(f"evaluating {name}: {len(samples)} problems x {args.num_samples} samples on "
                          f"{replica.share.count} replica(s)", file=sys.stderr)
                results[name] = evaluate_dataset(
                    samples, replica=replica, tokenizer=tokenizer, sampling=sampling, reward_pool=reward_pool,
                    prompts_per_call=args.prompts_per_call, progress=speaks,
                    skip_special_tokens=not source.synthetic_task,  # a synthetic reward reads the EOS (as trained)
                )
    finally:
        replica.close()
    settings = {"model": args.model, "datasets": list(problems),
                "template": template and dataclasses.asdict(template), "engine": args.engine, "dtype": args.dtype,
                **dataclasses.asdict(sampling)}
    if not speaks:
        return None
    summary = write_report(results, args.output_dir, args.ks, settings)
    print(format_summary(summary))
    print(f"wrote {os.path.join(args.output_dir, RESULTS_JSON)}, {RESULTS_CSV} and {RESPONSES_JSONL}",
          file=sys.stderr)
    return summary


def _text_problems(args, source):
    """({dataset: prompt samples}, tokenizer, reward, template) of --datasets (default: every bundled set), prompted
    with the template of --prompt-style / --suffix / --system-prompt / --plain, graded by math verification."""
    if args.tokenizer is None and source.missing_tokenizer():
        raise ValueError(f"--model: {source.missing_tokenizer()}; give one with --tokenizer")
    template = PROMPT_STYLES[args.prompt_style or DEFAULT_PROMPT_STYLE]
    template = dataclasses.replace(template, suffix=template.suffix if args.suffix is None else args.suffix,
                                   chat=not args.plain, system_prompt=args.system_prompt)
    args.max_new_tokens = args.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    tokenizer = load_tokenizer(args.tokenizer or source.tokenizer_dir)
    # Before the engine starts the process group: the launcher's rank decides who shows the bar.
    speaks = read_launch_env().rank == 0
    problems = {name: tokenize_prompts(load_dataset(path), tokenizer, template, progress=speaks)  # no length filter
                for name, path in map(_dataset_source, args.datasets or EVAL_SET_NAMES)}
    return problems, tokenizer, verify_math_answer, template


def _synthetic_task_problems(args, source):
    """({task: prompt samples}, tokenizer, reward, None) of the synthetic task a trainer checkpoint learned: its
    held-out split where it has one, else its problems, its tokenizer and reward (module doc)."""
    from megatron_gtpo.checkpoint.megatron_checkpoint import read_checkpoint_metadata
    from megatron_gtpo.data.synthetic_tasks import SYNTHETIC_TASKS

    name = source.synthetic_task
    given = [flag for flag, value in (("--datasets", args.datasets), ("--tokenizer", args.tokenizer),
                                      ("--prompt-style", args.prompt_style), ("--suffix", args.suffix),
                                      ("--system-prompt", args.system_prompt), ("--plain", args.plain)) if value]
    if given:
        raise ValueError(f"{', '.join(given)}: {source.path} was trained on the synthetic task {name!r} "
                         f"(data.task), which it is evaluated on, prompted as it trained and with the task's own "
                         f"tokenizer; leave {', '.join(given)} out")
    task = SYNTHETIC_TASKS[name]
    args.max_new_tokens = args.max_new_tokens or read_checkpoint_metadata(source.path).extra.get("max_new_tokens") \
        or DEFAULT_MAX_NEW_TOKENS
    problems = task.heldout_problems() if task.heldout_problems else task.train_problems()
    return {name: problems}, task.tokenizer(), task.reward, None


def _cli() -> int:
    main()
    return 0


if __name__ == "__main__":
    run_cli("megatron_gtpo.evaluate", _cli)
