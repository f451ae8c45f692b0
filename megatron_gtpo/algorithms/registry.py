"""The algorithms as data: each name maps to one registry entry, resolved once against the run's config.

The registry is the only place an algorithm's name is read: the config's choices (config.py) are its names, and the
trainer resolves its algorithm once (`configure_algorithm`) into a `ConfiguredAlgorithm`, whose two functions have
ONE written signature whatever the algorithm:

    advantages(rewards_NG, entropy_NGT=None, mask_NGT=None) -> advantages_NGT (per token) or advantages_NG
    policy_loss(logprobs_BT, old_logprobs_BT, advantages, mask_BT, *, loss_normalizer, **tensors) -> loss, metrics

An entry names its pure advantage function (advantages.py) and the options of its own it takes as keywords, its
policy loss (losses.py) with the loss's defaults and the options of its own it takes, and the algorithm's defaults
for dynamic sampling and the length penalty. An algorithm's own options are the config section named after it
(`algorithm.gtpo`, `algorithm.grpo_s`, `algorithm.clip_cov`, `algorithm.kl_cov`), read here only when it is the
one configured (the config refuses a setting in another's section); the settings every loss reads (the clip range,
dual clip, KL and entropy coefficients) are the algorithm section's own fields, and each length penalty's options
its section (`algorithm.overlong`, `algorithm.group_relative`). Resolving binds the config's values once; nothing
downstream branches on the name (algorithms/ imports no config module: the config is read by attribute). Defaults
follow the papers (GTPO / GRPO-S: arXiv 2508.04349):

    algorithm  advantages                 policy loss                  clip (low, high)  dyn. sampling  length penalty
    GRPO       grpo_advantages [N, G]     token, seq-mean-token-mean   0.2, 0.2          no             none
    DAPO       grpo_advantages [N, G]     token, token-mean            0.2, 0.28         yes            overlong
    GTPO       gtpo_advantages [N, G, T]  token, token-mean            0.2, 0.28         yes            none
    GRPO_S     grpo_s_advantages [N, G]   sequence (arithmetic ratio)  0.2, 0.28         yes            none
    CLIP_COV   grpo_advantages [N, G]     token, token-mean, Clip-Cov  0.2, 0.28         yes            none
    KL_COV     grpo_advantages [N, G]     token, token-mean, KL-Cov    no clip           yes            none

GTPO and GRPO-S are built on DAPO (clip-higher, dynamic sampling: groups without both outcomes carry no
signal); their rewards must stay binary correctness, so no length penalty is added to them. A group without both
outcomes (dynamic sampling off) gets advantage 0 from them, as from GRPO, instead of the pure entropy noise their
formulas give it (docs/algorithms.md); the groups with both are shaped as if it had been dropped.

Clip-Cov and KL-Cov (arXiv 2505.22617) are DAPO's advantages and dynamic sampling with a token selection by the
covariance of log-prob and advantage (token_selection.py); the paper's recipes add no overlong penalty. KL-Cov's
surrogate has no PPO clip (the paper's and verl's): its penalty on the selected tokens takes the clip's place.
`algorithm.entropy_token_fraction` adds the high-entropy-token selection to any token-level loss.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable

import torch

from megatron_gtpo.algorithms.advantages import gtpo_advantages, grpo_advantages, grpo_s_advantages
from megatron_gtpo.algorithms.dynamic_sampling import informative_groups
from megatron_gtpo.algorithms.length_penalties import group_relative_overlong_penalty, overlong_penalty
from megatron_gtpo.algorithms.losses import PPOClip, sequence_policy_loss, token_policy_loss
from megatron_gtpo.algorithms.token_selection import TokenSelection, select_tokens


class Algorithm(str, enum.Enum):  # in the order the config lists them: the entropy-shaped ones first
    GTPO = "gtpo"
    GRPO_S = "grpo_s"
    GRPO = "grpo"
    DAPO = "dapo"
    CLIP_COV = "clip_cov"
    KL_COV = "kl_cov"


_TOKEN_LOSS_FIELDS = ("kl_coef", "entropy_coef")  # the algorithm section's fields every loss takes
_CLIP_FIELDS = ("eps_low", "eps_high", "dual_clip")  # the config's override the entry's clip where set
LENGTH_PENALTIES = ("none", "overlong", "group_relative")  # the config's choices of algorithm.length_penalty
CLIP_HIGHER = PPOClip(0.2, 0.28)  # DAPO's clip-higher, and the algorithms built on DAPO


@dataclass(frozen=True)
class AlgorithmEntry:
    """One algorithm: `advantages(rewards_NG[, entropy_NGT, mask_NGT], **options)` with `advantage_options` the
    fields of its own section (algorithm.<name>) passed by name (the entropy arguments iff `uses_entropy`);
    `policy_loss` with `loss_defaults`, the settings every loss takes and `loss_options` (loss keyword -> field of
    its own section); the defaults of dynamic sampling and of the length penalty ("none" | "overlong");
    `covariance_selection`: "clip" (Clip-Cov: its section's ratio, lb, ub), "kl" (KL-Cov: its section's ratio) or
    None."""

    advantages: Callable[..., torch.Tensor]
    uses_entropy: bool
    policy_loss: Callable[..., tuple]
    loss_defaults: dict = field(default_factory=dict)
    advantage_options: tuple[str, ...] = ()
    loss_options: dict = field(default_factory=dict)
    dynamic_sampling: bool = True
    length_penalty: str = "none"
    covariance_selection: str | None = None

    @property
    def sequence_level_loss(self) -> bool:
        """One surrogate term per sequence (GRPO-S), where a per-token weight has no term to multiply."""
        return self.policy_loss is sequence_policy_loss


ALGORITHMS: dict[Algorithm, AlgorithmEntry] = {
    Algorithm.GRPO: AlgorithmEntry(grpo_advantages, False, token_policy_loss,
                                   dict(clip=PPOClip(0.2, 0.2), loss_agg_mode="seq-mean-token-mean"),
                                   dynamic_sampling=False),
    Algorithm.DAPO: AlgorithmEntry(grpo_advantages, False, token_policy_loss,
                                   dict(clip=CLIP_HIGHER, loss_agg_mode="token-mean"), length_penalty="overlong"),
    Algorithm.GTPO: AlgorithmEntry(gtpo_advantages, True, token_policy_loss,
                                   dict(clip=CLIP_HIGHER, loss_agg_mode="token-mean"),
                                   advantage_options=("alpha1", "alpha2", "norm_scope", "entropy_clip")),
    Algorithm.GRPO_S: AlgorithmEntry(grpo_s_advantages, True, sequence_policy_loss, dict(clip=CLIP_HIGHER),
                                     advantage_options=("beta1", "beta2", "entropy_clip"),
                                     loss_options=dict(sequence_ratio="sequence_ratio")),
    Algorithm.CLIP_COV: AlgorithmEntry(grpo_advantages, False, token_policy_loss,
                                       dict(clip=CLIP_HIGHER, loss_agg_mode="token-mean"),
                                       covariance_selection="clip"),
    Algorithm.KL_COV: AlgorithmEntry(grpo_advantages, False, token_policy_loss,
                                     dict(clip=None, loss_agg_mode="token-mean"),
                                     loss_options=dict(kl_cov_coef="coef"), covariance_selection="kl"),
}


def resolve_algorithm(name: str | Algorithm) -> Algorithm:
    """The algorithm an enum or a name names ("grpo", "dapo", "gtpo", "grpo_s", "clip_cov", "kl_cov";
    case-insensitive, "-" for "_" accepted); ValueError for any other name."""
    if isinstance(name, Algorithm):
        return name
    try:
        return Algorithm(str(name).strip().lower().replace("-", "_"))
    except ValueError:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {[a.value for a in Algorithm]}") from None


ALGORITHM_NAMES: tuple[str, ...] = tuple(a.value for a in Algorithm)  # the config's choices of algorithm.name


@dataclass(frozen=True)
class ConfiguredAlgorithm:
    """An algorithm resolved against the run's config: what the trainer calls (module doc: the two signatures).
    `loss_agg_mode` is the token loss's aggregation ("seq-mean-token-mean" for the sequence-level loss), from which
    the update computes its loss normalisers; `length_penalty(lengths_NG, correct_NG) -> penalty_NG` or None;
    `select_tokens(advantages_K, old_logprobs_K, entropy_K, keys_K) -> TokenSelection` over one mini-batch's valid
    tokens (token_selection.py), or None where no selection is configured."""

    algorithm: Algorithm
    uses_entropy: bool
    dynamic_sampling: bool
    loss_agg_mode: str
    length_penalty: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    _advantages: Callable[..., torch.Tensor]
    _policy_loss: Callable[..., tuple]
    select_tokens: Callable[..., TokenSelection] | None = None

    @property
    def reads_old_policy(self) -> str | None:
        """What of the old policy the algorithm reads before its update, where the update's own forward comes too
        late to give it: "log-probs" for a token selection (its statistics span the whole mini-batch and decide the
        first micro-batch's loss; entropies too, for the high-entropy fraction), "entropies" for the entropy-shaped
        advantages (GTPO, GRPO-S), None for nothing (GRPO, DAPO: their old log-probs are read in the loss only).
        training/old_policy.py decides from it whether a step runs the old-policy pass."""
        if self.select_tokens is not None:
            return "log-probs"
        return "entropies" if self.uses_entropy else None

    def advantages(self, rewards_NG: torch.Tensor, entropy_NGT: torch.Tensor | None = None,
                   mask_NGT: torch.Tensor | None = None) -> torch.Tensor:
        """The algorithm's advantages; the entropy-shaped ones give 0 to every token of a group whose rewards are
        all equal and shape the other groups as if it were not there."""
        if not self.uses_entropy:
            return self._advantages(rewards_NG)
        if entropy_NGT is None or mask_NGT is None:
            raise ValueError(f"{self.algorithm.value} advantages need entropy_NGT and mask_NGT")
        informative_N = informative_groups(rewards_NG)
        if bool(informative_N.all()):  # one host read per step
            return self._advantages(rewards_NG, entropy_NGT, mask_NGT)
        if not bool(informative_N.any()):
            return torch.zeros_like(self._advantages(rewards_NG, entropy_NGT, mask_NGT))
        shaped = self._advantages(rewards_NG[informative_N], entropy_NGT[informative_N], mask_NGT[informative_N])
        advantages = shaped.new_zeros(rewards_NG.shape + shaped.shape[2:])
        advantages[informative_N] = shaped
        return advantages

    def policy_loss(self, logprobs_BT, old_logprobs_BT, advantages, mask_BT, *, loss_normalizer, **tensors):
        """loss_mb, metrics of one micro-batch under THE LOSS CONTRACT (losses.py); `advantages` flattened to
        [B, T] or [B] from what `advantages()` returned; `tensors`: entropy_BT, ref_logprobs_BT, pg_weights."""
        return self._policy_loss(logprobs_BT, old_logprobs_BT, advantages, mask_BT, loss_normalizer=loss_normalizer,
                                 **tensors)


def configure_algorithm(config, *, max_new_tokens: int) -> ConfiguredAlgorithm:
    """The algorithm `config.name` names, resolved against `config` (an AlgorithmConfig): its advantage settings
    and loss settings bound once (the config's clip range where set, else the algorithm's), from the settings every
    loss reads and the algorithm's own section (`config.<name>`: no other algorithm's is read); `max_new_tokens` is
    the rollout's, the overlong penalty's default length."""
    algorithm = resolve_algorithm(config.name)
    entry = ALGORITHMS[algorithm]
    own = getattr(config, algorithm.value, None)  # algorithm.<name>: its own options, where it has any
    clip = entry.loss_defaults["clip"]
    if clip is not None:  # KL-Cov's surrogate has none (the config refuses a clip setting with it)
        clip = replace(clip, **{k: getattr(config, k) for k in _CLIP_FIELDS if getattr(config, k) is not None})
    loss_settings = {**entry.loss_defaults, "clip": clip, **{k: getattr(config, k) for k in _TOKEN_LOSS_FIELDS},
                     **{keyword: getattr(own, option) for keyword, option in entry.loss_options.items()}}
    return ConfiguredAlgorithm(
        algorithm=algorithm, uses_entropy=entry.uses_entropy,
        dynamic_sampling=entry.dynamic_sampling if config.dynamic_sampling is None else config.dynamic_sampling,
        loss_agg_mode=entry.loss_defaults.get("loss_agg_mode", "seq-mean-token-mean"),
        length_penalty=_length_penalty(config.length_penalty or entry.length_penalty, config, max_new_tokens),
        _advantages=partial(entry.advantages, **{k: getattr(own, k) for k in entry.advantage_options}),
        _policy_loss=partial(entry.policy_loss, **loss_settings),
        select_tokens=_token_selection(entry.covariance_selection, own, config.entropy_token_fraction))


def _token_selection(covariance_selection: str | None, own, entropy_token_fraction: float | None):
    """select_tokens bound to the run's covariance selection (from the algorithm's own options `own`) and
    high-entropy fraction, or None when neither is on."""
    settings = {}
    if covariance_selection == "clip":
        settings["clip_cov"] = (own.ratio, own.lb, own.ub)
    elif covariance_selection == "kl":
        settings["kl_cov_ratio"] = own.ratio
    if entropy_token_fraction is not None:
        settings["entropy_token_fraction"] = entropy_token_fraction
    return partial(select_tokens, **settings) if settings else None


def _length_penalty(name: str, config, max_new_tokens: int):
    """The length penalty `name` (LENGTH_PENALTIES) bound to its own options (config.overlong, config.group_relative),
    or None."""
    if name == "overlong":
        max_len = config.overlong.max_len or max_new_tokens
        cache_len = config.overlong.cache_len or max(1, max_len // 5)
        return lambda lengths_NG, correct_NG: overlong_penalty(lengths_NG, max_len=max_len, cache_len=cache_len)
    if name == "group_relative":
        gamma = config.group_relative.gamma
        return lambda lengths_NG, correct_NG: group_relative_overlong_penalty(lengths_NG, correct_NG, gamma=gamma)
    return None
