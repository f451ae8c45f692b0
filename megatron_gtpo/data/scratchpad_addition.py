"""Three-digit addition with a written scratchpad: the synthetic task on which token-level credit assignment matters
(the algorithm study, tools/compare_algorithms.py).

A problem is "374+658="; the reference response writes one step per column, least significant first, each with the
carry coming in, then the answer after ':':

    4+8+0=12,7+5+1=13,3+6+1=10:1032</s>

Why this shape:
- Responses are 31-32 tokens, and correctness is decided by a few of them: the two-digit sums of the three columns
  (each a lookup in the addition table plus the carry copied from the previous step) and the answer digits copied
  back from them. The other tokens (operand digits copied from the prompt, the fixed punctuation) are easy. An
  outcome-only reward then leaves the algorithm to find which tokens a failure came from: the credit-assignment
  problem that GTPO / GRPO-S address with entropy-weighted rewards, and that the single-digit task (2-3 response
  tokens) does not have.
- The reward is outcome-only: 1.0 when the text after the last ':' equals the sum and the response ends with EOS,
  whatever the scratchpad says; 0.0 otherwise.
- Training and held-out problems are disjoint unordered operand pairs drawn from one seeded shuffle, so held-out
  accuracy measures the addition skill, not recall of trained problems (810,000 ordered pairs exist; a run sees a
  few thousand).
- Carries make the task graded: a problem with no carry is easier than one whose carry ripples through every column,
  so a partly trained model gets some problems right, which gives RL groups with mixed rewards to learn from.
- The vocabulary is 14 characters, so a tiny Qwen2-shaped model (hidden 64, 2 layers; `tiny_model_hf_config`) runs
  a generation of 32 tokens fast on one CPU core, and a short supervised warm start on the reference responses
  brings it to a partial held-out accuracy that RL can improve.
"""
from __future__ import annotations

import random

from .records import PromptSample
from . import synthetic
from .synthetic import BOS_ID, EOS_ID, CharTokenizer

SYMBOLS = "0123456789+=,:"
VOCAB_SIZE = 20
DIGITS = 3
_SPLIT_SEED = 20240820
NUM_HELDOUT = 128
NUM_TRAIN = 4096
_EOS_TEXT = "</s>"  # how CharTokenizer.decode writes EOS


def tokenizer() -> CharTokenizer:
    return CharTokenizer(SYMBOLS, VOCAB_SIZE)


def scratchpad(a: int, b: int) -> str:
    """The reference response text (without EOS): one "x+y+carry=ss" step per column, lowest first, then ':sum'."""
    steps, carry = [], 0
    for i in range(DIGITS):
        x, y = a // 10**i % 10, b // 10**i % 10
        total = x + y + carry
        steps.append(f"{x}+{y}+{carry}={total:02d}")
        carry = total // 10
    return ",".join(steps) + f":{a + b}"


def final_answer(response: str) -> str | None:
    """The answer of a decoded response: the text between the last ':' and the closing EOS; None if it has neither."""
    if not response.endswith(_EOS_TEXT) or ":" not in response:
        return None
    return response[:-len(_EOS_TEXT)].rsplit(":", 1)[1]


def reward(response: str, reference: str) -> float:
    """Outcome-only: 1.0 when the decoded response's final answer is the reference sum, else 0.0."""
    return 1.0 if final_answer(response) == reference else 0.0


def _operand_pairs() -> list[tuple[int, int]]:
    """NUM_HELDOUT + NUM_TRAIN distinct unordered pairs of DIGITS-digit operands, in a fixed seeded order."""
    rng = random.Random(_SPLIT_SEED)
    low, high = 10 ** (DIGITS - 1), 10**DIGITS - 1
    seen, pairs = set(), []
    while len(pairs) < NUM_HELDOUT + NUM_TRAIN:
        a, b = rng.randint(low, high), rng.randint(low, high)
        if (min(a, b), max(a, b)) not in seen:
            seen.add((min(a, b), max(a, b)))
            pairs.append((a, b))
    return pairs


def _samples(pairs: list[tuple[int, int]], split: str) -> list[PromptSample]:
    tok = tokenizer()
    return [PromptSample(index=i, id=f"{split}-{a}+{b}", prompt_token_ids=(BOS_ID, *tok.encode(f"{a}+{b}=")),
                         answer=str(a + b)) for i, (a, b) in enumerate(pairs)]


def train_problems() -> list[PromptSample]:
    return _samples(_operand_pairs()[NUM_HELDOUT:], "train")


def heldout_problems() -> list[PromptSample]:
    return _samples(_operand_pairs()[:NUM_HELDOUT], "heldout")


def demonstration(sample: PromptSample) -> list[int]:
    """The warm start's target response for a problem: its scratchpad, then EOS."""
    a, b = map(int, tokenizer().decode(sample.prompt_token_ids).rstrip("=").split("+"))
    return tokenizer().encode(scratchpad(a, b)) + [EOS_ID]


def tiny_model_hf_config() -> dict:
    """The Qwen2 config.json of the study's model (synthetic.tiny_model_hf_config at this vocabulary): prompt 9 +
    response 32 tokens fit its 64 positions."""
    return synthetic.tiny_model_hf_config(VOCAB_SIZE)
