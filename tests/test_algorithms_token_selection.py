"""The token selections (Clip-Cov, KL-Cov, the high-entropy fraction; algorithms/token_selection.py) against float64
loop references, and the selection with token_policy_loss against the transcription of verl's functions
(algorithm_references.py) where the scopes coincide: one on-policy micro-batch, Clip-Cov's random pick from the same
seeded permutation."""
from __future__ import annotations

import math

import pytest
import torch

from algorithm_references import verl_clip_cov_loss, verl_kl_cov_loss
from megatron_gtpo.algorithms import PPOClip, token_policy_loss
from megatron_gtpo.algorithms.token_selection import (
    clip_cov_tokens,
    select_tokens,
    token_covariance,
    top_tokens,
)


def _tokens(seed, K=300):
    gen = torch.Generator().manual_seed(seed)
    advantages = 2 * torch.randn(K, generator=gen, dtype=torch.float64)
    logprobs = -4 * torch.rand(K, generator=gen, dtype=torch.float64)
    entropy = 3 * torch.rand(K, generator=gen, dtype=torch.float64)
    keys = torch.rand(K, generator=gen, dtype=torch.float64)
    return advantages, logprobs, entropy, keys


def _ref_covariance(a, lp):
    mean_a, mean_lp = sum(a) / len(a), sum(lp) / len(lp)
    return [(x - mean_a) * (y - mean_lp) for x, y in zip(a, lp)]


def _ref_top(values, fraction):
    """The max(1, floor(fraction K)) largest, the earlier of equal values first (sorted is stable)."""
    n = max(1, math.floor(fraction * len(values)))
    chosen = sorted(range(len(values)), key=lambda k: -values[k])[:n]
    return [k in chosen for k in range(len(values))]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ratio", [0.002, 0.05, 0.3])
def test_kl_cov_and_entropy_fraction_match_a_sorted_loop(seed, ratio):
    a, lp, h, keys = _tokens(seed)
    cov = _ref_covariance(a.tolist(), lp.tolist())
    torch.testing.assert_close(token_covariance(a, lp), torch.tensor(cov, dtype=torch.float64), atol=1e-12, rtol=0)
    selection = select_tokens(a, lp, h, keys, kl_cov_ratio=ratio, entropy_token_fraction=ratio)
    assert selection.penalise_K.tolist() == _ref_top(cov, ratio)
    assert selection.keep_K.tolist() == _ref_top(h.tolist(), ratio)
    n = max(1, math.floor(ratio * 300))
    assert selection.metrics["kl_cov_fraction"].item() == selection.metrics["entropy_kept_fraction"].item() == n / 300
    assert selection.metrics["entropy_kept_threshold"].item() == sorted(h.tolist())[-n]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ratio,lb,ub", [(0.0002, 1.0, 5.0), (0.05, 0.5, 3.0), (0.9, -1.0, 1.0)])
def test_clip_cov_picks_the_candidates_with_the_smallest_keys(seed, ratio, lb, ub):
    a, lp, h, keys = _tokens(seed)
    cov = _ref_covariance(a.tolist(), lp.tolist())
    candidates = [k for k in range(300) if lb < cov[k] < ub]
    n = max(1, math.floor(ratio * 300))
    picked = sorted(candidates, key=lambda k: keys[k].item())[:n]
    got = clip_cov_tokens(token_covariance(a, lp), keys, ratio=ratio, lb=lb, ub=ub)
    assert got.nonzero().flatten().tolist() == sorted(picked) and len(picked) == min(n, len(candidates)) > 0
    selection = select_tokens(a, lp, h, keys, clip_cov=(ratio, lb, ub))
    assert selection.keep_K.tolist() == (~got).tolist() and selection.penalise_K is None
    assert selection.metrics["clip_cov_fraction"].item() == len(picked) / 300


def test_ties_at_the_threshold_are_all_picked_and_empty_input_picks_nothing():
    assert top_tokens(torch.tensor([1.0, 3.0, 3.0, 2.0]), 0.25).tolist() == [False, True, True, False]
    empty = torch.zeros(0)
    assert top_tokens(empty, 0.2).numel() == 0
    selection = select_tokens(empty, empty, empty, empty, clip_cov=(0.1, 0.0, 1.0), kl_cov_ratio=0.1,
                              entropy_token_fraction=0.2)
    assert selection.keep_K.numel() == 0 and all(v.item() == 0 for v in selection.metrics.values())
    with pytest.raises(ValueError, match="fraction must be in"):
        top_tokens(torch.ones(3), 0.0)
    with pytest.raises(ValueError, match="clip_cov_lb must be < clip_cov_ub"):
        clip_cov_tokens(torch.ones(3), torch.ones(3), ratio=0.1, lb=2.0, ub=1.0)


def _micro_batch(seed, B=6, T=9):
    gen = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(B, T, generator=gen, dtype=torch.float64)
    advantages = 2 * torch.randn(B, 1, generator=gen, dtype=torch.float64).expand(B, T).clone()
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = torch.arange(T) < lengths[:, None]
    current = old + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    return old, current, advantages, mask


def _ours(logprobs, old, advantages, mask, selection, **loss_kw):
    """token_policy_loss of one micro-batch (token-mean) with the selection mapped back to [B, T]."""
    keep = torch.ones_like(mask)
    keep[mask] = selection.keep_K
    penalise = None
    if selection.penalise_K is not None:
        penalise = torch.zeros_like(mask)
        penalise[mask] = selection.penalise_K
    return token_policy_loss(logprobs, old, advantages, mask, loss_normalizer=mask.sum(), pg_weights=keep.double(),
                             kl_penalty_BT=penalise, **loss_kw)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_clip_cov_equals_verl_on_one_on_policy_micro_batch(seed):
    old, _, advantages, mask = _micro_batch(seed)
    ratio, lb, ub = 0.1, 0.2, 4.0  # verl's bounds would leave this small batch few candidates
    cov = _ref_covariance(advantages[mask].tolist(), old[mask].tolist())
    candidates = [k for k, c in enumerate(cov) if lb < c < ub]
    assert len(candidates) > max(1, int(ratio * mask.sum())), "the random pick must choose among candidates"

    theirs_lp = old.clone().requires_grad_()
    torch.manual_seed(seed)
    loss_v, clipfrac_v, _ = verl_clip_cov_loss(old, theirs_lp, advantages, mask.double(), cliprange_low=0.2,
                                               cliprange_high=0.28, clip_cov_ratio=ratio, clip_cov_lb=lb,
                                               clip_cov_ub=ub)
    loss_v.backward()

    torch.manual_seed(seed)  # the same permutation, as keys: candidate j's key is its place in verl's permutation
    perm = torch.randperm(len(candidates))
    keys = torch.full((int(mask.sum()),), 1e9, dtype=torch.float64)
    keys[torch.tensor(candidates)[perm]] = torch.arange(len(candidates), dtype=torch.float64)
    selection = select_tokens(advantages[mask], old[mask], old[mask], keys, clip_cov=(ratio, lb, ub))
    ours_lp = old.clone().requires_grad_()
    loss, _ = _ours(ours_lp, old, advantages, mask, selection, clip=PPOClip(0.2, 0.28))
    loss.backward()
    torch.testing.assert_close(loss, loss_v, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, atol=1e-12, rtol=1e-12)
    assert selection.metrics["clip_cov_fraction"].item() == pytest.approx(clipfrac_v.item(), abs=1e-15)
    assert 0 < clipfrac_v.item()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("on_policy", [True, False])
def test_kl_cov_equals_verl_when_the_covariance_uses_the_same_log_probs(seed, on_policy):
    """On policy the scopes coincide. Off policy verl's covariance takes the current log-probs: given those as the
    statistic, the selection and the loss (the unclipped surrogate plus the |log-ratio| penalty) are verl's too."""
    old, current, advantages, mask = _micro_batch(seed)
    current = old if on_policy else current
    theirs_lp = current.clone().requires_grad_()
    loss_v, abs_log_ratio_v, penalised_v = verl_kl_cov_loss(old, theirs_lp, advantages, mask.double(),
                                                            kl_cov_ratio=0.1, ppo_kl_coef=1.0)
    loss_v.backward()
    selection = select_tokens(advantages[mask], current[mask], current[mask], current[mask], kl_cov_ratio=0.1)
    assert selection.penalise_K.tolist() == penalised_v[mask].tolist()
    ours_lp = current.clone().requires_grad_()
    loss, metrics = _ours(ours_lp, old, advantages, mask, selection, clip=None, kl_cov_coef=1.0)
    loss.backward()
    torch.testing.assert_close(loss, loss_v, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, atol=1e-12, rtol=1e-12)
    assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == 0
    torch.testing.assert_close(metrics["kl_cov_abs_log_ratio"], abs_log_ratio_v, atol=1e-15, rtol=0)
    assert (metrics["kl_cov_abs_log_ratio"] > 0) != on_policy


@pytest.mark.parametrize("seed,advantage", [(0, 0.0), (1, 0.0), (2, 0.5)])
@pytest.mark.parametrize("ratio", [0.002, 0.1, 0.5])
def test_kl_cov_penalises_verls_count_when_every_covariance_ties(seed, advantage, ratio):
    """All advantages equal (0: every group's rewards equal; or 0.5, whose mean is exact): every covariance is 0.
    verl penalises max(1, floor(ratio K)) tokens (torch.topk's choice among them); so does ours, the earliest ones.
    The loss and the mean |log-ratio| against a float64 loop."""
    old, current, advantages, mask = _micro_batch(seed)
    advantages = torch.full_like(advantages, advantage)
    K, coef = int(mask.sum()), 0.5
    n = max(1, math.floor(ratio * K))
    _, abs_log_ratio_v, penalised_v = verl_kl_cov_loss(old, current, advantages, mask.double(), kl_cov_ratio=ratio,
                                                       ppo_kl_coef=coef)
    selection = select_tokens(advantages[mask], current[mask], current[mask], current[mask], kl_cov_ratio=ratio)
    assert int(penalised_v.sum()) == n < K
    assert selection.penalise_K.nonzero().flatten().tolist() == list(range(n))
    assert selection.metrics["kl_cov_fraction"].item() == n / K
    loss, metrics = _ours(current, old, advantages, mask, selection, clip=None, kl_cov_coef=coef)
    log_ratios = [c - o for c, o in zip(current[mask].tolist(), old[mask].tolist())]
    expected = sum(-advantage * math.exp(x) + (coef * abs(x) if k < n else 0.0) for k, x in enumerate(log_ratios)) / K
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert metrics["kl_cov_abs_log_ratio"].item() == pytest.approx(sum(map(abs, log_ratios)) / K, abs=1e-15)
    torch.testing.assert_close(metrics["kl_cov_abs_log_ratio"], abs_log_ratio_v, atol=1e-15, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.3])
def test_kl_cov_breaks_ties_at_the_threshold_by_position(seed, ratio):
    """Few distinct covariances (advantages +-1, log-probs on a coarse grid): the threshold falls inside a run of
    ties. Exactly verl's count, the earlier of the tied tokens first (a stable sorted loop over the covariances)."""
    gen = torch.Generator().manual_seed(seed)
    K = 200
    advantages = torch.randint(0, 2, (K,), generator=gen).double() * 2 - 1
    logprobs = -torch.randint(1, 4, (K,), generator=gen).double()
    covariance = token_covariance(advantages, logprobs)
    n = max(1, math.floor(ratio * K))
    values = covariance.tolist()
    assert values.count(sorted(values)[-n]) > 1, "the case must tie at the threshold"
    picked = select_tokens(advantages, logprobs, logprobs, logprobs, kl_cov_ratio=ratio).penalise_K
    assert picked.tolist() == _ref_top(values, ratio) and int(picked.sum()) == n
    _, _, penalised_v = verl_kl_cov_loss(logprobs[None], logprobs[None], advantages[None],
                                         torch.ones(1, K, dtype=torch.float64), kl_cov_ratio=ratio)
    assert int(penalised_v.sum()) == n
