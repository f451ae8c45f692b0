"""Arithmetic target (a small Countdown): reach a target from four digits with +, - and *, in as many attempts as the
response likes. The synthetic task on which exploration can pay (the entropy methods' study, docs/algorithms.md).

A problem is "3 1 9 8:70=" (four digits, a target); a response writes steps "x op y=z" separated by ',', each taking
two numbers still available (the problem's digits and the results of the attempt's earlier steps, each used once)
and giving one new number; a ';' abandons the attempt and starts again from the digits. Three correct responses:

    3-1=2,9*8=72,72-2=70</s>
    8*9=72,72-3=69,69+1=70</s>
    8*9=72,72-3=69;9*8=72,3-1=2,72-2=70</s>      (the first attempt ends at 69; the second reaches 70)

The reward reads only the LAST attempt: 1.0 when its every step is well-formed, takes available numbers, computes
correctly (subtraction only with x >= y, no leading zeros) and its last step gives the target, and the response
ends with EOS; else 0.0.

Why it qualifies for the study:
- several correct responses per problem: the generator keeps targets with at least MIN_SOLUTIONS step sequences
  that reach them (`count_solutions`), and operand order within a step, which steps come first, and other subsets
  of the digits all give further correct texts;
- free length: solutions take 2 or 3 steps, and a response may write failed attempts before the one it is scored
  on, so the policy may write more or less; no target is one step away (at least two steps are needed);
- held out: no held-out problem shares its digits (as a multiset) with a training problem; the multisets are split
  by one seeded shuffle, at most HELDOUT_PER_DIGITS problems each for the held-out set;
- a tiny Qwen2-shaped model (hidden 64, 2 layers, 128 positions) runs it on a CPU core, as the other synthetic
  tasks. After the study's warm start (examples/algorithm_study_v2.yaml) its held-out Pass@1 was 0.087, inside the
  study's band (0.05-0.30), and Pass@64 0.74, 0.57-0.70 after 60 DAPO steps (below 0.9): most failures are
  well-formed attempts that miss the target, so more attempts and other attempts pay.

The warm start's demonstration of a problem is a shortest solution (the first the search finds) after 0 to
MAX_FAILED_ATTEMPTS failed attempts (the format of trying again until the target is reached): with one failed
attempt in a third of them, the warm-started model's held-out Mean@16 was half of what it is with 0-3 (measured in
benchmarks/results/algorithms_v2.md).
"""
from __future__ import annotations

import itertools
import random
import re
from collections import Counter
from functools import lru_cache

from . import synthetic
from .records import PromptSample
from .synthetic import BOS_ID, EOS_ID, CharTokenizer

SYMBOLS = "0123456789+-*=,; :"
VOCAB_SIZE = 24
NUM_DIGITS = 4
DIGIT_RANGE = (1, 9)
MIN_SOLUTIONS = 2
NUM_HELDOUT = 128
HELDOUT_PER_DIGITS = 2
MAX_FAILED_ATTEMPTS = 3  # before the solution in the warm start's demonstrations
_SPLIT_SEED = 20261127
_EOS_TEXT = "</s>"  # how CharTokenizer.decode writes EOS
_STEP = re.compile(r"(\d+)([+\-*])(\d+)=(\d+)")
_OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


def tokenizer() -> CharTokenizer:
    return CharTokenizer(SYMBOLS, VOCAB_SIZE)


def _apply(pool: tuple[int, ...], x: int, op: str, y: int) -> tuple[int, ...] | None:
    """The pool after the step x op y (x and y taken from it, the result added), or None where the step is not
    allowed: a number not available, subtraction below zero."""
    remaining = list(pool)
    for n in (x, y):
        if n not in remaining:
            return None
        remaining.remove(n)
    if op == "-" and x < y:
        return None
    return tuple(sorted(remaining + [_OPS[op](x, y)]))


def score_attempt(digits: tuple[int, ...], attempt: str, target: int) -> bool:
    """Whether `attempt` ("x op y=z,..." with no ';') reaches `target` from `digits` by allowed, correct steps."""
    pool, result = tuple(sorted(digits)), None
    for step in attempt.split(","):
        match = _STEP.fullmatch(step)
        if match is None:
            return False
        x, op, y, z = int(match[1]), match[2], int(match[3]), int(match[4])
        pool = _apply(pool, x, op, y)
        if pool is None or _OPS[op](x, y) != z or any(len(s) > 1 and s[0] == "0" for s in match.group(1, 3, 4)):
            return False
        result = z
    return result == target


def parse_prompt(prompt: str) -> tuple[tuple[int, ...], int]:
    """(digits, target) of a prompt's text "d d d d:target="."""
    digits, target = prompt.rstrip("=").split(":")
    return tuple(int(d) for d in digits.split(" ")), int(target)


def reward(response: str, reference: str) -> float:
    """Outcome-only: 1.0 when the response ends with EOS and its last attempt reaches the target (module doc).
    `reference` is the problem's prompt text (its digits and target: the answer is not unique)."""
    if not response.endswith(_EOS_TEXT):
        return 0.0
    digits, target = parse_prompt(reference)
    return 1.0 if score_attempt(digits, response[:-len(_EOS_TEXT)].rsplit(";", 1)[-1], target) else 0.0


def _steps(pool: tuple[int, ...]):
    """(x, op, y, pool after) for every allowed step from the sorted `pool`, commutative steps once (x >= y)."""
    values = sorted(set(pool))
    for x in values:
        for y in values:
            if y > x or (x == y and pool.count(x) < 2):
                continue
            for op in _OPS:
                yield x, op, y, _apply(pool, x, op, y)


@lru_cache(maxsize=65536)
def _reachable(pool: tuple[int, ...]) -> dict[int, tuple[int, str]]:
    """value -> (number of step sequences from the sorted `pool` whose last step gives it, one shortest such
    sequence's text). Commutative steps count once (x >= y); a sequence may leave numbers unused."""
    counts: Counter = Counter()
    shortest: dict[int, str] = {}

    def found(value: int, n: int, text: str) -> None:
        counts[value] += n
        if value not in shortest or len(text) < len(shortest[value]):
            shortest[value] = text

    for x, op, y, after in _steps(pool):
        z = _OPS[op](x, y)
        step = f"{x}{op}{y}={z}"
        found(z, 1, step)
        for value, (n, rest) in _reachable(after).items():
            found(value, n, step + "," + rest)
    return {value: (n, shortest[value]) for value, n in counts.items()}


def count_solutions(digits: tuple[int, ...], target: int) -> int:
    """The number of step sequences (commutative steps once) from `digits` whose last step gives `target`."""
    return _reachable(tuple(sorted(digits))).get(target, (0, ""))[0]


def _one_step_values(digits: tuple[int, ...]) -> set[int]:
    return {_OPS[op](x, y) for x, op, y, _ in _steps(tuple(sorted(digits)))}


def _problems() -> tuple[list, list]:
    """(held-out, train) problems (digits, target) in a fixed seeded order: targets 10-99 that no single step reaches
    and at least MIN_SOLUTIONS step sequences do. The digit multisets are split, not the problems: no held-out
    problem shares its digits with a training one. Held out: HELDOUT_PER_DIGITS problems of each of the first
    multisets, NUM_HELDOUT in all (the other targets of those multisets are not used)."""
    lo, hi = DIGIT_RANGE
    multisets = sorted({tuple(sorted(c)) for c in itertools.combinations_with_replacement(range(lo, hi + 1),
                                                                                         NUM_DIGITS)})
    rng = random.Random(_SPLIT_SEED)
    rng.shuffle(multisets)
    heldout, train = [], []
    for digits in multisets:
        one_step = _one_step_values(digits)
        targets = [v for v, (n, _) in sorted(_reachable(digits).items())
                   if 10 <= v <= 99 and n >= MIN_SOLUTIONS and v not in one_step]
        rng.shuffle(targets)
        problems = [(tuple(rng.sample(digits, len(digits))), t) for t in targets]
        if len(heldout) < NUM_HELDOUT:
            heldout.extend(problems[:HELDOUT_PER_DIGITS])
        else:
            train.extend(problems)
    _reachable.cache_clear()
    rng.shuffle(train)
    return heldout[:NUM_HELDOUT], train


def prompt_text(digits: tuple[int, ...], target: int) -> str:
    return " ".join(map(str, digits)) + f":{target}="


def _samples(problems, split: str) -> list[PromptSample]:
    tok = tokenizer()
    return [PromptSample(index=i, id=f"{split}-{prompt_text(d, t)}", prompt_token_ids=(BOS_ID, *tok.encode(
        prompt_text(d, t))), answer=prompt_text(d, t)) for i, (d, t) in enumerate(problems)]


def train_problems() -> list[PromptSample]:
    return _samples(_problems()[1], "train")


def heldout_problems() -> list[PromptSample]:
    return _samples(_problems()[0], "heldout")


def demonstration(sample: PromptSample) -> list[int]:
    """The warm start's target response: `sample.index % (MAX_FAILED_ATTEMPTS + 1)` failed attempts (shortest
    sequences of two or more steps to other reachable values, picked by a generator seeded with the index), each
    abandoned with ';', then a shortest solution and EOS: the format of trying again until the target is reached."""
    digits, target = parse_prompt(sample.answer)
    reachable = _reachable(tuple(sorted(digits)))
    wrong = [v for v in sorted(reachable) if v != target and "," in reachable[v][1]]
    failed = random.Random(sample.index).sample(wrong, sample.index % (MAX_FAILED_ATTEMPTS + 1))
    return tokenizer().encode(";".join([*(reachable[v][1] for v in failed), reachable[target][1]])) + [EOS_ID]


def tiny_model_hf_config() -> dict:
    """The Qwen2 config.json of the study's model (synthetic.tiny_model_hf_config at this vocabulary, with 128
    positions: prompt 12 + responses of several attempts)."""
    return {**synthetic.tiny_model_hf_config(VOCAB_SIZE), "max_position_embeddings": 128}
