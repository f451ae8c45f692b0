"""One step's batch: built once after rollout and rewards, read by every later phase, which adds named fields to it.

Layout. This data-parallel rank's S kept sequences (n prompt groups x G responses, group-major), each the prompt's
token ids followed by the response's. Per-sequence fields are [S]; per-token fields are response-aligned [S, T] (T
the longest response): column t of row s belongs to response token t of sequence s. `group_index_S` and
`response_index_S` say which prompt group and which response of it each sequence is: the advantages read the
per-token fields through them.

The micro-batch plan is computed once (`plan_micro_batches`): per mini-batch (optimizer step), the sequence ids of
each micro-batch, length-bucketed and cut by a sequence count and a padded-token budget. The old-log-prob pass and
the update run the same micro-batches, so an on-policy first mini-batch sees the very same computation twice (its
importance ratio is exactly 1). The loss contract (algorithms/losses.py) makes the update independent of the split.

The next-token offset lives here only: in a micro-batch's [B, L] layout column k scores token k + 1, so response
token t of a sequence with a P-token prompt is scored at column P - 1 + t (`_MicroBatchColumns`).

Fields, by the phase that adds them (all on groups.device; per-token ones on the last pipeline stage only):
    build_step_batch      mask_ST, rollout_logprobs_ST, correct_NG, rewards_NG, group_index_S, response_index_S
    score (old policy)    old_logprobs_ST, entropy_ST, ref_logprobs_ST (with a reference policy)
    correct_rollout       loss_mask_ST (mask_ST less rejected tokens), pg_weights ([S, T] or [S]), mismatch sums
    advantages            advantages ([S, T] per token or [S] per sequence)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_gtpo.distributed import ParallelGroups

from .experience import Experience
from .forward import MicroBatch, make_micro_batches


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_micro_batches(lengths: list[int], mini_batches: list[list[int]], *, max_sequences: int,
                       max_tokens: int | None, pad_to_multiple: int = 1) -> list[list[list[int]]]:
    """Per mini-batch, the sequence ids (indices into `lengths`) of each micro-batch. Within a mini-batch sequences
    are sorted longest first and cut greedily: a micro-batch holds at most `max_sequences` sequences and, with
    `max_tokens`, at most that many tokens once padded to its longest sequence (rounded up to `pad_to_multiple`).
    A mini-batch without sequences gets one empty micro-batch (its rank still takes part in the collective step).
    A sequence longer than the budget is an error naming data.max_tokens_per_micro_batch."""
    if max_sequences < 1:
        raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
    plan = []
    for ids in mini_batches:
        ordered = sorted(ids, key=lambda i: -lengths[i])
        micro_batches, current, padded_length = [], [], 0
        for i in ordered:
            length = _round_up(lengths[i], pad_to_multiple)
            if max_tokens is not None and length > max_tokens:
                raise ValueError(f"data.max_tokens_per_micro_batch = {max_tokens} is smaller than a sequence of "
                                 f"{lengths[i]} tokens (padded to {length}): raise it to at least the longest "
                                 f"prompt + response")
            padded_length = padded_length or length  # longest first: the first sequence sets the padding
            fits = len(current) < max_sequences and (max_tokens is None
                                                     or (len(current) + 1) * padded_length <= max_tokens)
            if current and not fits:
                micro_batches.append(current)
                current, padded_length = [], length
            current.append(i)
        micro_batches.append(current)
        plan.append(micro_batches)
    return plan


@dataclass
class _MicroBatchColumns:
    """Where the response tokens of a micro-batch's rows sit in its [B, L] layout."""

    rows_B: torch.Tensor  # long: the sequence ids (rows of the [S, ...] fields)
    columns_BT: torch.Tensor  # long [B, T_mb]: P - 1 + t on response tokens, L - 1 (scores no token) elsewhere
    valid_BT: torch.Tensor  # bool [B, T_mb]: t < the response's length

    def gather_BT(self, values_BL: torch.Tensor) -> torch.Tensor:
        """[B, L] next-token scores -> response-aligned [B, T_mb], 0 past each response."""
        return torch.where(self.valid_BT, values_BL.gather(1, self.columns_BT), 0.0)

    def scatter_BL(self, values_ST: torch.Tensor, length: int) -> torch.Tensor:
        """The rows' response-aligned values -> [B, L] next-token layout, 0 (False) wherever no response token is
        scored. Padding positions all write their 0 to column L - 1, which no response token uses."""
        values_BT = values_ST.index_select(0, self.rows_B)[:, :self.columns_BT.shape[1]]
        values_BT = torch.where(self.valid_BT, values_BT, torch.zeros((), dtype=values_BT.dtype,
                                                                      device=values_BT.device))
        out = values_BT.new_zeros(values_BT.shape[0], length)
        return out.scatter(1, self.columns_BT, values_BT)


@dataclass
class PlannedMicroBatch:
    """One micro-batch of the plan: its model inputs (built once, on the device) and where its responses sit."""

    inputs: MicroBatch
    rows: list[int]  # the sequence ids (host ints); empty for the padding micro-batch of a rank without sequences
    columns: _MicroBatchColumns | None  # None with no rows


@dataclass
class StepBatch:
    """This rank's sequences of one step and everything the phases add (module docstring)."""

    num_groups: int
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
    old_logprobs_ST: torch.Tensor | None = None
    entropy_ST: torch.Tensor | None = None
    ref_logprobs_ST: torch.Tensor | None = None
    loss_mask_ST: torch.Tensor | None = None
    pg_weights: torch.Tensor | None = None
    mismatch_sums: dict = field(default_factory=dict)
    advantages: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    def micro_batches(self) -> list[PlannedMicroBatch]:
        """Every micro-batch of the plan that holds sequences, in plan order (what the old-policy pass scores)."""
        return [mb for mini in self.plan for mb in mini if mb.rows]

    def per_group_NGT(self, values_ST: torch.Tensor) -> torch.Tensor:
        """[S, T] -> [n, G, T] through the group index."""
        out = values_ST.new_zeros(self.num_groups, self.group_size, values_ST.shape[-1])
        out[self.group_index_S, self.response_index_S] = values_ST
        return out

    def per_sequence(self, values_NG_or_NGT: torch.Tensor) -> torch.Tensor:
        """[n, G] -> [S] or [n, G, T] -> [S, T] through the group index."""
        return values_NG_or_NGT[self.group_index_S, self.response_index_S]


def build_step_batch(exp: Experience, groups: ParallelGroups, *, mini_batches: list[list[int]], max_sequences: int,
                     max_tokens: int | None) -> StepBatch:
    """The step batch of `exp`'s kept groups; `mini_batches` lists the group ids of each mini-batch."""
    device, G = groups.device, exp.group_size
    sequences = exp.sequences()
    prompt_lengths = exp.response_starts()
    responses = [r for group in exp.responses for r in group]
    response_lengths = [len(r.token_ids) for r in responses]
    T = max(response_lengths, default=0)
    rollout = torch.zeros(len(responses), T)
    for s, r in enumerate(responses):  # one host tensor, one copy to the device
        rollout[s, :len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float32)
    lengths_S = torch.tensor(response_lengths, dtype=torch.long, device=device)
    sequence_ids = [[g * G + j for g in groups_of_mini for j in range(G)] for groups_of_mini in mini_batches]
    plan = plan_micro_batches([len(s) for s in sequences], sequence_ids, max_sequences=max_sequences,
                              max_tokens=max_tokens, pad_to_multiple=groups.sequence_multiple)
    planned = [[_planned(rows, sequences, prompt_lengths, response_lengths, groups) for rows in mini]
               for mini in plan]
    index_S = torch.arange(len(sequences), device=device)
    return StepBatch(num_groups=exp.num_groups, group_size=G, sequence_lengths=[len(s) for s in sequences],
                     response_lengths=response_lengths, group_index_S=index_S // G, response_index_S=index_S % G,
                     mask_ST=torch.arange(T, device=device) < lengths_S[:, None],
                     rollout_logprobs_ST=rollout.to(device), correct_NG=exp.correct_NG.to(device),
                     rewards_NG=exp.rewards_NG.to(device), plan=planned)


def _planned(rows: list[int], sequences, prompt_lengths, response_lengths, groups: ParallelGroups
             ) -> PlannedMicroBatch:
    device = groups.device
    if not rows:  # a rank without sequences: one dummy sequence that scores nothing
        (inputs,) = make_micro_batches([[0, 0]], 1, device=device, pad_to_multiple=groups.sequence_multiple)
        return PlannedMicroBatch(inputs, rows, None)
    (inputs,) = make_micro_batches([sequences[i] for i in rows], len(rows), device=device,
                                   pad_to_multiple=groups.sequence_multiple)
    L = inputs.tokens_BL.shape[1]
    T = max(response_lengths[i] for i in rows)
    t_T = torch.arange(T)
    starts_B1 = torch.tensor([prompt_lengths[i] - 1 for i in rows])[:, None]
    valid_BT = t_T < torch.tensor([response_lengths[i] for i in rows])[:, None]
    columns_BT = torch.where(valid_BT, starts_B1 + t_T, L - 1)
    columns = _MicroBatchColumns(torch.tensor(rows, device=device), columns_BT.to(device), valid_BT.to(device))
    return PlannedMicroBatch(inputs, rows, columns)
