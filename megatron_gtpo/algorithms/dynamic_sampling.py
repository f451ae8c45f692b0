"""DAPO's dynamic-sampling filter: which groups carry a group-relative learning signal.

The loop that keeps generating until enough informative groups are collected (bounded extra rounds) lives
in the trainer; this is the pure decision it takes on each generated batch.
"""
from __future__ import annotations

import torch

from megatron_gtpo.algorithms._checks import check_floating


def informative_groups(rewards_NG: torch.Tensor) -> torch.Tensor:
    """keep_N: True for the groups whose rewards are not all equal.

    A group where every response got the same reward (all correct or all failed, for binary rewards) has
    zero group-relative advantage under GRPO/DAPO and no correctness contrast under GTPO/GRPO-S. Pass the
    rewards the filter should look at: DAPO filters on correctness (accuracy 0 or 1), before any length
    penalty is added.
    """
    check_floating("rewards_NG", rewards_NG, 2)
    return rewards_NG.amax(dim=1) > rewards_NG.amin(dim=1)
