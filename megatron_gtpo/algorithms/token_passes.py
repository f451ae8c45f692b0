"""The passes over [N, G, T] of GTPO and GRPO-S: entropy weights per token, summed per position or per row.

Three functions, each with one contract, in torch ops on whatever device the entropies live on (the training
device: the step's advantages never leave it). Their cost next to a GRPO step is recorded in
benchmarks/results/throughput.md.

Shared definitions. rows are responses: failed_NG is True for a failed response (reward 0), False for a successful
one; a response's type k is 0 (successful) or 1 (failed). The entropy is clamped to [low, high]: entropy_clip, or
[0, inf) without it (entropy is >= 0, but rounding can leave tiny negative values, and 1/(H + eps) must stay
finite); its weight is
    w = H            on a successful response's valid token,
    w = 1 / (H + eps) on a failed response's valid token,
    w = 0            at padding, whatever the entropy holds there (NaN included; it is selected away, never
                     multiplied), while a NaN at a valid token propagates.
"""
from __future__ import annotations

import math

import torch

from megatron_gtpo.algorithms._checks import check_bool_mask, check_same_shape


def _clip_bounds(entropy_clip: tuple[float, float] | None) -> tuple[float, float]:
    return (0.0, math.inf) if entropy_clip is None else (float(entropy_clip[0]), float(entropy_clip[1]))


def _check_inputs(entropy_NGT, mask_NGT, failed_NG=None) -> None:
    tensors = [t for t in (entropy_NGT, mask_NGT, failed_NG) if t is not None]
    if len({t.device for t in tensors}) > 1:
        devices = [str(t.device) for t in tensors]
        raise ValueError(f"entropy, mask and rewards must be on the same device, got {devices}")
    check_bool_mask("mask_NGT", mask_NGT, entropy_NGT.shape)
    if failed_NG is not None:
        check_same_shape("failed_NG", failed_NG, entropy_NGT.shape[:2])


def _weights(entropy_NGT, mask_NGT, failed_NG, low, high, eps, dtype) -> torch.Tensor:
    entropy_NGT = entropy_NGT.to(dtype).clamp(min=low, max=high)
    weights_NGT = torch.where(failed_NG.unsqueeze(-1), 1.0 / (entropy_NGT + eps), entropy_NGT)
    return torch.where(mask_NGT, weights_NGT, 0.0)


def shaping_moments(entropy_NGT: torch.Tensor, mask_NGT: torch.Tensor, failed_NG: torch.Tensor, *, alpha2: float,
                    entropy_clip: tuple[float, float] | None, eps: float, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """GTPO's per-position bonus coefficients and per-prompt moments of the bonus.

    For prompt n, type k and position t, with count = the number of type-k responses that have a token at t (d_t
    for k = 0, h_t for k = 1), sum the sum of w over them and SS the centred sum of squares of those w:
        coef_N2T[n, k, t]  = alpha2 * count / (sum + eps)       (a type-k token's bonus is w * coef)
        b                  = coef * sum                          (the sum of the position's bonus)
        moments_N32[n, :, k] = (sum_t count, sum_t b, sum_t (coef^2 * SS + b^2 / count))
                           = (number of valid type-k tokens, sum of their bonus, sum of their squared bonus).
    coef_N2T in `dtype`, moments_N32 float64.

    Why the centred form: gtpo_advantages subtracts (sum of bonus)^2 / count from the squared-bonus moment, and in a
    scope with one outcome only (all correct or all failed) nothing else is left of the variance, so with nearly
    equal entropies it is a tiny difference of large numbers (entropy spread 1e-3: the variance is ~1e-7 of the
    squared-bonus moment). Built from float32 sums of w and w^2 it was lost (advantages of ~7e3 where the z-score
    is at most 2.6). Here the per-position sums are of deviations from the per-position mean (two passes), SS and
    the moments are formed in float64, and both moments use the same float64 b, so the subtraction only cancels
    the true between-position spread of b / count.
    """
    _check_inputs(entropy_NGT, mask_NGT, failed_NG)
    low, high = _clip_bounds(entropy_clip)
    weights_NGT = _weights(entropy_NGT, mask_NGT, failed_NG, low, high, eps, dtype)
    onehot_N2G = torch.stack([~failed_NG, failed_NG], dim=1).to(dtype)
    count_N2T = torch.bmm(onehot_N2G, mask_NGT.to(dtype))  # sums over the G responses of one type, per position
    mean_N2T = torch.bmm(onehot_N2G, weights_NGT) / count_N2T.clamp(min=1)
    # Second pass: deviations of the valid tokens from their type's mean at t (0 at padding). Their sum corrects the
    # rounding of the mean; the sum of their squares, less that correction, is the centred sum of squares SS. The
    # mean of each row's type by a one-hot product (exact; several times faster than a gather on CPU), which like
    # the sums above lets a NaN of one type reach the other type's sums of that prompt.
    mean_NGT = torch.bmm(onehot_N2G.transpose(1, 2), mean_N2T)
    deviation_NGT = torch.where(mask_NGT, weights_NGT - mean_NGT, 0.0)
    deviation_sum_N2T = torch.bmm(onehot_N2G, deviation_NGT).double()
    deviation_sq_sum_N2T = torch.bmm(onehot_N2G, deviation_NGT.square()).double()
    count_N2T = count_N2T.double()
    count_or_1_N2T = count_N2T.clamp(min=1)
    sum_N2T = count_N2T * mean_N2T.double() + deviation_sum_N2T
    centred_sq_N2T = deviation_sq_sum_N2T - deviation_sum_N2T.square() / count_or_1_N2T
    coef_N2T = (alpha2 * count_N2T / (sum_N2T + eps)).to(dtype)
    coef64_N2T = coef_N2T.double()
    bonus_sum_N2T = coef64_N2T * sum_N2T  # with the coefficient as apply_affine will use it
    moments_N32 = torch.stack([count_N2T.sum(dim=-1), bonus_sum_N2T.sum(dim=-1),
                               (coef64_N2T.square() * centred_sq_N2T + bonus_sum_N2T.square() / count_or_1_N2T
                                ).sum(dim=-1)], dim=1)
    return coef_N2T, moments_N32


def apply_affine(entropy_NGT: torch.Tensor, mask_NGT: torch.Tensor, failed_NG: torch.Tensor, coef_N2T: torch.Tensor,
                 slope_N2: torch.Tensor, intercept_N2: torch.Tensor, *, entropy_clip: tuple[float, float] | None,
                 eps: float, dtype: torch.dtype) -> torch.Tensor:
    """out_NGT = (w * coef[n, k, t]) * slope[n, k] + intercept[n, k] on valid tokens (k the response's type), exactly
    0 at padding; a fresh tensor of `dtype`."""
    _check_inputs(entropy_NGT, mask_NGT, failed_NG)
    N, G, T = entropy_NGT.shape
    check_same_shape("coef_N2T", coef_N2T, (N, 2, T))
    check_same_shape("slope_N2", slope_N2, (N, 2))
    check_same_shape("intercept_N2", intercept_N2, (N, 2))
    low, high = _clip_bounds(entropy_clip)
    weights_NGT = _weights(entropy_NGT, mask_NGT, failed_NG, low, high, eps, dtype)
    type_NG = failed_NG.long()
    coef_NGT = torch.gather(coef_N2T.to(dtype), 1, type_NG.unsqueeze(-1).expand(N, G, T))
    slope_NG1 = torch.gather(slope_N2.to(dtype), 1, type_NG).unsqueeze(-1)
    intercept_NG1 = torch.gather(intercept_N2.to(dtype), 1, type_NG).unsqueeze(-1)
    return torch.where(mask_NGT, weights_NGT * coef_NGT * slope_NG1 + intercept_NG1, 0.0)


def row_sums(entropy_NGT: torch.Tensor, mask_NGT: torch.Tensor, *, entropy_clip: tuple[float, float] | None,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(length_NG, entropy_sum_NG): each response's number of valid tokens and the sum of its clamped entropies over
    them, in `dtype`."""
    _check_inputs(entropy_NGT, mask_NGT)
    low, high = _clip_bounds(entropy_clip)
    clamped_NGT = entropy_NGT.to(dtype).clamp(min=low, max=high)
    return mask_NGT.sum(dim=-1).to(dtype), torch.where(mask_NGT, clamped_NGT, 0.0).sum(dim=-1)
