"""The four algorithms as data: each name maps to its advantage function and its loss settings.

The trainer resolves its configured algorithm once (resolve_algorithm) and then calls the spec; nothing
downstream branches on the algorithm's name. Defaults follow the papers (GTPO / GRPO-S: arXiv 2508.04349):

    algorithm  advantages                 policy loss                  clip (low, high)  dyn. sampling  length penalty
    GRPO       grpo_advantages [N, G]     token, seq-mean-token-mean   0.2, 0.2          no             none
    DAPO       grpo_advantages [N, G]     token, token-mean            0.2, 0.28         yes            overlong
    GTPO       gtpo_advantages [N, G, T]  token, token-mean            0.2, 0.28         yes            none
    GRPO_S     grpo_s_advantages [N, G]   sequence (arithmetic ratio)  0.2, 0.28         yes            none

GTPO and GRPO-S are built on DAPO (clip-higher, dynamic sampling: groups without both outcomes carry no
signal); their rewards must stay binary correctness, so no length penalty is added to them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_gtpo.algorithms.advantages import gtpo_advantages, grpo_advantages, grpo_s_advantages
from megatron_gtpo.algorithms.losses import sequence_policy_loss, token_policy_loss


class Algorithm(str, enum.Enum):
    GRPO = "grpo"
    DAPO = "dapo"
    GTPO = "gtpo"
    GRPO_S = "grpo_s"


@dataclass(frozen=True)
class AlgorithmSpec:
    """What an algorithm computes. Hyper-parameters of the advantage (alpha1, beta2, norm_scope, eps...)
    pass through `advantages(**kwargs)`; loss settings here are defaults that `policy_loss` overrides take
    precedence over."""

    algorithm: Algorithm
    advantage_fn: Callable[..., torch.Tensor]
    uses_entropy: bool  # advantage_fn(rewards_NG, entropy_NGT, mask_NGT, **kw), else advantage_fn(rewards_NG, **kw)
    token_advantages: bool  # advantage_fn returns advantages_NGT, else advantages_NG
    sequence_level_loss: bool  # sequence_policy_loss, else token_policy_loss
    loss_agg_mode: str  # token_policy_loss's mode; "seq-mean-token-mean" for the sequence-level loss
    eps_low: float
    eps_high: float
    dynamic_sampling: bool
    length_penalty: str  # "none" | "overlong" (DAPO's overlong_penalty added to the reward)

    def advantages(self, rewards_NG: torch.Tensor, entropy_NGT: torch.Tensor | None = None,
                   mask_NGT: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """advantages_NGT (GTPO) or advantages_NG (the others); entropy and mask are needed iff uses_entropy."""
        if not self.uses_entropy:
            return self.advantage_fn(rewards_NG, **kwargs)
        if entropy_NGT is None or mask_NGT is None:
            raise ValueError(f"{self.algorithm.value} advantages need entropy_NGT and mask_NGT")
        return self.advantage_fn(rewards_NG, entropy_NGT, mask_NGT, **kwargs)

    def policy_loss(self, logprobs_BT, old_logprobs_BT, advantages, mask_BT, *, loss_normalizer, **overrides):
        """loss_mb, metrics of one micro-batch under THE LOSS CONTRACT (losses.py); `advantages` flattened to
        [B, T] or [B] from what `advantages()` returned."""
        settings = dict(eps_low=self.eps_low, eps_high=self.eps_high)
        if self.sequence_level_loss:
            settings.update(overrides)
            return sequence_policy_loss(logprobs_BT, old_logprobs_BT, advantages, mask_BT,
                                        loss_normalizer=loss_normalizer, **settings)
        settings.update(loss_agg_mode=self.loss_agg_mode, **overrides)
        return token_policy_loss(logprobs_BT, old_logprobs_BT, advantages, mask_BT,
                                 loss_normalizer=loss_normalizer, **settings)


ALGORITHMS: dict[Algorithm, AlgorithmSpec] = {
    Algorithm.GRPO: AlgorithmSpec(Algorithm.GRPO, grpo_advantages, uses_entropy=False, token_advantages=False,
                                  sequence_level_loss=False, loss_agg_mode="seq-mean-token-mean", eps_low=0.2,
                                  eps_high=0.2, dynamic_sampling=False, length_penalty="none"),
    Algorithm.DAPO: AlgorithmSpec(Algorithm.DAPO, grpo_advantages, uses_entropy=False, token_advantages=False,
                                  sequence_level_loss=False, loss_agg_mode="token-mean", eps_low=0.2,
                                  eps_high=0.28, dynamic_sampling=True, length_penalty="overlong"),
    Algorithm.GTPO: AlgorithmSpec(Algorithm.GTPO, gtpo_advantages, uses_entropy=True, token_advantages=True,
                                  sequence_level_loss=False, loss_agg_mode="token-mean", eps_low=0.2,
                                  eps_high=0.28, dynamic_sampling=True, length_penalty="none"),
    Algorithm.GRPO_S: AlgorithmSpec(Algorithm.GRPO_S, grpo_s_advantages, uses_entropy=True,
                                    token_advantages=False, sequence_level_loss=True,
                                    loss_agg_mode="seq-mean-token-mean", eps_low=0.2, eps_high=0.28,
                                    dynamic_sampling=True, length_penalty="none"),
}


def resolve_algorithm(name: str | Algorithm) -> AlgorithmSpec:
    """The spec of an algorithm given its enum or its name ("grpo", "dapo", "gtpo", "grpo_s"; case-insensitive,
    "grpo-s" accepted)."""
    if isinstance(name, Algorithm):
        return ALGORITHMS[name]
    key = str(name).strip().lower().replace("-", "_")
    try:
        return ALGORITHMS[Algorithm(key)]
    except ValueError:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {[a.value for a in Algorithm]}") from None
