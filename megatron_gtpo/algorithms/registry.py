"""The four algorithms as data: each name maps to its advantage function and its loss settings.

The registry is the only place an algorithm's name is read: the config's choices (config.py) are its names, and the
trainer binds its configured algorithm once (`configure_algorithm`) and then calls what that returns; nothing
downstream branches on the name. Every entry's advantages have ONE written signature,
`(rewards_NG, entropy_NGT, mask_NGT, config) -> advantages`, where `config` is the run's algorithm section
(config.AlgorithmConfig, read by attribute: algorithms/ imports no config module) and the estimator passes the
scalars its pure function takes as keyword arguments. Defaults follow the papers (GTPO / GRPO-S: arXiv 2508.04349):

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
from typing import Any, Callable

import torch

from megatron_gtpo.algorithms.advantages import gtpo_advantages, grpo_advantages, grpo_s_advantages
from megatron_gtpo.algorithms.length_penalties import group_relative_overlong_penalty, overlong_penalty
from megatron_gtpo.algorithms.losses import sequence_policy_loss, token_policy_loss


class Algorithm(str, enum.Enum):  # in the order the config lists them: the entropy-shaped ones first
    GTPO = "gtpo"
    GRPO_S = "grpo_s"
    GRPO = "grpo"
    DAPO = "dapo"


@dataclass(frozen=True)
class AlgorithmSpec:
    """What an algorithm computes. `estimate_advantages(rewards_NG, entropy_NGT, mask_NGT, config)` reads the
    advantage's hyper-parameters (alpha1, beta2, norm_scope, ...) from the config; loss settings here are defaults
    that `policy_loss` overrides (the config's, when set) take precedence over."""

    algorithm: Algorithm
    advantage_fn: Callable[..., torch.Tensor]  # the pure tensor function (advantages.py)
    estimate_advantages: Callable[[torch.Tensor, Any, Any, Any], torch.Tensor]  # its written-signature entry
    uses_entropy: bool  # advantage_fn(rewards_NG, entropy_NGT, mask_NGT, **kw), else advantage_fn(rewards_NG, **kw)
    token_advantages: bool  # advantage_fn returns advantages_NGT, else advantages_NG
    sequence_level_loss: bool  # sequence_policy_loss, else token_policy_loss
    loss_agg_mode: str  # token_policy_loss's mode; "seq-mean-token-mean" for the sequence-level loss
    eps_low: float
    eps_high: float
    dynamic_sampling: bool
    length_penalty: str  # "none" | "overlong" (DAPO's overlong_penalty added to the reward)

    def advantages(self, rewards_NG: torch.Tensor, entropy_NGT: torch.Tensor | None, mask_NGT: torch.Tensor | None,
                   config) -> torch.Tensor:
        """advantages_NGT (GTPO) or advantages_NG (the others); entropy and mask are needed iff uses_entropy."""
        if self.uses_entropy and (entropy_NGT is None or mask_NGT is None):
            raise ValueError(f"{self.algorithm.value} advantages need entropy_NGT and mask_NGT")
        return self.estimate_advantages(rewards_NG, entropy_NGT, mask_NGT, config)

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


def _grpo_estimator(rewards_NG, entropy_NGT, mask_NGT, config) -> torch.Tensor:
    return grpo_advantages(rewards_NG)


def _gtpo_estimator(rewards_NG, entropy_NGT, mask_NGT, config) -> torch.Tensor:
    return gtpo_advantages(rewards_NG, entropy_NGT, mask_NGT, alpha1=config.alpha1, alpha2=config.alpha2,
                           norm_scope=config.norm_scope, entropy_clip=config.entropy_clip)


def _grpo_s_estimator(rewards_NG, entropy_NGT, mask_NGT, config) -> torch.Tensor:
    return grpo_s_advantages(rewards_NG, entropy_NGT, mask_NGT, beta1=config.beta1, beta2=config.beta2,
                             entropy_clip=config.entropy_clip)


ALGORITHMS: dict[Algorithm, AlgorithmSpec] = {
    Algorithm.GRPO: AlgorithmSpec(Algorithm.GRPO, grpo_advantages, _grpo_estimator,
                                  uses_entropy=False, token_advantages=False,
                                  sequence_level_loss=False, loss_agg_mode="seq-mean-token-mean", eps_low=0.2,
                                  eps_high=0.2, dynamic_sampling=False, length_penalty="none"),
    Algorithm.DAPO: AlgorithmSpec(Algorithm.DAPO, grpo_advantages, _grpo_estimator,
                                  uses_entropy=False, token_advantages=False,
                                  sequence_level_loss=False, loss_agg_mode="token-mean", eps_low=0.2,
                                  eps_high=0.28, dynamic_sampling=True, length_penalty="overlong"),
    Algorithm.GTPO: AlgorithmSpec(Algorithm.GTPO, gtpo_advantages, _gtpo_estimator,
                                  uses_entropy=True, token_advantages=True,
                                  sequence_level_loss=False, loss_agg_mode="token-mean", eps_low=0.2,
                                  eps_high=0.28, dynamic_sampling=True, length_penalty="none"),
    Algorithm.GRPO_S: AlgorithmSpec(Algorithm.GRPO_S, grpo_s_advantages, _grpo_s_estimator,
                                    uses_entropy=True,
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


ALGORITHM_NAMES: tuple[str, ...] = tuple(a.value for a in Algorithm)  # the config's choices of algorithm.name


@dataclass(frozen=True)
class ConfiguredAlgorithm:
    """An algorithm bound to the run's algorithm config once: what the trainer calls. `config` is the config's
    algorithm section (AlgorithmConfig); `max_new_tokens` the rollout's, the overlong penalty's default length."""

    spec: AlgorithmSpec
    config: Any
    max_new_tokens: int

    @property
    def uses_entropy(self) -> bool:
        return self.spec.uses_entropy

    @property
    def loss_agg_mode(self) -> str:
        return self.spec.loss_agg_mode

    @property
    def dynamic_sampling(self) -> bool:
        return self.spec.dynamic_sampling if self.config.dynamic_sampling is None else self.config.dynamic_sampling

    def advantages(self, rewards_NG: torch.Tensor, entropy_NGT: torch.Tensor | None = None,
                   mask_NGT: torch.Tensor | None = None) -> torch.Tensor:
        return self.spec.advantages(rewards_NG, entropy_NGT, mask_NGT, self.config)

    def policy_loss(self, logprobs_BT, old_logprobs_BT, advantages, mask_BT, *, loss_normalizer, **tensors):
        """The spec's loss with the config's settings (eps_low / eps_high when set, dual clip, KL and entropy
        coefficients, GRPO-S's sequence ratio); `tensors`: entropy_BT, ref_logprobs_BT, pg_weights."""
        c = self.config
        settings = dict(eps_low=self.spec.eps_low if c.eps_low is None else c.eps_low,
                        eps_high=self.spec.eps_high if c.eps_high is None else c.eps_high,
                        dual_clip=c.dual_clip, kl_coef=c.kl_coef, entropy_coef=c.entropy_coef)
        if self.spec.sequence_level_loss:
            settings["sequence_ratio"] = c.sequence_ratio
        return self.spec.policy_loss(logprobs_BT, old_logprobs_BT, advantages, mask_BT,
                                     loss_normalizer=loss_normalizer, **settings, **tensors)

    @property
    def length_penalty(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """(lengths_NG, correct_NG) -> penalty_NG added to the rewards, or None (the config's choice, else the
        algorithm's default)."""
        c = self.config
        name = c.length_penalty or self.spec.length_penalty
        max_len = c.overlong_max_len or self.max_new_tokens
        return {
            "none": None,
            "overlong": lambda lengths_NG, correct_NG: overlong_penalty(
                lengths_NG, max_len=max_len, cache_len=c.overlong_cache_len or max(1, max_len // 5)),
            "group_relative": lambda lengths_NG, correct_NG: group_relative_overlong_penalty(
                lengths_NG, correct_NG, gamma=c.group_relative_gamma),
        }[name]


def configure_algorithm(config, *, max_new_tokens: int) -> ConfiguredAlgorithm:
    """The algorithm `config.name` names, bound to `config` (an AlgorithmConfig)."""
    return ConfiguredAlgorithm(resolve_algorithm(config.name), config, max_new_tokens)
