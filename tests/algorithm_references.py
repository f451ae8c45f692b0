"""Float64 references of the entropy-shaped advantages (GTPO, GRPO-S; arXiv 2508.04349), straight from the spec with
Python floats and loops, and the random batches the advantage tests draw: shared by test_algorithms_advantages.py and
test_algorithms_token_passes.py."""
from __future__ import annotations

import math

import torch

from megatron_gtpo.algorithms.advantages import _TYPE_SIGN_12, _affine_in_bonus, _check_shaping_inputs, _gtpo_shaping

NAN = float("nan")


def gtpo_token_rewards(
    rewards_NG: torch.Tensor,
    entropy_NGT: torch.Tensor,
    mask_NGT: torch.Tensor,
    *,
    alpha1: float = 1.0,
    alpha2: float = 0.1,
    entropy_clip: tuple[float, float] | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """GTPO's shaped token rewards, rpos on successful responses and rneg on failed ones, 0 at padding: what
    gtpo_advantages z-scores, formed by its own shaping pass (the trainer needs only the advantages).

    With d_t (h_t) the number of successful (failed) responses that have a token at position t:
        successful i: rpos_{i,t} = alpha1 * r_i + alpha2 * H_{i,t} / (sum_{k in O+} H_{k,t} + eps) * d_t
        failed j:     rneg_{j,t} = -alpha1
                                   - alpha2 * (1/(H_{j,t} + eps)) / (sum_{k in O-} 1/(H_{k,t} + eps) + eps) * h_t
    The sums run over the responses that have a token at t (shorter ones contribute 0). rpos and rneg live on
    disjoint tokens, so one [N, G, T] tensor holds both. rewards_NG must be exactly 0 or 1.
    """
    _check_shaping_inputs(rewards_NG, entropy_NGT, mask_NGT, entropy_clip, eps)
    shaping = _gtpo_shaping(rewards_NG, entropy_NGT, mask_NGT, alpha2=alpha2, entropy_clip=entropy_clip, eps=eps)
    sign_N2 = torch.tensor(_TYPE_SIGN_12, dtype=torch.float64, device=rewards_NG.device).expand(len(rewards_NG), 2)
    return _affine_in_bonus(shaping, entropy_NGT, mask_NGT, sign_N2, alpha1 * sign_N2, entropy_clip=entropy_clip,
                            eps=eps)


def reference_gtpo(rewards, entropy, lengths, *, alpha1, alpha2, norm_scope, entropy_clip, eps):
    """Straight from the spec with Python floats and loops (independent of the vectorised code)."""
    N, G = len(rewards), len(rewards[0])

    def H(n, g, t):
        h = entropy[n][g][t]
        return min(max(h, entropy_clip[0]), entropy_clip[1]) if entropy_clip else h

    shaped = {}
    for n in range(N):
        for t in range(max(lengths[n])):
            pos = [g for g in range(G) if rewards[n][g] == 1 and lengths[n][g] > t]
            neg = [g for g in range(G) if rewards[n][g] == 0 and lengths[n][g] > t]
            pos_sum = sum(H(n, g, t) for g in pos)
            neg_sum = sum(1 / (H(n, g, t) + eps) for g in neg)
            for g in pos:
                shaped[n, g, t] = alpha1 * rewards[n][g] + alpha2 * H(n, g, t) / (pos_sum + eps) * len(pos)
            for g in neg:
                shaped[n, g, t] = -alpha1 - alpha2 * (1 / (H(n, g, t) + eps)) / (neg_sum + eps) * len(neg)
    scopes = [list(range(N))] if norm_scope == "batch" else [[n] for n in range(N)]
    advantages = {}
    for members in scopes:
        tokens = [(n, g, t) for n in members for g in range(G) for t in range(lengths[n][g])]
        for sign in (1, 0):
            values = [shaped[k] if rewards[k[0]][k[1]] == sign else 0.0 for k in tokens]
            if not values:
                continue
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1))
            for k, v in zip(tokens, values):
                if rewards[k[0]][k[1]] == sign:
                    advantages[k] = (v - mean) / (std + eps)
    return advantages


def reference_grpo_s(rewards, entropy, lengths, *, beta1, beta2, entropy_clip, eps):
    out = []
    for r_row, h_row, l_row in zip(rewards, entropy, lengths):
        hbar = []
        for h, length in zip(h_row, l_row):
            hs = [min(max(x, entropy_clip[0]), entropy_clip[1]) if entropy_clip else x for x in h[:length]]
            hbar.append(sum(hs) / length if length else 0.0)
        pos = [g for g, r in enumerate(r_row) if r == 1]
        neg = [g for g, r in enumerate(r_row) if r == 0]
        pos_sum = sum(hbar[g] for g in pos)
        neg_sum = sum(1 / (hbar[g] + eps) for g in neg)
        shaped = [beta1 * r_row[g] + beta2 * hbar[g] / (pos_sum + eps) * len(pos) if r_row[g] == 1
                  else -beta1 - beta2 * (1 / (hbar[g] + eps)) / (neg_sum + eps) * len(neg) for g in range(len(r_row))]
        mean = sum(shaped) / len(shaped)
        std = math.sqrt(sum((s - mean) ** 2 for s in shaped) / max(len(shaped) - 1, 1))
        out.append([(s - mean) / (std + eps) for s in shaped])
    return out


def random_batch(seed, N=3, G=5, T=7, *, dtype=torch.float64, min_entropy=0.0, p_correct=0.5, min_len=0):
    gen = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(N, G, generator=gen) < p_correct).to(dtype)
    entropy = (min_entropy + 3 * torch.rand(N, G, T, generator=gen)).to(dtype)
    lengths = torch.randint(min_len, T + 1, (N, G), generator=gen)
    mask = torch.arange(T) < lengths.unsqueeze(-1)
    entropy = torch.where(mask, entropy, torch.full_like(entropy, NAN))  # padding must never be read
    return rewards, entropy, mask, lengths


def dense_from_dict(values, shape):
    out = torch.zeros(shape, dtype=torch.float64)
    for (n, g, t), v in values.items():
        out[n, g, t] = v
    return out


# ------------------------------------------------------------------------------------------------- verl (0.5 - 0.9)
# Transcriptions of verl's verl/trainer/ppo/core_algos.py compute_policy_loss_clip_cov and compute_policy_loss_kl_cov
# (themselves from PRIME-RL/Entropy-Mechanism-of-RL), with verl_F.masked_mean and agg_loss("token-mean") written out
# and the config read replaced by keywords: the scope is ONE micro-batch and the covariance uses the CURRENT log-probs.


def _masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def verl_clip_cov_loss(old_log_prob, log_prob, advantages, response_mask, *, cliprange_low, cliprange_high,
                       clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0):
    """(pg_loss, pg_clipfrac, ppo_kl); token-mean. Draws torch.randperm from the global generator, as verl does."""
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = _masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - _masked_mean(advantages, response_mask)) * (
        log_prob - _masked_mean(log_prob.detach(), response_mask))
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    top_k_idx = (cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (response_mask > 0)
    top_k_idx = torch.nonzero(top_k_idx)
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), device=cov_all.device, dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_clipfrac = _masked_mean((corr == 0).float(), response_mask)
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    return _masked_mean(pg_losses, response_mask), pg_clipfrac, ppo_kl


def verl_kl_cov_loss(old_log_prob, log_prob, advantages, response_mask, *, kl_cov_ratio=0.0002, ppo_kl_coef=1.0):
    """(pg_loss, ppo_kl_abs, penalised); token-mean. verl's `k = min(kl_cov_ratio, len(...))` is kept: it only skips
    the selection of an empty micro-batch. `penalised` (bool, the mask's shape; not verl's) marks the tokens verl's
    torch.topk picked: their number is verl's count, their place among tied covariances torch.topk's choice."""
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    ppo_kl_abs = _masked_mean(negative_approx_kl.abs(), response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    penalised = torch.zeros(advantages.shape, dtype=torch.bool)
    k = min(kl_cov_ratio, len(all_valid_adv))
    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
        if len(large_cov_idxs) != 0:
            large_cov_idxs = all_valid_idx[large_cov_idxs]
            rows, cols = large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]
            pg_losses[rows, cols] = pg_losses_kl[rows, cols]
            penalised[rows, cols] = True
    return _masked_mean(pg_losses, response_mask), ppo_kl_abs, penalised
