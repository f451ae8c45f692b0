"""The synthetic tasks built in code, selected by `data.task` (with `data.source: synthetic`): each has its
problems, a held-out split where it has one, a character tokenizer, an outcome reward on decoded text, the warm
start's reference response and the Qwen2 config of its tiny model (`model.tiny_synthetic`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import arithmetic_target, scratchpad_addition, synthetic
from .records import PromptSample


@dataclass(frozen=True)
class SyntheticTask:
    train_problems: Callable[[], list[PromptSample]]
    heldout_problems: Callable[[], list[PromptSample]] | None  # None: no held-out split
    tokenizer: Callable[[], synthetic.CharTokenizer]
    reward: Callable[[str, str], float]  # (decoded response, reference answer) -> reward
    demonstration: Callable[[PromptSample], list[int]]  # the warm start's target response token ids
    tiny_model_hf_config: Callable[[], dict]


SYNTHETIC_TASKS = {
    "addition": SyntheticTask(synthetic.addition_problems, None, synthetic.CharTokenizer,
                              synthetic.exact_match_reward, lambda p: synthetic.answer_token_ids(p.answer),
                              synthetic.tiny_model_hf_config),
    "scratchpad_addition": SyntheticTask(
        scratchpad_addition.train_problems, scratchpad_addition.heldout_problems, scratchpad_addition.tokenizer,
        scratchpad_addition.reward, scratchpad_addition.demonstration, scratchpad_addition.tiny_model_hf_config),
    "arithmetic_target": SyntheticTask(
        arithmetic_target.train_problems, arithmetic_target.heldout_problems, arithmetic_target.tokenizer,
        arithmetic_target.reward, arithmetic_target.demonstration, arithmetic_target.tiny_model_hf_config),
}
