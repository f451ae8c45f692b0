"""Math verifier on reference answers of the public datasets, rewritten in equivalent forms, and adversarial cases.

Every case is scored through one RewardPool(verify_math_answer, num_workers=2), the batch path the trainer
uses. Expected rewards come from how each case is built (an equivalent rewriting must score 1.0, another
problem's different answer 0.0), not from the verifier.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from fractions import Fraction

import pytest

from megatron_gtpo.rewards import RewardPool, extract_final_answer, verify_math_answer

# Full-size answer sets, used when present: the repository's data/ (where the README's "From a Hugging Face model"
# puts the training data) with dapo_math_17k.jsonl and gsm8k_test.jsonl (GSM8K's test split as {problem, answer}).
DATA_DIR = os.path.join(os.path.dirname(__file__), "..", "data")
EVAL_SETS_DIR = os.path.join(os.path.dirname(__file__), "..", "megatron_gtpo", "data", "eval_sets")


def _answers(path: str, every: int) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["answer"] for line in f][::every]


def _sampled_answers() -> dict[str, list[str]]:
    """Deterministic samples: all of MATH-500 and AIME, every 10th GSM8K answer, every 100th DAPO answer."""
    answers = {name: _answers(os.path.join(EVAL_SETS_DIR, f"{name}.jsonl"), 1)
               for name in ("math500", "aime24", "aime25")}
    for name, file, every in (("gsm8k", "gsm8k_test.jsonl", 10), ("dapo", "dapo_math_17k.jsonl", 100)):
        if os.path.exists(os.path.join(DATA_DIR, file)):
            answers[name] = _answers(os.path.join(DATA_DIR, file), every)
    return answers


def _with_thousands_commas(integer_text: str) -> str:
    sign, digits = ("-", integer_text[1:]) if integer_text.startswith("-") else ("", integer_text)
    return sign + f"{int(digits):,}"


def _exact_decimal(value: Fraction) -> str | None:
    """The finite decimal expansion of value, or None if it has none (denominator not of the form 2^a 5^b)."""
    denominator = value.denominator
    twos = fives = 0
    while denominator % 2 == 0:
        denominator //= 2
        twos += 1
    while denominator % 5 == 0:
        denominator //= 5
        fives += 1
    if denominator != 1:
        return None
    places = max(twos, fives)
    scaled = abs(value.numerator) * 10**places // value.denominator
    text = str(scaled).rjust(places + 1, "0")
    return ("-" if value < 0 else "") + (text[:-places] + "." + text[-places:] if places else text)


_FRACTION_RE = re.compile(r"^(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}$")


def _equivalent_rewritings(answer: str) -> list[str]:
    """Answer texts that must verify against `answer`, built from its form (integers, numeric fractions, LaTeX)."""
    rewritten = [answer, f"  {answer}  ", f"${answer}$"]
    if "\\frac" in answer:
        rewritten.append(answer.replace("\\frac", "\\dfrac"))
    if re.fullmatch(r"-?\d+", answer):
        rewritten += [_with_thousands_commas(answer), f"{answer}.0", f"{int(answer):,}".replace(",", "{,}")]
    fraction = _FRACTION_RE.match(answer)
    if fraction:
        sign, numerator, denominator = fraction.groups()
        value = Fraction(int(sign + numerator), int(denominator))
        rewritten += [f"{sign}{numerator}/{denominator}", f"{sign}\\frac{{ {numerator} }}{{ {denominator} }}"]
        decimal = _exact_decimal(value)
        if decimal is not None:
            rewritten.append(decimal)
    return rewritten


def _response_forms(answer_text: str) -> list[str]:
    return [
        f"We simplify step by step.\nThus the result is $\\boxed{{{answer_text}}}$.",
        f"Let me think.\n\nAnswer: {answer_text}",
        f"**Answer:** {answer_text}.",
    ]


def _comparable(answer: str) -> str:
    """Key under which two reference answers count as the same, so a negative pair is really different."""
    return re.sub(r"^[a-z]\s*=", "", answer.replace(" ", "").replace("\\!", "").replace(",", ""))


@pytest.fixture(scope="module")
def reward_pool():
    # A generous limit: these tests are about answers, the limit itself is tested in test_rewards_pool.py,
    # and a shared 2-core machine can slow a 5 ms verification a hundredfold.
    with RewardPool(verify_math_answer, num_workers=2, timeout_s=60.0, chunk_size=32) as reward_pool:
        yield reward_pool


@pytest.mark.slow
def test_reference_answers_verify_in_equivalent_forms_and_not_against_other_answers(reward_pool):
    responses, references, expected, labels = [], [], [], []
    for dataset, answers in _sampled_answers().items():
        for position, answer in enumerate(answers):
            # the answer itself in every response form, each rewriting in one form (rotating, to bound the run time)
            positives = _response_forms(answer) + [
                _response_forms(rewritten)[(position + i) % 3]
                for i, rewritten in enumerate(_equivalent_rewritings(answer)[1:])
            ]
            for response in positives:
                responses.append(response)
                references.append(answer)
                expected.append(1.0)
                labels.append(f"{dataset}[{position}] {answer!r} <- {response!r}")
            other = next(
                (a for a in answers[position + 1 :] + answers[:position] if _comparable(a) != _comparable(answer)),
                None,
            )
            if other is not None:
                for response in _response_forms(other):
                    responses.append(response)
                    references.append(answer)
                    expected.append(0.0)
                    labels.append(f"{dataset}[{position}] {answer!r} must reject {response!r}")
    assert len(set(references)) > 300
    rewards = reward_pool.rewards(responses, references)
    wrong = [label for label, got, want in zip(labels, rewards, expected) if got != want]
    assert not wrong, f"{len(wrong)} of {len(labels)} cases wrong, e.g.:\n" + "\n".join(wrong[:80])
    assert reward_pool.stats.num_soft_timeouts == 0 and reward_pool.stats.num_killed == 0


@pytest.mark.parametrize(
    "response, reference, expected",
    [
        # several boxed answers: the last one is the final answer
        ("First guess \\boxed{1}, but correcting: \\boxed{2}", "2", 1.0),
        ("First guess \\boxed{1}, but correcting: \\boxed{2}", "1", 0.0),
        # "Answer:" lines and boxed answers: whichever comes last
        ("\\boxed{1}\nAnswer: 2", "2", 1.0),
        ("Answer: 2\nOn reflection, \\boxed{1}", "1", 1.0),
        ("Answer: 7\nhmm\nAnswer: 8", "8", 1.0),
        ("Answer: 7\nhmm\nAnswer: 8", "7", 0.0),
        ("answer: $\\frac{3}{4}$", "0.75", 1.0),
        ("Answer: \\boxed{12}", "12", 1.0),
        # no answer at all
        ("I think it is 5.", "5", 0.0),
        ("", "5", 0.0),
        # nested braces
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\boxed{\\left\\{1, 2\\right\\}}", "\\{2, 1\\}", 1.0),
        ("\\boxed{\\frac{\\sqrt{3}}{\\left(1+\\frac{1}{2}\\right)}}", "\\frac{2\\sqrt{3}}{3}", 1.0),
        # a last boxed answer that never closes (truncated response) is no answer, not the earlier one
        ("\\boxed{3} and then \\boxed{\\frac{1}{2}", "3", 0.0),
        # thin spaces and thousands separators
        ("\\boxed{1\\,000\\,000}", "1000000", 1.0),
        ("\\boxed{10,\\!080}", "10080", 1.0),
        ("\\boxed{1,2}", "12", 0.0),
        # end-of-turn tokens left by decoding without skip_special_tokens
        ("Answer: 5<|im_end|>", "5", 1.0),
        ("The sum is \\boxed{5}.</s>", "5", 1.0),
        ("Answer: $\\frac{1}{2}$.<|im_end|><|endoftext|>", "0.5", 1.0),
        # a huge whitespace run (math-verify's regexes are cubic in it) is collapsed, not a slow case
        pytest.param("Answer: 5" + " " * 50_000 + "x", "5", 0.0, id="huge-whitespace-run"),
        # equivalent forms that are not rewritings of a number
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{\\dfrac{\\pi}{2}}", "\\frac{\\pi}{2}", 1.0),
        ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("\\boxed{\\text{(C)}}", "\\text{(C)}", 1.0),
    ],
)
def test_adversarial_extraction(reward_pool, response, reference, expected):
    assert reward_pool.rewards([response], [reference]) == [expected]


def test_extract_final_answer_cleans_delimiters_and_markdown():
    assert extract_final_answer("so **Answer:** $\\frac{1}{2}$.") == "\\frac{1}{2}"
    assert extract_final_answer("\\boxed{ 42 }") == "42"
    assert extract_final_answer("\\fbox{7}") == "7"
    assert extract_final_answer("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert extract_final_answer("no answer here") is None
    assert extract_final_answer("Answer:   ") is None


def test_empty_reference_is_an_error():
    with pytest.raises(ValueError, match="reference answer is empty"):
        verify_math_answer("\\boxed{1}", "  $ $ ")


def test_missing_math_verify_names_the_package():
    hide_math_verify = "import sys; sys.modules['math_verify'] = None; import megatron_gtpo.rewards"
    result = subprocess.run([sys.executable, "-c", hide_math_verify], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "pip install 'math-verify>=0.7'" in result.stderr
