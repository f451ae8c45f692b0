"""Per-token log-prob of a target id and full-vocabulary entropy from vocab-sharded logits.

Tensor parallelism splits the output layer's vocabulary: TP rank r holds the logits of the contiguous global ids
[r * V_local, (r + 1) * V_local). This op never gathers those shards. Each rank reduces its shard to a few scalars
per token and the TP group all-reduces only those, so the communication is O(tokens), not O(tokens x vocab):

    z = logits / temperature                       (global ids >= vocab_size do not exist: they are sliced off)
    m_r = max_v z_v,   S_r = sum_v exp(z_v - m_r),   A_r = sum_v exp(z_v - m_r) (z_v - m_r)     (local, per rank)
    m = max_r m_r                                                                  (all-reduce MAX, one per token)
    S = sum_r S_r e^(m_r - m),   A = sum_r e^(m_r - m) (A_r + S_r (m_r - m)),   z_target   (one all-reduce SUM)
    log Z = m + log S,   E_p[z] = m + A / S
    logprob = z_target - log Z,   entropy = log Z - E_p[z] = log S - A / S

Each rank's statistics are taken against its own maximum, so a chunk of tokens is reduced in a single sweep while
it is in cache and the two all-reduces run once per call, after the sweep, whatever the chunk size.

Backward needs no communication: with p = softmax(z) over the whole vocabulary and g_lp, g_H the incoming
gradients of the two outputs,

    d logprob / d z_v = 1[v = target] - p_v,        d entropy / d z_v = -p_v (z_v - E_p[z])
    d / d logits_v = (1 / temperature) (g_lp 1[v = target] - p_v (g_lp + g_H (z_v - E_p[z])))

and p_v = exp(z_v - log Z), z_v - E_p[z] = (z_v - log Z) + entropy are local to the rank given the saved
per-token log Z and entropy. Backward recomputes them chunk by chunk from the input it keeps a reference to.

Truncated sampling (`truncation`: top-k and/or top-p, distributed/truncation.py): the log-prob of the target t is
that of the truncated, renormalised distribution the engine sampled from, over the kept set K (found per token from
a few all-gathered candidates per rank, never the vocabulary) and t itself:

    logprob = z_t - log sum_{v in K u {t}} exp(z_v)

t is always in K when the same logits sampled it; adding it otherwise (logits of other kernels or weights moved the
boundary, or the KL reference's own kept set) keeps every log-prob finite, and equal to the value in K where t
crosses the boundary. K is a selection: the gradient treats it as fixed, d logprob / d z_v = 1[v = t] - q_v with q
the renormalised distribution (0 outside K u {t}). The entropy stays that of the full distribution
(docs/algorithms.md, "Truncated sampling"). Backward recomputes K's mask from the two per-token numbers that
describe it (KeptSets).

Layout: megatron-core's output layer produces [s, b, V_local] (any leading dims work; they are flattened). Under
sequence parallelism megatron's output ColumnParallelLinear all-gathers the sequence before the vocab projection, so
every TP rank sees the full [s, b, V_local] and passes the same full [s, b] targets; nothing changes here.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .truncation import KeptSets, Truncation, kept_sets, scaled_logits


def _compute_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 are accumulated in fp32; float64 stays float64 (gradcheck needs it).
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


def _shifted_chunk(logits_chunk_CV, shift_C, temperature: float, out_CV: torch.Tensor) -> torch.Tensor:
    """out = logits / temperature - shift (per row), in out's (compute) dtype, converting before dividing so that
    bf16 is never divided in bf16. Returns out."""
    if logits_chunk_CV.dtype == out_CV.dtype and temperature == 1.0:
        return torch.sub(logits_chunk_CV, shift_C.unsqueeze(-1), out=out_CV)
    if logits_chunk_CV.dtype == out_CV.dtype:
        torch.div(logits_chunk_CV, temperature, out=out_CV)
    else:
        out_CV.copy_(logits_chunk_CV)
        if temperature != 1.0:
            out_CV.div_(temperature)
    return out_CV.sub_(shift_C.unsqueeze(-1))


def _chunk_max(logits_chunk_CV, temperature: float, compute_dtype) -> torch.Tensor:
    # fl(x / t) is monotone in x, so max_v fl(x_v / t) == fl(max_v x_v / t): no scaled copy is needed for the max.
    return torch.amax(logits_chunk_CV, dim=-1).to(compute_dtype) / temperature


WORKSPACE_BYTES_PER_ELEMENT = 4  # the compute dtype of bf16 / fp16 / fp32 logits is fp32


def chunk_tokens_for_budget(workspace_bytes: float, vocab_local: int) -> int:
    """Tokens per chunk such that the op's two fp32 [chunk, V_local] workspaces fit in `workspace_bytes` (at least
    one token). Unchunked, a 6k-token micro-batch of Qwen2.5 (V = 152k) at TP=1 needs 7.5 GB of them."""
    if workspace_bytes <= 0:
        raise ValueError(f"the log-prob workspace budget must be positive, got {workspace_bytes} bytes")
    return max(1, int(workspace_bytes // (2 * vocab_local * WORKSPACE_BYTES_PER_ELEMENT)))


class _VocabParallelLogprobsEntropy(torch.autograd.Function):
    """Autograd core of `vocab_parallel_logprobs_and_entropy` on flattened, validated inputs.

    Saved for backward: the input `logits_TV` itself (a reference, no copy), `targets_T`, and two per-token
    scalars in the compute dtype (log Z and the entropy, [T] each), three more with a truncation (the kept set's
    threshold and tie columns, and its log-mass with the target). Softmax is recomputed chunk by chunk in
    backward. Forward and backward each allocate two [chunk, V_local] compute-dtype workspaces (besides the
    gradient that backward returns), freed when they return; a truncation adds its own (distributed/truncation.py)
    and a third, with a bool mask, in backward.
    """

    @staticmethod
    def forward(ctx, logits_TV, targets_T, tp_group, tp_rank, vocab_size, temperature, chunk_size, truncation):
        num_tokens, vocab_local = logits_TV.shape
        compute_dtype = _compute_dtype(logits_TV.dtype)
        device = logits_TV.device
        vocab_start = tp_rank * vocab_local
        # Columns of this shard that hold real ids; the rest is padding and is sliced away, not masked.
        num_valid = min(max(vocab_size - vocab_start, 0), vocab_local)
        chunk = max(1, num_tokens if chunk_size is None else min(chunk_size, num_tokens))

        local_max_T = torch.full((num_tokens,), -math.inf, dtype=compute_dtype, device=device)
        local_sum_exp_T = torch.zeros(num_tokens, dtype=compute_dtype, device=device)
        local_sum_exp_shift_T = torch.zeros(num_tokens, dtype=compute_dtype, device=device)
        if num_valid > 0 and num_tokens > 0:
            shifted_CV = torch.empty(chunk, num_valid, dtype=compute_dtype, device=device)
            exp_CV = torch.empty(chunk, num_valid, dtype=compute_dtype, device=device)
            for start in range(0, num_tokens, chunk):
                stop = min(start + chunk, num_tokens)
                n = stop - start
                logits_CV = logits_TV[start:stop, :num_valid]
                local_max_T[start:stop] = _chunk_max(logits_CV, temperature, compute_dtype)
                d_CV = _shifted_chunk(logits_CV, local_max_T[start:stop], temperature, shifted_CV[:n])
                e_CV = torch.exp(d_CV, out=exp_CV[:n])
                torch.sum(e_CV, dim=-1, out=local_sum_exp_T[start:stop])
                torch.sum(e_CV.mul_(d_CV), dim=-1, out=local_sum_exp_shift_T[start:stop])
            del shifted_CV, exp_CV

        target_col_T, owns_target_T = _local_target_columns(targets_T, vocab_start, num_valid)
        target_z_T = logits_TV.gather(1, target_col_T.unsqueeze(1)).squeeze(1).to(compute_dtype) / temperature
        target_z_T = torch.where(owns_target_T, target_z_T, 0.0)

        global_max_T = local_max_T.clone()
        if tp_group is not None:
            dist.all_reduce(global_max_T, op=dist.ReduceOp.MAX, group=tp_group)
        if num_valid > 0:
            shift_T = local_max_T - global_max_T
            scale_T = torch.exp(shift_T)
            sums_3T = torch.stack([local_sum_exp_T * scale_T,
                                   scale_T * (local_sum_exp_shift_T + local_sum_exp_T * shift_T),
                                   target_z_T])
        else:  # this rank is all padding: it contributes nothing (and must not turn 0 * -inf into NaN)
            sums_3T = torch.stack([local_sum_exp_T, local_sum_exp_shift_T, target_z_T])
        if tp_group is not None:
            dist.all_reduce(sums_3T, op=dist.ReduceOp.SUM, group=tp_group)
        sum_exp_T, sum_exp_shift_T, target_z_T = sums_3T.unbind(0)

        log_sum_exp_T = torch.log(sum_exp_T)
        log_normalizer_T = global_max_T + log_sum_exp_T
        entropy_T = log_sum_exp_T - sum_exp_shift_T / sum_exp_T
        logprobs_T = target_z_T - log_normalizer_T
        # Out-of-range targets (reachable only with check_targets=False) are owned by no rank: make them loud.
        in_range_T = (targets_T >= 0) & (targets_T < vocab_size)
        kept = log_kept_T = None
        if truncation is not None:
            kept = kept_sets(logits_TV, truncation, vocab_size=vocab_size, num_valid=num_valid,
                             temperature=temperature, max_T=global_max_T, sum_exp_T=sum_exp_T, tp_group=tp_group,
                             chunk=chunk)
            log_kept_T = _log_kept_with_target(kept, target_z_T, target_col_T, owns_target_T, tp_group)
            logprobs_T = target_z_T - log_kept_T
        logprobs_T = torch.where(in_range_T, logprobs_T, math.nan)

        # A copy of the entropy ([T]), not the output itself: callers may modify the outputs in place.
        ctx.save_for_backward(logits_TV, targets_T, log_normalizer_T, entropy_T.clone(),
                              *((kept.threshold_T, kept.tie_columns_T, log_kept_T) if kept else ()))
        ctx.truncated = kept is not None
        ctx.vocab_start, ctx.num_valid = vocab_start, num_valid
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        return logprobs_T, entropy_T

    @staticmethod
    @once_differentiable  # the backward is hand-written, not itself differentiable: say so instead of being wrong
    def backward(ctx, grad_logprobs_T, grad_entropy_T):
        none_for_args = (None,) * 7
        if grad_logprobs_T is None and grad_entropy_T is None:
            return (None,) + none_for_args
        logits_TV, targets_T, log_normalizer_T, entropy_T, *truncated = ctx.saved_tensors
        num_tokens, vocab_local = logits_TV.shape
        num_valid, temperature, chunk = ctx.num_valid, ctx.temperature, ctx.chunk
        compute_dtype = log_normalizer_T.dtype
        device = logits_TV.device

        grad_logits_TV = torch.empty_like(logits_TV)
        grad_logits_TV[:, num_valid:] = 0.0  # padding ids do not exist: zero gradient
        if num_valid == 0 or num_tokens == 0:
            return (grad_logits_TV,) + none_for_args
        if ctx.truncated:
            _truncated_backward(grad_logits_TV, logits_TV, targets_T, grad_logprobs_T, grad_entropy_T,
                                log_normalizer_T, entropy_T, KeptSets(*truncated), ctx)
            return (grad_logits_TV,) + none_for_args

        # With ls_v = z_v - log Z (so p_v = exp(ls_v) and z_v - E_p[z] = ls_v + H), the gradient is
        #   d/d logits_v = p_v (a + s ls_v) + [v = target] c,   a = -(g_lp + g_H H) / t,  s = -g_H / t,  c = g_lp / t.
        inv_t = 1.0 / temperature
        zeros_T = torch.zeros(num_tokens, dtype=compute_dtype, device=device)
        g_lp_T = grad_logprobs_T.to(compute_dtype) if grad_logprobs_T is not None else zeros_T
        coef_const_T = -inv_t * g_lp_T
        coef_slope_T = None
        if grad_entropy_T is not None:
            coef_slope_T = -inv_t * grad_entropy_T.to(compute_dtype)
            coef_const_T = coef_const_T + coef_slope_T * entropy_T
        if grad_logprobs_T is not None:
            target_col_T, owns_target_T = _local_target_columns(targets_T, ctx.vocab_start, num_valid)
            target_add_T = torch.where(owns_target_T, inv_t * g_lp_T, 0.0)
            row_index_C = torch.arange(chunk, device=device)

        writes_in_place = logits_TV.dtype == compute_dtype
        prob_CV = torch.empty(chunk, num_valid, dtype=compute_dtype, device=device)
        coef_CV = torch.empty(chunk, num_valid, dtype=compute_dtype, device=device) if coef_slope_T is not None \
            else None
        for start in range(0, num_tokens, chunk):
            stop = min(start + chunk, num_tokens)
            n = stop - start
            grad_CV = grad_logits_TV[start:stop, :num_valid]
            p_CV = _shifted_chunk(logits_TV[start:stop, :num_valid], log_normalizer_T[start:stop], temperature,
                                  prob_CV[:n])  # ls for now
            coef_C1 = coef_const_T[start:stop].unsqueeze(-1)
            if coef_slope_T is not None:
                coef_C1 = torch.addcmul(coef_C1, p_CV, coef_slope_T[start:stop].unsqueeze(-1), out=coef_CV[:n])
            p_CV.exp_()
            # fp32 results go straight into the gradient; others are finished in fp32 and rounded once.
            out_CV = torch.mul(p_CV, coef_C1, out=grad_CV if writes_in_place else p_CV)
            if grad_logprobs_T is not None:
                out_CV.index_put_((row_index_C[:n], target_col_T[start:stop]), target_add_T[start:stop],
                                  accumulate=True)
            if not writes_in_place:
                grad_CV.copy_(out_CV)
        return (grad_logits_TV,) + none_for_args


def _log_kept_with_target(kept: KeptSets, target_z_T, target_col_T, owns_target_T, tp_group) -> torch.Tensor:
    """log sum_{K u {t}} exp(z) per token: the kept set's log-mass, with the target's exp(z_t) added where the
    target is not kept (its owner decides; one all-reduce of a flag per token)."""
    threshold_T = kept.threshold_T
    kept_T = owns_target_T & ((target_z_T > threshold_T) | ((target_z_T == threshold_T)
                                                          & (target_col_T < kept.tie_columns_T)))
    kept_T = kept_T.to(threshold_T.dtype)
    if tp_group is not None:
        dist.all_reduce(kept_T, group=tp_group)
    return torch.where(kept_T > 0, kept.log_mass_T, torch.logaddexp(kept.log_mass_T, target_z_T))


def _truncated_backward(grad_logits_TV, logits_TV, targets_T, grad_logprobs_T, grad_entropy_T, log_normalizer_T,
                        entropy_T, kept: KeptSets, ctx) -> None:
    """Fills grad_logits_TV[:, :num_valid] under a truncation (module doc), chunk by chunk: with q the renormalised
    distribution over K u {t} (exp(z - log-mass with the target), 0 elsewhere) and p the full one,
        d / d logits_v = (1 / T) (g_lp (1[v = t] - q_v) - g_H p_v (z_v - log Z + H))."""
    num_tokens = logits_TV.shape[0]
    num_valid, temperature, chunk = ctx.num_valid, ctx.temperature, ctx.chunk
    compute_dtype, device = log_normalizer_T.dtype, logits_TV.device
    inv_t = 1.0 / temperature
    log_kept_T = kept.log_mass_T
    target_col_T, owns_target_T = _local_target_columns(targets_T, ctx.vocab_start, num_valid)
    row_index_C = torch.arange(chunk, device=device)
    z_CV = torch.empty(chunk, num_valid, dtype=compute_dtype, device=device)
    work_CV = torch.empty_like(z_CV)
    out_CV = torch.empty_like(z_CV)
    for start in range(0, num_tokens, chunk):
        stop = min(start + chunk, num_tokens)
        n, rows = stop - start, slice(start, stop)
        z = scaled_logits(logits_TV[rows, :num_valid], temperature, z_CV[:n])
        out = out_CV[:n].zero_()
        if grad_logprobs_T is not None:
            keep_CV = kept.mask(z, rows)
            targets = (row_index_C[:n], target_col_T[rows])
            keep_CV.index_put_(targets, keep_CV[targets] | owns_target_T[rows])  # the target is always in
            q = torch.exp(torch.sub(z, log_kept_T[rows, None], out=work_CV[:n]), out=work_CV[:n])
            g_lp_C1 = grad_logprobs_T[rows].to(compute_dtype)[:, None]
            torch.mul(q.masked_fill_(~keep_CV, 0.0), g_lp_C1, out=out).neg_()
            out.index_put_(targets, torch.where(owns_target_T[rows], g_lp_C1[:, 0], 0.0), accumulate=True)
        if grad_entropy_T is not None:
            shifted = z.sub_(log_normalizer_T[rows, None])  # log p
            p = torch.exp(shifted, out=work_CV[:n])
            shifted.add_(entropy_T[rows, None]).mul_(p).mul_(grad_entropy_T[rows].to(compute_dtype)[:, None])
            out.sub_(shifted)
        grad_logits_TV[rows, :num_valid] = out.mul_(inv_t)


def _local_target_columns(targets_T, vocab_start: int, num_valid: int):
    """Column of each target inside this shard's valid columns (0 where the shard does not own it) and ownership."""
    local_T = targets_T - vocab_start
    owns_T = (local_T >= 0) & (local_T < num_valid)
    return torch.where(owns_T, local_T, 0), owns_T


def vocab_parallel_logprobs_and_entropy(logits_local, targets, *, tp_group, vocab_size=None, temperature=1.0,
                                        chunk_size=None, check_targets=True, truncation: Truncation | None = None):
    """Target log-probs and full-vocabulary entropies from this TP rank's vocab shard of the logits.

    Args:
        logits_local: [..., V_local] float (fp32, bf16, fp16 or fp64), contiguous. This rank's contiguous vocab
            shard: TP rank r holds global ids [r * V_local, (r + 1) * V_local). megatron-core's output layer gives
            [s, b, V_local]; under sequence parallelism too (the sequence is gathered before the projection).
        targets: [...] integer global token ids, the leading dims of `logits_local`, identical on every TP rank.
        tp_group: the tensor-parallel process group, or None for no tensor parallelism (a world of one). The
            default group is never used implicitly.
        vocab_size: the true vocabulary size; ids >= vocab_size are padding and are excluded exactly (they get
            zero probability and zero gradient). Default V_local * TP (no padding).
        temperature: z = logits / temperature, applied to both outputs (> 0).
        chunk_size: tokens processed at a time; None processes all tokens at once. With a chunk of C tokens the
            extra memory beyond the input shard is two [C, V_local] compute-dtype workspaces in forward and in
            backward, plus O(T) per-token scalars (and the gradient backward returns). On CPU small chunks (4-16)
            are also the fastest, because each chunk's passes stay in cache; on a GPU pick the largest chunk the
            memory budget allows (each chunk costs a handful of kernel launches).
        truncation: top-k / top-p of the sampling (distributed/truncation.Truncation; None or one that keeps every
            id: none): the log-probs are those of the truncated, renormalised distribution, over the kept set and
            the target (module doc); the entropy is the full distribution's either way.
        check_targets: raise ValueError unless 0 <= targets < vocab_size. The check is a min/max over the [T]
            target ids on this rank (no communication) but on an accelerator it is one host synchronisation, so
            hot paths whose ids come from the tokenizer may pass False; out-of-range targets then yield NaN
            log-probs (detectable without a sync) instead of an error.

    Returns:
        (logprobs, entropy): shaped like `targets`, float32 (float64 for float64 logits). logprobs[i] =
        log softmax(z_i)[targets[i]] (under a truncation: over the kept set and the target), entropy[i] =
        -sum_v p_iv log p_iv over the vocab_size real ids. Both are differentiable w.r.t. `logits_local` (the kept
        set held fixed); the gradient has its dtype. Backward does no communication.

    Memory: autograd keeps a reference to `logits_local` (no copy), `targets`, and two [T] compute-dtype
    per-token scalars (five with a truncation); no [T, V_local] float32 buffer is kept between forward and backward.
    Logits must be finite (as an output layer produces them); padding is handled by slicing, not by -inf.
    """
    if not isinstance(logits_local, torch.Tensor) or not logits_local.is_floating_point() or logits_local.dim() < 1:
        raise ValueError(f"logits_local must be a floating-point tensor [..., V_local], got "
                         f"{type(logits_local).__name__} {getattr(logits_local, 'dtype', '')} "
                         f"{tuple(getattr(logits_local, 'shape', ()))}")
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.is_complex() \
            or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor of token ids, got {getattr(targets, 'dtype', targets)}")
    if tuple(targets.shape) != tuple(logits_local.shape[:-1]):
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal the leading dims of logits_local "
                         f"{tuple(logits_local.shape)}, i.e. {tuple(logits_local.shape[:-1])}")
    if targets.device != logits_local.device:
        raise ValueError(f"targets are on {targets.device} but logits_local is on {logits_local.device}")
    if not logits_local.is_contiguous():
        raise ValueError(f"logits_local must be contiguous (strides {logits_local.stride()} for shape "
                         f"{tuple(logits_local.shape)}); copying it here would double its memory, so call "
                         f".contiguous() where the copy is intended")
    vocab_local = logits_local.shape[-1]
    if vocab_local == 0:
        raise ValueError("logits_local has an empty vocab dim (V_local = 0)")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size <= 0):
        raise ValueError(f"chunk_size must be None or an int > 0, got {chunk_size!r}")
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    if tp_rank < 0:
        raise ValueError("this process is not a member of tp_group")
    padded_vocab = vocab_local * tp_size
    if vocab_size is None:
        vocab_size = padded_vocab
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= padded_vocab:
        raise ValueError(f"vocab_size must be an int in [1, V_local * TP = {vocab_local} * {tp_size} = "
                         f"{padded_vocab}], got {vocab_size!r}")
    if truncation is not None and not isinstance(truncation, Truncation):
        raise ValueError(f"truncation must be a Truncation or None, got {type(truncation).__name__}")
    if truncation is not None and not truncation.truncates(vocab_size):
        truncation = None
    if check_targets and targets.numel() > 0:
        low, high = torch.aminmax(targets)
        if bool(low < 0) or bool(high >= vocab_size):  # one host sync on an accelerator; see check_targets
            raise ValueError(f"targets must be token ids in [0, vocab_size={vocab_size}), got values in "
                             f"[{int(low)}, {int(high)}]")

    logprobs_T, entropy_T = _VocabParallelLogprobsEntropy.apply(
        logits_local.view(-1, vocab_local), targets.reshape(-1),
        tp_group if tp_size > 1 else None, tp_rank, vocab_size, float(temperature), chunk_size, truncation)
    return logprobs_T.view(targets.shape), entropy_T.view(targets.shape)
