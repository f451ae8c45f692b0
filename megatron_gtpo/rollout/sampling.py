"""Next-token sampling from last-position logits: temperature, top-k, top-p, greedy; with the sampled tokens'
log-probs under the distribution they were drawn from (the convention of rollout/engine.py).

Top-k / top-p keep the tokens distributed/truncation.py defines (vLLM's selection, ties by id), found by the same
code as the trainer's log-prob op, so that both sides renormalise over the same kept set. Why this takes the FULL
vocabulary [B, V] and not a vocab-parallel shard: the trainer's op finds the kept sets without gathering the
vocabulary because it scores [tokens, V] at once; here megatron's output layer all-gathers the logits of the LAST
position only (`runtime_gather_output=True`, which megatron's inference path requires anyway): B x V floats per
decoded token, small next to the forward pass that reads every weight once per step, and no collective per step
besides. vLLM makes the same choice (its logits processor gathers the vocab shards before sampling). Every TP rank
then holds bit-identical logits; the engine still broadcasts the chosen tokens from one rank so that no two ranks can
disagree.
"""
from __future__ import annotations

import functools

import torch

from megatron_gtpo.distributed.truncation import Truncation, kept_sets


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def sampling_log_probs(logits_BV: torch.Tensor, *, vocab_size: int, temperature: float,
                       truncation: Truncation) -> torch.Tensor:
    """[B, vocab_size] log-probs of the distribution sampled from: softmax(logits / temperature) renormalised over
    the kept set of `truncation` (distributed/truncation.py), -inf outside it; float32 (float64 for float64 logits).
    `logits_BV`: [B, V_padded], the columns >= vocab_size padding."""
    scaled_BV = logits_BV[:, :vocab_size].to(_compute_dtype(logits_BV.dtype)) / temperature
    if not truncation.truncates(vocab_size):
        return torch.log_softmax(scaled_BV, dim=-1)
    max_B = scaled_BV.amax(-1)
    kept = kept_sets(logits_BV, truncation, vocab_size=vocab_size, num_valid=vocab_size, temperature=temperature,
                     max_T=max_B, sum_exp_T=torch.exp(scaled_BV - max_B[:, None]).sum(-1), tp_group=None,
                     chunk=max(1, logits_BV.shape[0]))
    return (scaled_BV - kept.log_mass_T[:, None]).masked_fill_(~kept.mask(scaled_BV), -torch.inf)


def sample_next_tokens(logits_BV: torch.Tensor, *, vocab_size: int, temperature: float, top_k: int = 0,
                       top_p: float = 1.0, stream_keys_B: torch.Tensor | None = None,
                       draws_B: torch.Tensor | None = None):
    """Sample one token per row.

    Args:
        logits_BV: [B, V_padded] last-position logits over the whole (possibly padded) vocabulary, any float dtype.
        vocab_size: the true vocabulary; columns >= vocab_size are padding and are never sampled.
        temperature: > 0 samples from softmax(logits / temperature) restricted by top_k / top_p (then
            renormalised: `sampling_log_probs`); 0 is greedy (argmax, ties to the lowest id).
        stream_keys_B, draws_B: int64 [B] on logits_BV's device, needed when sampling: row b's random numbers are
            a function of (stream_keys_B[b], draws_B[b]) only (`counter_uniform`): the key of the row's own random
            stream (`stream_keys` of its seed) and the index of this draw in it (the built-in engine: the
            response's seed and the index of the token in the response). A row's token therefore depends on its
            logits, seed and draw index, not on the other rows.

    Returns:
        (tokens_B int64, logprobs_B float32 (float64 for float64 logits)): logprobs_B[b] = the log-prob of
        tokens_B[b] under the distribution it was drawn from (`sampling_log_probs`; vLLM's processed log-probs);
        greedy: log softmax(logits[b])[tokens_B[b]] over the true vocabulary, untempered and untruncated.
    """
    if logits_BV.dim() != 2:
        raise ValueError(f"logits_BV must be [B, V], got shape {tuple(logits_BV.shape)}")
    if not 0 < vocab_size <= logits_BV.shape[-1]:
        raise ValueError(f"vocab_size must be in [1, {logits_BV.shape[-1]}] (the logits' width), got {vocab_size}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if temperature == 0:
        logits_BV = logits_BV[:, :vocab_size].to(_compute_dtype(logits_BV.dtype))
        tokens_B = torch.argmax(logits_BV, dim=-1)
        log_probs_BV = torch.log_softmax(logits_BV, dim=-1)
    else:
        if stream_keys_B is None or draws_B is None or stream_keys_B.shape != (logits_BV.shape[0],) or \
                draws_B.shape != stream_keys_B.shape:
            raise ValueError(f"sampling needs stream_keys_B and draws_B of shape [{logits_BV.shape[0]}] (one per "
                             "row)")
        log_probs_BV = sampling_log_probs(logits_BV, vocab_size=vocab_size, temperature=temperature,
                                          truncation=Truncation(top_k, top_p))
        probs_BV = torch.exp(log_probs_BV)
        # argmax p / E with E = -log U ~ Exp(1) i.i.d. draws token v with probability p_v (the exponential race):
        # all rows in a constant number of kernels, no host synchronisation, and filtered-out tokens (p = 0) never
        # win, as U < 1 makes E > 0.
        race_BV = counter_uniform(stream_keys_B, draws_B, vocab_size, dtype=probs_BV.dtype).log_().neg_()
        tokens_B = torch.argmax(probs_BV / race_BV, dim=-1)
    return tokens_B, log_probs_BV.gather(-1, tokens_B.unsqueeze(-1)).squeeze(-1)


_LOW32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (shift-xor-multiply; constants of C. Wellons' hash-prospector search) of
    int64 values in [0, 2**32). The multipliers are < 2**31, so no product overflows int64 (no wraparound is relied
    on), and every step keeps the values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _LOW32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _LOW32
    return x ^ (x >> 15)


def stream_keys(seeds_B: torch.Tensor) -> torch.Tensor:
    """The 32-bit keys (int64 in [0, 2**32)) of the random streams of `seeds_B` (int64 seeds of any value), for
    `counter_uniform`: a hash of each seed's two 32-bit halves, computed once per stream, not per draw."""
    seed_B = seeds_B.long()
    return _mix32(_mix32(seed_B & _LOW32) ^ ((seed_B >> 32) & _LOW32))


def counter_uniform(stream_keys_B: torch.Tensor, draws_B: torch.Tensor, width: int, *,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, width] uniform random numbers in (0, 1), counter-based: entry [b, v] is a fixed function of
    (stream_keys_B[b], draws_B[b], v) (a hash of the three; draws >= 0), computed with integer tensor ops on the
    inputs' device: no generator state, a constant number of kernels for any B, and the same numbers on every
    device. Values are multiples of 2**-24 offset by 2**-25 (24 random bits: exact in float32, never 0 or 1)."""
    row_key_B = _mix32(stream_keys_B ^ (draws_B.long() & _LOW32))
    bits_BV = _mix32(row_key_B[:, None] ^ _column_keys(width, stream_keys_B.device)[None, :]) >> 8
    return (bits_BV.to(dtype) + 0.5) * 2.0 ** -24


@functools.lru_cache(maxsize=4)
def _column_keys(width: int, device: torch.device) -> torch.Tensor:
    """The hashes of the token ids 0..width-1, kept: a decode step would otherwise recompute them (11 kernels)."""
    return _mix32(torch.arange(width, device=device))
