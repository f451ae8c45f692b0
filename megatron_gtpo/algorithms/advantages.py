"""Advantages of GRPO (also DAPO's), GTPO (token-level entropy shaping) and GRPO-S (sequence-level).

GTPO and GRPO-S as in arXiv 2508.04349. Conventions shared by every function here:

- N prompts, G responses per prompt, T token positions: rewards_NG, entropy_NGT, mask_NGT.
  mask_NGT is True on valid response tokens (a prefix of each row); entropy at padding positions may hold
  anything (NaN included) and is never read arithmetically.
- Every z-score uses the Bessel-corrected standard deviation (count - 1 in the denominator, as torch.std and
  the public GRPO implementations do); a set of one value has std 0, never NaN. [choice: the spec is silent]
- `eps` guards a division additively: x / (y + eps).
- Arithmetic runs in float32 at least (float64 inputs stay float64; bf16/fp16 entropies are upcast); GTPO's
  per-prompt sums are combined over the normalisation scope in float64.
- Everything is vectorised over [N, G, T]: no Python loop runs over responses or tokens. The passes over
  [N, G, T] live in token_passes.py (torch ops, on the device the entropies live on).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_gtpo.algorithms import token_passes
from megatron_gtpo.algorithms._checks import (
    check_binary_rewards,
    check_bool_mask,
    check_choice,
    check_entropy_clip,
    check_floating,
    check_positive,
)

NORM_SCOPES = ("batch", "group")


def _bessel_std(centered_sum_sq: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Sample std from the sum of squared deviations of `count` values; 0 when count <= 1."""
    return (centered_sum_sq / (count - 1).clamp(min=1)).clamp(min=0).sqrt()


def _group_zscore(values_NG: torch.Tensor, *, eps: float) -> torch.Tensor:
    """(v - mean_G) / (std_G + eps) within each group (row)."""
    centered_NG = values_NG - values_NG.mean(dim=1, keepdim=True)
    count = torch.tensor(values_NG.shape[1], dtype=values_NG.dtype, device=values_NG.device)
    std_N1 = _bessel_std(centered_NG.square().sum(dim=1, keepdim=True), count)
    return centered_NG / (std_N1 + eps)


def grpo_advantages(rewards_NG: torch.Tensor, *, eps: float = 1e-6, normalize_std: bool = True) -> torch.Tensor:
    """GRPO (and DAPO) advantages: A_i = (r_i - mean_G r) / (std_G r + eps), shared by every token of o_i.

    rewards_NG: any real rewards (binary correctness, possibly plus length penalties). With
    normalize_std=False the advantage is r_i - mean_G r (no division). Returns advantages_NG in the dtype of
    the rewards; a group whose rewards are all equal gets advantage 0.
    """
    check_floating("rewards_NG", rewards_NG, 2)
    check_positive("eps", eps)
    if not normalize_std:
        return rewards_NG - rewards_NG.mean(dim=1, keepdim=True)
    return _group_zscore(rewards_NG, eps=eps)


def _check_shaping_inputs(rewards_NG, entropy_NGT, mask_NGT, entropy_clip, eps) -> None:
    check_floating("rewards_NG", rewards_NG, 2)
    check_floating("entropy_NGT", entropy_NGT, 3)
    if entropy_NGT.shape[:2] != rewards_NG.shape:
        raise ValueError(f"entropy_NGT must have shape [N, G, T] with [N, G] = {tuple(rewards_NG.shape)} "
                         f"(the shape of rewards_NG), got {tuple(entropy_NGT.shape)}")
    check_bool_mask("mask_NGT", mask_NGT, entropy_NGT.shape)
    check_entropy_clip(entropy_clip)
    check_positive("eps", eps)
    check_binary_rewards("rewards_NG", rewards_NG)


def _compute_dtype(entropy_NGT: torch.Tensor) -> torch.dtype:
    return torch.promote_types(entropy_NGT.dtype, torch.float32)


# ---------------------------------------------------------------------------------------------- GRPO-S


def grpo_s_shaped_rewards(
    rewards_NG: torch.Tensor,
    entropy_NGT: torch.Tensor,
    mask_NGT: torch.Tensor,
    *,
    beta1: float = 1.0,
    beta2: float = 0.1,
    entropy_clip: tuple[float, float] | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """GRPO-S sequence-level shaped rewards r_hat_NG.

    Hbar_i = (1/|o_i|) sum_t H_{i,t} (0 for an empty response), then within each group, with n successful
    (reward 1) and m = G - n failed responses:
        successful i: beta1 * r_i + beta2 * Hbar_i / (sum_{k in O+} Hbar_k + eps) * n
        failed j:     -beta1 - beta2 * (1/(Hbar_j + eps)) / (sum_{k in O-} 1/(Hbar_k + eps) + eps) * m
    rewards_NG must be exactly 0 or 1 (ValueError otherwise).
    """
    _check_shaping_inputs(rewards_NG, entropy_NGT, mask_NGT, entropy_clip, eps)
    dtype = _compute_dtype(entropy_NGT)
    lengths_NG, entropy_sum_NG = token_passes.row_sums(entropy_NGT, mask_NGT, entropy_clip=entropy_clip, dtype=dtype)
    mean_entropy_NG = entropy_sum_NG / lengths_NG.clamp(min=1)

    rewards_NG = rewards_NG.to(dtype)
    correct_NG = rewards_NG == 1
    num_correct_N1 = correct_NG.sum(dim=1, keepdim=True).to(dtype)
    num_failed_N1 = rewards_NG.shape[1] - num_correct_N1

    pos_weight_NG = torch.where(correct_NG, mean_entropy_NG, 0.0)
    pos_share_NG = pos_weight_NG / (pos_weight_NG.sum(dim=1, keepdim=True) + eps)
    neg_weight_NG = torch.where(correct_NG, 0.0, 1.0 / (mean_entropy_NG + eps))
    neg_share_NG = neg_weight_NG / (neg_weight_NG.sum(dim=1, keepdim=True) + eps)
    return torch.where(
        correct_NG,
        beta1 * rewards_NG + beta2 * pos_share_NG * num_correct_N1,
        -beta1 - beta2 * neg_share_NG * num_failed_N1,
    )


def grpo_s_advantages(
    rewards_NG: torch.Tensor,
    entropy_NGT: torch.Tensor,
    mask_NGT: torch.Tensor,
    *,
    beta1: float = 1.0,
    beta2: float = 0.1,
    entropy_clip: tuple[float, float] | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """GRPO-S advantages_NG: the group z-score (r_hat_i - mean_G) / (std_G + eps) of grpo_s_shaped_rewards.

    One advantage per response, shared by all its tokens. With beta2 = 0 this equals grpo_advantages.
    Groups whose responses all succeeded (or all failed) still get entropy-driven advantages when beta2 > 0;
    dynamic sampling removes such groups before this stage.
    """
    shaped_NG = grpo_s_shaped_rewards(rewards_NG, entropy_NGT, mask_NGT, beta1=beta1, beta2=beta2,
                                      entropy_clip=entropy_clip, eps=eps)
    return _group_zscore(shaped_NG, eps=eps)


# ------------------------------------------------------------------------------------------------ GTPO


class _GTPOShaping(NamedTuple):
    """GTPO's token rewards in factored form. A response of type k (0 = successful, O+; 1 = failed, O-;
    sign_k = +1 / -1) has on each valid token t the shaped reward  sign_k * (alpha1 + bonus), with the entropy bonus
        O+: alpha2 * H_{g,t} / (sum_{O+} H_t + eps) * d_t                  = H_{g,t} * coef_N2T[n, 0, t]
        O-: alpha2 * (1/(H_{g,t} + eps)) / (sum_{O-} 1/(H_t + eps) + eps) * h_t = 1/(H_{g,t} + eps) * coef_N2T[n, 1, t]
    (token_passes.shaping_moments)."""

    failed_NG: torch.Tensor  # bool: the response's type
    coef_N2T: torch.Tensor
    # Per prompt and type: number of valid tokens, sum of the bonus over them, sum of the squared bonus (float64).
    moments_N32: torch.Tensor


def _gtpo_shaping(rewards_NG, entropy_NGT, mask_NGT, *, alpha2, entropy_clip, eps) -> _GTPOShaping:
    failed_NG = rewards_NG != 1
    coef_N2T, moments_N32 = token_passes.shaping_moments(entropy_NGT, mask_NGT, failed_NG, alpha2=alpha2,
                                                         entropy_clip=entropy_clip, eps=eps,
                                                         dtype=_compute_dtype(entropy_NGT))
    return _GTPOShaping(failed_NG, coef_N2T, moments_N32)


def _affine_in_bonus(shaping: _GTPOShaping, entropy_NGT, mask_NGT, slope_N2, intercept_N2, *, entropy_clip,
                     eps) -> torch.Tensor:
    """slope[n, k] * bonus[n, g, t] + intercept[n, k] on valid tokens (k the type of response g), 0 at padding."""
    return token_passes.apply_affine(entropy_NGT, mask_NGT, shaping.failed_NG, shaping.coef_N2T, slope_N2,
                                     intercept_N2, entropy_clip=entropy_clip, eps=eps,
                                     dtype=_compute_dtype(entropy_NGT))


_TYPE_SIGN_12 = (1.0, -1.0)  # successful tokens carry +(alpha1 + bonus), failed ones -(alpha1 + bonus)


def gtpo_advantages(
    rewards_NG: torch.Tensor,
    entropy_NGT: torch.Tensor,
    mask_NGT: torch.Tensor,
    *,
    alpha1: float = 1.0,
    alpha2: float = 0.1,
    norm_scope: str = "batch",
    entropy_clip: tuple[float, float] | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """GTPO token advantages_NGT: Apos on tokens of successful responses, Aneg on failed ones, 0 at padding.

        Apos = (rpos - mean(Rpos)) / (std(Rpos) + eps)      Aneg = (rneg - mean(Rneg)) / (std(Rneg) + eps)

    rpos/rneg are GTPO's shaped token rewards (arXiv 2508.04349, docs/algorithms.md): with d_t (h_t) the number of
    successful (failed) responses that have a token at position t, and the sums over the responses that have one,
        successful i: rpos_{i,t} = alpha1 * r_i + alpha2 * H_{i,t} / (sum_{k in O+} H_{k,t} + eps) * d_t
        failed j:     rneg_{j,t} = -alpha1
                                   - alpha2 * (1/(H_{j,t} + eps)) / (sum_{k in O-} 1/(H_{k,t} + eps) + eps) * h_t
    Rpos (Rneg) is the set of rpos (rneg) values over ALL valid tokens in
    scope, the structural zeros included (rpos = 0 on failed tokens, rneg = 0 on successful ones), so with
    alpha2 = 0 both reduce to the z-score of the binary token reward. norm_scope "batch" takes the
    statistics over the whole batch, "group" over each prompt's group.

    Sign of the advantages. In a scope with P successful and F failed valid tokens, mean(Rpos) <=
    (alpha1 + alpha2) * P / (P + F) and rpos >= alpha1, so every successful token gets Apos >= 0 when
    alpha2 * P <= alpha1 * F; symmetrically every failed token gets Aneg <= 0 when alpha2 * F <= alpha1 * P.
    Outside these bounds (e.g. fewer than 1 failed token in 11 in scope, with the defaults) a low-entropy
    successful token can get a negative advantage and a high-entropy failed token a positive one, even in a
    group with both outcomes.

    Implementation: a type-k token's reward is sign_k * (alpha1 + bonus), so the mean and the centred sum of
    squares of each set follow exactly from three per-prompt moments per type (_GTPOShaping.moments_N32),
    and the advantage is one affine map of the token's entropy bonus:
        A = sign_k / (std_k + eps) * (alpha1 - sign_k * mean_k + bonus_{i,t}).
    """
    _check_shaping_inputs(rewards_NG, entropy_NGT, mask_NGT, entropy_clip, eps)
    check_choice("norm_scope", norm_scope, NORM_SCOPES)
    shaping = _gtpo_shaping(rewards_NG, entropy_NGT, mask_NGT, alpha2=alpha2, entropy_clip=entropy_clip, eps=eps)

    # Per-type moments over each normalisation scope (C: 1 for norm_scope "batch", N for "group"), combined in
    # float64: token count, sum of bonus, sum of squared bonus.
    moments_C32 = shaping.moments_N32.sum(dim=0, keepdim=True) if norm_scope == "batch" else shaping.moments_N32
    count_C2, bonus_sum_C2, bonus_sq_sum_C2 = moments_C32.unbind(dim=1)
    sign_12 = torch.tensor(_TYPE_SIGN_12, dtype=torch.float64, device=rewards_NG.device).view(1, 2)
    tokens_C1 = count_C2.sum(dim=1, keepdim=True)  # all valid tokens in scope, both types
    # Mean of the signed rewards over all valid tokens (the other type's tokens add zeros).
    mean_C2 = sign_12 * (alpha1 * count_C2 + bonus_sum_C2) / tokens_C1.clamp(min=1)
    # Deviation of a type-k token from the mean, in units of its magnitude: offset_k + bonus.
    offset_C2 = alpha1 - sign_12 * mean_C2
    # In a scope holding one outcome only this is bonus_sq_sum - bonus_sum^2 / count, with nearly equal entropies a
    # tiny fraction of either term (~1e-7 at an entropy spread of 1e-3): float64 keeps it only because
    # token_passes.shaping_moments forms the two moments from centred per-position sums (its docstring says how).
    centered_sum_sq_C2 = (count_C2 * offset_C2.square() + 2 * offset_C2 * bonus_sum_C2 + bonus_sq_sum_C2
                          + (tokens_C1 - count_C2) * mean_C2.square())
    scale_C2 = sign_12 / (_bessel_std(centered_sum_sq_C2, tokens_C1) + eps)

    # Per token: A = scale_k * bonus + scale_k * offset_k (one row of statistics per prompt).
    slope_N2 = scale_C2.expand(len(rewards_NG), 2)
    intercept_N2 = (scale_C2 * offset_C2).expand(len(rewards_NG), 2)
    return _affine_in_bonus(shaping, entropy_NGT, mask_NGT, slope_N2, intercept_N2, entropy_clip=entropy_clip,
                            eps=eps)
