"""Evaluation: sample responses on AIME / MATH-500 style datasets and report Mean@n and Pass@k.

    python -m megatron_gtpo.evaluate --model HF_DIR --datasets aime24 aime25 math500 \\
        --num-samples 32 --temperature 1.0 --output-dir runs/eval

Steps: records (bundled eval sets or any jsonl/parquet) -> prompt token ids (chat or plain template) ->
`engine.generate` (n samples per prompt) -> decode -> math verification in worker processes -> per-problem
correctness -> metrics per dataset, written atomically to <output-dir>/eval_results.json and .csv, and every
response (problem id, sample index, response text, extracted answer, correct) to eval_responses.jsonl; the summary is
printed as a table.

Metrics, per dataset, from c correct out of n samples per problem, averaged over problems:
- Mean@n: c / n, the expected accuracy of one sample (Mean@k for any k <= n has the same unbiased estimate);
- Pass@k: the unbiased estimator 1 - C(n-c, k) / C(n, k) of "at least one of k samples is correct"
  (Chen et al. 2021), computed as a product so that it never forms huge binomials.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
import os
import sys
import tempfile
from typing import Mapping, Protocol, Sequence

from tqdm import tqdm

from megatron_gtpo.data import (
    EVAL_SET_NAMES,
    PROMPT_STYLES,
    PromptRecord,
    PromptTemplate,
    Tokenizer,
    load_dataset,
    load_tokenizer,
    tokenize_prompts,
)
from megatron_gtpo.cli import run_cli
from megatron_gtpo.rewards import DEFAULT_TIMEOUT_S, RewardScorer, extract_final_answer, verify_math_answer

RESULTS_JSON = "eval_results.json"
RESULTS_CSV = "eval_results.csv"
RESPONSES_JSONL = "eval_responses.jsonl"


def _check_counts(num_samples: int, num_correct: int, k: int) -> None:
    for name, value in (("num_samples", num_samples), ("num_correct", num_correct), ("k", k)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct must be in [0, num_samples={num_samples}], got {num_correct}")
    if not 1 <= k <= num_samples:
        raise ValueError(f"k must be in [1, num_samples={num_samples}], got {k}")


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased Pass@k from c = num_correct correct out of n = num_samples: 1 - C(n-c, k) / C(n, k).

    Evaluated as 1 - prod_{i=n-c+1}^{n} (1 - k / i), which stays accurate for large n. Requires
    1 <= k <= n and 0 <= c <= n (ValueError otherwise).
    """
    _check_counts(num_samples, num_correct, k)
    if num_samples - num_correct < k:  # every k-subset holds a correct sample
        return 1.0
    failure_probability = 1.0
    for i in range(num_samples - num_correct + 1, num_samples + 1):
        failure_probability *= 1.0 - k / i
    return 1.0 - failure_probability


def mean_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased Mean@k (the expected accuracy averaged over k samples): c / n for every 1 <= k <= n."""
    _check_counts(num_samples, num_correct, k)
    return num_correct / num_samples


@dataclasses.dataclass(frozen=True)
class ProblemResult:
    """The graded samples of one problem."""

    problem_id: str
    answer: str
    correct: tuple[bool, ...]
    predicted_answers: tuple[str | None, ...]  # extracted final answers, None where a response has none
    responses: tuple[str, ...]  # the decoded response texts, one per sample

    @property
    def num_samples(self) -> int:
        return len(self.correct)

    @property
    def num_correct(self) -> int:
        return sum(self.correct)


def summarize(results: Sequence[ProblemResult], ks: Sequence[int]) -> dict:
    """Mean@n and Pass@k (each k in ks) of one dataset, averaged over its problems (same n for all)."""
    if not results:
        raise ValueError("results must hold at least one problem")
    sample_counts = {result.num_samples for result in results}
    if len(sample_counts) != 1:
        raise ValueError(f"every problem must have the same number of samples, got {sorted(sample_counts)}")
    (num_samples,) = sample_counts
    summary: dict = {"num_problems": len(results), "num_samples": num_samples}
    mean_accuracy = math.fsum(mean_at_k(num_samples, r.num_correct, num_samples) for r in results) / len(results)
    summary[f"mean@{num_samples}"] = mean_accuracy
    for k in ks:
        summary[f"pass@{k}"] = math.fsum(pass_at_k(num_samples, r.num_correct, k) for r in results) / len(results)
    return summary


def _write_atomically(path: str, text: str) -> None:
    """Write to a temporary file next to `path`, then rename over it: readers never see a partial file."""
    directory = os.path.dirname(os.path.abspath(path))
    handle, tmp_path = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


def write_report(
    results_by_dataset: Mapping[str, Sequence[ProblemResult]],
    output_dir: str,
    ks: Sequence[int],
    settings: Mapping | None = None,
) -> dict:
    """Summarize each dataset and write <output_dir>/eval_results.json (settings, summary, per-problem
    results), eval_results.csv (one row per problem) and eval_responses.jsonl (one row per response), each
    atomically. Returns the summary."""
    if not results_by_dataset:
        raise ValueError("results_by_dataset must name at least one dataset")
    summary = {name: summarize(results, ks) for name, results in results_by_dataset.items()}
    problems = [
        {"dataset": name, **{k: v for k, v in dataclasses.asdict(result).items() if k != "responses"},
         "num_samples": result.num_samples, "num_correct": result.num_correct}
        for name, results in results_by_dataset.items()
        for result in results
    ]
    os.makedirs(output_dir, exist_ok=True)
    report = {"settings": dict(settings or {}), "summary": summary, "problems": problems}
    _write_atomically(os.path.join(output_dir, RESULTS_JSON), json.dumps(report, indent=1, ensure_ascii=False) + "\n")

    csv_text = io.StringIO()
    writer = csv.writer(csv_text)
    writer.writerow(
        ["dataset", "problem_id", "answer", "num_samples", "num_correct", "accuracy", *(f"pass@{k}" for k in ks)]
    )
    for name, results in results_by_dataset.items():
        for r in results:
            writer.writerow([name, r.problem_id, r.answer, r.num_samples, r.num_correct, r.num_correct / r.num_samples,
                             *(pass_at_k(r.num_samples, r.num_correct, k) for k in ks)])
    _write_atomically(os.path.join(output_dir, RESULTS_CSV), csv_text.getvalue())
    rows = [{"dataset": name, "problem_id": r.problem_id, "sample_index": i, "response": response,
             "extracted_answer": extracted, "correct": correct}
            for name, results in results_by_dataset.items() for r in results
            for i, (response, extracted, correct) in enumerate(zip(r.responses, r.predicted_answers, r.correct))]
    _write_atomically(os.path.join(output_dir, RESPONSES_JSONL),
                      "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return summary


def format_summary(summary: Mapping[str, Mapping[str, float]]) -> str:
    """The summary as a plain-text table: one row per dataset, one column per metric."""
    columns = list(dict.fromkeys(key for row in summary.values() for key in row))
    cells = [["dataset", *columns]] + [
        [name, *(f"{row[c]:.4f}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns)]
        for name, row in summary.items()]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
             for line in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


class GenerationEngine(Protocol):
    """What evaluation needs from a rollout engine: `n` sampled responses (token ids, EOS included or not)
    for each prompt, returned in prompt order."""

    def generate(
        self,
        prompts_token_ids: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int,
    ) -> list[list[list[int]]]: ...


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    num_samples: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int


def generate_responses(
    engine: GenerationEngine,
    prompts_token_ids: Sequence[Sequence[int]],
    sampling: SamplingSettings,
    *,
    prompts_per_call: int,
    progress: bool = True,
) -> list[list[list[int]]]:
    """Response token ids [prompt][sample][token], asking the engine for `prompts_per_call` prompts at a time.

    The call starting at prompt index s uses seed `sampling.seed + s`, so calls never share a random stream
    and a rerun with the same settings asks for the same samples.
    """
    if prompts_per_call < 1:
        raise ValueError(f"prompts_per_call must be >= 1, got {prompts_per_call}")
    responses: list[list[list[int]]] = []
    starts = range(0, len(prompts_token_ids), prompts_per_call)
    for start in tqdm(starts, desc="generating", disable=not progress):
        prompts = [list(prompt) for prompt in prompts_token_ids[start : start + prompts_per_call]]
        outputs = engine.generate(
            prompts,
            n=sampling.num_samples,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_new_tokens=sampling.max_new_tokens,
            seed=sampling.seed + start,
        )
        if len(outputs) != len(prompts) or any(len(samples) != sampling.num_samples for samples in outputs):
            raise RuntimeError(
                f"the engine returned {[len(samples) for samples in outputs]} responses for {len(prompts)} prompts "
                f"with n={sampling.num_samples}"
            )
        responses.extend([list(response) for response in samples] for samples in outputs)
    return responses


def evaluate_dataset(
    records: Sequence[PromptRecord],
    *,
    engine: GenerationEngine,
    tokenizer: Tokenizer,
    template: PromptTemplate,
    sampling: SamplingSettings,
    scorer: RewardScorer,
    prompts_per_call: int = 64,
    progress: bool = True,
) -> list[ProblemResult]:
    """Generate `sampling.num_samples` responses per problem and grade each (math verification == 1.0).
    `progress`: show progress bars (one rank of a model-parallel group does)."""
    samples = tokenize_prompts(records, tokenizer, template, progress=progress)  # no length filter: keep every one
    response_ids = generate_responses(
        engine, [sample.prompt_token_ids for sample in samples], sampling, prompts_per_call=prompts_per_call,
        progress=progress,
    )
    texts = [[tokenizer.decode(ids, skip_special_tokens=True) for ids in per_prompt] for per_prompt in response_ids]
    flat_texts = [text for per_prompt in texts for text in per_prompt]
    flat_references = [sample.answer for sample in samples for _ in range(sampling.num_samples)]
    rewards = scorer.score(flat_texts, flat_references, progress=progress)
    results = []
    for position, sample in enumerate(samples):
        first = position * sampling.num_samples
        results.append(
            ProblemResult(
                problem_id=sample.id,
                answer=sample.answer,
                correct=tuple(reward == 1.0 for reward in rewards[first : first + sampling.num_samples]),
                predicted_answers=tuple(extract_final_answer(text) for text in texts[position]),
                responses=tuple(texts[position]),
            )
        )
    return results


class _RolloutEngineAdapter:
    """The rollout engine (megatron_gtpo.rollout) behind this module's GenerationEngine call shape."""

    def __init__(self, engine, eos_token_id: int):
        self.engine = engine
        self.eos_token_id = eos_token_id

    def generate(self, prompts_token_ids, *, n, temperature, top_p, max_new_tokens, seed):
        from megatron_gtpo.rollout.engine import SamplingParams

        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                stop_token_ids=(self.eos_token_id,), seed=seed)
        return [[r.token_ids for r in group] for group in self.engine.generate(prompts_token_ids, params)]


def build_engine(args: argparse.Namespace, tokenizer: Tokenizer) -> GenerationEngine:
    """The built-in Megatron engine on `--model` (HF directory or megatron_gtpo checkpoint) at --tp/--pp, under
    torchrun with world size TP x PP (every rank generates the same batch; rank 0 writes the report)."""
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.qwen2 import Qwen2Shape, build_model
    from megatron_gtpo.models.sources import ModelSource
    from megatron_gtpo.rollout.builtin import BuiltinEngine

    source = ModelSource.detect(args.model)
    hf_config = source.hf_config()
    groups = initialize_parallel(args.tp, args.pp)
    if groups.dp_size != 1:
        raise ValueError(f"evaluation runs one model replica: world size {groups.world_size} must equal "
                         f"--tp x --pp = {args.tp * args.pp}")
    chunks = build_model(hf_config, tensor_parallel=args.tp, pipeline_parallel=args.pp, pp_rank=groups.pp_rank)
    source.load_into(chunks, groups)
    engine = BuiltinEngine(chunks, groups, vocab_size=Qwen2Shape.from_hf(hf_config).vocab_size)
    return _RolloutEngineAdapter(engine, tokenizer.eos_token_id)


def _default_tokenizer(model: str) -> str:
    """--model's tokenizer: the Hugging Face files a checkpoint copied along, else the model directory itself."""
    from megatron_gtpo.checkpoint.megatron_checkpoint import HF_FILES_DIR, METADATA_FILE

    return os.path.join(model, HF_FILES_DIR) if os.path.isfile(os.path.join(model, METADATA_FILE)) else model


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
    parser = argparse.ArgumentParser(prog="python -m megatron_gtpo.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="Hugging Face directory or megatron_gtpo checkpoint directory to evaluate")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (built-in engine)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size (built-in engine)")
    parser.add_argument("--tokenizer", help="HF tokenizer directory or SentencePiece .model (default: --model's, "
                                             "or the tokenizer a checkpoint copied along)")
    parser.add_argument("--datasets", nargs="+", default=list(EVAL_SET_NAMES),
                        help=f"bundled names {EVAL_SET_NAMES} or NAME=PATH.jsonl|.parquet (default: all bundled)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--num-samples", type=int, default=16, help="responses per problem (n)")
    parser.add_argument("--ks", type=lambda text: [int(k) for k in text.split(",")],
                        help="comma-separated k of Pass@k (default: powers of two up to n, and n)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-style", choices=sorted(PROMPT_STYLES), default="boxed",
                        help="instructions around the problem: boxed (\\boxed{} answer) or dapo (Answer: line)")
    parser.add_argument("--suffix", help="replace the prompt style's text after the problem")
    parser.add_argument("--system-prompt", help="system turn of the chat template")
    parser.add_argument("--plain", action="store_true", help="plain text prompt instead of the chat template")
    parser.add_argument("--prompts-per-call", type=int, default=256, help="prompts per engine.generate call")
    parser.add_argument("--num-reward-workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--reward-timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    args = parser.parse_args(argv)
    if args.num_samples < 1:
        parser.error(f"--num-samples must be >= 1, got {args.num_samples}")
    args.ks = args.ks or _default_ks(args.num_samples)
    if any(not 1 <= k <= args.num_samples for k in args.ks):
        parser.error(f"every k in --ks must be in [1, --num-samples={args.num_samples}], got {args.ks}")
    return args


def main(argv: Sequence[str] | None = None, *, engine_factory=build_engine) -> dict:
    """Run the evaluation CLI; returns the summary it wrote. `engine_factory(args, tokenizer)` builds the engine."""
    args = parse_args(argv)
    template = PROMPT_STYLES[args.prompt_style]
    template = dataclasses.replace(
        template,
        suffix=template.suffix if args.suffix is None else args.suffix,
        chat=not args.plain,
        system_prompt=args.system_prompt,
    )
    sampling = SamplingSettings(args.num_samples, args.temperature, args.top_p, args.max_new_tokens, args.seed)
    datasets = {name: load_dataset(source) for name, source in map(_dataset_source, args.datasets)}
    tokenizer = load_tokenizer(args.tokenizer or _default_tokenizer(args.model))
    engine = engine_factory(args, tokenizer)
    import torch.distributed as dist

    # Every rank of the model-parallel group generates and grades the same batch; the first one speaks and writes.
    speaks = not dist.is_initialized() or dist.get_rank() == 0
    results = {}
    scorer = RewardScorer(verify_math_answer, num_workers=args.num_reward_workers, timeout_s=args.reward_timeout_s)
    with scorer:
        for name, records in datasets.items():
            if speaks:
                print(f"evaluating {name}: {len(records)} problems x {args.num_samples} samples", file=sys.stderr)
            results[name] = evaluate_dataset(
                records, engine=engine, tokenizer=tokenizer, template=template, sampling=sampling, scorer=scorer,
                prompts_per_call=args.prompts_per_call, progress=speaks,
            )
    settings = {"model": args.model, "datasets": args.datasets, "template": dataclasses.asdict(template),
                **dataclasses.asdict(sampling)}
    if not speaks:  # every rank of the model-parallel group has the results
        return {name: summarize(rs, args.ks) for name, rs in results.items()}
    summary = write_report(results, args.output_dir, args.ks, settings)
    print(format_summary(summary))
    print(f"wrote {os.path.join(args.output_dir, RESULTS_JSON)}, {RESULTS_CSV} and {RESPONSES_JSONL}",
          file=sys.stderr)
    return summary


def _cli() -> int:
    main()
    return 0


if __name__ == "__main__":
    run_cli("megatron_gtpo.evaluate", _cli)
