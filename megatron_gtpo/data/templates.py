"""Prompt text and tokenization: the instructions around a problem, then a chat or a plain template.

    user text = prefix + problem + suffix
    prompt    = tokenizer.apply_chat_template([system?, user])    (chat=True)
              | plain_format with "{problem}" replaced by the user text   (chat=False)

Two instruction styles are predefined: BOXED_TEMPLATE (answer in \\boxed{}, MATH/AIME evaluation style) and
DAPO_TEMPLATE (DAPO-Math-17k's own prompt, answer on a last line "Answer: ...", verbatim from upstream).
DATA_TEMPLATES maps the training config's `data.template` to its template.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

from megatron_gtpo.data.records import PromptRecord, PromptSample
from megatron_gtpo.data.tokenizer import Tokenizer
from megatron_gtpo.progress import progress_bar

logger = logging.getLogger(__name__)

BOXED_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
PROBLEM_PLACEHOLDER = "{problem}"


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    """How a problem becomes prompt text (see the module docstring). `system_prompt` is chat-only."""

    prefix: str = ""
    suffix: str = ""
    chat: bool = True
    system_prompt: str | None = None
    plain_format: str = PROBLEM_PLACEHOLDER

    def __post_init__(self):
        if self.plain_format.count(PROBLEM_PLACEHOLDER) != 1:
            raise ValueError(
                f"plain_format must contain {PROBLEM_PLACEHOLDER!r} exactly once, got {self.plain_format!r}"
            )
        if self.system_prompt is not None and not self.chat:
            raise ValueError("system_prompt needs chat=True (a plain template has no system turn)")

    def user_text(self, problem: str) -> str:
        return self.prefix + problem + self.suffix

    def render(self, problem: str, tokenizer: Tokenizer) -> str:
        text = self.user_text(problem)
        if not self.chat:
            return self.plain_format.replace(PROBLEM_PLACEHOLDER, text)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        messages.append({"role": "user", "content": text})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


BOXED_TEMPLATE = PromptTemplate(suffix=BOXED_SUFFIX)
DAPO_TEMPLATE = PromptTemplate(prefix=DAPO_PREFIX, suffix=DAPO_SUFFIX)
PROMPT_STYLES = {"boxed": BOXED_TEMPLATE, "dapo": DAPO_TEMPLATE}
# data.template: chat = the boxed instruction in the tokenizer's chat template, dapo = DAPO's prompt in it,
# plain = the prompt field as it is (no instruction, no chat markup: a dataset whose prompts are complete).
DATA_TEMPLATES = {"chat": BOXED_TEMPLATE, "dapo": DAPO_TEMPLATE, "plain": PromptTemplate(chat=False)}


def tokenize_prompts(
    records: Sequence[PromptRecord],
    tokenizer: Tokenizer,
    template: PromptTemplate,
    *,
    max_prompt_tokens: int | None = None,
    progress: bool = False,
) -> list[PromptSample]:
    """Render and tokenize every record; samples are indexed by their position in the returned list.

    Prompts longer than `max_prompt_tokens` are dropped (the count is logged); dropping all is an error.
    """
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1 or None, got {max_prompt_tokens!r}")
    samples: list[PromptSample] = []
    num_too_long = 0
    for record in progress_bar(records, desc="tokenizing prompts", disable=not progress):
        token_ids = tuple(tokenizer.encode(template.render(record.problem, tokenizer)))
        if max_prompt_tokens is not None and len(token_ids) > max_prompt_tokens:
            num_too_long += 1
            continue
        samples.append(PromptSample(index=len(samples), id=record.id, prompt_token_ids=token_ids, answer=record.answer))
    if num_too_long:
        logger.warning("dropped %d of %d prompts longer than %d tokens", num_too_long, len(records), max_prompt_tokens)
    if not samples:
        raise ValueError(f"no prompt left: all {len(records)} are longer than max_prompt_tokens={max_prompt_tokens}")
    return samples
