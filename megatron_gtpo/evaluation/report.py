"""The evaluation report: <output-dir>/eval_results.json (settings, summary, per-problem results), eval_results.csv
(one row per problem) and eval_responses.jsonl (one row per response), each written atomically; and the summary as
a table."""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from typing import Mapping, Sequence

from megatron_gtpo.atomic_files import write_atomically

from .passk import ProblemResult, pass_at_k, summarize

RESULTS_JSON = "eval_results.json"
RESULTS_CSV = "eval_results.csv"
RESPONSES_JSONL = "eval_responses.jsonl"


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
    write_atomically(os.path.join(output_dir, RESULTS_JSON), json.dumps(report, indent=1, ensure_ascii=False) + "\n")

    csv_text = io.StringIO()
    writer = csv.writer(csv_text)
    writer.writerow(
        ["dataset", "problem_id", "answer", "num_samples", "num_correct", "accuracy", *(f"pass@{k}" for k in ks)]
    )
    for name, results in results_by_dataset.items():
        for r in results:
            writer.writerow([name, r.problem_id, r.answer, r.num_samples, r.num_correct, r.num_correct / r.num_samples,
                             *(pass_at_k(r.num_samples, r.num_correct, k) for k in ks)])
    write_atomically(os.path.join(output_dir, RESULTS_CSV), csv_text.getvalue())
    rows = [{"dataset": name, "problem_id": r.problem_id, "sample_index": i, "response": response,
             "extracted_answer": extracted, "correct": correct}
            for name, results in results_by_dataset.items() for r in results
            for i, (response, extracted, correct) in enumerate(zip(r.responses, r.predicted_answers, r.correct))]
    write_atomically(os.path.join(output_dir, RESPONSES_JSONL),
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
