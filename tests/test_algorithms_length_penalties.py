"""DAPO's overlong penalty and the group-relative overlong punishment: hand-computed cases and edges."""
from __future__ import annotations

import pytest
import torch

from megatron_gtpo.algorithms import group_relative_overlong_penalty, overlong_penalty


def test_overlong_penalty_hand_computed():
    # max_len 20, cache 4: soft zone (16, 20]; penalty (16 - L) / 4 there, 0 below, -1 beyond 20.
    lengths = torch.tensor([0, 10, 16, 17, 18, 19, 20, 21, 1000])
    expected = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, max_len=20, cache_len=4), expected)


def test_overlong_penalty_paper_defaults():
    # L_max 20480, L_cache 4096: 16384 is the last unpenalised length; 18432 is half way down the ramp.
    lengths = torch.tensor([[16384, 16385, 18432], [20480, 20481, 4096]])
    expected = torch.tensor([[0.0, -1 / 4096, -0.5], [-1.0, -1.0, 0.0]])
    torch.testing.assert_close(overlong_penalty(lengths, max_len=20480, cache_len=4096), expected)


def test_overlong_penalty_keeps_float64_and_validates():
    out = overlong_penalty(torch.tensor([17.0], dtype=torch.float64), max_len=20, cache_len=4)
    assert out.dtype == torch.float64 and out.item() == -0.25
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1]), max_len=20, cache_len=0)
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1]), max_len=20, cache_len=21)
    with pytest.raises(ValueError, match="max_len"):
        overlong_penalty(torch.tensor([1]), max_len=0, cache_len=1)


def test_group_relative_overlong_penalty_hand_computed():
    lengths = torch.tensor([
        [100, 200, 300, 500],  # accuracy 3/4 >= 0.75; L_ref = (100+200+300)/3 = 200; 300 -> -(100/200) = -0.5;
                               # the failed 500-token response is not length-penalised
        [100, 100, 100, 700],  # accuracy 1; L_ref = 250; 700 -> -min(1, 450/250) = -1; 100 -> 0
        [100, 900, 300, 50],   # accuracy 2/4 < 0.75: a hard prompt, no length penalty
        [100, 900, 300, 50],   # no correct response: nothing to compare with
    ])
    rewards = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    expected = torch.tensor([[0.0, 0, -0.5, 0], [0, 0, 0, -1], [0, 0, 0, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(group_relative_overlong_penalty(lengths, rewards), expected)
    # A lower gamma also punishes the third group: L_ref = 500; 900 -> -(400/500) = -0.8; failed ones never.
    got = group_relative_overlong_penalty(lengths, rewards, gamma=0.5)
    torch.testing.assert_close(got[2], torch.tensor([0.0, -0.8, 0.0, 0.0]))


def test_group_relative_overlong_penalty_validates():
    lengths, rewards = torch.tensor([[1, 2]]), torch.tensor([[1.0, 0.0]])
    with pytest.raises(ValueError, match="gamma"):
        group_relative_overlong_penalty(lengths, rewards, gamma=0.0)
    with pytest.raises(ValueError, match="rewards_NG must hold only"):
        group_relative_overlong_penalty(lengths, rewards - 0.5)
    with pytest.raises(ValueError, match="lengths_NG must have the shape"):
        group_relative_overlong_penalty(lengths[:, :1], rewards)
