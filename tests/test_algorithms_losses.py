"""Policy losses against a float64 loop reference (values and gradients), metrics, and the loss contract:
micro-batches x DP shards summed with the global normaliser give the full-batch loss and gradients.

Tolerances: float64 throughout, 1e-12 absolute/relative on losses and gradients.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_gtpo.algorithms import PPOClip, local_loss_normalizer, sequence_policy_loss, token_policy_loss

TOL = dict(atol=1e-12, rtol=1e-12)


def _inputs(seed, B=6, T=5, *, spread=0.4):
    gen = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(B, T, generator=gen, dtype=torch.float64)
    # Current log-probs straddle every clip boundary: ratios from about exp(-2 spread) to exp(2 spread).
    logprobs = (old + spread * torch.randn(B, T, generator=gen, dtype=torch.float64)).requires_grad_()
    ref = old + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    entropy = (2 * torch.rand(B, T, generator=gen, dtype=torch.float64)).requires_grad_()
    advantages_BT = torch.randn(B, T, generator=gen, dtype=torch.float64)
    advantages_B = torch.randn(B, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[1] = 0  # an empty sequence
    mask = torch.arange(T) < lengths.unsqueeze(-1)
    nan = torch.full_like(old, float("nan"))
    # Padding holds NaN in every input: it must neither leak into the loss nor into a gradient.
    old, ref, advantages_BT = (torch.where(mask, x, nan) for x in (old, ref, advantages_BT))
    return logprobs, old, ref, entropy, advantages_BT, advantages_B, mask


# ------------------------------------------------------------------------------------ loop reference


def _ref_token_term(lp, old, adv, ref, ent, *, eps_low, eps_high, dual_clip, kl_coef, entropy_coef):
    """Per-token loss by case analysis: min(wA, clip(w)A) = A * min(w, 1 + eps_high) for A >= 0,
    A * max(w, 1 - eps_low) for A < 0; the dual clip caps the A < 0 case at -c * A."""
    w = torch.exp(lp - old)
    if adv >= 0:
        term = -adv * torch.clamp(w, max=1 + eps_high)
    else:
        term = -adv * torch.clamp(w, min=1 - eps_low)
        if dual_clip is not None and w.item() > dual_clip:
            term = -adv * dual_clip + 0 * w
    if kl_coef:
        x = ref - lp
        term = term + kl_coef * (torch.exp(x) - x - 1)
    if entropy_coef:
        term = term - entropy_coef * ent
    return term


def reference_token_loss(logprobs, old, advantages, mask, ref, entropy, *, mode, normalizer, **kw):
    total = logprobs.sum() * 0
    for i in range(logprobs.shape[0]):
        n = int(mask[i].sum())
        seq_total = logprobs.sum() * 0
        for t in range(n):
            adv = advantages[i, t] if advantages.ndim == 2 else advantages[i]
            seq_total = seq_total + _ref_token_term(logprobs[i, t], old[i, t], adv.item(), ref[i, t], entropy[i, t],
                                                    **kw)
        if mode == "seq-mean-token-mean":
            total = total + (seq_total / n if n else seq_total)
        else:
            total = total + seq_total
    return total / normalizer


def reference_sequence_loss(logprobs, old, advantages, mask, ref, entropy, *, ratio, eps_low, eps_high, dual_clip,
                            kl_coef, entropy_coef, normalizer):
    total = logprobs.sum() * 0
    for i in range(logprobs.shape[0]):
        n = int(mask[i].sum())
        if n == 0:
            continue
        log_w = [logprobs[i, t] - old[i, t] for t in range(n)]
        wbar = sum(torch.exp(x) for x in log_w) / n if ratio == "arithmetic" else torch.exp(sum(log_w) / n)
        adv = advantages[i].item()
        if adv >= 0:
            term = -adv * torch.clamp(wbar, max=1 + eps_high)
        else:
            term = -adv * torch.clamp(wbar, min=1 - eps_low)
            if dual_clip is not None and wbar.item() > dual_clip:
                term = -adv * dual_clip + 0 * wbar
        reg = 0
        for t in range(n):
            x = ref[i, t] - logprobs[i, t]
            reg = reg + kl_coef * (torch.exp(x) - x - 1) - entropy_coef * entropy[i, t]
        total = total + term + reg / n
    return total / normalizer


# ----------------------------------------------------------------------------------------- the tests

TOKEN_CASES = [
    dict(mode="token-mean", eps_low=0.2, eps_high=0.28, dual_clip=None, kl_coef=0.0, entropy_coef=0.0),
    dict(mode="seq-mean-token-mean", eps_low=0.2, eps_high=0.2, dual_clip=None, kl_coef=0.04, entropy_coef=0.0),
    dict(mode="seq-mean-token-sum", eps_low=0.2, eps_high=0.28, dual_clip=3.0, kl_coef=0.0, entropy_coef=0.01),
    dict(mode="token-mean", eps_low=0.1, eps_high=0.3, dual_clip=1.5, kl_coef=0.1, entropy_coef=0.05),
]


def _settings(case: dict) -> dict:
    """A case's settings as the losses take them: the clip's in a PPOClip."""
    clip = PPOClip(case["eps_low"], case["eps_high"], case["dual_clip"])
    return dict(clip=clip, **{k: v for k, v in case.items() if k not in ("eps_low", "eps_high", "dual_clip")})


def _global_normalizer(mask, mode):
    return int(mask.sum()) if mode == "token-mean" else mask.shape[0]


@pytest.mark.parametrize("case", TOKEN_CASES,
                         ids=lambda c: f"{c['mode']}-dual{c['dual_clip']}-kl{c['kl_coef']}-ent{c['entropy_coef']}")
@pytest.mark.parametrize("advantage_shape", ["BT", "B"])
def test_token_loss_matches_reference_with_gradients(case, advantage_shape):
    case = dict(case)
    mode = case.pop("mode")
    for seed in range(4):
        logprobs, old, ref, entropy, adv_BT, adv_B, mask = _inputs(seed, spread=0.6)
        advantages = adv_BT if advantage_shape == "BT" else adv_B
        normalizer = _global_normalizer(mask, mode)
        loss, _ = token_policy_loss(logprobs, old, advantages, mask, loss_normalizer=normalizer, loss_agg_mode=mode,
                                    ref_logprobs_BT=ref, entropy_BT=entropy, **_settings(case))
        expected = reference_token_loss(logprobs, old, advantages, mask, ref, entropy, mode=mode,
                                        normalizer=normalizer, **case)
        torch.testing.assert_close(loss, expected, **TOL)
        got_grads = torch.autograd.grad(loss, (logprobs, entropy), allow_unused=True)
        exp_grads = torch.autograd.grad(expected, (logprobs, entropy), allow_unused=True)
        for got, exp in zip(got_grads, exp_grads):
            got = torch.zeros_like(logprobs) if got is None else got
            exp = torch.zeros_like(logprobs) if exp is None else exp
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, exp, **TOL)
        # The entropy bonus differentiates through the current policy's entropy: -coef / normaliser per token.
        if case["entropy_coef"]:
            assert got_grads[1].abs().sum() > 0


SEQUENCE_CASES = [
    dict(ratio="arithmetic", eps_low=0.2, eps_high=0.28, dual_clip=None, kl_coef=0.0, entropy_coef=0.0),
    dict(ratio="geometric", eps_low=0.2, eps_high=0.28, dual_clip=None, kl_coef=0.0, entropy_coef=0.0),
    dict(ratio="arithmetic", eps_low=0.05, eps_high=0.1, dual_clip=1.3, kl_coef=0.04, entropy_coef=0.01),
    dict(ratio="geometric", eps_low=0.05, eps_high=0.1, dual_clip=1.3, kl_coef=0.04, entropy_coef=0.01),
]


@pytest.mark.parametrize("case", SEQUENCE_CASES, ids=lambda c: f"{c['ratio']}-dual{c['dual_clip']}")
def test_sequence_loss_matches_reference_with_gradients(case):
    case = dict(case)
    ratio = case.pop("ratio")
    for seed in range(6):
        logprobs, old, ref, entropy, _, adv_B, mask = _inputs(10 + seed, spread=0.5)
        normalizer = mask.shape[0]
        loss, _ = sequence_policy_loss(logprobs, old, adv_B, mask, loss_normalizer=normalizer, sequence_ratio=ratio,
                                       ref_logprobs_BT=ref, entropy_BT=entropy, **_settings(case))
        expected = reference_sequence_loss(logprobs, old, adv_B, mask, ref, entropy, ratio=ratio,
                                           normalizer=normalizer, **case)
        torch.testing.assert_close(loss, expected, **TOL)
        got = torch.autograd.grad(loss, (logprobs, entropy), allow_unused=True)
        exp = torch.autograd.grad(expected, (logprobs, entropy), allow_unused=True)
        for g, e in zip(got, exp):
            g = torch.zeros_like(logprobs) if g is None else g
            e = torch.zeros_like(logprobs) if e is None else e
            torch.testing.assert_close(g, e, **TOL)


def test_clip_fractions_ratio_stats_and_approx_kl():
    # Hand case, one sequence of 6 tokens: log-ratios chosen to land in each clip region (eps 0.2 / 0.28).
    log_w = torch.tensor([[math.log(0.5), math.log(0.5), math.log(1.5), math.log(1.5), math.log(1.0), math.log(4.0)]],
                         dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    old = torch.zeros_like(log_w)
    mask = torch.ones_like(log_w, dtype=torch.bool)
    loss, metrics = token_policy_loss(log_w, old, adv, mask, loss_normalizer=6, clip=PPOClip(0.2, 0.28, 3.0))
    # low binds: A<0, w<0.8 -> token 0; high binds: A>0, w>1.28 -> token 2; dual binds: A<0, w>3 -> token 5.
    assert metrics["clip_frac_low"].item() == pytest.approx(1 / 6)
    assert metrics["clip_frac_high"].item() == pytest.approx(1 / 6)
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 6)
    # Per-token losses: 0.8, -0.5, -1.28, 1.5, -1.0, 3.0 (dual-clipped from 4.0) -> mean 2.52 / 6.
    assert loss.item() == pytest.approx((0.8 - 0.5 - 1.28 + 1.5 - 1.0 + 3.0) / 6)
    w = [0.5, 0.5, 1.5, 1.5, 1.0, 4.0]
    assert metrics["ratio_mean"].item() == pytest.approx(sum(w) / 6)
    assert metrics["ratio_max"].item() == pytest.approx(4.0)
    assert metrics["ratio_min"].item() == pytest.approx(0.5)
    # approx_kl: k3 of KL(pi_old || pi_theta) = mean of (w - 1) - log w.
    assert metrics["approx_kl"].item() == pytest.approx(sum((x - 1) - math.log(x) for x in w) / 6)
    assert metrics["num_tokens"].item() == 6
    assert all(not v.requires_grad for v in metrics.values())


def test_metrics_of_an_empty_micro_batch_are_zero():
    x = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for fn, adv in ((token_policy_loss, torch.ones(2, dtype=torch.float64)),
                    (sequence_policy_loss, torch.ones(2, dtype=torch.float64))):
        loss, metrics = fn(x, x.detach(), adv, mask, loss_normalizer=4.0)
        assert loss.item() == 0.0
        assert all(torch.isfinite(v).all() and v.item() == 0 for v in metrics.values())
        (grad,) = torch.autograd.grad(loss, x)
        assert (grad == 0).all()


def _param_logprobs(theta, tokens):
    """Log-probs of `tokens` under a tiny differentiable 'policy': logits theta [T, V] shared by all rows."""
    log_probs_BTV = torch.log_softmax(theta, dim=-1).expand(tokens.shape[0], -1, -1)
    return log_probs_BTV.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("loss_kind", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "sequence"])
def test_micro_batches_and_dp_shards_sum_to_the_full_batch(loss_kind):
    """THE LOSS CONTRACT: sum over DP shards and micro-batches of loss_mb (global normaliser) == full loss,
    and the summed parameter gradient == the full-batch gradient (float64)."""
    gen = torch.Generator().manual_seed(5)
    B, T, V = 12, 6, 7
    theta = torch.randn(T, V, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    with torch.no_grad():
        old = _param_logprobs(theta + 0.3 * torch.randn(T, V, generator=gen, dtype=torch.float64), tokens)
        ref = old + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    mask = torch.arange(T) < lengths.unsqueeze(-1)
    adv_B = torch.randn(B, generator=gen, dtype=torch.float64)
    adv_BT = torch.randn(B, T, generator=gen, dtype=torch.float64)
    kwargs = dict(clip=PPOClip(0.2, 0.28, 3.0), kl_coef=0.05, entropy_coef=0.01)

    def micro_batch_loss(rows, normalizer):
        logprobs = _param_logprobs(theta, tokens[rows])
        entropy = -(torch.softmax(theta, -1) * torch.log_softmax(theta, -1)).sum(-1).expand(len(rows), T)
        common = dict(loss_normalizer=normalizer, ref_logprobs_BT=ref[rows], entropy_BT=entropy, **kwargs)
        if loss_kind == "sequence":
            return sequence_policy_loss(logprobs, old[rows], adv_B[rows], mask[rows], **common)[0]
        return token_policy_loss(logprobs, old[rows], adv_BT[rows], mask[rows], loss_agg_mode=loss_kind, **common)[0]

    mode = "seq-mean-token-mean" if loss_kind == "sequence" else loss_kind
    everything = torch.arange(B)
    # 2 DP ranks x uneven micro-batches; each rank's local normaliser shares add up to the global one.
    shards = [[torch.arange(0, 2), torch.arange(2, 7)], [torch.arange(7, 8), torch.arange(8, 10), torch.arange(10, 12)]]
    global_normalizer = sum(local_loss_normalizer(mask[rows], mode) for shard in shards for rows in shard)
    assert int(global_normalizer) == _global_normalizer(mask, mode)

    full = micro_batch_loss(everything, global_normalizer)
    (full_grad,) = torch.autograd.grad(full, theta)
    summed, summed_grad = 0.0, torch.zeros_like(theta)
    for shard in shards:
        for rows in shard:
            loss_mb = micro_batch_loss(rows, global_normalizer)
            (grad,) = torch.autograd.grad(loss_mb, theta)
            summed, summed_grad = summed + loss_mb.detach(), summed_grad + grad  # DP all-reduce is a SUM
    torch.testing.assert_close(summed, full.detach(), **TOL)
    torch.testing.assert_close(summed_grad, full_grad, **TOL)
    # Option b) of the contract: raw sums (loss_normalizer=1) divided by the summed local normalisers.
    raw = sum(micro_batch_loss(rows, 1.0).detach() for shard in shards for rows in shard)
    torch.testing.assert_close(raw / global_normalizer, full.detach(), **TOL)


def test_seq_mean_modes_differ_from_token_mean():
    """Guards the aggregation: with unequal lengths the three modes give three different losses."""
    logprobs, old, _, _, adv_BT, _, mask = _inputs(3, spread=0.3)
    modes = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
    losses = [token_policy_loss(logprobs, old, adv_BT, mask, loss_normalizer=_global_normalizer(mask, m),
                                loss_agg_mode=m)[0].item() for m in modes]
    assert len({round(x, 10) for x in losses}) == 3


def test_invalid_arguments_raise_value_errors():
    logprobs, old, ref, entropy, adv_BT, adv_B, mask = _inputs(0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        token_policy_loss(logprobs, old, adv_BT, mask, loss_normalizer=1.0, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="dual_clip"):
        PPOClip(dual_clip=0.9)
    with pytest.raises(ValueError, match="need 0 <= eps_low < 1"):
        PPOClip(eps_low=1.0)
    with pytest.raises(ValueError, match="needs ref_logprobs_BT"):
        token_policy_loss(logprobs, old, adv_BT, mask, loss_normalizer=1.0, kl_coef=0.1)
    with pytest.raises(ValueError, match="needs entropy_BT"):
        sequence_policy_loss(logprobs, old, adv_B, mask, loss_normalizer=1.0, entropy_coef=0.1)
    with pytest.raises(ValueError, match="loss_normalizer must be > 0"):
        token_policy_loss(logprobs, old, adv_BT, mask, loss_normalizer=0)
    with pytest.raises(ValueError, match="sequence_ratio"):
        sequence_policy_loss(logprobs, old, adv_B, mask, loss_normalizer=1.0, sequence_ratio="harmonic")
    with pytest.raises(ValueError, match="advantages must have shape"):
        token_policy_loss(logprobs, old, adv_BT[:, :2], mask, loss_normalizer=1.0)
    with pytest.raises(ValueError, match="advantages_B must have shape"):
        sequence_policy_loss(logprobs, old, adv_BT, mask, loss_normalizer=1.0)
