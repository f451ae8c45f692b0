"""The kept set of truncated sampling (top-k, top-p) per token, from vocab-sharded logits, without gathering the
vocabulary: what the vocab-parallel log-prob op renormalises over, and what the built-in engine samples from.

The definition (vLLM 0.32's sampler, with the rule for ties of its GPU kernel, docs/algorithms.md "Truncated
sampling"): with z = logits / temperature over the true vocabulary, order the tokens by decreasing z, ties by
increasing token id. Top-k keeps the first k tokens of that order (exactly k, also when several tie at the k-th
value); top-p then keeps the shortest prefix of those survivors whose probability, renormalised over the survivors,
reaches top_p, i.e. a survivor is kept iff the survivors before it in the order hold less than top_p of their mass.
The kept set is thus a prefix of the order, which two numbers per token and rank describe: column v of a rank's shard
is kept iff z_v > threshold, or z_v == threshold and v < tie_columns (a rank keeps its lowest tied ids, and ranks hold
consecutive id ranges, so ties are taken rank after rank).

How the threshold is found, with O(tokens x candidates) communication, never O(tokens x vocabulary):
1. Each rank takes the c largest z of its shard (c = top_k; for top-p alone c = NUCLEUS_CANDIDATES) and the TP group
   all-gathers them: [tokens, TP, c] values. Their c largest are the c largest of the whole vocabulary, in order (a
   token among the global c largest is among its own rank's c largest).
2. With top-k the survivors are those k values, and top-p's prefix is a cumulative sum over them. With top-p alone the
   same cumulative sum runs over the c largest with the whole vocabulary's mass; where they hold less than top_p of
   it, the nucleus is longer than c and that token's threshold comes from the fallback below.
3. The ties at the threshold: the prefix takes (prefix length - candidates above the threshold) of them; each rank's
   count is read from the gathered candidates (a rank whose list ends in ties may hold more, but then it holds at
   least all that are needed, so the split is the same), and each rank keeps its share, lowest columns first, found
   by a running count of its ties (only for tokens whose ties it splits).
Fallback (top-p alone, nucleus longer than c): the threshold is the largest value x with mass(z >= x) >= top_p x mass,
found exactly, 8 bits at a time, as a radix select on the order-preserving integer key of the floats: 4 rounds in
float32 (8 in float64), each one scatter-add of the shard's masses into 256 bins per token and one all-reduce of
[tokens, 256]; then one all-gather of every rank's ties. It runs on those tokens only. (Two simpler searches were
measured first, on CPU at Qwen's vocabulary, 128 flat tokens, interleaved: a bisection on the key with one masked
sum per step (33 steps) took 26-41 s, sorting each shard once and bisecting on running sums 30-35 s, this 4.2-4.8 s.)

Memory, beyond the input: the gathered candidates of `block` tokens at a time (sized to take no more than one
[chunk, V_local] workspace); the tie split one [chunk, V_local] workspace and its running count; the fallback, for a
chunk of tokens, the keys (in z's buffer), the exponentials and one round's digits (int64, as scatter-add takes) and
masses: about five float32 [chunk, V_local] workspaces (benchmarks/results/vocab_parallel.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Candidates per rank and token for top-p without top-k: a nucleus up to this long is found from one all-gather.
NUCLEUS_CANDIDATES = 64


@dataclass(frozen=True)
class Truncation:
    """Sampling truncation after the temperature: top_k (0 = off) then top_p (1 = off), vLLM's order."""

    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")

    def truncates(self, vocab_size: int) -> bool:
        """Whether it removes tokens from a vocabulary of `vocab_size` (top_k >= vocab_size keeps them all)."""
        return 0 < self.top_k < vocab_size or self.top_p < 1


@dataclass(frozen=True)
class KeptSets:
    """Per token, this rank's part of the kept set (module doc) and the kept set's mass."""

    threshold_T: torch.Tensor  # compute dtype: kept iff z > threshold, ...
    tie_columns_T: torch.Tensor  # int64: ... or z == threshold and the shard column < tie_columns
    log_mass_T: torch.Tensor  # compute dtype: log sum over the kept set (whole vocabulary) of exp(z)

    def mask(self, z_CV: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """bool [C, V]: which of the shard columns of `z_CV` (z of tokens `rows`, columns from 0) are kept."""
        threshold_C1 = self.threshold_T[rows].unsqueeze(-1)
        columns_V = torch.arange(z_CV.shape[-1], device=z_CV.device)
        return (z_CV > threshold_C1) | ((z_CV == threshold_C1) & (columns_V < self.tie_columns_T[rows, None]))


def scaled_logits(logits_CV: torch.Tensor, temperature: float, out_CV: torch.Tensor) -> torch.Tensor:
    """out = logits / temperature in out's (compute) dtype, converted before dividing: the one rounding of z that every
    truncation decision is made on (vLLM's: float32 logits divided by the temperature). Returns out."""
    if logits_CV.dtype == out_CV.dtype:
        return torch.div(logits_CV, temperature, out=out_CV)
    out_CV.copy_(logits_CV)
    return out_CV.div_(temperature)


@torch.no_grad()
def kept_sets(logits_TV: torch.Tensor, truncation: Truncation, *, vocab_size: int, num_valid: int,
              temperature: float, max_T: torch.Tensor, sum_exp_T: torch.Tensor, tp_group, chunk: int) -> KeptSets:
    """The kept sets of `truncation` (which must truncate a vocabulary of `vocab_size`) for every token.

    Args:
        logits_TV: [T, V_local] this rank's shard (any float dtype); its first `num_valid` columns are real ids.
        max_T, sum_exp_T: per token, the global max of z and the global sum of exp(z - max), in the compute dtype
            (float64 for float64 logits, else float32), identical on every rank.
        tp_group: the TP group (None: the shard is the whole vocabulary). Collective over it: every rank calls this
            with its shard of the same tokens.
        chunk: tokens per [chunk, V_local] workspace.
    """
    num_tokens, dtype = logits_TV.shape[0], max_T.dtype
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    top_k = truncation.top_k if truncation.top_k < vocab_size else 0
    width = top_k or min(NUCLEUS_CANDIDATES, vocab_size)
    out = KeptSets(torch.empty_like(max_T), torch.empty(num_tokens, dtype=torch.long, device=max_T.device),
                   torch.empty_like(max_T))
    shard = _Shard(logits_TV, num_valid, temperature, dtype, tp_group, chunk)
    block = max(chunk, chunk * logits_TV.shape[1] // (width * tp_size))  # V_local: the same on every rank
    for start in range(0, num_tokens, block):
        rows = slice(start, min(start + block, num_tokens))
        _resolve_block(shard, rows, top_k, truncation.top_p, width, tp_rank, max_T[rows], sum_exp_T[rows], out)
    return out


class _Shard:
    """This rank's logits with what every sweep over them needs."""

    def __init__(self, logits_TV, num_valid, temperature, dtype, tp_group, chunk):
        self.logits_TV, self.num_valid, self.temperature = logits_TV, num_valid, temperature
        self.dtype, self.tp_group, self.chunk = dtype, tp_group, chunk

    def z(self, rows) -> torch.Tensor:
        """[R, num_valid] z of the tokens `rows` (a slice, or an index tensor; R <= chunk)."""
        picked_RV = (self.logits_TV[rows] if isinstance(rows, slice) else self.logits_TV.index_select(0, rows))
        picked_RV = picked_RV[:, :self.num_valid]
        return scaled_logits(picked_RV, self.temperature,
                             torch.empty(picked_RV.shape, dtype=self.dtype, device=picked_RV.device))

    def row_chunks(self, rows_R: torch.Tensor):
        return (rows_R[start:start + self.chunk] for start in range(0, len(rows_R), self.chunk))

    def all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """[TP, *local.shape]: every rank's `local`, in rank order."""
        if self.tp_group is None:
            return local.unsqueeze(0)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.tp_group))]
        dist.all_gather(parts, local.contiguous(), group=self.tp_group)
        return torch.stack(parts)


def _resolve_block(shard: _Shard, rows: slice, top_k: int, top_p: float, width: int, tp_rank: int,
                   max_N: torch.Tensor, sum_exp_N: torch.Tensor, out: KeptSets) -> None:
    """The kept sets of the tokens `rows` (module doc, steps 1-3), written into `out`."""
    device = max_N.device
    rows_N = torch.arange(rows.start, rows.stop, device=device)
    local_NC = _local_candidates(shard, rows, width)
    gathered_NRC = shard.all_gather(local_NC).transpose(0, 1)
    largest_NC = gathered_NRC.reshape(len(rows_N), -1).topk(width, dim=-1).values  # sorted, largest first
    weight_NC = torch.exp(largest_NC - max_N[:, None])  # 0 for the -inf that pad short lists
    real_NC = largest_NC > -math.inf
    unresolved_N = None
    if top_p < 1:
        bound_N = top_p * (weight_NC.sum(-1) if top_k else sum_exp_N)
        inclusive_NC = weight_NC.cumsum(-1)
        exclusive_NC = torch.nn.functional.pad(inclusive_NC[:, :-1], (1, 0))
        kept_N = ((exclusive_NC < bound_N[:, None]) & real_NC).sum(-1)  # >= 1: the first is at mass 0
        if not top_k:  # all c candidates hold less than top_p and more tokens follow: the nucleus is longer
            unresolved_N = (inclusive_NC[:, -1] < bound_N) & real_NC[:, -1]
    else:
        kept_N = real_NC.sum(-1)
    threshold_N = largest_NC.gather(1, (kept_N - 1)[:, None]).squeeze(1)
    ties_needed_N = kept_N - (largest_NC > threshold_N[:, None]).sum(-1)
    mass_N = torch.where(torch.arange(width, device=device) < kept_N[:, None], weight_NC, 0.0).sum(-1)
    ties_NR = (gathered_NRC == threshold_N[:, None, None]).sum(-1)
    may_hold_more_N = local_NC[:, -1] == threshold_N  # this rank's list ends in ties: it may hold more of them
    if unresolved_N is not None and bool(unresolved_N.any()):  # one host sync; identical on every rank
        long_U = unresolved_N.nonzero().squeeze(1)
        threshold_N[long_U], ties_needed_N[long_U], mass_N[long_U], ties_NR[long_U] = _nucleus_fallback(
            shard, rows_N[long_U], max_N[long_U], bound_N[long_U])
        may_hold_more_N[long_U] = False  # the fallback counts every tie
    # This rank's share of the ties: what the ranks before it do not cover, at most what it holds.
    own_N = ties_NR[:, tp_rank]
    share_N = torch.minimum((ties_needed_N - ties_NR[:, :tp_rank].sum(-1)).clamp(min=0), own_N)
    tie_columns_N = torch.where(share_N > 0, shard.num_valid, 0)
    split_N = (share_N > 0) & ((share_N < own_N) | may_hold_more_N)
    if bool(split_N.any()):
        split_S = split_N.nonzero().squeeze(1)
        tie_columns_N[split_S] = _tie_columns(shard, rows_N[split_S], threshold_N[split_S], share_N[split_S])
    out.threshold_T[rows] = threshold_N
    out.tie_columns_T[rows] = tie_columns_N
    out.log_mass_T[rows] = max_N + torch.log(mass_N)


def _local_candidates(shard: _Shard, rows: slice, width: int) -> torch.Tensor:
    """[N, width]: the `width` largest z of this rank's shard per token `rows`, largest first, padded with -inf."""
    local_NC = torch.full((rows.stop - rows.start, width), -math.inf, dtype=shard.dtype,
                          device=shard.logits_TV.device)
    taken = min(width, shard.num_valid)
    if taken:
        for start in range(rows.start, rows.stop, shard.chunk):
            stop = min(start + shard.chunk, rows.stop)
            local_NC[start - rows.start:stop - rows.start, :taken] = \
                shard.z(slice(start, stop)).topk(taken, dim=-1).values
    return local_NC


def _nucleus_fallback(shard: _Shard, rows_U, max_U, bound_U):
    """(threshold, ties needed, kept mass relative to the max, ties per rank [U, TP]) of tokens whose nucleus is
    longer than the candidates: threshold = the largest x with mass(z >= x) >= bound, found digit by digit (8 bits at
    a time, most significant first) of its order-preserving integer key: each round adds the mass of the shard's
    values per next digit among those that share the digits found so far into 256 bins (one scatter-add), all-reduces
    the bins, and takes the largest digit whose mass above, with the mass already above, still reaches the bound."""
    threshold_U = torch.empty_like(max_U)
    above_U = torch.empty_like(max_U)
    ties_UR = []
    bits = torch.finfo(shard.dtype).bits
    for start, rows_R in zip(range(0, len(rows_U), shard.chunk), shard.row_chunks(rows_U)):
        part = slice(start, start + len(rows_R))
        keys_RV = shard.z(rows_R)
        exp_RV = torch.exp(keys_RV - max_U[part, None])
        keys_RV = _order_key_(keys_RV)  # z's buffer becomes its keys: two buffers live, not three
        prefix_R = torch.zeros(len(rows_R), dtype=torch.long, device=rows_R.device)  # the key's digits so far
        above_R = torch.zeros_like(max_U[part])  # the mass of the values whose key is above those digits
        for shift in range(bits - 8, -1, -8):
            if shift == bits - 8:  # the top digit of a two's complement key is signed: -128..127
                mass_RV = exp_RV
                digit_RV = ((keys_RV >> shift) + 128).long()
            else:
                mass_RV = torch.where((keys_RV >> (shift + 8)) == prefix_R[:, None], exp_RV, 0.0)
                digit_RV = ((keys_RV >> shift) & 255).long()
            bins_R256 = torch.zeros(len(rows_R), 256, dtype=shard.dtype, device=rows_R.device)
            bins_R256.scatter_add_(1, digit_RV, mass_RV)
            del digit_RV, mass_RV
            if shard.tp_group is not None:
                dist.all_reduce(bins_R256, group=shard.tp_group)
            at_least_R256 = bins_R256.flip(-1).cumsum(-1).flip(-1)  # mass of the digits >= d
            digit_R = ((above_R[:, None] + at_least_R256 >= bound_U[part, None]).sum(-1) - 1).clamp(min=0)
            above_R += torch.nn.functional.pad(at_least_R256, (0, 1)).gather(1, digit_R[:, None] + 1).squeeze(1)
            prefix_R = (prefix_R << 8) + (digit_R - 128 if shift == bits - 8 else digit_R)
        threshold_U[part] = _from_order_key(prefix_R, shard.dtype)
        above_U[part] = above_R
        ties_UR.append(shard.all_gather((keys_RV == prefix_R[:, None]).sum(-1)).t())
        del keys_RV, exp_RV
    ties_UR = torch.cat(ties_UR)
    tie_weight_U = torch.exp(threshold_U - max_U)
    total_ties_U = ties_UR.sum(-1)
    # The ties the prefix takes: those at which the mass before them is still below the bound.
    needed_U = torch.where(total_ties_U > 0, torch.ceil((bound_U - above_U) / tie_weight_U), 0.0)
    needed_U = torch.minimum(needed_U.clamp(min=1), total_ties_U.to(needed_U.dtype)).long()
    return threshold_U, needed_U, above_U + needed_U * tie_weight_U, ties_UR


def _tie_columns(shard: _Shard, rows_S, threshold_S, share_S) -> torch.Tensor:
    """For tokens whose ties this rank splits: the column before which it keeps `share` ties (lowest first)."""
    parts = []
    for start, rows_R in zip(range(0, len(rows_S), shard.chunk), shard.row_chunks(rows_S)):
        part = slice(start, start + len(rows_R))
        running_RV = (shard.z(rows_R) == threshold_S[part, None]).cumsum(-1)
        parts.append((running_RV <= share_S[part, None]).sum(-1))  # the columns before the (share + 1)-th tie
    return torch.cat(parts)


# Order-preserving integer keys of floats (int32 for float32, int64 for float64): the sign-magnitude bit patterns made
# two's complement (a negative float's magnitude bits flipped), so that x < y iff key(x) < key(y) and x == y iff
# key(x) == key(y) for non-NaN floats (-0.0 is made +0.0 first). The map is its own inverse on the bits.
_INT_BITS = {torch.float32: (torch.int32, 31, 0x7FFFFFFF), torch.float64: (torch.int64, 63, 0x7FFFFFFFFFFFFFFF)}


def _order_key_(x: torch.Tensor) -> torch.Tensor:
    """The keys of `x`, in x's own memory (x is overwritten)."""
    int_dtype, sign, magnitude = _INT_BITS[x.dtype]
    bits = x.add_(0.0).view(int_dtype)  # -0.0 + 0.0 = +0.0
    return bits.bitwise_xor_((bits >> sign).bitwise_and_(magnitude))


def _from_order_key(key: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    int_dtype, sign, magnitude = _INT_BITS[dtype]
    bits = key.to(int_dtype, copy=True)
    return bits.bitwise_xor_((bits >> sign).bitwise_and_(magnitude)).view(dtype)


