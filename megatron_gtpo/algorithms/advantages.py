"""Advantages of GRPO (also DAPO's), GTPO (token-level entropy shaping) and GRPO-S (sequence-level).

Follows /work/shared/specs/algorithms.md. Conventions shared by every function here:

- N prompts, G responses per prompt, T token positions: rewards_NG, entropy_NGT, mask_NGT.
  mask_NGT is True on valid response tokens (a prefix of each row); entropy at padding positions may hold
  anything (NaN included) and is never read arithmetically.
- Every z-score uses the Bessel-corrected standard deviation (count - 1 in the denominator, as torch.std and
  the public GRPO implementations do); a set of one value has std 0, never NaN. [choice: the spec is silent]
- `eps` guards a division additively: x / (y + eps).
- Arithmetic runs in float32 at least (float64 inputs stay float64; bf16/fp16 entropies are upcast); GTPO's
  per-prompt sums are combined over the normalisation scope in float64.
- Everything is vectorised over [N, G, T]: no Python loop runs over responses or tokens. On CPU the batch is
  processed in blocks of whole prompts to stay in cache (see _prompt_blocks); elsewhere in one block.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

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


# Performance of the [N, G, T] work below (it runs once per step on the whole batch). On CPU, memory traffic
# and first-touch page faults of fresh tensors dominate, so:
# - the work runs in blocks of prompts (_prompt_blocks) whose intermediates fit in cache, each block fully
#   vectorised; the only full-size tensor allocated is the [N, G, T] output (none for GRPO-S);
# - intermediates go to block-sized scratch buffers through `out=` and in-place ops;
# - the bool mask becomes a float factor through a uint8 view (bool -> float directly is ~6x slower);
# - no torch.where on [N, G, T] (its bool-conditioned CPU kernel is not vectorised: 5-30x a multiply): padding
#   that may hold NaN is cleared bitwise (_write_masked_entropy), rows are selected by exact arithmetic.
# benchmarks/results/advantages.md has the figures.
# Other devices get a single block.
_CPU_BLOCK_ELEMENTS = 1 << 19  # 2 MiB of float32 per scratch buffer


def _prompt_blocks(num_prompts: int, elements_per_prompt: int, device: torch.device) -> list[slice]:
    if device.type != "cpu":
        return [slice(0, num_prompts)]
    per_block = max(1, _CPU_BLOCK_ELEMENTS // max(elements_per_prompt, 1))
    return [slice(start, min(start + per_block, num_prompts)) for start in range(0, num_prompts, per_block)]


def _scratch(blocks: list[slice], shape_GT, dtype, device) -> torch.Tensor:
    largest = max((block.stop - block.start for block in blocks), default=0)
    return torch.empty((largest, *shape_GT), dtype=dtype, device=device)


def _write_float_mask(scratch_nGT: torch.Tensor, mask_nGT: torch.Tensor) -> torch.Tensor:
    """scratch <- 1.0 on valid tokens, 0.0 at padding."""
    return scratch_nGT.copy_(mask_nGT.view(torch.uint8))


_SAME_WIDTH_INT = {torch.float64: torch.int64, torch.float32: torch.int32}


def _write_masked_entropy(buffer_nGT, entropy_nGT, mask_nGT, entropy_clip, bits_scratch_nGT) -> torch.Tensor:
    """buffer <- old-policy entropy, clamped to entropy_clip if given, exactly 0 at padding (whatever it held,
    NaN included). Entropy is >= 0 by definition; rounding can leave tiny negative values, which are clamped
    to 0 so that 1/(H + eps) stays finite.

    Padding is cleared with a bitwise AND against an all-ones / all-zeros word per element (bits_scratch_nGT,
    the integer type of the buffer's width): exact, and several times faster on CPU than torch.where, whose
    bool-conditioned kernel is not vectorised. A NaN at a valid token stays NaN (and poisons the result)."""
    low, high = (0.0, None) if entropy_clip is None else entropy_clip
    if entropy_nGT.dtype == buffer_nGT.dtype:
        torch.clamp(entropy_nGT, min=low, max=high, out=buffer_nGT)
    else:  # e.g. bf16 entropies into a float32 buffer: clamp's out= does not convert
        buffer_nGT.copy_(entropy_nGT).clamp_(min=low, max=high)
    all_ones_where_valid = bits_scratch_nGT.copy_(mask_nGT.view(torch.uint8)).neg_()  # -1 = every bit set
    bits_nGT = buffer_nGT.view(bits_scratch_nGT.dtype)
    torch.bitwise_and(bits_nGT, all_ones_where_valid, out=bits_nGT)
    return buffer_nGT


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
    N, G, T = entropy_NGT.shape
    lengths_NG = torch.empty((N, G), dtype=dtype, device=entropy_NGT.device)
    entropy_sum_NG = torch.empty_like(lengths_NG)
    blocks = _prompt_blocks(N, G * T, entropy_NGT.device)
    scratch_nGT = _scratch(blocks, (G, T), dtype, entropy_NGT.device)
    bits_scratch_nGT = _scratch(blocks, (G, T), _SAME_WIDTH_INT[dtype], entropy_NGT.device)
    for block in blocks:
        size = block.stop - block.start
        buffer_nGT = scratch_nGT[:size]
        torch.sum(_write_float_mask(buffer_nGT, mask_NGT[block]), dim=-1, out=lengths_NG[block])
        masked_entropy_nGT = _write_masked_entropy(buffer_nGT, entropy_NGT[block], mask_NGT[block], entropy_clip,
                                                   bits_scratch_nGT[:size])
        torch.sum(masked_entropy_nGT, dim=-1, out=entropy_sum_NG[block])
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
    sign_k = +1 / -1) has on each valid token t the shaped reward  sign_k * (alpha1 + bonus_NGT[n, g, t]),
    with the entropy bonus
        O+: alpha2 * H_{g,t} / (sum_{O+} H_t + eps) * d_t
        O-: alpha2 * (1/(H_{g,t} + eps)) / (sum_{O-} 1/(H_t + eps) + eps) * h_t
    """

    bonus_NGT: torch.Tensor  # 0 at padding; the buffer becomes the caller's output
    blocks: list[slice]
    type_onehot_NG2: torch.Tensor  # float one-hot of the type of each response
    # Per prompt and type: number of valid tokens, sum of the bonus over them, sum of the squared bonus.
    moments_N32: torch.Tensor


def _gtpo_shaping(rewards_NG, entropy_NGT, mask_NGT, *, alpha2, entropy_clip, eps) -> _GTPOShaping:
    dtype, device = _compute_dtype(entropy_NGT), entropy_NGT.device
    N, G, T = entropy_NGT.shape
    correct_NG1 = (rewards_NG == 1).unsqueeze(-1).to(dtype)
    failed_NG1 = 1 - correct_NG1
    type_onehot_NG2 = torch.cat([correct_NG1, failed_NG1], dim=-1)
    type_onehot_N2G = type_onehot_NG2.transpose(1, 2)
    bonus_NGT = torch.empty((N, G, T), dtype=dtype, device=device)
    moments_N32 = torch.empty((N, 3, 2), dtype=dtype, device=device)
    blocks = _prompt_blocks(N, G * T, device)
    float_mask_scratch = _scratch(blocks, (G, T), dtype, device)
    inverse_scratch = _scratch(blocks, (G, T), dtype, device)
    bits_scratch = _scratch(blocks, (G, T), _SAME_WIDTH_INT[dtype], device)
    for block in blocks:
        size = block.stop - block.start
        onehot_n2G, onehot_nG2 = type_onehot_N2G[block], type_onehot_NG2[block]
        float_mask_nGT = _write_float_mask(float_mask_scratch[:size], mask_NGT[block])
        # Sums over the G responses of one type at each position are [n, 2, G] x [n, G, T] batched products.
        active_count_n2T = torch.bmm(onehot_n2G, float_mask_nGT)  # d_t and h_t
        # Successful tokens weigh their entropy, failed ones its inverse (confident mistakes weigh more);
        # padding weighs 0, so a response shorter than t adds 0 to every sum at position t.
        weight_nGT = _write_masked_entropy(bonus_NGT[block], entropy_NGT[block], mask_NGT[block], entropy_clip,
                                           bits_scratch[:size])
        inverse_nGT = torch.add(weight_nGT, eps, out=inverse_scratch[:size]).reciprocal_().mul_(float_mask_nGT)
        # Row select by exact arithmetic (x * 1 + y * 0 = x for finite x, y; a NaN entropy stays NaN).
        weight_nGT.mul_(correct_NG1[block]).addcmul_(inverse_nGT, failed_NG1[block])
        weight_sum_n2T = torch.bmm(onehot_n2G, weight_nGT)
        bonus_coef_n2T = weight_sum_n2T.add_(eps).reciprocal_().mul_(active_count_n2T).mul_(alpha2)
        # Each row takes its type's coefficient: [n, G, 2] x [n, 2, T] (exact, one of the two terms is 0).
        bonus_nGT = weight_nGT.mul_(torch.bmm(onehot_nG2, bonus_coef_n2T, out=inverse_scratch[:size]))
        # Moments per response, then per type: [n, 2, G] x [n, G, 1]. The sum of squares per response is a
        # batched dot product ([n*G, 1, T] x [n*G, T, 1]), which reads the bonus once.
        torch.sum(active_count_n2T, dim=-1, out=moments_N32[block, 0])
        torch.bmm(onehot_n2G, bonus_nGT.sum(dim=-1, keepdim=True), out=moments_N32[block, 1].unsqueeze(-1))
        rows_R1T = bonus_nGT.view(size * G, 1, T)
        bonus_sq_nG1 = torch.bmm(rows_R1T, rows_R1T.transpose(1, 2)).view(size, G, 1)
        torch.bmm(onehot_n2G, bonus_sq_nG1, out=moments_N32[block, 2].unsqueeze(-1))
    return _GTPOShaping(bonus_NGT, blocks, type_onehot_NG2, moments_N32)


def _affine_in_bonus(shaping: _GTPOShaping, slope_NG1, intercept_NG1, mask_NGT) -> torch.Tensor:
    """Turns shaping.bonus_NGT, in place, into slope[n, g] * bonus[n, g, t] + intercept[n, g] on valid tokens
    and 0 at padding (where the bonus is already 0); returns it."""
    bonus_NGT = shaping.bonus_NGT
    float_mask_scratch = _scratch(shaping.blocks, bonus_NGT.shape[1:], bonus_NGT.dtype, bonus_NGT.device)
    for block in shaping.blocks:
        float_mask_nGT = _write_float_mask(float_mask_scratch[:block.stop - block.start], mask_NGT[block])
        bonus_NGT[block].mul_(slope_NG1[block]).addcmul_(float_mask_nGT, intercept_NG1[block])
    return bonus_NGT


_TYPE_SIGN_12 = (1.0, -1.0)  # successful tokens carry +(alpha1 + bonus), failed ones -(alpha1 + bonus)


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
    """GTPO's shaped token rewards, rpos on successful responses and rneg on failed ones, 0 at padding.

    With d_t (h_t) the number of successful (failed) responses that have a token at position t:
        successful i: rpos_{i,t} = alpha1 * r_i + alpha2 * H_{i,t} / (sum_{k in O+} H_{k,t} + eps) * d_t
        failed j:     rneg_{j,t} = -alpha1
                                   - alpha2 * (1/(H_{j,t} + eps)) / (sum_{k in O-} 1/(H_{k,t} + eps) + eps) * h_t
    The sums run over the responses that have a token at t (shorter ones contribute 0). rpos and rneg live on
    disjoint tokens, so one [N, G, T] tensor holds both. rewards_NG must be exactly 0 or 1.
    """
    _check_shaping_inputs(rewards_NG, entropy_NGT, mask_NGT, entropy_clip, eps)
    shaping = _gtpo_shaping(rewards_NG, entropy_NGT, mask_NGT, alpha2=alpha2, entropy_clip=entropy_clip, eps=eps)
    sign_21 = torch.tensor(_TYPE_SIGN_12, dtype=shaping.bonus_NGT.dtype, device=rewards_NG.device).view(2, 1)
    sign_NG1 = shaping.type_onehot_NG2 @ sign_21
    return _affine_in_bonus(shaping, sign_NG1, alpha1 * sign_NG1, mask_NGT)


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

    rpos/rneg are gtpo_token_rewards. Rpos (Rneg) is the set of rpos (rneg) values over ALL valid tokens in
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
    dtype = shaping.bonus_NGT.dtype

    # Per-type moments over the scope, combined in float64: token count, sum of bonus, sum of squared bonus.
    moments_N32 = shaping.moments_N32.double()
    moments_S32 = moments_N32.sum(dim=0, keepdim=True) if norm_scope == "batch" else moments_N32
    count_S2, bonus_sum_S2, bonus_sq_sum_S2 = moments_S32.unbind(dim=1)
    sign_12 = torch.tensor(_TYPE_SIGN_12, dtype=torch.float64, device=rewards_NG.device).view(1, 2)
    tokens_S1 = count_S2.sum(dim=1, keepdim=True)  # all valid tokens in scope, both types
    # Mean of the signed rewards over all valid tokens (the other type's tokens add zeros).
    mean_S2 = sign_12 * (alpha1 * count_S2 + bonus_sum_S2) / tokens_S1.clamp(min=1)
    # Deviation of a type-k token from the mean, in units of its magnitude: offset_k + bonus.
    offset_S2 = alpha1 - sign_12 * mean_S2
    centered_sum_sq_S2 = (count_S2 * offset_S2.square() + 2 * offset_S2 * bonus_sum_S2 + bonus_sq_sum_S2
                          + (tokens_S1 - count_S2) * mean_S2.square())
    scale_S2 = sign_12 / (_bessel_std(centered_sum_sq_S2, tokens_S1) + eps)

    # Per token: A = scale_k * bonus + scale_k * offset_k.
    onehot_NG2 = shaping.type_onehot_NG2.double()
    slope_NG1 = (onehot_NG2 @ scale_S2.unsqueeze(-1)).to(dtype)
    intercept_NG1 = (onehot_NG2 @ (scale_S2 * offset_S2).unsqueeze(-1)).to(dtype)
    return _affine_in_bonus(shaping, slope_NG1, intercept_NG1, mask_NGT)
