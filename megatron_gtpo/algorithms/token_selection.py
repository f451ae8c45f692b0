"""Token selection of the entropy methods: which response tokens keep their policy gradient, and which take a penalty.

Clip-Cov and KL-Cov ("The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models", arXiv
2505.22617) and the high-entropy-token fraction ("Beyond the 80/20 Rule", arXiv 2506.01939). Each function works on
the K valid response tokens of ONE mini-batch (every micro-batch and every data-parallel rank of it), flattened in a
fixed order: the statistics never depend on how the mini-batch is split (the loss contract, losses.py). The trainer
gathers them once per step from the old-policy pass (training/token_selection.py); on an on-policy first mini-batch
the old log-probs are the current ones, so the covariance is verl's where verl's scope (one micro-batch) is the
mini-batch.

    cov_k = (A_k - mean_K A) * (l_k - mean_K l)       l: the old policy's log-prob of token k, A its advantage

    Clip-Cov:  candidates are the tokens with lb < cov_k < ub; max(1, floor(ratio * K)) of them (all, if fewer),
               chosen uniformly at random, lose their policy gradient: the ones with the smallest `keys_K` (uniform
               random numbers, one per token, drawn by the caller from a seeded generator).
    KL-Cov:    exactly max(1, floor(ratio * K)) tokens, those of largest cov_k, take kl_cov_coef * |log-ratio|
               (losses.py); ties in cov_k are broken by position, the earlier token first (`first_top_tokens`).
    High-entropy fraction: the policy gradient is kept on the tokens whose old-policy entropy reaches the
               max(1, floor(F * K))-th largest (`top_tokens`).

Ties. KL-Cov picks a fixed count, as its paper and verl do (verl's torch.topk returns that many tokens and breaks
ties arbitrarily): here the order of the flattened mini-batch breaks them, so the pick is reproducible. Ties are not
rare there: when every advantage of a mini-batch is equal, every covariance is 0, and picking all tied tokens would
penalise the whole mini-batch. The high-entropy fraction keeps every token at or above its entropy threshold, ties
included: with continuous entropies there are none. Everything returns bool [K] tensors on the inputs'
device.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_gtpo.algorithms._checks import check_floating, check_same_shape


def _check_fraction(name: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def _count(fraction: float, K: int) -> int:
    """max(1, floor(fraction * K)) tokens of K (0 of none): verl's `max(int(ratio * K), 1)`."""
    return min(K, max(1, int(fraction * K)))


def top_tokens(values_K: torch.Tensor, fraction: float) -> torch.Tensor:
    """bool [K]: the max(1, floor(fraction * K)) tokens of largest value (ties at the threshold included)."""
    check_floating("values_K", values_K, 1)
    _check_fraction("fraction", fraction)
    n = _count(fraction, values_K.numel())
    if n == 0:
        return torch.zeros_like(values_K, dtype=torch.bool)
    threshold = torch.topk(values_K, n).values[-1]
    return values_K >= threshold


def first_top_tokens(values_K: torch.Tensor, fraction: float) -> torch.Tensor:
    """bool [K]: exactly max(1, floor(fraction * K)) tokens (0 of none), those of largest value; among equal values
    the earlier token is picked first."""
    check_floating("values_K", values_K, 1)
    _check_fraction("fraction", fraction)
    n = _count(fraction, values_K.numel())
    picked_K = torch.zeros_like(values_K, dtype=torch.bool)
    picked_K[torch.sort(values_K, descending=True, stable=True).indices[:n]] = True
    return picked_K


def token_covariance(advantages_K: torch.Tensor, logprobs_K: torch.Tensor) -> torch.Tensor:
    """cov_k = (A_k - mean A) * (l_k - mean l) over the K tokens, in their dtype (float32 at least)."""
    check_floating("advantages_K", advantages_K, 1)
    check_same_shape("logprobs_K", logprobs_K, advantages_K.shape)
    dtype = torch.promote_types(advantages_K.dtype, torch.float32)
    advantages_K, logprobs_K = advantages_K.to(dtype), logprobs_K.to(dtype)
    if advantages_K.numel() == 0:
        return advantages_K
    return (advantages_K - advantages_K.mean()) * (logprobs_K - logprobs_K.mean())


def clip_cov_tokens(covariance_K: torch.Tensor, keys_K: torch.Tensor, *, ratio: float, lb: float,
                    ub: float) -> torch.Tensor:
    """bool [K]: Clip-Cov's picked tokens (module doc), whose policy gradient is removed."""
    check_floating("covariance_K", covariance_K, 1)
    check_same_shape("keys_K", keys_K, covariance_K.shape)
    _check_fraction("clip_cov_ratio", ratio)
    if not lb < ub:
        raise ValueError(f"clip_cov_lb must be < clip_cov_ub, got {lb!r} and {ub!r}")
    candidate_K = (covariance_K > lb) & (covariance_K < ub)
    n = _count(ratio, covariance_K.numel())
    if n == 0:
        return candidate_K
    candidate_keys_K = torch.where(candidate_K, keys_K.to(torch.float64), torch.inf)
    threshold = torch.topk(candidate_keys_K, n, largest=False).values[-1]
    return candidate_K & (candidate_keys_K <= threshold)


class TokenSelection(NamedTuple):
    """What a selection does to the K tokens of a mini-batch: `keep_K` (bool: the token keeps its policy-gradient
    term), `penalise_K` (bool: KL-Cov's penalty applies; None without KL-Cov) and its metrics over the K tokens
    (SELECTION_METRICS; 0-dim float64 tensors, 0 when K = 0)."""

    keep_K: torch.Tensor
    penalise_K: torch.Tensor | None
    metrics: dict[str, torch.Tensor]


# name -> meaning; each a mean over the mini-batch's valid tokens, logged weighted by their number
SELECTION_METRICS = {
    "clip_cov_fraction": "the fraction of tokens Clip-Cov removes from the policy gradient",
    "kl_cov_fraction": "the fraction of tokens KL-Cov penalises",
    "entropy_kept_fraction": "the fraction of tokens the high-entropy fraction keeps in the policy gradient",
    "entropy_kept_threshold": "the lowest old-policy entropy of a kept token",
}


def select_tokens(advantages_K: torch.Tensor, old_logprobs_K: torch.Tensor, entropy_K: torch.Tensor,
                  keys_K: torch.Tensor, *, clip_cov: tuple[float, float, float] | None = None,
                  kl_cov_ratio: float | None = None, entropy_token_fraction: float | None = None) -> TokenSelection:
    """The configured selections over one mini-batch's K tokens: Clip-Cov with clip_cov = (ratio, lb, ub), KL-Cov
    with kl_cov_ratio, the high-entropy fraction with entropy_token_fraction (each None: off). A token keeps its
    policy gradient unless Clip-Cov picks it or the entropy fraction leaves it out. Metrics of the selections that
    are on only."""
    K = advantages_K.numel()
    keep_K = torch.ones(K, dtype=torch.bool, device=advantages_K.device)
    penalise_K = None
    metrics = {}

    def fraction(flags_K):
        return flags_K.sum().double() / max(K, 1)

    if clip_cov is not None or kl_cov_ratio is not None:
        covariance_K = token_covariance(advantages_K, old_logprobs_K)
        if clip_cov is not None:
            ratio, lb, ub = clip_cov
            picked_K = clip_cov_tokens(covariance_K, keys_K, ratio=ratio, lb=lb, ub=ub)
            keep_K &= ~picked_K
            metrics["clip_cov_fraction"] = fraction(picked_K)
        if kl_cov_ratio is not None:
            penalise_K = first_top_tokens(covariance_K, kl_cov_ratio)
            metrics["kl_cov_fraction"] = fraction(penalise_K)
    if entropy_token_fraction is not None:
        check_same_shape("entropy_K", entropy_K, advantages_K.shape)
        kept_K = top_tokens(entropy_K, entropy_token_fraction)
        keep_K &= kept_K
        metrics["entropy_kept_fraction"] = fraction(kept_K)
        metrics["entropy_kept_threshold"] = (torch.where(kept_K, entropy_K.double(), torch.inf).amin() if K
                                             else torch.zeros((), dtype=torch.float64, device=keep_K.device))
    return TokenSelection(keep_K, penalise_K, metrics)
