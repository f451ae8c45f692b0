"""Math answer verification: pull the final answer out of a response and compare it with the reference.

Extraction (our rules, so they are explicit and testable; math-verify only compares):
- the final answer is whichever comes LAST in the response: the last `\\boxed{...}` (or `\\fbox{...}`),
  or the last "Answer: ..." line (DAPO's prompt asks for `Answer: $Answer` on the last line);
- braces inside a boxed answer are matched (`\\boxed{\\frac{1}{2}}`, `\\boxed{\\{1,2\\}}`); a last `\\boxed{`
  that never closes (a truncated response) means there is no answer, we do not fall back to an earlier one;
- the extracted text is cleaned of end-of-turn tokens left by decoding (`<|im_end|>`, `</s>`), markdown bold,
  math delimiters ($...$, \\(...\\), \\[...\\]), a trailing period, whitespace runs (one space is kept) and LaTeX
  thin spaces between digits (`1\\,000`, `10,\\!000`); the reference is cleaned the same way.

Comparison: both sides are parsed by math-verify from `\\boxed{<cleaned>}` and compared with
`math_verify.verify(gold, prediction)`: symbolic and numeric equality, fractions vs decimals, integers with
thousands separators, sets and tuples, intervals, equations such as `x=5` vs `5`, percentages, `\\text{}`.

`verify_math_answer` runs in the calling process WITHOUT any time limit: math-verify's own timeouts use
SIGALRM, which only works in the main thread and clashes with our worker's own timer, so they are switched
off here. Pathological answers (`9^{9^{9^{9}}}`) make sympy run for minutes; the time limit lives in the
worker processes of `RewardPool`, and `math_reward` (the public entry) always goes through one.
"""
from __future__ import annotations

import functools
import logging
import re
import threading

try:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
except ImportError as err:  # math-verify is a hard dependency: no format-only fallback exists
    raise ImportError(
        "megatron_gtpo.rewards needs the `math-verify` package to verify math answers; install it with "
        "`pip install 'math-verify>=0.7'`"
    ) from err

from megatron_gtpo.rewards.pool import RewardPool

# Seconds one guarded verification may take (extraction + parsing + comparison) before it scores 0.0.
DEFAULT_TIMEOUT_S = 5.0

_EXTRACTION_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "Answer:" anywhere on a line, also "**Answer:**" and "**Answer**:"; the answer is the rest of that line.
_ANSWER_LINE_RE = re.compile(r"(?i)\banswer\b[*\s]*:(?P<answer>[^\n]*)")
_WHITESPACE_RUN_RE = re.compile(r"\s+")
_THIN_SPACE_BETWEEN_DIGITS_RE = re.compile(r"(?<=[\d,])\\[,!;:](?=\s*\d)")
_MATH_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
# End-of-turn tokens left in text decoded without skip_special_tokens ("Answer: 5<|im_end|>").
_TRAILING_SPECIAL_TOKEN_RE = re.compile(r"(?:<\|[A-Za-z0-9_]+\|>|</s>|<eos>)$")


class _DropDisabledTimeoutWarning(logging.Filter):
    """math-verify warns once per process that its timeout is disabled; we disable it on purpose (see above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())


def _matching_brace_end(text: str, open_brace_pos: int) -> int | None:
    """Index just past the `}` closing the `{` at open_brace_pos, or None if it never closes.

    A backslash escapes the next character, so `\\{` and `\\}` (set braces) do not count and `\\\\` is skipped.
    """
    depth = 0
    pos = open_brace_pos
    while pos < len(text):
        char = text[pos]
        if char == "\\":
            pos += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return pos + 1
        pos += 1
    return None


def _clean_answer(text: str) -> str:
    """Strip end-of-turn tokens, markdown, enclosing math delimiters, a trailing period; collapse whitespace;
    drop thin spaces between digits."""
    text = text.strip()
    while (special_token := _TRAILING_SPECIAL_TOKEN_RE.search(text)) is not None:
        text = text[: special_token.start()].rstrip()
    text = text.strip("*").strip()
    text = text.removesuffix(".").strip()
    for opening, closing in _MATH_DELIMITERS:
        if len(text) >= len(opening) + len(closing) and text.startswith(opening) and text.endswith(closing):
            text = text[len(opening) : len(text) - len(closing)].strip()
            break
    text = text.removesuffix(".").strip()
    # LaTeX reads a whitespace run as one space; long runs make math-verify's regexes take seconds.
    text = _WHITESPACE_RUN_RE.sub(" ", text)
    return _THIN_SPACE_BETWEEN_DIGITS_RE.sub("", text)


def extract_final_answer(response: str) -> str | None:
    """The response's final answer as cleaned text, or None when it has none (see the module docstring)."""
    boxed_matches = list(_BOXED_RE.finditer(response))
    answer_matches = list(_ANSWER_LINE_RE.finditer(response))
    last_boxed = boxed_matches[-1] if boxed_matches else None
    last_answer_line = answer_matches[-1] if answer_matches else None
    if last_boxed is None and last_answer_line is None:
        return None
    if last_boxed is not None and (last_answer_line is None or last_boxed.start() > last_answer_line.start()):
        open_brace_pos = last_boxed.end() - 1
        close_end = _matching_brace_end(response, open_brace_pos)
        if close_end is None:
            return None
        answer = _clean_answer(response[open_brace_pos + 1 : close_end - 1])
    else:
        answer = _clean_answer(last_answer_line.group("answer"))
    return answer or None


@functools.lru_cache(maxsize=4096)
def _parse_answer(cleaned_answer: str) -> tuple:
    """math-verify's parse of an already extracted answer; cached because each reference recurs G times."""
    return tuple(
        parse("\\boxed{" + cleaned_answer + "}", extraction_config=_EXTRACTION_CONFIG, parsing_timeout=None)
    )


def verify_math_answer(response: str, reference: str) -> float:
    """1.0 if the response's final answer equals the reference answer mathematically, else 0.0.

    Runs in the calling process with NO time limit (see the module docstring); use `math_reward` or a
    `RewardPool` around this function to guard against pathological expressions.
    """
    reference_answer = _clean_answer(reference)
    if not reference_answer:
        raise ValueError(f"reference answer is empty: {reference!r}")
    predicted_answer = extract_final_answer(response)
    if predicted_answer is None:
        return 0.0
    gold = _parse_answer(reference_answer)
    prediction = _parse_answer(predicted_answer)
    if not gold or not prediction:
        return 0.0
    return 1.0 if verify(list(gold), list(prediction), timeout_seconds=None) else 0.0


_default_pool: RewardPool | None = None
_default_pool_lock = threading.Lock()


def math_reward(response: str, reference: str) -> float:
    """1.0 if the response's final answer equals the reference mathematically, else 0.0; safe from any thread.

    The verification runs in a worker process shared by all callers in this process (started on first use,
    ~1 s), under a DEFAULT_TIMEOUT_S limit: a response whose verification takes longer gets reward 0.0. For
    batches, build a `RewardPool(verify_math_answer, num_workers=...)` and call its `rewards`.
    """
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = RewardPool(verify_math_answer, num_workers=1, timeout_s=DEFAULT_TIMEOUT_S)
        reward_pool = _default_pool
    return reward_pool.rewards([response], [reference])[0]
