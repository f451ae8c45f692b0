"""GRPO, GTPO and GRPO-S advantages: hand-computed cases, a float64 loop reference, and properties.

Tolerances: float64 inputs against the float64 reference 1e-9 absolute; float32 inputs 2e-5 relative to the
scale of the advantages; hand-computed cases 1e-6 (they ignore eps = 1e-8).
"""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from megatron_gtpo.algorithms import (
    grpo_advantages,
    grpo_s_advantages,
    grpo_s_shaped_rewards,
    gtpo_advantages,
)
from algorithm_references import dense_from_dict, gtpo_token_rewards, random_batch, reference_grpo_s, reference_gtpo

NAN = float("nan")


def _batch(rows):
    """rows: per prompt, per response (reward, [entropies]); pads with NaN to the longest response."""
    T = max(len(h) for group in rows for _, h in group)
    rewards = torch.tensor([[r for r, _ in group] for group in rows], dtype=torch.float64)
    entropy = torch.tensor([[h + [NAN] * (T - len(h)) for _, h in group] for group in rows], dtype=torch.float64)
    mask = torch.tensor([[[t < len(h) for t in range(T)] for _, h in group] for group in rows])
    return rewards, entropy, mask


# Group 1 (G = 4, T = 3): o1, o2 correct; o3, o4 failed.
GROUP_1 = [(1.0, [1.0, 2.0, 1.0]), (1.0, [3.0, 2.0]), (0.0, [0.5, 1.0, 2.0]), (0.0, [2.0])]
# Shaped rewards worked by hand (alpha1 = 1, alpha2 = 0.1):
#  t=1: O+ = {o1 H=1, o2 H=3}: d=2, sum=4 -> o1 1 + 0.1*(1/4)*2 = 1.05, o2 1 + 0.1*(3/4)*2 = 1.15
#       O- = {o3 1/H=2, o4 1/H=0.5}: h=2, sum=2.5 -> o3 -1 - 0.1*(2/2.5)*2 = -1.16, o4 -1 - 0.1*(0.5/2.5)*2 = -1.04
#  t=2: O+ = {o1 H=2, o2 H=2}: each 1 + 0.1*(1/2)*2 = 1.1;  O- = {o3}: -1 - 0.1*1*1 = -1.1
#  t=3: O+ = {o1}: 1.1;  O- = {o3}: -1.1
SHAPED_1 = [[1.05, 1.1, 1.1], [1.15, 1.1], [-1.16, -1.1, -1.1], [-1.04]]
# Group 2 (G = 4, T = 4): o1, o4 correct; o2, o3 failed.
GROUP_2 = [(1.0, [2.0, 2.0]), (0.0, [1.0, 4.0]), (0.0, [0.25]), (1.0, [2.0, 6.0, 1.0, 1.0])]
#  t=1: O+ = {o1 H=2, o4 H=2}: 1.1 each; O- = {o2 1/H=1, o3 1/H=4}: sum 5 -> o2 -1 - 0.1*(1/5)*2 = -1.04,
#       o3 -1 - 0.1*(4/5)*2 = -1.16
#  t=2: O+ = {o1 H=2, o4 H=6}: sum 8 -> o1 1 + 0.1*(2/8)*2 = 1.05, o4 1 + 0.1*(6/8)*2 = 1.15; O- = {o2}: -1.1
#  t=3, t=4: O+ = {o4}: 1.1; no failed response is that long.
SHAPED_2 = [[1.1, 1.05], [-1.04, -1.1], [-1.16], [1.1, 1.15, 1.1, 1.1]]


def _zscores(values, num_other_tokens):
    """Hand z-score of `values` within a set that also holds num_other_tokens structural zeros."""
    full = list(values) + [0.0] * num_other_tokens
    mean, std = sum(full) / len(full), statistics.stdev(full)  # Bessel-corrected, the documented choice
    return [(v - mean) / std for v in values]


def _expected_from_shaped(shaped_groups, rewards_groups, scope):
    """Advantages from hand-computed shaped rewards: z-score per sign over the scope, structural zeros included."""
    def scopes():
        if scope == "group":
            return [[i] for i in range(len(shaped_groups))]
        return [list(range(len(shaped_groups)))]

    expected = [[[0.0] * len(s) for s in group] for group in shaped_groups]
    for members in scopes():
        tokens = [(n, g, t) for n in members for g, s in enumerate(shaped_groups[n]) for t in range(len(s))]
        for sign in (1.0, 0.0):
            own = [(n, g, t) for n, g, t in tokens if rewards_groups[n][g] == sign]
            z = _zscores([shaped_groups[n][g][t] for n, g, t in own], len(tokens) - len(own))
            for (n, g, t), value in zip(own, z):
                expected[n][g][t] = value
    return expected


def _dense(nested, mask):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for n, group in enumerate(nested):
        for g, seq in enumerate(group):
            out[n, g, :len(seq)] = torch.tensor(seq, dtype=torch.float64)
    return out


# --------------------------------------------------------------------------------------- hand-computed


def test_gtpo_token_rewards_hand_computed():
    rewards, entropy, mask = _batch([GROUP_1, GROUP_2])
    got = gtpo_token_rewards(rewards, entropy, mask)
    torch.testing.assert_close(got, _dense([SHAPED_1, SHAPED_2], mask), atol=1e-6, rtol=0)


def test_gtpo_advantages_hand_computed_group_scope():
    rewards, entropy, mask = _batch([GROUP_1, GROUP_2])
    got = gtpo_advantages(rewards, entropy, mask, norm_scope="group")
    expected = _expected_from_shaped([SHAPED_1, SHAPED_2], rewards.tolist(), "group")
    torch.testing.assert_close(got, _dense(expected, mask), atol=1e-6, rtol=0)
    # Spelled out for o1, t=1 in group 1: Rpos = {1.05, 1.1, 1.1, 1.15, 1.1} plus 4 zeros (failed tokens);
    # mean = 5.5 / 9 = 0.61111, sample std = sqrt((6.055 - 5.5**2 / 9) / 8) = 0.580290 -> 0.756327.
    assert got[0, 0, 0].item() == pytest.approx((1.05 - 5.5 / 9) / math.sqrt((6.055 - 5.5 ** 2 / 9) / 8), abs=1e-6)
    assert got[0, 0, 0].item() == pytest.approx(0.7563272, abs=1e-6)
    # o3, t=1 in group 1: Rneg = {-1.16, -1.1, -1.1, -1.04} plus 5 zeros: mean -4.4/9, std 0.580527 -> -1.156039.
    assert got[0, 2, 0].item() == pytest.approx(-1.1560386, abs=1e-6)


def test_gtpo_advantages_hand_computed_batch_scope():
    rewards, entropy, mask = _batch([GROUP_1, GROUP_2])
    got = gtpo_advantages(rewards, entropy, mask)  # norm_scope="batch" is the default
    expected = _expected_from_shaped([SHAPED_1, SHAPED_2], rewards.tolist(), "batch")
    torch.testing.assert_close(got, _dense(expected, mask), atol=1e-6, rtol=0)
    # Batch Rpos: 11 successful-token values summing to 12.1 plus 7 zeros: mean 12.1 / 18 = 0.672222.
    assert got[0, 0, 0].item() == pytest.approx(0.6839746, abs=1e-6)
    assert got[1, 2, 0].item() == pytest.approx(-1.3251416, abs=1e-6)


def test_grpo_s_hand_computed():
    rewards, entropy, mask = _batch([GROUP_1])
    # Hbar: o1 (1+2+1)/3 = 4/3, o2 (3+2)/2 = 5/2, o3 (0.5+1+2)/3 = 7/6, o4 2.
    # O+ (n=2): sum 4/3 + 5/2 = 23/6 -> o1 1 + 0.1*(8/23)*2, o2 1 + 0.1*(15/23)*2
    # O- (m=2): 1/Hbar = 6/7, 1/2; sum 19/14 -> o3 -1 - 0.1*(12/19)*2, o4 -1 - 0.1*(7/19)*2
    shaped = [1 + 1.6 / 23, 1 + 3.0 / 23, -1 - 2.4 / 19, -1 - 1.4 / 19]
    got_shaped = grpo_s_shaped_rewards(rewards, entropy, mask)
    torch.testing.assert_close(got_shaped, torch.tensor([shaped], dtype=torch.float64), atol=1e-7, rtol=0)
    mean, std = sum(shaped) / 4, statistics.stdev(shaped)  # mean ~0, std 1.270595
    expected = torch.tensor([[(s - mean) / std for s in shaped]], dtype=torch.float64)
    torch.testing.assert_close(grpo_s_advantages(rewards, entropy, mask), expected, atol=1e-7, rtol=0)
    assert expected[0, 0].item() == pytest.approx(0.8417827, abs=1e-6)


def test_grpo_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # Row 1: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.866025.
    # Row 2: mean 0.25, deviations 0.75, -0.25 x3, sample std sqrt(0.75 / 3) = 0.5 -> 1.5, -0.5 x3.
    # Row 3: all equal -> 0. The default eps = 1e-6 is added to the std.
    s1, s2 = math.sqrt(1 / 3) + 1e-6, 0.5 + 1e-6
    expected = torch.tensor([[0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1],
                             [0.75 / s2, -0.25 / s2, -0.25 / s2, -0.25 / s2],
                             [0.0] * 4])
    assert expected[0, 0].item() == pytest.approx(0.866024, abs=1e-6)  # sqrt(3)/2 shrunk by eps
    torch.testing.assert_close(grpo_advantages(rewards), expected, atol=1e-6, rtol=0)
    centered = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.75, -0.25, -0.25, -0.25], [0.0] * 4])
    torch.testing.assert_close(grpo_advantages(rewards, normalize_std=False), centered, atol=1e-7, rtol=0)


def test_entropy_clip_clamps_before_shaping():
    rewards, entropy, mask = _batch([GROUP_1])
    # Clamping to [1.5, 2.5]: O+ at t=1 becomes {1.5, 2.5} -> 1 + 0.1*(1.5/4)*2 = 1.075, 1 + 0.1*(2.5/4)*2 = 1.125.
    got = gtpo_token_rewards(rewards, entropy, mask, entropy_clip=(1.5, 2.5))
    assert got[0, 0, 0].item() == pytest.approx(1.075, abs=1e-7)
    assert got[0, 1, 0].item() == pytest.approx(1.125, abs=1e-7)
    clipped = torch.where(mask, entropy.clamp(1.5, 2.5), entropy)
    torch.testing.assert_close(gtpo_advantages(rewards, entropy, mask, entropy_clip=(1.5, 2.5)),
                               gtpo_advantages(rewards, clipped, mask))


# ------------------------------------------------------------------------------ float64 loop reference


@pytest.mark.parametrize("norm_scope", ["batch", "group"])
@pytest.mark.parametrize("entropy_clip", [None, (0.3, 2.0)])
def test_gtpo_matches_loop_reference_float64(norm_scope, entropy_clip):
    for seed in range(12):
        rewards, entropy, mask, lengths = random_batch(seed, N=3, G=5, T=7)
        alpha1, alpha2 = (1.0, 0.1) if seed % 2 else (0.7, 0.45)
        got = gtpo_advantages(rewards, entropy, mask, alpha1=alpha1, alpha2=alpha2, norm_scope=norm_scope,
                              entropy_clip=entropy_clip)
        ref = reference_gtpo(rewards.tolist(), entropy.tolist(), lengths.tolist(), alpha1=alpha1, alpha2=alpha2,
                             norm_scope=norm_scope, entropy_clip=entropy_clip, eps=1e-8)
        torch.testing.assert_close(got, dense_from_dict(ref, mask.shape), atol=1e-9, rtol=0)


def test_gtpo_float32_matches_float64_reference():
    for seed in range(4):
        rewards, entropy, mask, lengths = random_batch(100 + seed, N=4, G=8, T=33, dtype=torch.float32)
        for norm_scope in ("batch", "group"):
            got = gtpo_advantages(rewards, entropy, mask, norm_scope=norm_scope)
            assert got.dtype == torch.float32
            ref = reference_gtpo(rewards.double().tolist(), entropy.double().tolist(), lengths.tolist(), alpha1=1.0,
                                 alpha2=0.1, norm_scope=norm_scope, entropy_clip=None, eps=1e-8)
            torch.testing.assert_close(got.double(), dense_from_dict(ref, mask.shape), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("spread", [1e-3, 1e-2])
@pytest.mark.parametrize("outcome", [1.0, 0.0], ids=["all_correct", "all_failed"])
@pytest.mark.parametrize("norm_scope", ["group", "batch"])
def test_gtpo_float32_single_outcome_scope_is_a_z_score(spread, outcome, norm_scope):
    """A scope holding one outcome only, with entropies in [1, 1 + spread): the advantages are the z-score of the
    entropy bonus alone, whose variance is ~1e-7 (spread 1e-3) of its mean square, so they must still have mean 0,
    sample std 1 (eps made negligible) and |A| <= (n - 1) / sqrt(n) < sqrt(n) over the n tokens of the scope.
    float32 inputs through the default path. Tolerance: each float32 rounding of the final affine map costs up to
    u sqrt(12) / spread (tests/test_algorithms_token_passes.py derives it), allowed 8 of them: tol = 1.65e-6 / spread
    per token, hence on the mean. The sample std moves by the relative error of the moments' variance (~1e-7,
    test_shaping_moments_keep_the_centred_second_moment) plus the per-token errors' correlation with A, about
    tol / sqrt(n) for roundings independent of A (n >= 600 tokens per scope here): allowed tol / 8, 3x that
    (measured: below tol / 500). Built from float32 sums of w and w^2 (before the fix) the std was off by factors
    up to 3e7."""
    tol = 8 * 2.0 ** -24 * math.sqrt(12) / spread
    gen = torch.Generator().manual_seed(77)
    N, G, T = 3, 8, 203
    entropy = 1 + spread * torch.rand(N, G, T, generator=gen)
    mask = torch.arange(T) < torch.randint(T // 2, T + 1, (N, G), generator=gen).unsqueeze(-1)
    entropy = torch.where(mask, entropy, NAN)
    rewards = torch.full((N, G), outcome)
    adv = gtpo_advantages(rewards, entropy, mask, norm_scope=norm_scope, eps=1e-12).double()
    assert (adv[~mask] == 0).all()
    scopes = [slice(None)] if norm_scope == "batch" else [slice(n, n + 1) for n in range(N)]
    for scope in scopes:
        values = adv[scope][mask[scope]]
        n = values.numel()
        assert abs(values.mean().item()) <= tol
        assert abs(values.std().item() - 1) <= tol / 8
        assert values.abs().max().item() <= (n - 1) / math.sqrt(n) + tol
        assert values.abs().max().item() > 1.5  # advantages of order 1, not all 0


def test_gtpo_bfloat16_entropy_is_upcast():
    rewards, entropy, mask, _ = random_batch(7, N=2, G=4, T=9, dtype=torch.float32)
    entropy_bf16 = entropy.to(torch.bfloat16)
    got = gtpo_advantages(rewards, entropy_bf16, mask)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, gtpo_advantages(rewards, entropy_bf16.float(), mask))


@pytest.mark.parametrize("entropy_clip", [None, (0.5, 1.5)])
def test_grpo_s_matches_loop_reference(entropy_clip):
    for seed in range(12):
        rewards, entropy, mask, lengths = random_batch(200 + seed, N=4, G=6, T=9)
        beta1, beta2 = (1.0, 0.1) if seed % 2 else (0.5, 0.8)
        got = grpo_s_advantages(rewards, entropy, mask, beta1=beta1, beta2=beta2, entropy_clip=entropy_clip)
        ref = reference_grpo_s(rewards.tolist(), entropy.tolist(), lengths.tolist(), beta1=beta1, beta2=beta2,
                               entropy_clip=entropy_clip, eps=1e-8)
        torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), atol=1e-9, rtol=0)


# ----------------------------------------------------------------------------------------- properties


def _binary_token_zscore(rewards, mask, scope_dims):
    """Token-level normalised binary reward, in float64: z-score of r_i over all valid tokens in scope."""
    r = rewards.double().unsqueeze(-1).expand(mask.shape)
    m = mask.double()
    count = m.sum(dim=scope_dims, keepdim=True)
    mean = (r * m).sum(dim=scope_dims, keepdim=True) / count.clamp(min=1)
    var = (((r - mean) ** 2) * m).sum(dim=scope_dims, keepdim=True) / (count - 1).clamp(min=1)
    return torch.where(mask, (r - mean) / (var.sqrt() + 1e-8), 0.0)


@pytest.mark.parametrize("norm_scope, scope_dims", [("batch", (0, 1, 2)), ("group", (1, 2))])
def test_alpha2_zero_reduces_to_token_level_binary_reward(norm_scope, scope_dims):
    for seed in range(10):
        rewards, entropy, mask, _ = random_batch(300 + seed, N=4, G=6, T=11, min_len=1)
        got = gtpo_advantages(rewards, entropy, mask, alpha2=0.0, norm_scope=norm_scope)
        torch.testing.assert_close(got, _binary_token_zscore(rewards, mask, scope_dims), atol=1e-7, rtol=1e-7)


def test_beta2_zero_reduces_grpo_s_to_grpo():
    for seed in range(10):
        rewards, entropy, mask, _ = random_batch(400 + seed, N=5, G=8, T=6)
        torch.testing.assert_close(grpo_s_advantages(rewards, entropy, mask, beta2=0.0, eps=1e-8),
                                   grpo_advantages(rewards, eps=1e-8), atol=1e-7, rtol=1e-7)


def test_entropy_bonus_sums_to_alpha2_times_active_count():
    alpha1, alpha2 = 1.0, 0.3
    for seed in range(10):
        rewards, entropy, mask, _ = random_batch(500 + seed, N=3, G=7, T=10, min_entropy=0.05)
        shaped = gtpo_token_rewards(rewards, entropy, mask, alpha1=alpha1, alpha2=alpha2)
        correct = (rewards == 1).unsqueeze(-1) & mask
        failed = (rewards == 0).unsqueeze(-1) & mask
        pos_bonus_sum = torch.where(correct, shaped - alpha1, 0.0).sum(dim=1)  # [N, T]
        neg_bonus_sum = torch.where(failed, -shaped - alpha1, 0.0).sum(dim=1)
        torch.testing.assert_close(pos_bonus_sum, alpha2 * correct.sum(dim=1).double(), atol=1e-7, rtol=0)
        torch.testing.assert_close(neg_bonus_sum, alpha2 * failed.sum(dim=1).double(), atol=1e-7, rtol=0)


def test_advantages_are_zero_exactly_on_padding():
    for seed in range(5):
        rewards, entropy, mask, _ = random_batch(600 + seed)
        for norm_scope in ("batch", "group"):
            got = gtpo_advantages(rewards, entropy, mask, norm_scope=norm_scope)
            assert torch.isfinite(got).all()
            assert (got[~mask] == 0).all()
        assert (gtpo_token_rewards(rewards, entropy, mask)[~mask] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_padding_contents_are_never_read_and_valid_nan_is_not_hidden(dtype):
    rewards, entropy, mask, _ = random_batch(650, N=4, G=6, T=9, dtype=dtype)
    zero_padded = torch.where(mask, entropy, torch.zeros_like(entropy))
    garbage = torch.tensor([float("inf"), -float("inf"), NAN, 1e30, -5.0, 0.0], dtype=dtype)
    garbage_padded = torch.where(mask, entropy, garbage[torch.arange(mask.numel()) % 6].view(mask.shape))
    for fn in (gtpo_advantages, gtpo_token_rewards, grpo_s_advantages):
        expected = fn(rewards, zero_padded, mask)
        assert torch.isfinite(expected).all()
        assert torch.equal(fn(rewards, garbage_padded, mask), expected), fn.__name__
    # A NaN at a VALID token is an upstream bug: it must show in the result, not be cleared like padding.
    poisoned = zero_padded.clone()
    poisoned[0, 0, 0] = NAN
    assert mask[0, 0, 0]
    assert torch.isnan(gtpo_advantages(rewards, poisoned, mask)).any()
    assert torch.isnan(grpo_s_advantages(rewards, poisoned, mask)).any()


def _sign_condition_holds(rewards, mask, scope_dims, alpha1, alpha2):
    """Per scope: (alpha2 * P <= alpha1 * F, alpha2 * F <= alpha1 * P) with P / F successful / failed tokens."""
    correct = (rewards == 1).unsqueeze(-1) & mask
    failed = (rewards == 0).unsqueeze(-1) & mask
    P = correct.sum(dim=scope_dims, keepdim=True).double()
    F = failed.sum(dim=scope_dims, keepdim=True).double()
    return alpha2 * P <= alpha1 * F, alpha2 * F <= alpha1 * P


@pytest.mark.parametrize("norm_scope, scope_dims", [("batch", (0, 1, 2)), ("group", (1, 2))])
def test_sign_of_advantages_under_the_token_balance_condition(norm_scope, scope_dims):
    """Statement (proved in gtpo_advantages' docstring): in a scope with P successful and F failed tokens,
    alpha2 * P <= alpha1 * F  =>  every successful token has A >= 0, and
    alpha2 * F <= alpha1 * P  =>  every failed token has A <= 0."""
    alpha1, alpha2 = 1.0, 0.1
    checked_pos = checked_neg = 0
    for seed in range(40):
        # Unfiltered batches: some all-correct / all-failed groups, varied balance of outcomes.
        rewards, entropy, mask, _ = random_batch(700 + seed, N=4, G=6, T=12, p_correct=0.15 + 0.7 * (seed % 5) / 4)
        adv = gtpo_advantages(rewards, entropy, mask, alpha1=alpha1, alpha2=alpha2, norm_scope=norm_scope)
        pos_ok, neg_ok = _sign_condition_holds(rewards, mask, scope_dims, alpha1, alpha2)
        correct = (rewards == 1).unsqueeze(-1) & mask
        failed = (rewards == 0).unsqueeze(-1) & mask
        pos_ok, neg_ok = pos_ok.expand(mask.shape), neg_ok.expand(mask.shape)
        assert (adv[correct & pos_ok] >= -1e-12).all()
        assert (adv[failed & neg_ok] <= 1e-12).all()
        checked_pos += int((correct & pos_ok).sum())
        checked_neg += int((failed & neg_ok).sum())
    assert checked_pos > 1000 and checked_neg > 1000


def test_sign_fails_outside_the_condition_even_with_both_outcomes():
    """One group with both outcomes but only 2 failed tokens against 30 successful ones (F/P < alpha2/alpha1):
    mean(Rpos) = (1 + 0.1) * 30 / 32 = 1.03125 > 1, so a successful token with zero entropy next to
    higher-entropy ones (bonus 0, rpos = 1) gets a negative advantage, in either scope."""
    zero_entropy = [0.0] * 10
    group = [(1.0, zero_entropy), (1.0, [1.0] * 10), (1.0, [1.0] * 10), (0.0, [1.0, 1.0])]
    rewards, entropy, mask = _batch([group])
    for norm_scope in ("batch", "group"):
        adv = gtpo_advantages(rewards, entropy, mask, norm_scope=norm_scope)
        assert (adv[0, 0, :10] < 0).all()
        # Its advantage is (1 - 1.03125) / std with Rpos = {1 x10, 1.15 x20, 0 x2}.
        rpos = [1.0] * 10 + [1.15] * 20 + [0.0] * 2
        assert adv[0, 0, 0].item() == pytest.approx((1 - sum(rpos) / 32) / statistics.stdev(rpos), abs=1e-6)
    # Symmetric case for failed tokens: 30 failed tokens, 2 successful ones; the most uncertain failed token
    # (largest H, smallest 1/H) gets a share below average and a positive advantage.
    group = [(0.0, [1e6] * 10), (0.0, [1.0] * 10), (0.0, [1.0] * 10), (1.0, [1.0, 1.0])]
    rewards, entropy, mask = _batch([group])
    assert (gtpo_advantages(rewards, entropy, mask)[0, 0, :10] > 0).all()


def _permute(rewards, entropy, mask, group_perm, response_perm):
    return (rewards[group_perm][:, response_perm], entropy[group_perm][:, response_perm],
            mask[group_perm][:, response_perm])


def test_invariance_to_permuting_responses_and_groups():
    gen = torch.Generator().manual_seed(11)
    for seed in range(6):
        rewards, entropy, mask, _ = random_batch(800 + seed, N=4, G=6, T=8)
        group_perm = torch.randperm(4, generator=gen)
        response_perm = torch.randperm(6, generator=gen)
        permuted = _permute(rewards, entropy, mask, group_perm, response_perm)
        for norm_scope in ("batch", "group"):
            base = gtpo_advantages(rewards, entropy, mask, norm_scope=norm_scope)
            torch.testing.assert_close(gtpo_advantages(*permuted, norm_scope=norm_scope),
                                       base[group_perm][:, response_perm], atol=1e-12, rtol=1e-12)
        base = grpo_s_advantages(rewards, entropy, mask)
        torch.testing.assert_close(grpo_s_advantages(*permuted), base[group_perm][:, response_perm],
                                   atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(grpo_advantages(permuted[0]), grpo_advantages(rewards)[group_perm][:, response_perm])


@pytest.mark.parametrize("case", ["zero_entropy", "all_correct_and_all_failed", "length_one", "empty_rows",
                                  "all_empty"])
def test_degenerate_inputs_stay_finite(case):
    rewards, entropy, mask, lengths = random_batch(900, N=4, G=5, T=6, min_len=1)
    if case == "zero_entropy":
        entropy = torch.where(mask, 0.0, entropy)
    elif case == "all_correct_and_all_failed":
        rewards[0] = 1.0
        rewards[1] = 0.0
    elif case == "length_one":
        mask = torch.zeros_like(mask)
        mask[..., 0] = True
    elif case == "empty_rows":
        mask[0, 1] = False  # one empty response
        mask[2] = False  # one group without any token
    elif case == "all_empty":
        mask = torch.zeros_like(mask)
    for dtype in (torch.float32, torch.float64):
        r, h = rewards.to(dtype), entropy.to(dtype)
        for norm_scope in ("batch", "group"):
            adv = gtpo_advantages(r, h, mask, norm_scope=norm_scope)
            assert torch.isfinite(adv).all() and (adv[~mask] == 0).all()
        assert torch.isfinite(gtpo_token_rewards(r, h, mask)).all()
        assert torch.isfinite(grpo_s_advantages(r, h, mask)).all()
        assert torch.isfinite(grpo_advantages(r)).all()
    if case == "all_empty":
        assert (gtpo_advantages(rewards, entropy, mask) == 0).all()
    if case == "zero_entropy":
        # All entropies 0: no successful token gets a bonus; failed tokens share alpha2 * h_t equally.
        shaped = gtpo_token_rewards(rewards, entropy, mask)
        correct = (rewards == 1).unsqueeze(-1) & mask
        assert (shaped[correct] == 1.0).all()


def test_invalid_inputs_raise_value_errors():
    rewards, entropy, mask, _ = random_batch(1)
    with pytest.raises(ValueError, match="rewards_NG must hold only 0.0"):
        gtpo_advantages(rewards * 0.5, entropy, mask)
    with pytest.raises(ValueError, match="rewards_NG must hold only 0.0"):
        grpo_s_advantages(rewards + 0.1, entropy, mask)
    with pytest.raises(ValueError, match="norm_scope"):
        gtpo_advantages(rewards, entropy, mask, norm_scope="token")
    with pytest.raises(ValueError, match="entropy_clip"):
        gtpo_advantages(rewards, entropy, mask, entropy_clip=(2.0, 1.0))
    with pytest.raises(ValueError, match="mask_NGT must be a bool tensor"):
        gtpo_advantages(rewards, entropy, mask.double())
    with pytest.raises(ValueError, match="entropy_NGT must have shape"):
        gtpo_advantages(rewards, entropy[:, :-1], mask[:, :-1])
    with pytest.raises(ValueError, match="eps must be > 0"):
        grpo_advantages(rewards, eps=0.0)
    with pytest.raises(ValueError, match="rewards_NG must be a 2-d floating-point tensor"):
        grpo_advantages(rewards.long())
