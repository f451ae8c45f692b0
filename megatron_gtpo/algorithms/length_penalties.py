"""Length penalties: additive terms in [-1, 0] for the scalar reward that GRPO / DAPO normalise.

- overlong_penalty: DAPO's soft overlong punishment (spec formula, absolute lengths).
- group_relative_overlong_penalty: the "group relative overlong punishment" the GTPO paper's experiments
  mention without giving its rule; the rule below is our reading (see its docstring).

Both are meant to be added to the correctness reward before grpo_advantages. GTPO and GRPO-S split each
group by binary correctness and accept rewards in {0, 1} only, so these penalties do not combine with them.
"""
from __future__ import annotations

import torch

from megatron_gtpo.algorithms._checks import check_binary_rewards, check_floating


def overlong_penalty(lengths_N: torch.Tensor, *, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO's soft overlong punishment, elementwise over response lengths (any shape, in tokens).

        penalty(L) = 0                                   if L <= max_len - cache_len
                     ((max_len - cache_len) - L) / cache_len   if max_len - cache_len < L <= max_len
                     -1                                  if L > max_len

    which is clamp(((max_len - cache_len) - L) / cache_len, -1, 0) (the ramp reaches -1 at L = max_len).
    Requires 1 <= cache_len <= max_len. Returns the default float dtype (float64 for float64 lengths).
    """
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    if not isinstance(cache_len, int) or not 1 <= cache_len <= max_len:
        raise ValueError(f"cache_len must be an int in [1, max_len={max_len}], got {cache_len!r}")
    dtype = lengths_N.dtype if lengths_N.dtype == torch.float64 else torch.get_default_dtype()
    lengths_N = lengths_N.to(dtype)
    return (((max_len - cache_len) - lengths_N) / cache_len).clamp(min=-1.0, max=0.0)


def group_relative_overlong_penalty(
    lengths_NG: torch.Tensor, rewards_NG: torch.Tensor, *, gamma: float = 0.75
) -> torch.Tensor:
    """Group-relative overlong punishment (our reading; the paper gives neither rule nor threshold).

    A prompt's difficulty is its group accuracy a = n / G (n correct responses out of G). Only prompts the
    policy already solves reliably, a >= gamma, are punished for length: on harder prompts long reasoning
    is still what earns the reward and is left alone. The reference length L_ref is the mean length of the
    group's correct responses; a correct response longer than L_ref gets

        penalty = -min(1, (L - L_ref) / L_ref)      (0 at the reference, -1 at twice the reference length)

    and every other response 0. Failed responses are never length-penalised: they already carry the
    failure, and penalising their length pays the policy for failing briefly.

    lengths_NG: response lengths in tokens; rewards_NG: correctness, exactly 0 or 1; 0 < gamma <= 1.
    Returns penalty_NG in [-1, 0] (float dtype of rewards_NG).
    """
    check_floating("rewards_NG", rewards_NG, 2)
    if lengths_NG.shape != rewards_NG.shape:
        raise ValueError(f"lengths_NG must have the shape of rewards_NG {tuple(rewards_NG.shape)}, "
                         f"got {tuple(lengths_NG.shape)}")
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma!r}")
    check_binary_rewards("rewards_NG", rewards_NG)
    correct_NG = rewards_NG == 1
    lengths_NG = lengths_NG.to(rewards_NG.dtype)
    num_correct_N1 = correct_NG.sum(dim=1, keepdim=True)
    accuracy_N1 = num_correct_N1 / rewards_NG.shape[1]
    reference_N1 = (lengths_NG * correct_NG).sum(dim=1, keepdim=True) / num_correct_N1.clamp(min=1)
    excess_NG = (lengths_NG - reference_N1) / reference_N1.clamp(min=1)
    punished_NG = correct_NG & (accuracy_N1 >= gamma)
    return torch.where(punished_NG, -excess_NG.clamp(min=0.0, max=1.0), 0.0)
