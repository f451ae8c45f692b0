"""The task: prompts, a tokenizer, a batched reward on decoded text and the model's HF config, built from the
config's data and model sections (`build_task`): a synthetic task built in code (data/synthetic_tasks.py), or math
problems from a JSONL file rewarded by math-verify in a pool of worker processes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_gtpo.config import ConfigError, TrainConfig


@dataclass
class Task:
    """Prompts (PromptSample items), a tokenizer and a batched reward on decoded text; a synthetic task also knows
    each prompt's reference response (the supervised warm start's target)."""

    samples: list
    tokenizer: object
    rewards: Callable[[list[str], list[str]], list[float]]  # (response texts, reference answers) -> rewards
    hf_config: dict
    demonstration: Callable[[object], list[int]] | None = None  # PromptSample -> reference response token ids


def check_prompt_lengths(samples: list, *, max_new_tokens: int, max_positions: int) -> None:
    """ConfigError naming the longest prompt when it and a whole response of `max_new_tokens` (rollout.max_new_tokens)
    exceed the model's `max_positions`: checked at start, so that a long prompt fails the run before its first step,
    not at the step that draws it (with partial rollouts: at a later segment, after the first passed)."""
    longest = max(samples, key=lambda sample: len(sample.prompt_token_ids))
    length = len(longest.prompt_token_ids)
    if length + max_new_tokens > max_positions:
        raise ConfigError(f"rollout.max_new_tokens: prompt {longest.id!r} has {length} tokens; with max_new_tokens = "
                          f"{max_new_tokens} that exceeds the model's {max_positions} positions (lower "
                          f"rollout.max_new_tokens, or data.max_prompt_tokens to drop the longer prompts)")


def _math_reward_pool(cfg: TrainConfig) -> Callable[[list[str], list[str]], list[float]]:
    """math-verify in a pool of worker processes with a per-item time limit (rewards.RewardPool), started on first
    use, so only the ranks that compute rewards (one per model replica) start workers."""
    from megatron_gtpo.rewards import RewardPool, verify_math_answer

    pool = []

    def rewards(texts: list[str], references: list[str]) -> list[float]:
        if not pool:
            pool.append(RewardPool(verify_math_answer, num_workers=cfg.data.reward_workers,
                                     timeout_s=cfg.data.reward_timeout_s))
        return pool[0].rewards(texts, references)

    return rewards


def build_task(cfg: TrainConfig) -> Task:
    if cfg.data.source == "synthetic":
        from megatron_gtpo.data.synthetic_tasks import SYNTHETIC_TASKS

        synthetic = SYNTHETIC_TASKS[cfg.data.task]
        hf_config = synthetic.tiny_model_hf_config() if cfg.model.tiny_synthetic else None
        return Task(synthetic.train_problems(), synthetic.tokenizer(),
                    lambda texts, refs: [synthetic.reward(t, r) for t, r in zip(texts, refs)],
                    hf_config or _model_hf_config(cfg), demonstration=synthetic.demonstration)
    from megatron_gtpo.data.datasets import load_dataset
    from megatron_gtpo.data.records import FieldMapping
    from megatron_gtpo.data.templates import DATA_TEMPLATES, tokenize_prompts
    from megatron_gtpo.data.tokenizer import load_tokenizer

    source = model_source(cfg)
    tokenizer = load_tokenizer(source.tokenizer_dir)
    records = load_dataset(cfg.data.path, FieldMapping(problem=cfg.data.prompt_field, answer=cfg.data.answer_field))
    samples = tokenize_prompts(records, tokenizer, DATA_TEMPLATES[cfg.data.template],
                               max_prompt_tokens=cfg.data.max_prompt_tokens)
    return Task(samples, tokenizer, _math_reward_pool(cfg), source.hf_config())


def _model_hf_config(cfg: TrainConfig) -> dict:
    return model_source(cfg).hf_config()


def model_source(cfg: TrainConfig):
    """The model `model.hf_dir` or `model.load` names (checkpoint.sources.ModelSource), checked to be of the kind
    the key says (ConfigError naming the key to use otherwise)."""
    from megatron_gtpo.checkpoint.sources import ModelSource

    key = "model.hf_dir" if cfg.model.hf_dir else "model.load"
    source = ModelSource.detect(cfg.model.hf_dir or cfg.model.load, what=key)
    if source.is_megatron_checkpoint != (key == "model.load"):
        kind, other = ("a megatron_gtpo checkpoint", "model.load") if source.is_megatron_checkpoint else \
            ("a Hugging Face directory", "model.hf_dir")
        raise ConfigError(f"{key}: {source.path} is {kind}; set {other}={source.path} instead")
    return source
