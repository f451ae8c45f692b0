"""Rollout/training mismatch correction: importance weights and rejection from the two log-probs of each sampled token.

The rollout engine samples with its own kernels (vLLM, another precision, top-k / top-p truncation), so its
sampled-token log-probs (rollout_logprobs) differ from the training pass's old-policy log-probs (old_logprobs) of
the same weights: the samples are slightly off-policy for pi_old, which the PPO ratio pi_theta / pi_old assumes
they are not. Per valid token, with log rho_t = old_logprobs_t - rollout_logprobs_t (rho = pi_old / pi_rollout):

    rollout_is  "token":     w_t = min(rho_t, cap)                           [S, T]
                "sequence":  w_i = min(prod_t rho_t, cap), shared by every token of sequence i   [S]
                "geometric": w_i = min(exp(mean_t log rho_t), cap), likewise      [S]
                "none":      no weight
    rollout_rs  "token":     reject token t when rho_t is outside [low, high]
                "sequence":  reject every token of sequence i when prod_t rho_t is outside [low, high]
                "geometric": reject every token of sequence i when exp(mean_t log rho_t) is outside [low, high]
                "none":      keep every token

The "geometric" weight is the length-normalised sequence weight, GRPO-S's choice: its sequence ratio is a mean over
the response's tokens too (arithmetic, or geometric like GSPO's), and with the geometric ratio r_i the weighted
term w_i r_i is, below the cap, exp(mean_t log pi_theta / pi_rollout): the geometric-mean ratio to the policy that
sampled. The
product of "sequence" takes one factor per token, so over a long stale response (partial rollouts, staleness) it
collapses towards 0 or sits at the cap.

The weights are detached and multiply the policy-gradient (surrogate) term only. Rejected tokens leave the loss mask:
under "token-mean" they count in no normaliser; under the per-sequence modes (seq-mean-*, GRPO-S) a wholly rejected
sequence still counts as a sequence of the mini-batch and contributes 0 (the loss contract in losses.py). Both are
computed once per step from log-probs that do not change during the update: before it, or, where the update's own
forward gives the old log-probs, per micro-batch (each weight and rejection is a function of one token or one
whole sequence) before its loss.

GTPO and GRPO-S: their token entropies, and so their shaped advantages, come from the old-policy pass (the trainer's
own forward at the training layout), never from a rollout engine but the built-in one sampling with the trainer's
model and weights (training/old_policy.py); the correction above reweights or rejects the samples those advantages
are attached to, and leaves the advantages as they are.

Metrics, as sums over valid tokens (`num_tokens` is the weight; sum over ranks, then divide):
    rollout_logprob_mismatch    |old_logprobs - rollout_logprobs|
    mismatch_kl                 k3 of pi_rollout against pi_old: rho - log rho - 1 (>= 0; 0 when they agree)
    token_mult_prob_error       exp(|old_logprobs - rollout_logprobs|) (>= 1; 1 when they agree)
    rollout_is_weight_mean      the weight each token's surrogate is multiplied by (1 without rollout_is)
    rollout_is_capped_fraction  1 on a token whose weight is the cap (0 without rollout_is)
    rollout_rs_masked_fraction  1 on a rejected token
With `staleness_ST` (per token, how many policy versions before the one that trains it its sampler was), the same
sums by staleness (STALENESS_METRICS, each weighted by the token count of its staleness, also in the sums): the mean
log rho of the tokens 0, 1 and 2 or more versions old (log_ratio_mean/staleness_*), and the mismatch metrics above
on the current version's tokens alone (*_current), where rho measures the engine's numerics only, not staleness.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from megatron_gtpo.algorithms._checks import check_bool_mask, check_choice, check_floating, check_same_shape

ROLLOUT_IS_LEVELS = ("none", "token", "sequence", "geometric")
ROLLOUT_RS_LEVELS = ("none", "token", "sequence", "geometric")
MISMATCH_METRICS = ("rollout_logprob_mismatch", "mismatch_kl", "token_mult_prob_error", "rollout_is_weight_mean",
                    "rollout_is_capped_fraction", "rollout_rs_masked_fraction")
# Staleness buckets: versions behind the policy that trains (the last one: that many or more).
STALENESS_BUCKETS = ("0", "1", "2plus")
# name -> the name of its weight (a token count, itself in the sums)
STALENESS_METRICS = {
    **{f"log_ratio_mean/staleness_{b}": f"tokens_staleness_{b}" for b in STALENESS_BUCKETS},
    **{f"{name}_current": "tokens_staleness_0"
       for name in ("rollout_logprob_mismatch", "mismatch_kl", "token_mult_prob_error")},
}
# log rho is clamped to +-LOG_RATIO_LIMIT before exp, as in losses.py (a guard against overflow; it never binds
# between two passes of the same weights).
LOG_RATIO_LIMIT = 20.0


class RolloutCorrection(NamedTuple):
    weights: torch.Tensor | None  # [S, T] (token) or [S] (sequence, geometric), float, detached; None for "none"
    keep_ST: torch.Tensor  # bool: the loss mask after rejection (a subset of the valid tokens)
    # MISMATCH_METRICS as 0-dim sums over valid tokens, and "num_tokens"; with staleness, STALENESS_METRICS and
    # their token counts
    metric_sums: dict[str, torch.Tensor]


def rollout_correction(old_logprobs_ST: torch.Tensor, rollout_logprobs_ST: torch.Tensor, mask_ST: torch.Tensor, *,
                       rollout_is: str = "none", rollout_is_cap: float = 2.0, rollout_rs: str = "none",
                       rollout_rs_bounds: tuple[float, float] = (0.5, 2.0),
                       staleness_ST: torch.Tensor | None = None) -> RolloutCorrection:
    """The weights, the kept tokens and the mismatch metrics of S sequences (module docstring); `staleness_ST`
    (integer, >= 0 on valid tokens) adds the metrics by staleness. Inputs may hold anything at padding (mask_ST
    False); every output is computed without a host sync."""
    check_floating("old_logprobs_ST", old_logprobs_ST, 2)
    check_same_shape("rollout_logprobs_ST", rollout_logprobs_ST, old_logprobs_ST.shape)
    check_bool_mask("mask_ST", mask_ST, old_logprobs_ST.shape)
    check_choice("rollout_is", rollout_is, ROLLOUT_IS_LEVELS)
    check_choice("rollout_rs", rollout_rs, ROLLOUT_RS_LEVELS)
    if not rollout_is_cap > 0:
        raise ValueError(f"rollout_is_cap must be > 0, got {rollout_is_cap!r}")
    low, high = rollout_rs_bounds
    if not 0 <= low <= high:
        raise ValueError(f"rollout_rs_bounds must be [low, high] with 0 <= low <= high, got {rollout_rs_bounds!r}")

    if staleness_ST is not None:
        check_same_shape("staleness_ST", staleness_ST, old_logprobs_ST.shape)

    with torch.no_grad():
        difference_ST = torch.where(mask_ST, old_logprobs_ST.float() - rollout_logprobs_ST.float(), 0.0)
        log_rho_ST = difference_ST.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        log_rho_sum_S = log_rho_ST.sum(dim=-1)
        lengths_S = mask_ST.sum(dim=-1)
        log_cap = math.log(rollout_is_cap)
        # The log of each level's weight before the cap: per token [S, T] or per sequence [S].
        log_statistics = {"token": log_rho_ST, "sequence": log_rho_sum_S,
                          "geometric": log_rho_sum_S / lengths_S.clamp(min=1)}
        uncapped = log_statistics.get(rollout_is)
        weights = None
        if uncapped is not None:
            weights = uncapped.clamp(max=log_cap).exp()
            weights = torch.where(mask_ST, weights, 0.0) if weights.ndim == 2 else weights

        log_low = math.log(low) if low > 0 else -math.inf
        log_high = math.log(high) if high > 0 else -math.inf
        statistic = log_statistics.get(rollout_rs)
        if statistic is None:
            keep_ST = mask_ST
        else:
            inside = (statistic >= log_low) & (statistic <= log_high)
            keep_ST = mask_ST & (inside if inside.ndim == 2 else inside.unsqueeze(-1))

        if weights is None:
            token_weights_ST = mask_ST.float()
            capped_ST = torch.zeros_like(mask_ST)
        else:
            token_weights_ST = weights if weights.ndim == 2 else torch.where(mask_ST, weights.unsqueeze(-1), 0.0)
            capped_ST = mask_ST & (uncapped >= log_cap if uncapped.ndim == 2 else (uncapped >= log_cap)[:, None])
        # Per token: the mismatch metrics' terms, 0 at padding.
        terms_ST = {"rollout_logprob_mismatch": difference_ST.abs(),
                    "mismatch_kl": torch.where(mask_ST, torch.expm1(log_rho_ST) - log_rho_ST, 0.0),
                    "token_mult_prob_error": torch.where(mask_ST, log_rho_ST.abs().exp(), 0.0)}
        metric_sums = {
            **{name: term_ST.sum() for name, term_ST in terms_ST.items()},
            "rollout_is_weight_mean": torch.where(mask_ST, token_weights_ST, 0.0).sum(),
            "rollout_is_capped_fraction": capped_ST.sum().float(),
            "rollout_rs_masked_fraction": (mask_ST & ~keep_ST).sum().float(),
            "num_tokens": mask_ST.sum().float(),
        }
        if staleness_ST is not None:
            buckets = {"0": staleness_ST == 0, "1": staleness_ST == 1, "2plus": staleness_ST >= 2}
            for bucket, where_ST in buckets.items():
                where_ST = where_ST & mask_ST
                metric_sums[f"log_ratio_mean/staleness_{bucket}"] = torch.where(where_ST, log_rho_ST, 0.0).sum()
                metric_sums[f"tokens_staleness_{bucket}"] = where_ST.sum().float()
            current_ST = buckets["0"] & mask_ST
            for name, term_ST in terms_ST.items():
                metric_sums[f"{name}_current"] = torch.where(current_ST, term_ST, 0.0).sum()
    return RolloutCorrection(weights, keep_ST, metric_sums)
