"""One step's experience: sampled groups with rewards (dynamic sampling included); then the phases that add fields
to the step batch (step_batch.py): old-policy log-probs and entropies from the forward-only pass, the rollout
mismatch correction, and advantages over the GLOBAL batch (all data-parallel ranks)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from megatron_gtpo.algorithms.rollout_correction import rollout_correction
from megatron_gtpo.distributed import ParallelGroups, vocab_parallel_logprobs_and_entropy
from megatron_gtpo.rollout.engine import Response, SamplingParams

from .forward import next_token_targets, run_forward

if TYPE_CHECKING:
    from .step_batch import StepBatch


@dataclass
class Experience:
    """This DP rank's prompt groups kept for training (n groups of G responses): what the rollout and the rewards
    produce, from which the step batch (step_batch.py) is built."""

    prompt_token_ids: list[tuple[int, ...]]
    responses: list[list[Response]]  # [n][G]
    correct_NG: torch.Tensor  # float {0, 1}: the verifier's reward
    rewards_NG: torch.Tensor  # correctness plus the length penalty (if any): what the advantages see
    stats: dict = field(default_factory=dict)

    @property
    def num_prompt_groups(self) -> int:
        return len(self.responses)

    @property
    def group_size(self) -> int:
        return self.correct_NG.shape[1]  # G even when this rank kept no group ([0, G])

    def sequences(self) -> list[list[int]]:
        return [list(p) + r.token_ids for p, group in zip(self.prompt_token_ids, self.responses) for r in group]

    def response_starts(self) -> list[int]:
        return [len(p) for p, group in zip(self.prompt_token_ids, self.responses) for _ in group]


def collect_experience(generate: Callable[[list[list[int]], int], list[list[Response]]],
                       next_prompts: Callable[[], list],
                       score_groups: Callable[[list, list[list[Response]]], torch.Tensor],
                       params: SamplingParams, parallel: ParallelGroups, *, target_prompt_groups: int,
                       dynamic_sampling: bool, max_extra_rounds: int,
                       length_penalty: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                       informative: Callable[[torch.Tensor], torch.Tensor]) -> Experience:
    """Sample G responses per prompt (`generate(prompts, round_index)`) and score them (`score_groups(prompts,
    responses) -> [N, G]` verifier rewards in {0, 1}). With dynamic sampling, groups whose rewards are all equal
    are dropped and more prompts are drawn (at most `max_extra_rounds` more rounds, the same number on every DP
    rank so data loaders stay aligned) until `target_prompt_groups` informative groups are kept; then train on what
    there is. `length_penalty(lengths_NG, correct_NG) -> penalty_NG` is added to the rewards."""
    kept_prompts, kept_responses, kept_correct, kept_rewards = [], [], [], []
    all_correct, all_rewards, all_lengths, all_truncated = [], [], [], []
    rounds = 0
    while True:
        prompts = next_prompts()
        if len(kept_prompts) < target_prompt_groups:
            responses = generate([list(p.prompt_token_ids) for p in prompts], rounds)
            correct_NG = score_groups(prompts, responses)
            lengths_NG = torch.tensor([[len(r.token_ids) for r in grp] for grp in responses], dtype=torch.float32)
            rewards_NG = correct_NG + (length_penalty(lengths_NG, correct_NG) if length_penalty else 0.0)
            # Filter on correctness, before length penalties (DAPO's rule).
            keep_N = informative(correct_NG) if dynamic_sampling else torch.ones(len(prompts), dtype=torch.bool)
            for i in keep_N.nonzero().flatten().tolist()[:target_prompt_groups - len(kept_prompts)]:
                kept_prompts.append(prompts[i].prompt_token_ids)
                kept_responses.append(responses[i])
                kept_correct.append(correct_NG[i])
                kept_rewards.append(rewards_NG[i])
            all_correct.append(correct_NG.flatten())
            all_rewards.append(rewards_NG.flatten())
            all_lengths.append(lengths_NG.flatten())
            all_truncated.append(torch.tensor([r.finish_reason == "length" for g in responses for r in g],
                                              dtype=torch.float32))
        rounds += 1
        # Collectives run on the process groups' device: an NCCL group takes no host tensors.
        short = torch.tensor([float(len(kept_prompts) < target_prompt_groups)], device=parallel.device)
        dist.all_reduce(short, op=dist.ReduceOp.MAX, group=parallel.dp_group)
        if not dynamic_sampling or short.item() == 0 or rounds > max_extra_rounds:
            break
    G = params.n
    stats = {
        "reward_mean": torch.cat(all_rewards).mean().item(),
        "accuracy": torch.cat(all_correct).mean().item(),
        "response_length_mean": torch.cat(all_lengths).mean().item(),
        "response_length_max": torch.cat(all_lengths).max().item(),
        "response_clip_ratio": torch.cat(all_truncated).mean().item(),
        "sampling_rounds": rounds,
        "groups_generated": sum(len(c) for c in all_correct) // G,
        "groups_kept": len(kept_prompts),
    }
    empty = torch.zeros(0, G)
    return Experience(kept_prompts, kept_responses,
                      torch.stack(kept_correct) if kept_correct else empty,
                      torch.stack(kept_rewards) if kept_rewards else empty, stats)


def score_old_policy(model_chunks: list, batch: StepBatch, parallel: ParallelGroups, *, vocab_size: int,
                     temperature: float, chunk_tokens: int | None = None,
                     reference_chunks: list | None = None) -> None:
    """The forward-only pass over the step batch's micro-batch plan: adds old_logprobs_ST and entropy_ST (the
    old-policy log-probs and full-vocabulary entropies of every response token, at the training TP/PP) and, with
    `reference_chunks`, ref_logprobs_ST. On the last pipeline stage only (the only place the loss needs them)."""
    micro_batches = batch.micro_batches()
    if not micro_batches:
        return
    score = partial(_response_logprobs_and_entropy, batch=batch, micro_batches=micro_batches, parallel=parallel,
                    vocab_size=vocab_size, temperature=temperature, chunk_tokens=chunk_tokens)
    batch.old_logprobs_ST, batch.entropy_ST = score(model_chunks)
    if reference_chunks is not None:
        batch.ref_logprobs_ST, _ = score(reference_chunks)


def _response_logprobs_and_entropy(model_chunks, *, batch: StepBatch, micro_batches: list, parallel: ParallelGroups,
                                   vocab_size: int, temperature: float, chunk_tokens: int | None):
    """Response-aligned [S, T] float32 log-probs and entropies on the device (None, None off the last stage)."""

    def on_last_stage(inputs, logits_BLV):
        logprobs_BL, entropy_BL = vocab_parallel_logprobs_and_entropy(
            logits_BLV, next_token_targets(inputs.tokens_BL), tp_group=parallel.tp_group, vocab_size=vocab_size,
            temperature=temperature, chunk_size=chunk_tokens, check_targets=False)  # no sync per micro-batch
        return logprobs_BL.float(), entropy_BL.float()

    for model in model_chunks:
        model.eval()
    outputs = run_forward(model_chunks, [mb.inputs for mb in micro_batches], parallel, on_last_stage)
    if not parallel.is_last_stage:
        return None, None
    logprobs_ST = torch.zeros(batch.mask_ST.shape, device=parallel.device)
    entropy_ST = torch.zeros_like(logprobs_ST)
    for mb, (logprobs_BL, entropy_BL) in zip(micro_batches, outputs):
        width = mb.columns.valid_ST.shape[1]
        logprobs_ST[mb.columns.sequences_S, :width] = mb.columns.gather(logprobs_BL)
        entropy_ST[mb.columns.sequences_S, :width] = mb.columns.gather(entropy_BL)
    return logprobs_ST, entropy_ST


def correct_rollout(batch: StepBatch, **settings) -> None:
    """Adds loss_mask_ST, pg_weights and mismatch_sums (algorithms/rollout_correction.py; `settings` are its
    rollout_is / rollout_is_cap / rollout_rs / rollout_rs_bounds). Last pipeline stage only."""
    if batch.old_logprobs_ST is None:
        return
    correction = rollout_correction(batch.old_logprobs_ST, batch.rollout_logprobs_ST, batch.mask_ST, **settings)
    batch.loss_mask_ST, batch.pg_weights, batch.mismatch_sums = correction.keep_ST, correction.weights, \
        correction.metric_sums


def _all_gather_padded(tensor: torch.Tensor, group, device: torch.device) -> list[torch.Tensor]:
    """all_gather of tensors whose sizes differ across ranks in every dim (padded, then cut back), on `device` (the
    group's: an NCCL group takes no host tensors)."""
    world = dist.get_world_size(group)
    if world == 1:
        return [tensor]
    shape = torch.tensor(tensor.shape, dtype=torch.long, device=device)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    shapes = torch.stack(shapes).tolist()  # the one host sync of the gather: the parts' sizes
    padded = tensor.new_zeros([max(dims) for dims in zip(*shapes)], device=device)
    padded[tuple(slice(0, s) for s in tensor.shape)] = tensor
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [p[tuple(slice(0, s) for s in sh)] for p, sh in zip(parts, shapes)]


def global_advantages(advantage_fn: Callable, uses_entropy: bool, batch: StepBatch, parallel: ParallelGroups) -> None:
    """Adds batch.advantages ([S, T] per token or [S] per sequence), computed on the device over the GLOBAL batch
    (the batch-scope z-scores of GTPO span every DP rank's groups; group-scope ones are unaffected). The entropies
    are read into [n, G, T] through the group index. Last pipeline stage only."""
    rewards = _all_gather_padded(batch.rewards_NG, parallel.dp_group, parallel.device)
    counts = [r.shape[0] for r in rewards]
    mine = slice(sum(counts[:parallel.dp_rank]), sum(counts[:parallel.dp_rank + 1]))
    rewards_NG = torch.cat(rewards)
    if rewards_NG.shape[0] == 0:
        return
    if not uses_entropy:
        batch.advantages = batch.per_sequence(advantage_fn(rewards_NG)[mine])
        return
    # A rank that kept no group (dynamic sampling) has no entropies, yet takes part in the gathers.
    own_entropy_NGT = (batch.per_group_NGT(batch.entropy_ST) if batch.num_prompt_groups
                       else torch.zeros(0, batch.group_size, 0, device=parallel.device))
    own_lengths_NG = batch.per_group_NGT(batch.mask_ST.sum(dim=-1, keepdim=True))[..., 0]
    entropy = _all_gather_padded(own_entropy_NGT, parallel.dp_group, parallel.device)
    lengths = _all_gather_padded(own_lengths_NG, parallel.dp_group, parallel.device)
    T = max(e.shape[-1] for e in entropy)
    entropy_NGT = torch.cat([torch.nn.functional.pad(e, (0, T - e.shape[-1])) for e in entropy])
    mask_NGT = torch.arange(T, device=parallel.device) < torch.cat(lengths)[..., None]
    advantages = advantage_fn(rewards_NG, entropy_NGT, mask_NGT)[mine]
    if advantages.ndim == 3:
        advantages = advantages[..., :own_entropy_NGT.shape[-1]]
    batch.advantages = batch.per_sequence(advantages)
