"""The [N, G, T] passes of GTPO / GRPO-S (algorithms/token_passes.py) against float64 references, and whole
advantages against the float64 loop reference (algorithm_references.py).

Shapes are chosen so that T is not a multiple of any vector width, with single-row
groups, empty rows, all-correct / all-failed groups, NaN / inf / huge values at padding, and non-contiguous inputs.
Tolerance for float32: 2e-5 relative to the scale of each output.
"""
from __future__ import annotations

import pytest
import torch

import megatron_gtpo.algorithms.token_passes as token_passes
from megatron_gtpo.algorithms import grpo_s_advantages, gtpo_advantages
from algorithm_references import dense_from_dict, gtpo_token_rewards, random_batch, reference_grpo_s, reference_gtpo

SHAPES = [(3, 5, 37), (2, 1, 9), (4, 8, 64), (1, 3, 1)]
CLIPS = [None, (0.3, 2.0)]
EPS, ALPHA2 = 1e-8, 0.1


def _inputs(seed, shape, *, garbage_padding=True):
    N, G, T = shape
    rewards, entropy, mask, _ = random_batch(seed, N=N, G=G, T=T, dtype=torch.float32)
    if G > 1:
        rewards[0] = 1.0  # an all-correct group
    if garbage_padding:
        junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -3.0])
        entropy = torch.where(mask, entropy, junk[torch.arange(mask.numel()) % 5].view(mask.shape))
    return rewards, entropy, mask, rewards != 1


def _reference_weights_f64(entropy, mask, failed, clip):
    low, high = (0.0, float("inf")) if clip is None else clip
    h = entropy.double().clamp(low, high)
    return torch.where(mask, torch.where(failed.unsqueeze(-1), 1 / (h + EPS), h), 0.0)


def _assert_close_scaled(got, expected, rtol=2e-5):
    scale = expected.abs().max().clamp(min=1.0)
    torch.testing.assert_close(got.double(), expected, atol=rtol * float(scale), rtol=rtol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("clip", CLIPS)
def test_shaping_moments_against_float64(shape, clip):
    for seed in range(3):
        rewards, entropy, mask, failed = _inputs(seed, shape)
        coef, moments = token_passes.shaping_moments(entropy, mask, failed, alpha2=ALPHA2, entropy_clip=clip, eps=EPS,
                                                     dtype=torch.float32)
        assert coef.dtype == torch.float32 and moments.dtype == torch.float64
        w = _reference_weights_f64(entropy, mask, failed, clip)
        for k, rows in enumerate((~failed, failed)):
            sel = rows.unsqueeze(-1).double()
            count, total = (sel * mask).sum(1), (sel * w).sum(1)
            expected_coef = ALPHA2 * count / (total + EPS)
            _assert_close_scaled(coef[:, k], expected_coef)
            bonus = w * expected_coef.unsqueeze(1) * sel  # the bonus of every type-k token
            _assert_close_scaled(moments[:, 0, k], count.sum(-1), rtol=0)
            _assert_close_scaled(moments[:, 1, k], bonus.sum((1, 2)))
            _assert_close_scaled(moments[:, 2, k], bonus.square().sum((1, 2)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("clip", CLIPS)
def test_apply_affine_against_float64(shape, clip):
    N, G, T = shape
    gen = torch.Generator().manual_seed(5)
    for seed in range(3):
        rewards, entropy, mask, failed = _inputs(10 + seed, shape)
        coef = torch.rand(N, 2, T, generator=gen)
        slope, intercept = torch.randn(N, 2, generator=gen), torch.randn(N, 2, generator=gen)
        got = token_passes.apply_affine(entropy, mask, failed, coef, slope, intercept, entropy_clip=clip, eps=EPS,
                                        dtype=torch.float32)
        k = failed.long()
        rows_coef = torch.gather(coef.double(), 1, k.unsqueeze(-1).expand(N, G, T))
        w = _reference_weights_f64(entropy, mask, failed, clip)
        expected = (w * rows_coef * slope.double().gather(1, k).unsqueeze(-1)
                    + intercept.double().gather(1, k).unsqueeze(-1))
        expected = torch.where(mask, expected, 0.0)
        assert got.dtype == torch.float32 and (got[~mask] == 0).all()
        _assert_close_scaled(got, expected)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("clip", CLIPS)
def test_row_sums_against_float64(shape, clip):
    rewards, entropy, mask, _ = _inputs(20, shape)
    length, total = token_passes.row_sums(entropy, mask, entropy_clip=clip, dtype=torch.float32)
    low, high = (0.0, float("inf")) if clip is None else clip
    torch.testing.assert_close(length.double(), mask.sum(-1).double(), atol=0, rtol=0)
    _assert_close_scaled(total, torch.where(mask, entropy.double().clamp(low, high), 0.0).sum(-1))


@pytest.mark.parametrize("norm_scope", ["batch", "group"])
@pytest.mark.parametrize("clip", CLIPS)
def test_advantages_through_each_path_match_the_loop_reference(norm_scope, clip):
    for seed in range(4):
        rewards, entropy, mask, lengths = random_batch(300 + seed, N=4, G=6, T=29, dtype=torch.float32)
        got = gtpo_advantages(rewards, entropy, mask, norm_scope=norm_scope, entropy_clip=clip)
        ref = reference_gtpo(rewards.double().tolist(), entropy.double().tolist(), lengths.tolist(), alpha1=1.0,
                             alpha2=ALPHA2, norm_scope=norm_scope, entropy_clip=clip, eps=EPS)
        _assert_close_scaled(got, dense_from_dict(ref, mask.shape))
        ref_s = reference_grpo_s(rewards.double().tolist(), entropy.double().tolist(), lengths.tolist(), beta1=1.0,
                                 beta2=0.1, entropy_clip=clip, eps=EPS)
        _assert_close_scaled(grpo_s_advantages(rewards, entropy, mask, entropy_clip=clip),
                             torch.tensor(ref_s, dtype=torch.float64))


def test_a_nan_at_a_valid_token_propagates():
    rewards, entropy, mask, _ = _inputs(40, (5, 7, 45))
    for advantage_fn in (gtpo_advantages, gtpo_token_rewards, grpo_s_advantages):
        assert torch.isfinite(advantage_fn(rewards, entropy, mask)).all()  # garbage at padding is never read
        poisoned = entropy.clone()
        poisoned[1, 2, 0] = float("nan")  # a valid token
        assert mask[1, 2, 0]
        assert torch.isnan(advantage_fn(rewards, poisoned, mask)).any()


def test_non_contiguous_and_bfloat16_inputs():
    rewards, entropy, mask, _ = _inputs(50, (3, 4, 40), garbage_padding=False)
    wide = torch.zeros(3, 4, 80)
    wide[..., ::2] = entropy  # a strided view holding the same values
    strided = wide[..., ::2]
    assert not strided.is_contiguous()
    expected = gtpo_advantages(rewards, entropy.contiguous(), mask)
    torch.testing.assert_close(gtpo_advantages(rewards, strided, mask), expected, atol=0, rtol=0)
    bf16 = entropy.to(torch.bfloat16)
    got = gtpo_advantages(rewards, bf16, mask)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, gtpo_advantages(rewards, bf16.float(), mask), atol=0, rtol=0)


def test_passes_refuse_inputs_that_do_not_fit():
    rewards, entropy, mask, failed = _inputs(60, (2, 3, 8))
    with pytest.raises(ValueError, match="same device"):
        token_passes.shaping_moments(entropy, mask.to("meta"), failed, alpha2=ALPHA2, entropy_clip=None, eps=EPS,
                                     dtype=torch.float32)
    with pytest.raises(ValueError, match="failed_NG must have shape"):
        token_passes.shaping_moments(entropy, mask, failed[:, :2], alpha2=ALPHA2, entropy_clip=None, eps=EPS,
                                     dtype=torch.float32)
    coef, _ = token_passes.shaping_moments(entropy, mask, failed, alpha2=ALPHA2, entropy_clip=None, eps=EPS,
                                           dtype=torch.float32)
    with pytest.raises(ValueError, match="coef_N2T must have shape"):
        token_passes.apply_affine(entropy, mask, failed, coef[:, :, :4], torch.ones(2, 2), torch.zeros(2, 2),
                                  entropy_clip=None, eps=EPS, dtype=torch.float32)


# ------------------------------------------------------------- single-outcome scopes, nearly equal entropies
#
# In a scope holding one outcome only (all responses correct, or all failed, in the group or the whole batch) the
# variance of the shaped rewards is the entropy bonus' own: ~(alpha2 * spread)^2 / 12 for entropies in
# [1, 1 + spread), against a squared bonus of ~alpha2^2 per token. shaping_moments' second moment must keep it:
# built from float32 sums of w and w^2 it lost it entirely (at spread 1e-3: advantages of ~7e3 instead of at most
# 2.6).
#
# Tolerance of the advantages (float32 inputs against the float64 loop reference on the same inputs): in such a
# scope A = bonus * slope + intercept with |bonus * slope| ~ |intercept| ~ mean(w) / std(w) = sqrt(12) / spread,
# whatever alpha2 (slope = 1 / std(bonus) and bonus = alpha2 * ...), so each float32 rounding on the way (the
# weight 1 / (H + eps), coef, w * coef, the product with the slope, the slope and the intercept themselves) costs up
# to u * sqrt(12) / spread, u = 2^-24: six of them make 1.2e-6 / spread. Measured worst over these cases:
# 7.2e-7 / spread. Allowed: 8 u sqrt(12) / spread = 1.65e-6 / spread (1.7e-3 at spread 1e-3, 1.7e-4 at 1e-2).

SPREADS = [1e-3, 1e-2]
UNIT_ROUNDOFF = 2.0 ** -24


def _single_outcome_batch(seed, spread, outcome, *, N=3, G=8, T=301):
    """float32 entropies uniform in [1, 1 + spread), lengths in [T/2, T], every reward equal to `outcome`,
    garbage at padding."""
    gen = torch.Generator().manual_seed(seed)
    entropy = 1 + spread * torch.rand(N, G, T, generator=gen)
    lengths = torch.randint(T // 2, T + 1, (N, G), generator=gen)
    mask = torch.arange(T) < lengths.unsqueeze(-1)
    junk = torch.tensor([float("nan"), float("inf"), 1e30, -3.0])
    entropy = torch.where(mask, entropy, junk[torch.arange(mask.numel()) % 4].view(mask.shape))
    return torch.full((N, G), float(outcome)), entropy, mask, lengths


def _single_outcome_tolerance(spread):
    return 8 * UNIT_ROUNDOFF * 12 ** 0.5 / spread


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("outcome", [1.0, 0.0], ids=["all_correct", "all_failed"])
@pytest.mark.parametrize("norm_scope", ["group", "batch"])
def test_single_outcome_scope_with_nearly_equal_entropies_matches_float64(spread, outcome, norm_scope):
    for seed in range(3):
        rewards, entropy, mask, lengths = _single_outcome_batch(1000 + seed, spread, outcome)
        got = gtpo_advantages(rewards, entropy, mask, alpha2=ALPHA2, norm_scope=norm_scope, eps=EPS)
        assert got.dtype == torch.float32 and (got[~mask] == 0).all()
        ref = reference_gtpo(rewards.double().tolist(), entropy.double().tolist(), lengths.tolist(), alpha1=1.0,
                             alpha2=ALPHA2, norm_scope=norm_scope, entropy_clip=None, eps=EPS)
        expected = dense_from_dict(ref, mask.shape)
        torch.testing.assert_close(got.double(), expected, atol=_single_outcome_tolerance(spread), rtol=0)
        # A z-score over n values never exceeds (n - 1) / sqrt(n) < sqrt(n) in magnitude.
        tokens = mask.sum() if norm_scope == "batch" else mask.sum(dim=(1, 2), keepdim=True)
        assert (got.double().abs() <= tokens.double().sqrt()).all()
        assert expected.abs().max() > 2  # the case is not vacuous: advantages of order 1, not all 0


@pytest.mark.parametrize("spread", SPREADS)
def test_shaping_moments_keep_the_centred_second_moment(spread):
    """moments[2] - moments[1]^2 / moments[0] (what gtpo_advantages' variance of a single-outcome scope reduces to)
    against the float64 centred sum of squares of the bonus w * coef, with the coefficients shaping_moments returned.
    The weights are those shaping_moments computes, 1 / (H + eps) rounded to float32 for failed responses (its
    rounding alone, u relative on w, moves the centred sum of squares by up to 2 u sqrt(12) / spread relative).
    Tolerance 1e-5 relative: the per-position sums of deviations carry float32 rounding of ~G u relative, amplified
    at most a few times by the shift (measured: below 1e-7); the float32 sums of w and w^2 of the old kernels
    were off by 0.1% (spread 1e-2) to 86% (spread 1e-3)."""
    for outcome in (1.0, 0.0):
        rewards, entropy, mask, _ = _single_outcome_batch(2000, spread, outcome, N=2, G=8, T=301)
        failed = rewards != 1
        coef, moments = token_passes.shaping_moments(entropy, mask, failed, alpha2=ALPHA2, entropy_clip=None,
                                                     eps=EPS, dtype=torch.float32)
        k = 1 if outcome == 0.0 else 0
        weights = entropy if outcome == 1.0 else 1 / (entropy + EPS)  # float32, as shaping_moments computes them
        bonus = torch.where(mask, weights.double() * coef[:, k:k + 1].double(), 0.0)
        count = mask.sum(dim=(1, 2)).double()
        mean = bonus.sum(dim=(1, 2)) / count
        expected = torch.where(mask, bonus - mean.view(-1, 1, 1), 0.0).square().sum(dim=(1, 2))  # two passes
        got = moments[:, 2, k] - moments[:, 1, k].square() / moments[:, 0, k]
        torch.testing.assert_close(moments[:, 0, k], count, atol=0, rtol=0)
        torch.testing.assert_close(moments[:, 1, k], bonus.sum(dim=(1, 2)), atol=0, rtol=1e-6)
        torch.testing.assert_close(got, expected, atol=0, rtol=1e-5)


@pytest.mark.parametrize("row", [0, 1, 3], ids=["first_row", "second_row", "last_row"])
def test_shaping_moments_propagate_a_valid_nan_from_any_row(row):
    """A NaN at a valid token of any row reaches the moments of that prompt and type (and never those of another
    prompt)."""
    rewards, entropy, mask, _ = _single_outcome_batch(3000, 1e-2, 1.0, N=2, G=4, T=19)
    entropy = torch.where(mask, entropy, 1.0)  # no NaN but the one set below
    mask[1] = True
    entropy[1, row, 7] = float("nan")
    coef, moments = token_passes.shaping_moments(entropy, mask, rewards != 1, alpha2=ALPHA2, entropy_clip=None,
                                                 eps=EPS, dtype=torch.float32)
    assert torch.isnan(moments[1, 1:, 0]).all() and torch.isnan(coef[1, 0, 7])
    assert torch.isfinite(moments[0]).all() and torch.isfinite(coef[0]).all()
