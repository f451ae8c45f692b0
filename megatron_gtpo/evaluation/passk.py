"""Metrics, per dataset, from c correct out of n samples per problem, averaged over problems:
- Mean@n: c / n, the expected accuracy of one sample (Mean@k for any k <= n has the same unbiased estimate);
- Pass@k: the unbiased estimator 1 - C(n-c, k) / C(n, k) of "at least one of k samples is correct"
  (Chen et al. 2021), computed as a product so that it never forms huge binomials.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence


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
