"""One step's batch: built once after rollout and rewards, read by every later phase, which adds named fields to it.

Layout. This data-parallel rank's S kept sequences (n prompt groups x G responses, group-major), each the prompt's
token ids followed by the response's, built from the experience's rollout record (rollout/responses.py) by tensor
ops: its flat tokens are scattered into [S, L] token rows (`sequence_tokens_SL`), out of which every micro-batch's
inputs are cut, and its flat log-probs into rollout_logprobs_ST. Per-sequence fields are [S]; per-token fields are
response-aligned [S, T] (T the longest response): column t of row s belongs to response token t of sequence s.
`group_index_S` and `response_index_S` say which prompt group and which response of it each sequence is: the
advantages read the per-token fields through them.

The micro-batch plan is computed once (`plan_micro_batches`): per mini-batch (optimizer step), the sequence ids of
each micro-batch, either length-bucketed and cut by a sequence count and a padded-token budget, or packed
(data.pack_sequences: first-fit decreasing into rows of at most the token budget, several sequences per row with
attention confined to each, forward.py). The old-log-prob pass and the update run the same micro-batches, so an
on-policy first mini-batch sees the very same computation twice (its importance ratio is exactly 1), and a step of
one optimizer step takes its old-policy values from the update's forward instead (old_policy.py). The loss
contract (algorithms/losses.py) makes the update independent of the split and of the packing.

Response columns: in a micro-batch's [B, L] layout column k scores token k + 1 (forward.next_token_targets), so
response token t of a sequence that starts at column o of its row with a P-token prompt is scored at column
o + P - 1 + t (o = 0 unpacked); `_planned` is the one place that computes these columns. `MicroBatchColumns` gathers
those scores into the response-aligned layout [S_mb, T_mb] that the step batch's fields and the losses use,
whichever the micro-batch's layout, and selects a micro-batch's rows of a field.

Expert parallelism (a mixture-of-experts model): the ranks of an expert-parallel group exchange tokens in every MoE
layer, so they must run the same number of micro-batches: each mini-batch's plan is padded with empty micro-batches
(one dummy sequence that scores nothing, as for a rank without sequences) to the largest count in the group.
Routing replay: each micro-batch's model inputs carry the experts the rollout routed its tokens to
(`MicroBatch.routed_experts`, models/moe_routing.py), placed like its tokens; positions nobody recorded (padding,
each sequence's last token) get filler experts.

Fields, by the phase that adds them (all on parallel.device; build_step_batch's on every pipeline stage, the later
phases' on the last stage only, elsewhere None and mismatch_sums empty):
    build_step_batch      mask_ST, rollout_logprobs_ST, correct_NG, rewards_NG, group_index_S, response_index_S,
                          staleness_ST (with a trained version), entropy_ST (the engine's, where it records them)
    score (old policy)    old_logprobs_ST, entropy_ST, ref_logprobs_ST (with a reference policy)
    correct_rollout       loss_mask_ST (mask_ST less rejected tokens), pg_weights ([S, T] or [S]), mismatch sums
    (or the update)       old_logprobs_ST, entropy_ST and mismatch sums from its forward (old_policy.py); the loss
                          mask and weights per micro-batch
    advantages            advantages ([S, T] per token or [S] per sequence)
    token selection       pg_weights times 0 where a token loses its policy gradient, kl_penalty_ST (with a
                          selection configured: Clip-Cov, KL-Cov, the high-entropy fraction)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import torch.distributed as dist

from megatron_gtpo.distributed import ParallelGroups
from megatron_gtpo.models.moe_routing import RoutedExperts, filler_experts

from megatron_gtpo.rollout.responses import Responses

from .experience import RewardedGroups
from .forward import MicroBatch, make_micro_batches, packed_micro_batch, padded_micro_batch, sequence_rows


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_micro_batches(lengths: list[int], mini_batches: list[list[int]], *, max_sequences: int,
                       max_tokens: int | None, pad_to_multiple: int = 1, pack: bool = False
                       ) -> list[list[list[int]]]:
    """Per mini-batch, the sequence ids (indices into `lengths`) of each micro-batch, longest first.

    Padded (pack=False): sequences sorted longest first and cut greedily; a micro-batch holds at most
    `max_sequences` sequences and, with `max_tokens`, at most that many tokens once padded to its longest sequence
    (rounded up to `pad_to_multiple`).
    Packed (pack=True): first-fit decreasing; each micro-batch is one row of sequences back to back whose total,
    rounded up to `pad_to_multiple`, is at most `max_tokens` (required); `max_sequences` does not apply.
    A mini-batch without sequences gets one empty micro-batch (its rank still takes part in the collective step).
    A sequence longer than the budget is an error naming data.max_tokens_per_micro_batch."""
    if max_sequences < 1:
        raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
    if pack and max_tokens is None:
        raise ValueError("data.pack_sequences needs data.max_tokens_per_micro_batch (the length of a packed row)")
    for i in (i for ids in mini_batches for i in ids):
        if max_tokens is not None and _round_up(lengths[i], pad_to_multiple) > max_tokens:
            raise ValueError(f"data.max_tokens_per_micro_batch = {max_tokens} is smaller than a sequence of "
                             f"{lengths[i]} tokens (padded to {_round_up(lengths[i], pad_to_multiple)}): raise it "
                             f"to at least the longest prompt + response")
    cut = _first_fit_decreasing if pack else _cut_padded
    return [cut(sorted(ids, key=lambda i: -lengths[i]), lengths, max_sequences, max_tokens, pad_to_multiple)
            for ids in mini_batches]


def _cut_padded(ordered, lengths, max_sequences, max_tokens, pad_to_multiple) -> list[list[int]]:
    micro_batches, current, padded_length = [], [], 0
    for i in ordered:
        length = _round_up(lengths[i], pad_to_multiple)
        padded_length = padded_length or length  # longest first: the first sequence sets the padding
        fits = len(current) < max_sequences and (max_tokens is None or (len(current) + 1) * padded_length <= max_tokens)
        if current and not fits:
            micro_batches.append(current)
            current, padded_length = [], length
        current.append(i)
    micro_batches.append(current)
    return micro_batches


def _first_fit_decreasing(ordered, lengths, max_sequences, max_tokens, pad_to_multiple) -> list[list[int]]:
    rows, used = [], []
    for i in ordered:
        row = next((r for r, n in enumerate(used) if _round_up(n + lengths[i], pad_to_multiple) <= max_tokens), None)
        if row is None:
            rows.append([])
            used.append(0)
            row = len(rows) - 1
        rows[row].append(i)
        used[row] += lengths[i]
    return rows or [[]]


@dataclass
class MicroBatchColumns:
    """Where each response token of a micro-batch sits in its [B, L] next-token layout (padded: sequence b in row b;
    packed: all in row 0, one after another)."""

    sequences_S: torch.Tensor  # long [S_mb]: the sequence ids (rows of the step batch's [S, ...] fields)
    row_S: torch.Tensor  # long [S_mb]: each sequence's row in the micro-batch
    columns_ST: torch.Tensor  # long [S_mb, T_mb]: start - 1 + t on response tokens, 0 (ignored) elsewhere
    valid_ST: torch.Tensor  # bool [S_mb, T_mb]: t < the response's length

    def gather(self, values_BL: torch.Tensor) -> torch.Tensor:
        """[B, L] next-token scores -> response-aligned [S_mb, T_mb], 0 past each response (differentiable)."""
        return torch.where(self.valid_ST, values_BL[self.row_S[:, None], self.columns_ST], 0.0)

    def select(self, values_S_or_ST: torch.Tensor) -> torch.Tensor:
        """The step batch's [S] or [S, T] field -> this micro-batch's [S_mb] or [S_mb, T_mb]."""
        values = values_S_or_ST.index_select(0, self.sequences_S)
        return values[:, :self.valid_ST.shape[1]] if values.ndim == 2 else values


@dataclass
class PlannedMicroBatch:
    """One micro-batch of the plan: its model inputs (built once, on the device) and where its responses sit."""

    inputs: MicroBatch
    rows: list[int]  # the sequence ids (host ints); empty for the padding micro-batch of a rank without sequences
    columns: MicroBatchColumns  # selects nothing with no rows


@dataclass
class StepBatch:
    """This rank's sequences of one step and everything the phases add (module docstring)."""

    num_prompt_groups: int
    group_size: int
    sequence_lengths: list[int]  # prompt + response tokens (host ints: the plan is built from them)
    response_lengths: list[int]
    group_index_S: torch.Tensor
    response_index_S: torch.Tensor
    mask_ST: torch.Tensor
    rollout_logprobs_ST: torch.Tensor
    correct_NG: torch.Tensor
    rewards_NG: torch.Tensor
    plan: list[list[PlannedMicroBatch]]  # per mini-batch
    lockstep: bool = False  # expert parallelism: the plan's padding micro-batches run too (module doc)
    # int64: how many versions before the trained one each token's sampler was (0 at padding); None: not asked for
    staleness_ST: torch.Tensor | None = None
    old_logprobs_ST: torch.Tensor | None = None
    entropy_ST: torch.Tensor | None = None
    ref_logprobs_ST: torch.Tensor | None = None
    loss_mask_ST: torch.Tensor | None = None
    pg_weights: torch.Tensor | None = None
    mismatch_sums: dict = field(default_factory=dict)
    advantages: torch.Tensor | None = None
    kl_penalty_ST: torch.Tensor | None = None  # bool: KL-Cov's penalised tokens (token_selection.py)

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    def micro_batches(self) -> list[PlannedMicroBatch]:
        """Every micro-batch of the plan that holds sequences, in plan order (what the old-policy pass scores); in
        lockstep, the padding ones too."""
        return [mb for mini in self.plan for mb in mini if mb.rows or self.lockstep]

    def per_group_NGT(self, values_ST: torch.Tensor) -> torch.Tensor:
        """[S, T] -> [n, G, T] through the group index."""
        out = values_ST.new_zeros(self.num_prompt_groups, self.group_size, values_ST.shape[-1])
        out[self.group_index_S, self.response_index_S] = values_ST
        return out

    def per_sequence(self, values_NG_or_NGT: torch.Tensor) -> torch.Tensor:
        """[n, G] -> [S] or [n, G, T] -> [S, T] through the group index."""
        return values_NG_or_NGT[self.group_index_S, self.response_index_S]


@dataclass(frozen=True)
class ReplayPlan:
    """Routing replay's shape on this rank: its MoE layers (megatron's layer numbers) and the experts per token."""

    layers: tuple[int, ...]
    topk: int


def build_step_batch(kept: RewardedGroups, parallel: ParallelGroups, *, mini_batches: list[list[int]],
                     max_sequences: int, max_tokens: int | None, pack: bool = False, replay: ReplayPlan | None = None,
                     trained_version: int | None = None) -> StepBatch:
    """The step batch of the `kept` groups; `mini_batches` lists the group ids of each mini-batch; `pack`: packed
    micro-batches (one row of several sequences each, forward.py) instead of padded ones; `replay`: the micro-batches
    carry the experts each response's recorded routing (`SampledGroups.routed_experts`, rank-local) holds (module
    doc); `trained_version`: the policy version the step trains, against which each token's staleness is counted.
    Built from the rollout record's flat tensors by tensor ops on the device (`sequence_tokens_SL`); only the lengths
    come to the host (the plan is built from them). With expert parallelism, collective over the expert-parallel
    group (the micro-batch counts are agreed on)."""
    device, G, sampled = parallel.device, kept.group_size, kept.groups
    prompt_token_ids = [p.prompt_token_ids for p in sampled.prompts]
    responses = sampled.responses.to(device)
    lengths_S = responses.lengths_R
    response_lengths = lengths_S.tolist()
    prompt_lengths = [len(p) for p in prompt_token_ids for _ in range(G)]
    sequence_lengths = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    mask_ST = torch.arange(max(response_lengths, default=0), device=device) < lengths_S[:, None]
    # Row-major order of the mask's True entries is the record's token order: response s's tokens fill row s.
    rollout_ST = torch.zeros(mask_ST.shape, device=device).masked_scatter_(mask_ST, responses.logprobs_T)
    entropy_ST = None if sampled.entropies_T is None else \
        torch.zeros(mask_ST.shape, device=device).masked_scatter_(mask_ST, sampled.entropies_T.to(device))
    staleness_ST = None
    if trained_version is not None:
        staleness_ST = torch.zeros(mask_ST.shape, dtype=torch.int64, device=device).masked_scatter_(
            mask_ST, trained_version - sampled.versions_T.to(device))
    tokens_SL = sequence_tokens_SL(prompt_token_ids, G, responses, sequence_lengths)
    sequence_ids = [[g * G + j for g in groups_of_mini for j in range(G)] for groups_of_mini in mini_batches]
    plan = plan_micro_batches(sequence_lengths, sequence_ids, max_sequences=max_sequences,
                              max_tokens=max_tokens, pad_to_multiple=parallel.sequence_multiple, pack=pack)
    lockstep = parallel.expert_lockstep_group
    if lockstep is not None:
        plan = _pad_to_peers(plan, lockstep, parallel.device)
    routes = sampled.routed_experts
    # Decided at start: routing replay needs a mixture-of-experts model (config.validate_for_model) and an engine
    # that records every response's routing (layout.check_layout; vLLM's checked as it starts).
    assert replay is None or (routes is not None and len(routes) == len(response_lengths)), \
        "layout.check_layout: routing replay's engines record each response's routing"
    planned = [[_planned(rows, tokens_SL, mask_ST, sequence_lengths, prompt_lengths, response_lengths, parallel, pack,
                         replay, routes)
                for rows in mini] for mini in plan]
    index_S = torch.arange(len(response_lengths), device=device)
    return StepBatch(num_prompt_groups=kept.num_groups, group_size=G, sequence_lengths=sequence_lengths,
                     response_lengths=response_lengths, group_index_S=index_S // G, response_index_S=index_S % G,
                     mask_ST=mask_ST, rollout_logprobs_ST=rollout_ST, correct_NG=kept.correct_NG.to(device),
                     rewards_NG=kept.rewards_NG.to(device), plan=planned, lockstep=lockstep is not None,
                     staleness_ST=staleness_ST, entropy_ST=entropy_ST)


def _pad_to_peers(plan: list[list[list[int]]], group, device) -> list[list[list[int]]]:
    """Each mini-batch's micro-batches padded with empty ones to the most any rank of `group` has (one
    all-reduce)."""
    counts = torch.tensor([len(mini) for mini in plan], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    return [mini + [[] for _ in range(most - len(mini))] for mini, most in zip(plan, counts.tolist())]


def sequence_tokens_SL(prompt_token_ids: list, group_size: int, responses: Responses,
                       sequence_lengths: list[int]) -> torch.Tensor:
    """[S, L] on the record's device, of its token dtype (int32): sequence s = g * G + j is prompt g's tokens followed
    by its response j's, from column 0, zeros after it (L: the longest sequence). The prompts (host ints, few) cross
    once as [n, P_max]; the responses' tokens are scattered from the record's flat token_ids_T. The micro-batches
    cut their int64 inputs out of it (forward.padded_micro_batch / packed_micro_batch)."""
    device = responses.device
    prompts_nP = sequence_rows([list(p) for p in prompt_token_ids], device)
    tokens_SL = torch.zeros(len(sequence_lengths), max(sequence_lengths, default=0), dtype=responses.token_ids_T.dtype,
                            device=device)
    tokens_SL[:, :prompts_nP.shape[1]] = prompts_nP.repeat_interleave(group_size, dim=0)
    column_L = torch.arange(tokens_SL.shape[1], device=device)
    prompt_lengths_S1 = torch.tensor([len(p) for p in prompt_token_ids], device=device).repeat_interleave(
        group_size)[:, None]
    response_SL = (column_L >= prompt_lengths_S1) & (column_L < torch.tensor(sequence_lengths, device=device)[:, None])
    return tokens_SL.masked_scatter_(response_SL, responses.token_ids_T)


def _planned(rows: list[int], tokens_SL: torch.Tensor, mask_ST: torch.Tensor, sequence_lengths, prompt_lengths,
             response_lengths, parallel: ParallelGroups, pack: bool, replay: ReplayPlan | None,
             routes: list | None) -> PlannedMicroBatch:
    """The micro-batch of sequences `rows`: its inputs cut out of the step batch's token rows, its columns computed
    on the device from the step batch's mask (host ints for the starts only); with `replay`, its routing targets."""
    device, multiple = parallel.device, parallel.sequence_multiple
    if not rows:  # a rank without sequences: one dummy sequence that scores nothing
        (inputs,) = make_micro_batches([[0, 0]], 1, device=device, pad_to_multiple=multiple)
        inputs.lengths_B.zero_()  # no real token (what the routers' statistics count)
        inputs.routed_experts = _placed_experts(inputs, [], [], replay, device)
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return PlannedMicroBatch(inputs, rows, MicroBatchColumns(empty, empty, empty[:, None][:, :0],
                                                                  torch.zeros(0, 0, dtype=torch.bool, device=device)))
    rows_S = torch.tensor(rows, device=device)
    lengths = [sequence_lengths[i] for i in rows]
    selected_SL = tokens_SL[:, :max(lengths)].index_select(0, rows_S)
    if pack:
        inputs = packed_micro_batch(selected_SL, lengths, pad_to_multiple=multiple)
        row_S = [0] * len(rows)
        offsets = [0]
        for length in lengths[:-1]:
            offsets.append(offsets[-1] + length)
    else:
        inputs = padded_micro_batch(selected_SL, lengths, pad_to_multiple=multiple)
        row_S, offsets = list(range(len(rows))), [0] * len(rows)
        if parallel.cp_size == 1 and not parallel.sequence_parallel:  # forward.MicroBatch.scored_from
            inputs.scored_from = min(prompt_lengths[i] for i in rows) - 1
    if replay is not None:
        inputs.routed_experts = _placed_experts(inputs, [routes[i] for i in rows],
                                                list(zip(row_S, offsets)), replay, device)
    T = max(response_lengths[i] for i in rows)
    starts_S1 = torch.tensor([offset + prompt_lengths[i] - 1 for i, offset in zip(rows, offsets)], device=device)
    valid_ST = mask_ST[:, :T].index_select(0, rows_S)
    columns_ST = (starts_S1[:, None] + torch.arange(T, device=device)).masked_fill_(~valid_ST, 0)
    columns = MicroBatchColumns(rows_S, torch.tensor(row_S, device=device), columns_ST, valid_ST)
    return PlannedMicroBatch(inputs, rows, columns)


def _placed_experts(inputs: MicroBatch, experts: list, places: list[tuple[int, int]], replay: ReplayPlan | None,
                    device) -> RoutedExperts | None:
    """The micro-batch's [B, L, M, k] replay targets: each sequence's recorded experts (its first length - 1 tokens)
    at its (row, start column), filler elsewhere (and which are recorded)."""
    if replay is None:
        return None
    B, L = inputs.tokens_BL.shape
    placed_BLMK = filler_experts(B * L, len(replay.layers), replay.topk, device).reshape(B, L, -1, replay.topk).clone()
    recorded_BL = torch.zeros(B, L, dtype=torch.bool, device=device)
    for experts_TMK, (row, start) in zip(experts, places):
        placed_BLMK[row, start:start + experts_TMK.shape[0]] = experts_TMK.to(device)
        recorded_BL[row, start:start + experts_TMK.shape[0]] = True
    return RoutedExperts(replay.layers, placed_BLMK, recorded_BL)
