"""Rollout/training mismatch correction (algorithms/rollout_correction.py) against a float64 loop over sequences and
tokens, and the policy losses' pg_weights against the unweighted loss."""
import math

import pytest
import torch

from megatron_gtpo.algorithms import sequence_policy_loss, token_policy_loss
from megatron_gtpo.algorithms.rollout_correction import rollout_correction

CAP, BOUNDS = 2.0, (0.6, 1.5)


def _batch(seed=0, S=6, T=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 1, 4, 0, 7, 5][:S])
    mask = torch.arange(T) < lengths[:, None]
    rollout = -3.0 + torch.rand(S, T, generator=g)
    old = rollout + 0.5 * torch.randn(S, T, generator=g)  # ratios from ~0.3 to ~3: every cap and bound binds
    old = torch.where(mask, old, torch.nan)  # garbage at padding is never read
    return old, rollout, mask


def _staleness(mask):
    """Versions behind per token, 0 to 3 (partial rollouts: a response's later tokens are newer), -1 at padding (never
    read)."""
    staleness = (torch.arange(mask.shape[1]).flip(0) // 2 + torch.arange(mask.shape[0])[:, None]) % 4
    return torch.where(mask, staleness, -1)


def _reference(old, rollout, mask, is_level, rs_level, staleness=None):
    """float64 loops: per-token weights (as multiplied into each token's surrogate), kept tokens, metric sums (by
    staleness bucket: log_rho, and the mismatch terms of the current version's tokens)."""
    S, T = mask.shape
    weight = [[0.0] * T for _ in range(S)]
    keep = [[False] * T for _ in range(S)]
    sums = dict(abs=0.0, kl=0.0, mult=0.0, w=0.0, capped=0.0, rejected=0.0, n=0)
    buckets = {b: dict(log_rho=0.0, n=0) for b in ("0", "1", "2plus")}
    current = dict(abs=0.0, kl=0.0, mult=0.0)
    for s in range(S):
        valid = [t for t in range(T) if mask[s, t]]
        log_rho = {t: float(old[s, t]) - float(rollout[s, t]) for t in valid}
        seq_log = sum(log_rho.values())
        for t in valid:
            uncapped = {"none": 1.0, "token": math.exp(log_rho[t]), "sequence": math.exp(seq_log),
                        "geometric": math.exp(seq_log / len(valid))}
            weight[s][t] = min(uncapped[is_level], CAP) if is_level != "none" else 1.0
            keep[s][t] = BOUNDS[0] <= uncapped[rs_level] <= BOUNDS[1]
            terms = dict(abs=abs(log_rho[t]), kl=math.exp(log_rho[t]) - log_rho[t] - 1, mult=math.exp(abs(log_rho[t])))
            for key, term in terms.items():
                sums[key] += term
            sums["w"] += weight[s][t]
            sums["capped"] += is_level != "none" and uncapped[is_level] >= CAP
            sums["rejected"] += not keep[s][t]
            sums["n"] += 1
            if staleness is not None:
                versions_behind = int(staleness[s, t])
                bucket = buckets[str(versions_behind) if versions_behind < 2 else "2plus"]
                bucket["log_rho"] += log_rho[t]
                bucket["n"] += 1
                if versions_behind == 0:
                    for key, term in terms.items():
                        current[key] += term
    return torch.tensor(weight, dtype=torch.float64), torch.tensor(keep), dict(sums, buckets=buckets,
                                                                               current=current)


@pytest.mark.parametrize("is_level", ["none", "token", "sequence", "geometric"])
@pytest.mark.parametrize("rs_level", ["none", "token", "sequence", "geometric"])
def test_weights_rejection_and_metrics_match_float64_loops(is_level, rs_level):
    old, rollout, mask = _batch()
    out = rollout_correction(old, rollout, mask, rollout_is=is_level, rollout_is_cap=CAP, rollout_rs=rs_level,
                             rollout_rs_bounds=BOUNDS)
    weight, keep, sums = _reference(old, rollout, mask, is_level, rs_level)
    if is_level == "none":
        assert out.weights is None
    else:
        per_token = out.weights if out.weights.ndim == 2 else out.weights.unsqueeze(-1).expand_as(mask)
        torch.testing.assert_close(torch.where(mask, per_token.double(), 0.0), weight, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.keep_ST, keep)
    if rs_level != "none":
        assert 0 < sums["rejected"] < sums["n"]  # the bounds really cut
    got = {k: float(v) for k, v in out.metric_sums.items()}
    assert got["num_tokens"] == sums["n"]
    if is_level != "none":
        assert 0 < sums["capped"] < sums["n"]  # the cap binds on some tokens
    assert got["rollout_is_capped_fraction"] == sums["capped"]
    assert got["rollout_logprob_mismatch"] == pytest.approx(sums["abs"], rel=1e-5)
    assert got["mismatch_kl"] == pytest.approx(sums["kl"], rel=1e-5)
    assert got["token_mult_prob_error"] == pytest.approx(sums["mult"], rel=1e-5)
    assert got["rollout_is_weight_mean"] == pytest.approx(sums["w"], rel=1e-5)
    assert got["rollout_rs_masked_fraction"] == sums["rejected"]


def test_equal_log_probs_give_unit_weights_no_rejection_and_zero_mismatch():
    old, _, mask = _batch(1)
    for is_level, rs_level in (("token", "token"), ("sequence", "sequence"), ("sequence", "geometric")):
        out = rollout_correction(old, old.clone(), mask, rollout_is=is_level, rollout_rs=rs_level,
                                 rollout_rs_bounds=(0.999, 1.001))
        weights = out.weights if out.weights.ndim == 2 else out.weights.unsqueeze(-1).expand_as(mask)
        assert (weights[mask] == 1).all() and torch.equal(out.keep_ST, mask)
        sums = out.metric_sums
        assert sums["mismatch_kl"] == 0 and sums["rollout_rs_masked_fraction"] == 0
        assert sums["token_mult_prob_error"] == sums["num_tokens"] == sums["rollout_is_weight_mean"]


def test_bad_settings_name_their_cause():
    old, rollout, mask = _batch()
    with pytest.raises(ValueError, match="rollout_is must be one of"):
        rollout_correction(old, rollout, mask, rollout_is="tokens")
    with pytest.raises(ValueError, match="rollout_rs_bounds"):
        rollout_correction(old, rollout, mask, rollout_rs="token", rollout_rs_bounds=(2.0, 1.0))
    with pytest.raises(ValueError, match="rollout_is_cap"):
        rollout_correction(old, rollout, mask, rollout_is="token", rollout_is_cap=0.0)


def _loss_inputs(seed=2, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T) < torch.tensor([7, 3, 1, 5, 6])[:, None]
    old = -2.0 + torch.rand(B, T, generator=g, dtype=torch.float64)
    current = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    return current, old, mask, torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, generator=g,
                                                                                                dtype=torch.float64)


def test_token_loss_pg_weights_scale_each_tokens_surrogate():
    current, old, mask, adv_BT, _ = _loss_inputs()
    weights_BT = torch.rand(adv_BT.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ones, _ = token_policy_loss(current, old, adv_BT, mask, loss_normalizer=10.0, pg_weights=torch.ones_like(old))
    plain, _ = token_policy_loss(current, old, adv_BT, mask, loss_normalizer=10.0)
    assert torch.equal(ones, plain)
    weighted, metrics = token_policy_loss(current, old, adv_BT, mask, loss_normalizer=10.0, pg_weights=weights_BT)
    ratio = (current - old).exp()
    surrogate = torch.maximum(-adv_BT * ratio, -adv_BT * ratio.clamp(0.8, 1.2))
    expected = torch.where(mask, weights_BT * surrogate, 0.0).sum() / 10.0
    torch.testing.assert_close(weighted, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(metrics["pg_loss"], expected.detach(), rtol=1e-12, atol=0)
    grad, = torch.autograd.grad(weighted, current)
    grad_expected, = torch.autograd.grad(expected, current)
    torch.testing.assert_close(grad, grad_expected, rtol=1e-12, atol=0)


def test_sequence_loss_pg_weights_scale_each_sequences_surrogate():
    current, old, mask, _, adv_B = _loss_inputs()
    weights_B = torch.tensor([0.5, 2.0, 1.0, 0.0, 1.5], dtype=torch.float64)
    plain, _ = sequence_policy_loss(current, old, adv_B, mask, loss_normalizer=5.0)
    ones, _ = sequence_policy_loss(current, old, adv_B, mask, loss_normalizer=5.0, pg_weights=torch.ones(5))
    assert torch.equal(ones, plain)
    weighted, _ = sequence_policy_loss(current, old, adv_B, mask, loss_normalizer=5.0, pg_weights=weights_B)
    ratio_B = torch.where(mask, (current - old).exp(), 0.0).sum(-1) / mask.sum(-1)
    surrogate_B = torch.maximum(-adv_B * ratio_B, -adv_B * ratio_B.clamp(0.8, 1.2))
    torch.testing.assert_close(weighted, (weights_B * surrogate_B).sum() / 5.0, rtol=1e-12, atol=0)


def test_metrics_by_staleness_match_float64_loops():
    """The mean log-ratio of tokens 0, 1 and 2+ versions old, and the mismatch on the current version's tokens."""
    from megatron_gtpo.algorithms.rollout_correction import STALENESS_METRICS

    old, rollout, mask = _batch()
    staleness = _staleness(mask)
    out = rollout_correction(old, rollout, mask, rollout_is="token", staleness_ST=staleness)
    _, _, sums = _reference(old, rollout, mask, "token", "none", staleness)
    got = {k: float(v) for k, v in out.metric_sums.items()}
    assert set(STALENESS_METRICS) | set(STALENESS_METRICS.values()) <= set(got)
    for bucket, expected in sums["buckets"].items():
        assert expected["n"] > 0
        assert got[f"tokens_staleness_{bucket}"] == expected["n"]
        assert got[f"log_ratio_mean/staleness_{bucket}"] == pytest.approx(expected["log_rho"], rel=1e-5)
    assert got["rollout_logprob_mismatch_current"] == pytest.approx(sums["current"]["abs"], rel=1e-5)
    assert got["mismatch_kl_current"] == pytest.approx(sums["current"]["kl"], rel=1e-5)
    assert got["token_mult_prob_error_current"] == pytest.approx(sums["current"]["mult"], rel=1e-5)
    assert not set(STALENESS_METRICS) & set(rollout_correction(old, rollout, mask).metric_sums)  # none without


def test_geometric_weight_is_length_normalised_where_the_product_collapses():
    """A long response whose every token is 5% less likely under the old policy than under the sampler: the product
    of its 400 token ratios is e^-20.5 (near 0), the geometric weight 0.95, and a sequence of the same per-token
    ratio but 4 tokens long gets the same geometric weight."""
    T = 400
    mask = torch.arange(T) < torch.tensor([T, 4])[:, None]
    rollout = torch.full((2, T), -2.0, dtype=torch.float64)
    old = rollout + math.log(0.95)
    product = rollout_correction(old, rollout, mask, rollout_is="sequence").weights
    geometric = rollout_correction(old, rollout, mask, rollout_is="geometric").weights
    assert float(product[0]) == pytest.approx(0.95 ** T, rel=1e-3) and float(product[0]) < 1e-8
    torch.testing.assert_close(geometric.double(), torch.tensor([0.95, 0.95], dtype=torch.float64), rtol=1e-5, atol=0)
