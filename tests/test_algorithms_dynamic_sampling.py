"""DAPO's dynamic-sampling filter."""
from __future__ import annotations

import pytest
import torch

from megatron_gtpo.algorithms import informative_groups


def test_informative_groups_keeps_groups_with_different_rewards():
    rewards = torch.tensor([
        [1.0, 1.0, 1.0, 1.0],   # all correct: dropped
        [0.0, 0.0, 0.0, 0.0],   # all failed: dropped
        [1.0, 0.0, 0.0, 0.0],   # both outcomes: kept
        [0.5, 0.5, 0.5, 0.25],  # shaped rewards that differ: kept
    ])
    assert informative_groups(rewards).tolist() == [False, False, True, True]


def test_informative_groups_single_response_groups_carry_no_signal():
    assert informative_groups(torch.tensor([[1.0], [0.0]])).tolist() == [False, False]


def test_informative_groups_validates():
    with pytest.raises(ValueError, match="rewards_NG must be a 2-d floating-point tensor"):
        informative_groups(torch.tensor([1.0, 0.0]))
