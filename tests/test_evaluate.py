"""Evaluation: Pass@k / Mean@k estimators, the atomic JSON/CSV report, and the CLI end to end with a test engine."""
from __future__ import annotations

import csv
import json
import math
import os
import re
from fractions import Fraction

import pytest

from megatron_gtpo import evaluate
from megatron_gtpo.cli import UsageError
from megatron_gtpo.data import BOXED_SUFFIX, load_dataset, load_tokenizer
from megatron_gtpo.evaluation import replicas
from megatron_gtpo.evaluation.passk import ProblemResult, mean_at_k, pass_at_k
from megatron_gtpo.evaluation.report import RESPONSES_JSONL, RESULTS_CSV, RESULTS_JSON, format_summary, write_report
from megatron_gtpo.rollout.responses import Response, Responses
from tokenizer_dirs import QWEN_DEFAULT_SYSTEM, build_hf_tokenizer_dir


def _closed_form_pass_at_k(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_matches_the_closed_form_exhaustively():
    for n in range(1, 16):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_closed_form_pass_at_k(n, c, k)), rel=1e-12, abs=1e-15)


def test_pass_at_k_hand_cases_and_large_n():
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    assert pass_at_k(2, 1, 1) == 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(10, 0, 10) == 0.0 and pass_at_k(10, 1, 10) == 1.0
    # C(1000, 500) has ~300 digits: the product form must still be exact to rounding
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5, rel=1e-12)
    assert pass_at_k(1000, 7, 100) == pytest.approx(float(_closed_form_pass_at_k(1000, 7, 100)), rel=1e-12)


@pytest.mark.parametrize(
    "n, c, k, message",
    [(4, 1, 5, r"k must be in \[1, num_samples=4\]"), (4, 1, 0, "k must be in"), (4, 5, 1, "num_correct must be in"),
     (4, -1, 1, "num_correct must be in"), (0, 0, 1, "num_samples must be >= 1"), (4, 1, 1.0, "k must be an int"),
     (4, True, 1, "num_correct must be an int")],
)
def test_pass_at_k_and_mean_at_k_reject_bad_counts(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)
    with pytest.raises(ValueError, match=message):
        mean_at_k(n, c, k)


def test_mean_at_k_is_the_fraction_correct():
    assert mean_at_k(8, 3, 1) == mean_at_k(8, 3, 8) == 3 / 8
    assert mean_at_k(5, 0, 2) == 0.0 and mean_at_k(5, 5, 5) == 1.0


def _result(problem_id: str, correct: list[bool]) -> ProblemResult:
    return ProblemResult(problem_id, "7", tuple(correct), tuple("7" if ok else "1" for ok in correct),
                         tuple(f"{problem_id} sample {i}: \\boxed{{{7 if ok else 1}}}" for i, ok in enumerate(correct)))


def test_report_metrics_json_and_csv(tmp_path):
    results = {
        "setA": [_result("a1", [True, False, False, False]), _result("a2", [True, True, False, True])],
        "setB": [_result("b1", [False] * 4)],
    }
    summary = write_report(results, str(tmp_path), ks=[1, 2, 4], settings={"model": "m"})
    # setA: c = 1 and 3 of n = 4. pass@2: 1 - C(3,2)/C(4,2) = 1/2 and 1 - 0 = 1.
    assert summary["setA"] == pytest.approx({"num_problems": 2, "num_samples": 4, "mean@4": (1 / 4 + 3 / 4) / 2,
                                             "pass@1": 0.5, "pass@2": (0.5 + 1.0) / 2, "pass@4": 1.0})
    assert summary["setB"] == {"num_problems": 1, "num_samples": 4, "mean@4": 0.0, "pass@1": 0.0, "pass@2": 0.0,
                               "pass@4": 0.0}

    with open(tmp_path / RESULTS_JSON, encoding="utf-8") as f:
        report = json.load(f)
    assert report["settings"] == {"model": "m"} and report["summary"] == json.loads(json.dumps(summary))
    assert [(p["dataset"], p["problem_id"], p["num_correct"], p["correct"]) for p in report["problems"]] == [
        ("setA", "a1", 1, [True, False, False, False]), ("setA", "a2", 3, [True, True, False, True]),
        ("setB", "b1", 0, [False] * 4),
    ]
    assert report["problems"][0]["predicted_answers"] == ["7", "1", "1", "1"]
    with open(tmp_path / RESULTS_CSV, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["dataset"], r["problem_id"], r["num_correct"]) for r in rows] == [
        ("setA", "a1", "1"), ("setA", "a2", "3"), ("setB", "b1", "0")]
    assert float(rows[1]["accuracy"]) == 0.75 and float(rows[0]["pass@2"]) == pytest.approx(0.5)
    with open(tmp_path / RESPONSES_JSONL, encoding="utf-8") as f:
        responses = [json.loads(line) for line in f]
    assert len(responses) == 12 and responses[5] == {
        "dataset": "setA", "problem_id": "a2", "sample_index": 1, "response": "a2 sample 1: \\boxed{7}",
        "extracted_answer": "7", "correct": True}
    assert "response" not in report["problems"][0] and "responses" not in report["problems"][0]
    assert sorted(os.listdir(tmp_path)) == sorted([RESULTS_CSV, RESULTS_JSON,
                                                   RESPONSES_JSONL])  # no temporary files left
    assert format_summary(summary).splitlines() == [
        "dataset  num_problems  num_samples  mean@4  pass@1  pass@2  pass@4",
        "------------------------------------------------------------------",
        "setA                2            4  0.5000  0.5000  0.7500  1.0000",
        "setB                1            4  0.0000  0.0000  0.0000  0.0000"]

    with pytest.raises(ValueError, match="same number of samples"):
        write_report({"bad": [_result("x", [True]), _result("y", [True, False])]}, str(tmp_path), ks=[1])
    with pytest.raises(ValueError, match=r"k must be in \[1, num_samples=4\]"):
        write_report(results, str(tmp_path), ks=[8])


def test_report_write_failure_keeps_the_previous_file(tmp_path, monkeypatch):
    write_report({"s": [_result("a", [True])]}, str(tmp_path), ks=[1])
    before = (tmp_path / RESULTS_JSON).read_text()

    def failing_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk full"):
        write_report({"s": [_result("a", [False])]}, str(tmp_path), ks=[1])
    assert (tmp_path / RESULTS_JSON).read_text() == before
    assert sorted(os.listdir(tmp_path)) == sorted([RESULTS_CSV, RESULTS_JSON,
                                                   RESPONSES_JSONL])


class CannedEngine:
    """Test double of a rollout engine (rollout.engine.RolloutEngine.generate): answers problem p (found by its text
    in the decoded prompt) with `num_correct[p]` correct responses, then wrong ones; records every call."""

    def __init__(self, tokenizer, records, num_correct):
        self.tokenizer = tokenizer
        self.records = records
        self.num_correct = num_correct
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append({"num_prompts": len(prompts), "n": params.n, "temperature": params.temperature,
                           "top_p": params.top_p, "max_new_tokens": params.max_new_tokens, "seed": params.seed,
                           "stop_token_ids": params.stop_token_ids,
                           "prompts": [self.tokenizer.decode(ids) for ids in prompts]})
        outputs = []
        for prompt_text in self.calls[-1]["prompts"]:
            (record,) = [r for r in self.records if f"user\n{r.problem}\n" in prompt_text]
            responses = []
            for sample in range(params.n):
                if sample < self.num_correct[record.id]:
                    text = f"Adding up, we get $\\boxed{{{record.answer}}}$."
                else:
                    text = f"So the answer is \\boxed{{{int(record.answer) + 1}}}" if sample % 2 else "I give up."
                ids = self.tokenizer.encode(text) + [self.tokenizer.eos_token_id]
                responses.append(Response(ids, [0.0] * len(ids), "stop"))
            outputs.append(responses)
        return Responses.from_lists(outputs)

    def close(self):
        self.closed = True


def test_cli_generates_scores_and_reports_with_a_test_engine(tmp_path):
    tokenizer_dir = build_hf_tokenizer_dir(str(tmp_path / "tokenizer"))
    (tmp_path / "tokenizer" / "config.json").write_text("{}")  # a model directory (the test engine reads no weights)
    tokenizer = load_tokenizer(tokenizer_dir)
    custom_path = tmp_path / "custom.jsonl"
    custom_path.write_text("".join(json.dumps({"id": f"c{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i)})
                                   + "\n" for i in range(5)))
    datasets = {"aime25": load_dataset("aime25"), "custom": load_dataset(str(custom_path))}
    n = 4
    num_correct = {r.id: position % (n + 1) for records in datasets.values() for position, r in enumerate(records)}
    engine = CannedEngine(tokenizer, [r for records in datasets.values() for r in records], num_correct)
    created = []

    def replica_factory(args, tok):
        created.append((args.model, tok.vocab_size))
        return replicas.Replica(engine, replicas.ReplicaShare(), tok.eos_token_id, vocab_size=tok.vocab_size,
                                max_positions=4096)

    output_dir = tmp_path / "eval"
    summary = evaluate.main(
        ["--model", tokenizer_dir, "--datasets", "aime25", f"custom={custom_path}", "--output-dir", str(output_dir),
         "--num-samples", str(n), "--temperature", "0.6", "--top-p", "0.95", "--max-new-tokens", "512",
         "--seed", "10", "--prompts-per-call", "8", "--num-reward-workers", "1"],
        replica_factory=replica_factory,
    )
    assert created == [(tokenizer_dir, tokenizer.vocab_size)]
    # aime25 in calls of 8, 8, 8, 6 prompts, then custom in one call of 5; seeds offset by the first prompt index
    assert [(c["num_prompts"], c["seed"]) for c in engine.calls] == [(8, 10), (8, 18), (8, 26), (6, 34), (5, 10)]
    assert {(c["n"], c["temperature"], c["top_p"], c["max_new_tokens"], c["stop_token_ids"]) for c in engine.calls} \
        == {(n, 0.6, 0.95, 512, (tokenizer.eos_token_id,))}
    assert engine.closed
    first_problem = datasets["aime25"][0].problem
    assert engine.calls[0]["prompts"][0] == (
        f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n{first_problem}{BOXED_SUFFIX}"
        "<|im_end|>\n<|im_start|>assistant\n"
    )

    for name, records in datasets.items():
        counts = [num_correct[r.id] for r in records]
        expected = {"num_problems": len(records), "num_samples": n,
                    f"mean@{n}": sum(c / n for c in counts) / len(counts)}
        for k in (1, 2, 4):  # the default ks for n = 4
            expected[f"pass@{k}"] = sum(float(_closed_form_pass_at_k(n, c, k)) for c in counts) / len(counts)
        assert summary[name] == pytest.approx(expected)
    with open(output_dir / RESULTS_JSON, encoding="utf-8") as f:
        report = json.load(f)
    assert report["settings"]["seed"] == 10 and report["settings"]["template"]["suffix"] == BOXED_SUFFIX
    problems = {(p["dataset"], p["problem_id"]): p for p in report["problems"]}
    assert len(problems) == 35
    c2 = problems[("custom", "c2")]  # 2 correct of 4: "4", "4", then no answer (sample 2), "5" (sample 3)
    assert c2["correct"] == [True, True, False, False] and c2["predicted_answers"] == ["4", "4", None, "5"]
    with open(output_dir / RESULTS_CSV, encoding="utf-8", newline="") as f:
        assert len(list(csv.DictReader(f))) == 35


def test_cli_argument_errors_and_model_that_is_not_one(tmp_path, capsys):
    with pytest.raises(UsageError, match=re.escape("every k in --ks must be in [1, --num-samples=4]")) as error:
        evaluate.parse_args(["--model", "m", "--output-dir", "o", "--num-samples", "4", "--ks", "1,8"])
    assert error.value.usage.startswith("usage: python -m megatron_gtpo.evaluate [-h] --model MODEL")
    assert evaluate.parse_args(["--model", "m", "--output-dir", "o", "--num-samples", "6"]).ks == [1, 2, 4, 6]
    tokenizer_dir = build_hf_tokenizer_dir(str(tmp_path / "tokenizer"))
    with pytest.raises(FileNotFoundError, match="neither a Hugging Face model directory"):
        evaluate.main(["--model", tokenizer_dir, "--datasets", "aime24", "--output-dir", str(tmp_path / "o")])


@pytest.mark.slow
def test_cli_end_to_end_with_the_builtin_engine_at_tp2(tmp_path):
    """torchrun, TP=2, a tiny random Qwen2 with the test tokenizer's vocabulary, 5 problems x 2 samples."""
    import subprocess
    import sys

    from distributed_harness import free_port
    from tiny_models import make_tiny_qwen2

    tokenizer_dir = build_hf_tokenizer_dir(str(tmp_path / "tok"))
    make_tiny_qwen2(tmp_path / "model", vocab_size=400, num_layers=2)
    data = tmp_path / "five.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(5)))
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "megatron_gtpo.evaluate", "--model", str(tmp_path / "model"), "--tokenizer", tokenizer_dir,
           "--tp", "2", "--datasets", f"five={data}", "--output-dir", str(out), "--num-samples", "2",
           "--max-new-tokens", "6", "--num-reward-workers", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "eval_results.json").read_text())
    assert report["summary"]["five"]["num_problems"] == 5 and report["summary"]["five"]["num_samples"] == 2
    assert len(report["problems"]) == 5
    assert all(len(p["correct"]) == 2 and len(p["predicted_answers"]) == 2 for p in report["problems"])
    responses = [json.loads(line) for line in (out / "eval_responses.jsonl").read_text().splitlines()]
    assert [(r["problem_id"], r["sample_index"]) for r in responses] == [(f"p{i}", j) for i in range(5) for j in (0, 1)]
    assert all(isinstance(r["response"], str) for r in responses)
    # One rank speaks: the dataset line, each progress bar and the summary table appear once at TP=2.
    assert res.stderr.count("evaluating five: 5 problems x 2 samples") == 1, res.stderr[-3000:]
    assert res.stderr.count("generating: 0/1 (0%)") == 1, res.stderr[-3000:]
    assert res.stderr.count("tokenizing prompts: 0/5") == 1, res.stderr[-3000:]
    assert res.stdout.count("dataset  num_problems") == 1, res.stdout
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in res.stderr  # CUDA advice that means nothing on the CPU


# ---- the memory-bounded built-in engine, data-parallel replicas, and the engine flags ----

NEW_TOKENS = 6
SAMPLES = 3


def _problems_file(path, count=5):
    """Problems of different lengths, the longest second (a batch's longest row is not always its last)."""
    path.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"What is {i} plus {'1 ' * (3 * ((2 * i + 2) % 5))}?",
                                        "answer": str(i + 1)}) + "\n" for i in range(count)))
    return path


def _evaluate_runs(rank, world_size, model_dir, tokenizer_dir, data, out_root, runs):
    """`evaluate.main` with the built-in engine once per (name, flags) in this rank (flags may name {three_rows} and
    {row_minus_1}: 3 x and 1 less than the KV-cache slots of one longest row, learnt from the first run). Returns
    per run: the response token ids [problem][sample] of all ranks and the KV caches this rank's engine allocated
    [(rows, slots per row, dtype)], or the error text."""
    import torch
    from megatron.core.inference import contexts

    caches, tokens = [], []

    class RecordingContext(contexts.StaticInferenceContext):
        def increment_sequence_len_offset(self, tokens_in_step):
            if self.sequence_len_offset == 0:  # after the prefill: the cache is allocated at its full size
                keys, _ = next(iter(self.key_value_memory_dict.values()))  # [slots per row, rows, heads, dim]
                caches.append((keys.shape[1], keys.shape[0], str(keys.dtype).removeprefix("torch.")))
            super().increment_sequence_len_offset(tokens_in_step)

    contexts.StaticInferenceContext = RecordingContext
    from megatron_gtpo.rollout.builtin import BuiltinEngine

    engine_generate = BuiltinEngine.generate

    def recording_generate(self, prompts, params):
        out = engine_generate(self, prompts, params)
        tokens.extend([r.token_ids for r in group] for group in out.to_lists())
        return out

    BuiltinEngine.generate = recording_generate
    results, row_slots = {}, None
    for name, flags in runs:
        caches.clear()
        tokens.clear()
        flags = [f.format(three_rows=3 * (row_slots or 0), row_minus_1=(row_slots or 0) - 1)
                 for f in flags]
        argv = ["--model", model_dir, "--tokenizer", tokenizer_dir, "--datasets", f"five={data}", "--plain",
                "--suffix", "", "--output-dir", os.path.join(out_root, name), "--num-samples", str(SAMPLES),
                "--max-new-tokens", str(NEW_TOKENS), "--seed", "7", "--num-reward-workers", "1", *flags]
        try:
            evaluate.main(argv)
        except ValueError as e:
            results[name] = str(e)
            continue
        row_slots = row_slots or caches[0][1]
        gathered = [None] * world_size
        torch.distributed.all_gather_object(gathered, tokens)
        results[name] = {"tokens": [per_prompt for rank_tokens in gathered for per_prompt in rank_tokens],
                         "caches": list(caches)}
    return results


@pytest.mark.slow
def test_bounded_builtin_engine_gives_the_same_responses_at_any_cap_and_obeys_it(tmp_path):
    """The caps on rows and on KV-cache slots per batch change no response, greedy or sampled: each row draws
    from its own seeded stream. (With one generator shared by a batch, as before, the sampled runs differ.)"""
    from distributed_harness import run_distributed
    from tiny_models import make_tiny_qwen2

    tokenizer_dir = build_hf_tokenizer_dir(str(tmp_path / "tok"))
    make_tiny_qwen2(tmp_path / "model", vocab_size=400, num_layers=2)
    data = _problems_file(tmp_path / "five.jsonl")
    greedy, bf16 = ["--temperature", "0"], ["--temperature", "0", "--dtype", "bfloat16"]
    runs = [("greedy", greedy), ("greedy_rows2", greedy + ["--max-batch-rows", "2"]),
            ("greedy_tokens3", greedy + ["--max-batch-tokens", "{three_rows}"]),
            ("sampled", []), ("sampled_tokens", ["--max-batch-tokens", "{three_rows}"]),
            ("bf16", bf16 + ["--max-batch-rows", "4"]), ("too_small", ["--max-batch-tokens", "{row_minus_1}"])]
    (results,) = run_distributed(_evaluate_runs, 1, args=(str(tmp_path / "model"), tokenizer_dir, str(data),
                                                           str(tmp_path / "out"), runs), timeout_s=600)
    rows = 5 * SAMPLES
    (unbounded,) = results["greedy"]["caches"]
    assert unbounded[0] == rows and unbounded[2] == "float32"
    row_slots = unbounded[1]  # the longest prompt + NEW_TOKENS
    caps = {"greedy_rows2": (2, None), "greedy_tokens3": (None, 3 * row_slots), "sampled_tokens": (None, 3 * row_slots),
            "bf16": (4, None)}
    for name, (max_rows, max_slots) in caps.items():
        caches = results[name]["caches"]
        assert sum(batch_rows for batch_rows, _, _ in caches) == rows, name  # every row once
        assert len(caches) > 1, name  # the cap did split the rows
        for batch_rows, slots_per_row, _ in caches:
            assert max_rows is None or batch_rows <= max_rows, (name, caches)
            assert max_slots is None or batch_rows * slots_per_row <= max_slots, (name, caches)
    for name in ("greedy_rows2", "greedy_tokens3"):
        assert results[name]["tokens"] == results["greedy"]["tokens"], name
    assert results["sampled_tokens"]["tokens"] == results["sampled"]["tokens"]
    assert results["sampled"]["tokens"] != results["greedy"]["tokens"]
    assert all(len(set(map(tuple, per_prompt))) > 1 for per_prompt in results["sampled"]["tokens"])  # samples differ
    # --dtype bfloat16: the model computes in bfloat16 (its KV cache is), every row is answered.
    assert {c[2] for c in results["bf16"]["caches"]} == {"bfloat16"}
    assert [len(per_prompt) for per_prompt in results["bf16"]["tokens"]] == [SAMPLES] * 5
    assert f"max_batch_tokens={row_slots - 1} cannot hold one row: prompts[1] has" in results["too_small"]

    # Two data-parallel replicas (2 ranks at TP=1): problems 0-2 on one, 3-4 on the other, gathered by rank 0.
    dp_runs = [("greedy_dp2", greedy + ["--max-batch-rows", "2"])]
    per_rank = run_distributed(_evaluate_runs, 2, args=(str(tmp_path / "model"), tokenizer_dir, str(data),
                                                        str(tmp_path / "out"), dp_runs), timeout_s=600)
    assert per_rank[0]["greedy_dp2"]["tokens"] == results["greedy"]["tokens"]
    assert sum(batch_rows for batch_rows, _, _ in per_rank[1]["greedy_dp2"]["caches"]) == 2 * SAMPLES  # its share
    assert (tmp_path / "out" / "greedy_dp2" / "eval_responses.jsonl").read_text() == \
        (tmp_path / "out" / "greedy" / "eval_responses.jsonl").read_text()

    responses = [json.loads(line) for line in (tmp_path / "out" / "sampled" / "eval_responses.jsonl").open()]
    assert [(r["problem_id"], r["sample_index"]) for r in responses] == [(f"p{i}", j) for i in range(5)
                                                                         for j in range(SAMPLES)]
    assert {"response", "extracted_answer", "correct"} <= set(responses[0])
    settings = json.loads((tmp_path / "out" / "bf16" / "eval_results.json").read_text())["settings"]
    assert (settings["engine"], settings["dtype"]) == ("builtin", "bfloat16")


def test_replica_calls_split_every_problem_once_across_replicas():
    from megatron_gtpo.evaluation.replicas import ReplicaShare
    from megatron_gtpo.evaluation.run import replica_calls

    assert replica_calls(10, prompts_per_call=4, share=ReplicaShare()) == [range(0, 4), range(4, 8), range(8, 10)]
    # 30 problems on 8 replicas: calls of at most ceil(30 / 8) = 4 prompts, so that every replica gets some.
    shares = [replica_calls(30, prompts_per_call=256, share=ReplicaShare(r, 8)) for r in range(8)]
    assert all(shares) and max(len(c) for calls in shares for c in calls) == 4
    assert sorted(p for calls in shares for c in calls for p in c) == list(range(30))
    assert replica_calls(2, prompts_per_call=8, share=ReplicaShare(2, 3)) == []  # more replicas than problems
    with pytest.raises(ValueError, match="prompts_per_call must be >= 1"):
        replica_calls(3, prompts_per_call=0, share=ReplicaShare())


def test_batch_ranges_hand_cases():
    from megatron_gtpo.rollout.builtin import batch_ranges

    lengths = [3, 5, 2, 2, 6]
    assert batch_ranges(lengths, max_new_tokens=4, max_rows=None, max_tokens=None) == [range(0, 5)]
    assert batch_ranges(lengths, max_new_tokens=4, max_rows=2, max_tokens=None) == [range(0, 2), range(2, 4),
                                                                                      range(4, 5)]
    # rows x (longest + 4) <= 20: [3, 5] -> 2 x 9 = 18; [2, 2] -> 12, + 6 -> 3 x 10 = 30 > 20
    assert batch_ranges(lengths, max_new_tokens=4, max_rows=None, max_tokens=20) == [range(0, 2), range(2, 4),
                                                                                       range(4, 5)]
    assert batch_ranges(lengths, max_new_tokens=4, max_rows=None, max_tokens=10) == [range(i, i + 1)
                                                                                       for i in range(5)]
    with pytest.raises(ValueError, match=r"max_batch_tokens=9 cannot hold one row: prompts\[2\] has 6 tokens"):
        batch_ranges(lengths, max_new_tokens=4, max_rows=None, max_tokens=9, rows_per_prompt=2)


@pytest.mark.parametrize("flags, message", [
    (["--engine", "vllm", "--max-batch-rows", "4"], "--max-batch-rows belong to the built-in engine"),
    (["--engine", "vllm", "--tp", "2"], "--tp belong to the built-in engine"),
    (["--max-batch-tokens", "0"], "--max-batch-tokens must be >= 1"),
    (["--dtype", "float16"], "invalid choice: 'float16'"),
    (["--engine", "vllm", "--vllm-tp", "0"], "--vllm-tp must be >= 1"),
    (["--vllm-kv-cache-bytes", "1000", "--enforce-eager"],
     "--vllm-kv-cache-bytes, --enforce-eager belong to --engine vllm"),
    (["--engine", "vllm", "--temperature", "0", "--num-samples", "2"], "only with --num-samples 1, got 2"),
])
def test_engine_flag_errors(flags, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        evaluate.parse_args(["--model", "m", "--output-dir", "o", *flags])
    assert evaluate.parse_args(["--model", "m", "--output-dir", "o"]).dtype == "float32"
    assert evaluate.parse_args(["--model", "m", "--output-dir", "o", "--engine", "vllm"]).dtype == "bfloat16"


@pytest.mark.slow
def test_vllm_engine_without_vllm_is_a_user_error(tmp_path):
    """Where vLLM is not installed (this venv; tests/test_rollout_vllm.py runs it where it is): exit 2, one line."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    from tiny_models import make_tiny_qwen2

    make_tiny_qwen2(tmp_path / "model", vocab_size=400, num_layers=2)  # a whole Hugging Face model: the path passes
    model_dir = build_hf_tokenizer_dir(str(tmp_path / "model"))
    res = subprocess.run([sys.executable, "-m", "megatron_gtpo.evaluate", "--engine", "vllm", "--model", model_dir,
                          "--datasets", "aime24", "--output-dir", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "megatron_gtpo.evaluate: error: --engine vllm needs vLLM, which does not import (" in res.stderr
    assert "Traceback" not in res.stderr


def test_vllm_replica_gpus_follow_the_local_rank(monkeypatch):
    """--engine vllm: local rank r of a node drives GPUs r x TP .. (r + 1) x TP - 1 of those the node shows it."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert replicas.replica_cuda_devices(2, 8) == "6,7"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2,4,6,8,10,12,14")
    assert replicas.replica_cuda_devices(1, 8) == "2"
    with pytest.raises(ValueError, match=r"8 replica\(s\) on this node x --vllm-tp 2 need 16 GPUs, the node shows "
                                         r"8; launch --nproc_per_node 4"):
        replicas.replica_cuda_devices(2, 8)


def test_a_synthetic_tasks_checkpoint_is_evaluated_on_its_task(tmp_path, capsys):
    """The demo's checkpoint (a synthetic task, its tokenizer built in code): evaluated on its task's problems with
    its tokenizer and reward (the answer's digits, then EOS) and the run's response length; the text datasets'
    flags are refused naming the task; its HF export says why it has no tokenizer and how to evaluate it."""
    import importlib.util

    import transformers

    from megatron_gtpo.checkpoint import convert_hf_to_megatron
    from megatron_gtpo.checkpoint.manifest import write_manifest
    from megatron_gtpo.data.synthetic import CharTokenizer, addition_problems, tiny_model_hf_config

    config = tiny_model_hf_config()
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))
    model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000250"
    checkpoint.parent.mkdir(parents=True)
    convert_hf_to_megatron(str(tmp_path / "hf"), str(checkpoint), progress=False)
    meta = checkpoint / "megatron_gtpo_checkpoint.json"
    record = json.loads(meta.read_text())
    record["extra"].update(synthetic_task="addition", max_new_tokens=4)  # as the trainer writes it
    meta.write_text(json.dumps(record))
    write_manifest(str(checkpoint))
    (checkpoint.parent / "latest").write_text("step_00000250\n")

    tokenizer = CharTokenizer()
    problems = addition_problems()

    class AdditionEngine:
        """Answers a+b right (digits, EOS) for a+b even, wrong (digits, no EOS: unfinished) otherwise."""

        def __init__(self):
            self.calls = []

        def generate(self, prompts, params):
            self.calls.append((len(prompts), params.max_new_tokens, prompts[0]))
            outputs = []
            for prompt in prompts:
                a, b = (int(c) for c in tokenizer.decode(prompt).rstrip("=").split("+"))
                ids = tokenizer.encode(str(a + b)) + ([tokenizer.eos_token_id] if (a + b) % 2 == 0 else [])
                outputs.append([Response(ids, [0.0] * len(ids), "stop")] * params.n)
            return Responses.from_lists(outputs)

    engine = AdditionEngine()
    summary = evaluate.main(
        ["--model", str(checkpoint.parent), "--output-dir", str(tmp_path / "eval"), "--num-samples", "2",
         "--num-reward-workers", "1"],
        replica_factory=lambda args, tok: replicas.Replica(engine, replicas.ReplicaShare(), tok.eos_token_id,
                                                           vocab_size=tok.vocab_size, max_positions=64))
    even = sum((int(p.answer) % 2 == 0) for p in problems) / len(problems)
    assert summary["addition"]["mean@2"] == pytest.approx(even) and summary["addition"]["num_problems"] == 100
    assert engine.calls[0][1:] == (4, list(problems[0].prompt_token_ids))  # the run's length, the task's prompt
    for flags in (["--datasets", "aime24"], ["--tokenizer", str(tmp_path)], ["--plain"]):
        with pytest.raises(ValueError, match=f"^{flags[0]}: {re.escape(str(checkpoint))} was trained on the "
                                             f"synthetic task 'addition'"):
            evaluate.main(["--model", str(checkpoint), "--output-dir", str(tmp_path / "e"), *flags])
    spec = importlib.util.spec_from_file_location("to_hf", os.path.join(os.path.dirname(__file__), "..", "tools",
                                                                       "convert_megatron_to_hf.py"))
    to_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(to_hf)
    capsys.readouterr()
    assert to_hf.main(["--megatron-dir", str(checkpoint), "--output-dir", str(tmp_path / "exported"), "--quiet"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        f"no tokenizer written: {checkpoint} was trained on the synthetic task 'addition', whose character tokenizer "
        f"is built in code (megatron_gtpo.data.synthetic_tasks), not saved with it; evaluate the checkpoint on its "
        f"task with python -m megatron_gtpo.evaluate --model {checkpoint} --output-dir DIR")
