"""Pure tensor functions of the RL algorithms (GRPO, DAPO, GTPO, GRPO-S, Clip-Cov, KL-Cov, the high-entropy-token
fraction); their formulas are in the docstrings of advantages.py, losses.py and token_selection.py, their defaults
in registry.py.

Imports no torch.distributed, megatron, vllm or config objects: tensors in, tensors out, scalars as keywords.
"""
from megatron_gtpo.algorithms.advantages import (
    grpo_advantages,
    grpo_s_advantages,
    grpo_s_shaped_rewards,
    gtpo_advantages,
)
from megatron_gtpo.algorithms.dynamic_sampling import informative_groups
from megatron_gtpo.algorithms.length_penalties import group_relative_overlong_penalty, overlong_penalty
from megatron_gtpo.algorithms.losses import PPOClip, local_loss_normalizer, sequence_policy_loss, token_policy_loss
from megatron_gtpo.algorithms.token_selection import TokenSelection, select_tokens
from megatron_gtpo.algorithms.registry import (
    ALGORITHM_NAMES,
    ALGORITHMS,
    Algorithm,
    AlgorithmEntry,
    ConfiguredAlgorithm,
    configure_algorithm,
    resolve_algorithm,
)

__all__ = [
    "ALGORITHMS",
    "ALGORITHM_NAMES",
    "Algorithm",
    "AlgorithmEntry",
    "ConfiguredAlgorithm",
    "configure_algorithm",
    "group_relative_overlong_penalty",
    "grpo_advantages",
    "grpo_s_advantages",
    "grpo_s_shaped_rewards",
    "gtpo_advantages",
    "informative_groups",
    "local_loss_normalizer",
    "overlong_penalty",
    "PPOClip",
    "resolve_algorithm",
    "select_tokens",
    "sequence_policy_loss",
    "TokenSelection",
    "token_policy_loss",
]
