"""The passes over [N, G, T] of GTPO and GRPO-S: entropy weights per token, summed per position or per row.

Three functions, each with one contract and two implementations chosen per call by where the data lives:
- torch ops, for every device and dtype (one block over the whole batch: the GPU path);
- native C (`_token_passes.c`, built by setup.py as `_token_passes_native`) for float32 on CPU, which reads each
  entropy twice and writes each advantage once instead of ~15 elementwise torch passes
  (benchmarks/results/advantages.md). bfloat16 / float16 entropies are upcast to float32 first; float64 stays on
  the torch path.
Both give the same values up to float32 rounding (tests/test_algorithms_token_passes.py). If the native module is
not built (no C compiler when the package was installed: setup.py marks the extension optional), the CPU path
uses the torch ops and logs a warning once.

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

import logging
import math

import torch

from megatron_gtpo.algorithms._checks import check_bool_mask, check_same_shape

logger = logging.getLogger(__name__)

try:
    from megatron_gtpo.algorithms import _token_passes_native as _native
except ImportError as e:  # pragma: no cover - the CI build has it (tests/test_algorithms_token_passes.py)
    _native, _NATIVE_MISSING = None, str(e)
else:
    _NATIVE_MISSING = ""
_warned_missing = False


def native_available() -> bool:
    return _native is not None


def _use_native(entropy_NGT: torch.Tensor) -> bool:
    """Native kernels for CPU tensors of float32 or narrower floats; torch ops otherwise."""
    global _warned_missing
    if entropy_NGT.device.type != "cpu" or entropy_NGT.dtype == torch.float64:
        return False
    if _native is None and not _warned_missing:
        logger.warning("megatron_gtpo's native CPU kernels are not built (%s): GTPO / GRPO-S advantages on CPU use "
                       "torch ops (same values, several times slower). Reinstall with a C compiler present.",
                       _NATIVE_MISSING)
        _warned_missing = True
    return _native is not None


def _clip_bounds(entropy_clip: tuple[float, float] | None) -> tuple[float, float]:
    return (0.0, math.inf) if entropy_clip is None else (float(entropy_clip[0]), float(entropy_clip[1]))


def _native_inputs(entropy_NGT, mask_NGT, failed_NG=None):
    """float32 entropy, bool mask (1 byte per element) and uint8 types, all contiguous and in host memory: what the
    C code reads through raw pointers."""
    tensors = [t for t in (entropy_NGT, mask_NGT, failed_NG) if t is not None]
    if any(t.device.type != "cpu" for t in tensors):
        devices = [str(t.device) for t in tensors]
        raise ValueError(f"entropy, mask and rewards must be on the same device, got {devices}")
    # Raw pointers read whatever lies past a short buffer: every shape is checked.
    check_bool_mask("mask_NGT", mask_NGT, entropy_NGT.shape)
    if failed_NG is not None:
        check_same_shape("failed_NG", failed_NG, entropy_NGT.shape[:2])
    native = [entropy_NGT.to(torch.float32).contiguous(), mask_NGT.contiguous()]
    if failed_NG is not None:
        native.append(failed_NG.to(torch.uint8).contiguous())
    return native


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
    coef_N2T in `dtype` (float32 on the native path), moments_N32 float64.

    Why the centred form: gtpo_advantages subtracts (sum of bonus)^2 / count from the squared-bonus moment, and in a
    scope with one outcome only (all correct or all failed) nothing else is left of the variance, so with nearly
    equal entropies it is a tiny difference of large numbers (entropy spread 1e-3: the variance is ~1e-7 of the
    squared-bonus moment). Built from float32 sums of w and w^2 it was lost (advantages of ~7e3 through the torch
    ops where the z-score is at most 2.6, off by 0.14 through the native kernel). Here the per-position sums are of
    deviations (the native kernel: from the first valid row's w, in one pass; the torch ops: from the per-position
    mean, in two), SS and the moments are formed in float64, and both moments use the same float64 b, so the
    subtraction only cancels the true between-position spread of b / count. (The native kernel evaluates
    coef^2 * SS + b^2 / count as coef^2 * (sum of w^2), that sum rebuilt in double from the deviations: the same
    number to double rounding, without a division; _token_passes.c.)
    """
    low, high = _clip_bounds(entropy_clip)
    N, G, T = entropy_NGT.shape
    if _use_native(entropy_NGT):
        entropy_NGT, mask_NGT, failed_NG = _native_inputs(entropy_NGT, mask_NGT, failed_NG)
        coef_N2T = torch.empty((N, 2, T), dtype=torch.float32)
        moments_N32 = torch.empty((N, 3, 2), dtype=torch.float64)
        # Per type and position: count, reference value, sum of deviations, sum of squared deviations.
        scratch_42T = torch.empty((4, 2, T), dtype=torch.float32)
        _native.shaping_moments(entropy_NGT.data_ptr(), mask_NGT.data_ptr(), failed_NG.data_ptr(), N, G, T, low,
                                high, eps, alpha2, coef_N2T.data_ptr(), moments_N32.data_ptr(), scratch_42T.data_ptr())
        return coef_N2T, moments_N32
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
    0 at padding; a fresh tensor of `dtype` (float32 on the native path)."""
    low, high = _clip_bounds(entropy_clip)
    N, G, T = entropy_NGT.shape
    if _use_native(entropy_NGT):
        entropy_NGT, mask_NGT, failed_NG = _native_inputs(entropy_NGT, mask_NGT, failed_NG)
        check_same_shape("coef_N2T", coef_N2T, (N, 2, T))
        check_same_shape("slope_N2", slope_N2, (N, 2))
        check_same_shape("intercept_N2", intercept_N2, (N, 2))
        coef_N2T, slope_N2, intercept_N2 = (x.to(device="cpu", dtype=torch.float32).contiguous()
                                            for x in (coef_N2T, slope_N2, intercept_N2))
        out_NGT = torch.empty((N, G, T), dtype=torch.float32)
        _native.apply_affine(entropy_NGT.data_ptr(), mask_NGT.data_ptr(), failed_NG.data_ptr(), N, G, T, low, high,
                             eps, coef_N2T.data_ptr(), slope_N2.data_ptr(), intercept_N2.data_ptr(),
                             out_NGT.data_ptr())
        return out_NGT
    weights_NGT = _weights(entropy_NGT, mask_NGT, failed_NG, low, high, eps, dtype)
    type_NG = failed_NG.long()
    coef_NGT = torch.gather(coef_N2T.to(dtype), 1, type_NG.unsqueeze(-1).expand(N, G, T))
    slope_NG1 = torch.gather(slope_N2.to(dtype), 1, type_NG).unsqueeze(-1)
    intercept_NG1 = torch.gather(intercept_N2.to(dtype), 1, type_NG).unsqueeze(-1)
    return torch.where(mask_NGT, weights_NGT * coef_NGT * slope_NG1 + intercept_NG1, 0.0)


def row_sums(entropy_NGT: torch.Tensor, mask_NGT: torch.Tensor, *, entropy_clip: tuple[float, float] | None,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(length_NG, entropy_sum_NG): each response's number of valid tokens and the sum of its clamped entropies over
    them, in `dtype` (float32 on the native path)."""
    low, high = _clip_bounds(entropy_clip)
    N, G, T = entropy_NGT.shape
    if _use_native(entropy_NGT):
        entropy_NGT, mask_NGT = _native_inputs(entropy_NGT, mask_NGT)
        length_NG = torch.empty((N, G), dtype=torch.float32)
        sum_NG = torch.empty((N, G), dtype=torch.float32)
        _native.row_sums(entropy_NGT.data_ptr(), mask_NGT.data_ptr(), N * G, T, low, high, length_NG.data_ptr(),
                         sum_NG.data_ptr())
        return length_NG, sum_NG
    clamped_NGT = entropy_NGT.to(dtype).clamp(min=low, max=high)
    return mask_NGT.sum(dim=-1).to(dtype), torch.where(mask_NGT, clamped_NGT, 0.0).sum(dim=-1)
