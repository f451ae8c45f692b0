"""Policy losses: the clipped surrogate per token (GRPO, DAPO, GTPO, Clip-Cov; KL-Cov's unclipped) and per sequence
(GRPO-S, GSPO).

Both are built from the same small pieces: the importance ratio, the clipping (`PPOClip`, or none: KL-Cov) and the
`surrogate` it gives, the token selections (`apply_selection`: the rollout correction's and the selections' weights,
KL-Cov's penalty), the regularisers (KL to the reference, the entropy bonus) and the `aggregate` of THE LOSS CONTRACT.

Shapes: B sequences (the N x G responses of the batch, flattened) x T positions. logprobs_BT are the current
policy's log-probs of the sampled tokens (differentiable), old_logprobs_BT the old policy's (detached),
mask_BT is True on valid response tokens. Every input may hold anything (NaN included) at padding.

THE LOSS CONTRACT
-----------------
A mini-batch (one optimizer step) is split into micro-batches (Megatron's pipeline schedule) and across
data-parallel (DP) ranks, always on sequence boundaries. Each loss function here returns, for its
micro-batch,

    loss_mb = ( sum over the micro-batch's terms ) / loss_normalizer

where, with l_{i,t} the per-token loss (surrogate + kl_coef * k3 - entropy_coef * entropy) and |o_i| the
number of valid tokens of sequence i:

    loss_agg_mode          one term per               loss_normalizer (GLOBAL, the same on every micro-batch)
    "token-mean"           valid token: l_{i,t}       total valid response tokens of the whole mini-batch
                                                      (all micro-batches, all DP ranks)
    "seq-mean-token-mean"  sequence: sum_t l / |o_i|  total sequences of the mini-batch (all micro-batches,
                                                      all DP ranks; N x G)
    "seq-mean-token-sum"   sequence: sum_t l          total sequences of the mini-batch
    sequence_policy_loss   sequence: l_i (below)      total sequences of the mini-batch

Nothing in a term depends on the other micro-batches, so the sum of loss_mb over all micro-batches and
all DP ranks equals the full mini-batch loss, and its gradient equals the full-batch gradient, however the
mini-batch is split (tests/test_algorithms_losses.py checks this in float64). local_loss_normalizer gives a
micro-batch's share of the normaliser: the trainer sums it over its micro-batches and all-reduces (SUM)
over DP once per step, as the update phase starts (training/update.py), before the update's first forward.

Handing loss_mb to megatron-core 0.16's schedule (forward_step_calc_loss / finalize_model_grads) without
changing its value (no context parallelism; the schedule would also scale by the CP size); pick one:
  a) calculate_per_token_loss=False, loss_func returns the 2-tuple (loss, reported): the schedule divides
     the loss by num_microbatches and DDP averages gradients over DP, so return
     loss_mb * num_microbatches * dp_size.
  b) calculate_per_token_loss=True, loss_func returns (loss, num_tokens, reported): the schedule keeps the
     loss, DDP sums gradients over DP, and finalize_model_grads divides them by the all-reduced sum of the
     returned num_tokens. Call with loss_normalizer=1.0 and return num_tokens = local_loss_normalizer(...)
     (tokens or sequences, per the table): Megatron then performs the same global division.

The approx_kl metric is the k3 estimator of KL(pi_old || pi_theta) from the tokens sampled from pi_old:
mean over valid tokens of (w - 1) - log w, w = pi_theta / pi_old (>= 0 per token). The KL penalty to a
reference policy is the spec's k3 = exp(ref - logp) - (ref - logp) - 1 per token.

Metrics come back as detached 0-dim tensors (no host sync) computed over this micro-batch only: fractions
and means are over its valid tokens (sequence_policy_loss: clip fractions and ratio statistics over its
non-empty sequences) and `num_tokens` / `num_sequences` are the weights to combine micro-batches with.
Statistics of an empty micro-batch are 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from megatron_gtpo.algorithms._checks import check_bool_mask, check_choice, check_floating, check_same_shape

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
SEQUENCE_RATIOS = ("arithmetic", "geometric")
# Log-ratios are clamped to +-20 (ratio in [2e-9, 4.9e8]) before exp: a guard against overflow to inf, whose
# 0 * inf would turn the gradient of a clipped token into NaN. It never binds in a healthy run.
LOG_RATIO_LIMIT = 20.0


def local_loss_normalizer(mask_BT: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """This micro-batch's share of the global loss_normalizer: its valid tokens for "token-mean", its
    sequences (rows of mask_BT) for the seq-mean modes and for sequence_policy_loss (pass "seq-mean-token-mean").
    Returns an int64 0-dim tensor on the mask's device (sum it over micro-batches and DP ranks)."""
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    if loss_agg_mode == "token-mean":
        return mask_BT.sum()
    return torch.tensor(mask_BT.shape[0], dtype=torch.int64, device=mask_BT.device)


@dataclass(frozen=True)
class PPOClip:
    """The clipped surrogate's trust region: the ratio w clipped to [1 - eps_low, 1 + eps_high] (clip-higher:
    eps_high > eps_low), and with `dual_clip` c > 1 the loss of a negative advantage capped at -c A (dual-clip PPO).
    KL-Cov's surrogate has none (`clip=None`)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None

    def __post_init__(self):
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={self.eps_low!r}, "
                             f"eps_high={self.eps_high!r}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be None or > 1 (the ratio cap for negative advantages), got "
                             f"{self.dual_clip!r}")


class ClipEvents(NamedTuple):
    """Where each clip binds (selects its constant branch, so the element has no gradient): the low clip (A < 0 and
    w < 1 - eps_low), the high clip (A > 0 and w > 1 + eps_high), the dual clip (A < 0 and w > dual_clip)."""

    low: torch.Tensor
    high: torch.Tensor
    dual: torch.Tensor


def surrogate(ratio, advantages, clip: PPOClip | None) -> tuple[torch.Tensor, ClipEvents]:
    """Per element, the policy-gradient surrogate and where its clips bind: -min(w A, clip(w, 1 - eps_low,
    1 + eps_high) A), with the dual clip min(., -c A) for A < 0; without a clip, -w A (no clip binds)."""
    if clip is None:
        no_event = torch.zeros(ratio.shape, dtype=torch.bool, device=ratio.device)
        return -advantages * ratio, ClipEvents(no_event, no_event, no_event)
    clipped = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip.eps_low, 1 + clip.eps_high))
    low = (advantages < 0) & (ratio < 1 - clip.eps_low)
    high = (advantages > 0) & (ratio > 1 + clip.eps_high)
    if clip.dual_clip is None:
        return clipped, ClipEvents(low, high, torch.zeros_like(low))
    dual = (advantages < 0) & (ratio > clip.dual_clip)
    return torch.where(advantages < 0, torch.minimum(clipped, -clip.dual_clip * advantages), clipped), \
        ClipEvents(low, high, dual)


def apply_selection(surrogate_BT, log_ratio_BT, mask_BT, *, pg_weights=None, kl_penalty_BT=None,
                     kl_cov_coef: float = 0.0) -> torch.Tensor:
    """The token selections applied to a per-token surrogate: KL-Cov's penalty kl_cov_coef * |log w| added on the
    tokens of kl_penalty_BT, then the per-token weights pg_weights ([B, T] or [B], detached: the rollout-mismatch
    importance weights times 0 where a selection removes the gradient); 0 at padding."""
    B, T = mask_BT.shape
    if kl_penalty_BT is not None:
        check_bool_mask("kl_penalty_BT", kl_penalty_BT, mask_BT.shape)
        surrogate_BT = surrogate_BT + kl_cov_coef * torch.where(kl_penalty_BT & mask_BT, log_ratio_BT.abs(), 0.0)
    if pg_weights is not None:
        if pg_weights.shape not in ((B, T), (B,)):
            raise ValueError(f"pg_weights must have shape [B, T] = {(B, T)} or [B] = ({B},), got "
                             f"{tuple(pg_weights.shape)}")
        weights_BT = pg_weights.detach() if pg_weights.ndim == 2 else pg_weights.detach().unsqueeze(-1)
        surrogate_BT = surrogate_BT * torch.where(mask_BT, weights_BT, 0.0)
    return surrogate_BT


def aggregate(per_token_BT, mask_BT, loss_agg_mode: str, loss_normalizer) -> torch.Tensor:
    """One micro-batch's share of the loss (THE LOSS CONTRACT) from per-token terms that are exactly 0 at padding:
    their sum, or for "seq-mean-token-mean" the sum of each sequence's mean, over `loss_normalizer`."""
    if loss_agg_mode == "seq-mean-token-mean":
        lengths_B = mask_BT.sum(dim=-1).clamp(min=1)
        return (per_token_BT.sum(dim=-1) / lengths_B).sum() / loss_normalizer
    return per_token_BT.sum() / loss_normalizer


def _check_common(logprobs_BT, old_logprobs_BT, mask_BT, loss_normalizer, ref_logprobs_BT, kl_coef, entropy_BT,
                  entropy_coef) -> None:
    check_floating("logprobs_BT", logprobs_BT, 2)
    check_same_shape("old_logprobs_BT", old_logprobs_BT, logprobs_BT.shape)
    check_bool_mask("mask_BT", mask_BT, logprobs_BT.shape)
    if isinstance(loss_normalizer, (int, float)) and not loss_normalizer > 0:
        raise ValueError(f"loss_normalizer must be > 0, got {loss_normalizer!r}")
    if kl_coef != 0 and ref_logprobs_BT is None:
        raise ValueError(f"kl_coef={kl_coef!r} needs ref_logprobs_BT")
    if ref_logprobs_BT is not None:
        check_same_shape("ref_logprobs_BT", ref_logprobs_BT, logprobs_BT.shape)
    if entropy_coef != 0 and entropy_BT is None:
        raise ValueError(f"entropy_coef={entropy_coef!r} needs entropy_BT (entropy of the current policy)")
    if entropy_BT is not None:
        check_same_shape("entropy_BT", entropy_BT, logprobs_BT.shape)


def _masked_log_ratio(numerator_BT, denominator_BT, mask_BT) -> torch.Tensor:
    """numerator - denominator on valid tokens (clamped to +-LOG_RATIO_LIMIT), exactly 0 at padding."""
    return torch.where(mask_BT, numerator_BT - denominator_BT, 0.0).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _k3(log_ratio):
    """exp(x) - x - 1 with x = log(q(y) / p(y)) for y sampled from p: the k3 estimate of KL(p || q), >= 0."""
    return torch.expm1(log_ratio) - log_ratio


def _fraction(flags, count):
    return flags.sum() / count.clamp(min=1)


def _masked_extremes(values, valid, count) -> tuple[torch.Tensor, torch.Tensor]:
    has_any = count > 0
    max_value = torch.where(valid, values, -torch.inf).amax()
    min_value = torch.where(valid, values, torch.inf).amin()
    return torch.where(has_any, max_value, 0.0), torch.where(has_any, min_value, 0.0)


def _regularisers_BT(logprobs_BT, mask_BT, num_tokens, ref_logprobs_BT, kl_coef, entropy_BT, entropy_coef):
    """Per-token kl_coef * k3(ref) - entropy_coef * entropy (0 at padding), and their metrics."""
    per_token_BT = torch.zeros_like(logprobs_BT)
    metrics = {}
    if ref_logprobs_BT is not None:
        ref_kl_BT = _k3(_masked_log_ratio(ref_logprobs_BT, logprobs_BT, mask_BT))
        metrics["ref_kl"] = ref_kl_BT.detach().sum() / num_tokens.clamp(min=1)
        if kl_coef != 0:
            per_token_BT = per_token_BT + kl_coef * ref_kl_BT
    if entropy_BT is not None:
        entropy_BT = torch.where(mask_BT, entropy_BT, 0.0)
        metrics["entropy"] = entropy_BT.detach().sum() / num_tokens.clamp(min=1)
        if entropy_coef != 0:
            per_token_BT = per_token_BT - entropy_coef * entropy_BT
    return per_token_BT, metrics


def _ratio_metrics(pg_loss, events: ClipEvents, ratio, valid, count, log_ratio_BT, num_tokens) -> dict:
    """The surrogate's metrics over `count` elements (`valid` of `ratio`): clip fractions and ratio statistics, and
    the k3 approx_kl over the tokens."""
    with torch.no_grad():
        ratio_max, ratio_min = _masked_extremes(ratio, valid, count)
        return dict(pg_loss=pg_loss.detach(), clip_frac_low=_fraction(events.low, count),
                    clip_frac_high=_fraction(events.high, count), dual_clip_frac=_fraction(events.dual, count),
                    approx_kl=_k3(log_ratio_BT).sum() / num_tokens.clamp(min=1),
                    ratio_mean=torch.where(valid, ratio, 0.0).sum() / count.clamp(min=1), ratio_max=ratio_max,
                    ratio_min=ratio_min, num_tokens=num_tokens)


def token_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    loss_normalizer: float | torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip: PPOClip | None = PPOClip(),
    ref_logprobs_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    pg_weights: torch.Tensor | None = None,
    kl_penalty_BT: torch.Tensor | None = None,
    kl_cov_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped surrogate (PPO/GRPO/DAPO/GTPO/Clip-Cov/KL-Cov) of one micro-batch; see THE LOSS CONTRACT.

    advantages: [B, T] per-token advantages (GTPO) or [B] per-sequence ones broadcast to every token
    (GRPO, DAPO). Per token, with w = exp(logprobs - old_logprobs):
        l = -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A)        [min(l, -dual_clip * A) when A < 0]
            + kl_coef * k3(ref_logprobs - logprobs) - entropy_coef * entropy
    built from the pieces above: the `surrogate` under `clip` (None: -w A, KL-Cov's), the token selections
    (`apply_selection`: KL-Cov's kl_cov_coef * |log w| on the tokens of kl_penalty_BT, the per-token pg_weights:
    the rollout-mismatch importance weights of rollout_correction.py, times 0 where a token selection removes the
    policy gradient, token_selection.py), the regularisers, and the `aggregate` of loss_agg_mode.
    entropy_BT is the CURRENT policy's entropy (differentiable) for the bonus; ref_logprobs_BT the reference
    policy's log-probs. Either may be given with a zero coefficient to get its metric only.
    Returns (loss_mb, metrics): pg_loss (the surrogate part of loss_mb), clip_frac_low (A < 0 and
    w < 1 - eps_low), clip_frac_high (A > 0 and w > 1 + eps_high), dual_clip_frac (A < 0 and w > dual_clip),
    approx_kl, ratio_mean/max/min, num_tokens, ref_kl / entropy when those inputs are given, and with kl_penalty_BT
    kl_cov_abs_log_ratio (the mean |log w| over the valid tokens).
    """
    _check_common(logprobs_BT, old_logprobs_BT, mask_BT, loss_normalizer, ref_logprobs_BT, kl_coef, entropy_BT,
                  entropy_coef)
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    if advantages.shape not in (logprobs_BT.shape, logprobs_BT.shape[:1]):
        raise ValueError(f"advantages must have shape [B, T] = {tuple(logprobs_BT.shape)} or [B] = "
                         f"({logprobs_BT.shape[0]},), got {tuple(advantages.shape)}")
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(-1)
    advantages_BT = torch.where(mask_BT, advantages.detach(), 0.0)

    log_ratio_BT = _masked_log_ratio(logprobs_BT, old_logprobs_BT, mask_BT)
    ratio_BT = torch.exp(log_ratio_BT)  # exactly 1 at padding, where the advantage is 0
    surrogate_BT, events = surrogate(ratio_BT, advantages_BT, clip)
    surrogate_BT = apply_selection(surrogate_BT, log_ratio_BT, mask_BT, pg_weights=pg_weights,
                                    kl_penalty_BT=kl_penalty_BT, kl_cov_coef=kl_cov_coef)
    num_tokens = mask_BT.sum()
    regularisers_BT, metrics = _regularisers_BT(logprobs_BT, mask_BT, num_tokens, ref_logprobs_BT, kl_coef,
                                                entropy_BT, entropy_coef)
    pg_loss = aggregate(surrogate_BT, mask_BT, loss_agg_mode, loss_normalizer)
    loss = pg_loss + aggregate(regularisers_BT, mask_BT, loss_agg_mode, loss_normalizer)
    metrics.update(_ratio_metrics(pg_loss, events, ratio_BT, mask_BT, num_tokens, log_ratio_BT, num_tokens))
    if kl_penalty_BT is not None:  # KL-Cov's: over every valid token, penalised or not (verl's ppo_kl_abs)
        with torch.no_grad():
            metrics["kl_cov_abs_log_ratio"] = log_ratio_BT.abs().sum() / num_tokens.clamp(min=1)
    return loss, metrics


def sequence_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    loss_normalizer: float | torch.Tensor,
    sequence_ratio: str = "arithmetic",
    clip: PPOClip = PPOClip(),
    ref_logprobs_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    pg_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sequence-level clipped surrogate (GRPO-S; GSPO with sequence_ratio="geometric"); see THE LOSS CONTRACT.

    Per sequence i with |o_i| > 0 valid tokens and token ratios w_t = exp(logprobs - old_logprobs):
        wbar_i = (1/|o_i|) sum_t w_t            ("arithmetic", GRPO-S)
               = exp((1/|o_i|) sum_t log w_t)   ("geometric", GSPO)
        l_i = -min(wbar A_i, clip(wbar, 1 - eps_low, 1 + eps_high) A_i)    [min(l_i, -dual_clip * A_i) if A_i < 0]
              + (1/|o_i|) sum_t (kl_coef * k3_t - entropy_coef * entropy_t)
    and l_i = 0 for an empty sequence. loss_normalizer is the total number of sequences of the mini-batch,
    which makes the loss the mean over sequences (1/G per group, then the mean over groups). pg_weights ([B],
    detached) multiply each sequence's surrogate term: the sequence-level rollout-mismatch importance weights
    (rollout_correction.py); None means 1.
    Metrics as token_policy_loss, with clip fractions and ratio statistics over the non-empty sequences of
    the micro-batch (num_sequences counts them) and approx_kl over its tokens.
    """
    _check_common(logprobs_BT, old_logprobs_BT, mask_BT, loss_normalizer, ref_logprobs_BT, kl_coef, entropy_BT,
                  entropy_coef)
    check_choice("sequence_ratio", sequence_ratio, SEQUENCE_RATIOS)
    check_same_shape("advantages_B", advantages_B, logprobs_BT.shape[:1])
    lengths_B = mask_BT.sum(dim=-1)
    nonempty_B = lengths_B > 0
    advantages_B = torch.where(nonempty_B, advantages_B.detach(), 0.0)

    log_ratio_BT = _masked_log_ratio(logprobs_BT, old_logprobs_BT, mask_BT)
    if sequence_ratio == "arithmetic":
        token_ratio_BT = torch.where(mask_BT, torch.exp(log_ratio_BT), 0.0)
        ratio_B = token_ratio_BT.sum(dim=-1) / lengths_B.clamp(min=1)
    else:
        ratio_B = torch.exp(log_ratio_BT.sum(dim=-1) / lengths_B.clamp(min=1))
    surrogate_B, events = surrogate(ratio_B, advantages_B, clip)
    if pg_weights is not None:
        check_same_shape("pg_weights", pg_weights, logprobs_BT.shape[:1])
        surrogate_B = surrogate_B * pg_weights.detach()
    num_tokens = mask_BT.sum()
    regularisers_BT, metrics = _regularisers_BT(logprobs_BT, mask_BT, num_tokens, ref_logprobs_BT, kl_coef,
                                                entropy_BT, entropy_coef)
    # An empty sequence has advantage 0, so its surrogate is 0 whatever its (meaningless) ratio.
    pg_loss = surrogate_B.sum() / loss_normalizer
    loss = pg_loss + aggregate(regularisers_BT, mask_BT, "seq-mean-token-mean", loss_normalizer)
    num_sequences = nonempty_B.sum()
    metrics.update(_ratio_metrics(pg_loss, events, ratio_B, nonempty_B, num_sequences, log_ratio_BT, num_tokens),
                   num_sequences=num_sequences)
    return loss, metrics
