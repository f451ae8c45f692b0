"""Rewards: math answer verification (math-verify) and a process-pool reward_pool for any reward function.

    math_reward(response, reference) -> 1.0 | 0.0           one guarded call, safe from any thread
    RewardPool(verify_math_answer, num_workers=8).rewards(responses, references) -> list[float]

A reward function is any picklable `RewardFn`: (response: str, reference: str) -> float.
"""
from megatron_gtpo.rewards.math_verifier import (
    DEFAULT_TIMEOUT_S,
    extract_final_answer,
    math_reward,
    verify_math_answer,
)
from megatron_gtpo.rewards.pool import RewardFn, RewardPool, RewardStats

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RewardFn",
    "RewardPool",
    "RewardStats",
    "extract_final_answer",
    "math_reward",
    "verify_math_answer",
]
