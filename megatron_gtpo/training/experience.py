"""One step's experience: sampled groups with rewards (dynamic sampling included), their old-policy log-probs and
entropies from the forward-only pass, and advantages over the GLOBAL batch (all data-parallel ranks)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from megatron_gtpo.distributed import ParallelGroups
from megatron_gtpo.rollout.engine import Response, SamplingParams

from .forward import make_micro_batches, next_token_logprobs_and_entropy


@dataclass
class Experience:
    """This DP rank's prompt groups kept for training (n groups of G responses)."""

    prompt_token_ids: list[tuple[int, ...]]
    responses: list[list[Response]]  # [n][G]
    correct_NG: torch.Tensor  # float {0, 1}: the verifier's reward
    rewards_NG: torch.Tensor  # correctness plus the length penalty (if any): what the advantages see
    stats: dict = field(default_factory=dict)
    # Filled by score_old_policy on the last pipeline stage: response-aligned, padded to the longest response.
    old_logprobs_NGT: torch.Tensor | None = None
    entropy_NGT: torch.Tensor | None = None
    ref_logprobs_NGT: torch.Tensor | None = None  # only with a reference policy (the KL term)

    @property
    def num_groups(self) -> int:
        return len(self.responses)

    @property
    def group_size(self) -> int:
        return self.correct_NG.shape[1]  # G even when this rank kept no group ([0, G])

    def sequences(self) -> list[list[int]]:
        return [list(p) + r.token_ids for p, group in zip(self.prompt_token_ids, self.responses) for r in group]

    def response_starts(self) -> list[int]:
        return [len(p) for p, group in zip(self.prompt_token_ids, self.responses) for _ in group]

    def response_lengths_NG(self) -> torch.Tensor:
        return torch.tensor([[len(r.token_ids) for r in g] for g in self.responses], dtype=torch.long).reshape(
            self.num_groups, self.group_size)

    def mask_NGT(self) -> torch.Tensor:
        lengths = self.response_lengths_NG()
        T = int(lengths.max()) if lengths.numel() else 0
        return torch.arange(T) < lengths[..., None]


def collect_experience(generate: Callable[[list[list[int]], int], list[list[Response]]],
                       next_prompts: Callable[[], list],
                       score_groups: Callable[[list, list[list[Response]]], torch.Tensor],
                       params: SamplingParams, groups: ParallelGroups, *, target_groups: int,
                       dynamic_sampling: bool, max_extra_rounds: int,
                       length_penalty: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                       informative: Callable[[torch.Tensor], torch.Tensor]) -> Experience:
    """Sample G responses per prompt (`generate(prompts, round_index)`) and score them (`score_groups(prompts,
    responses) -> [N, G]` verifier rewards in {0, 1}). With dynamic sampling, groups whose rewards are all equal
    are dropped and more prompts are drawn (at most `max_extra_rounds` more rounds, the same number on every DP
    rank so data loaders stay aligned) until `target_groups` informative groups are kept; then train on what
    there is. `length_penalty(lengths_NG, correct_NG) -> penalty_NG` is added to the rewards."""
    kept_prompts, kept_responses, kept_correct, kept_rewards = [], [], [], []
    all_correct, all_rewards, all_lengths, all_truncated = [], [], [], []
    rounds = 0
    while True:
        prompts = next_prompts()
        if len(kept_prompts) < target_groups:
            responses = generate([list(p.prompt_token_ids) for p in prompts], rounds)
            correct_NG = score_groups(prompts, responses)
            lengths_NG = torch.tensor([[len(r.token_ids) for r in grp] for grp in responses], dtype=torch.float32)
            rewards_NG = correct_NG + (length_penalty(lengths_NG, correct_NG) if length_penalty else 0.0)
            # Filter on correctness, before length penalties (DAPO's rule).
            keep_N = informative(correct_NG) if dynamic_sampling else torch.ones(len(prompts), dtype=torch.bool)
            for i in keep_N.nonzero().flatten().tolist()[:target_groups - len(kept_prompts)]:
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
        # Collectives run on the groups' device: an NCCL group takes no host tensors.
        short = torch.tensor([float(len(kept_prompts) < target_groups)], device=groups.device)
        dist.all_reduce(short, op=dist.ReduceOp.MAX, group=groups.dp_group)
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


def score_old_policy(model_chunks: list, exp: Experience, groups: ParallelGroups, *, vocab_size: int,
                     temperature: float, micro_batch_size: int, chunk_tokens: int | None = None,
                     reference_chunks: list | None = None) -> None:
    """The forward-only pass: old-policy log-probs and full-vocabulary entropy of every response token, at the
    training TP/PP (and the reference policy's log-probs when `reference_chunks` is given). Results land on the
    last pipeline stage (the only place the loss needs them); the micro-batches' padding fraction goes to
    exp.stats["old_logprob_padding_fraction"]."""
    if exp.num_groups == 0:
        return
    score = partial(_response_logprobs_and_entropy, exp=exp, groups=groups, vocab_size=vocab_size,
                    temperature=temperature, micro_batch_size=micro_batch_size, chunk_tokens=chunk_tokens)
    exp.old_logprobs_NGT, exp.entropy_NGT, exp.stats["old_logprob_padding_fraction"] = score(model_chunks)
    if reference_chunks is not None:
        exp.ref_logprobs_NGT, _, _ = score(reference_chunks)


def _response_logprobs_and_entropy(model_chunks, *, exp: Experience, groups: ParallelGroups, vocab_size: int,
                                   temperature: float, micro_batch_size: int, chunk_tokens: int | None):
    """Response-aligned [n, G, T] log-probs and entropies (None off the last stage), and the padding fraction of
    the micro-batches. Length-bucketed: sequences are sorted by length before being cut into micro-batches, so each
    micro-batch is padded only to the longest of similar-length sequences."""
    sequences, starts = exp.sequences(), exp.response_starts()
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    micro_batches = make_micro_batches([sequences[i] for i in order], micro_batch_size,
                                       device=groups.device, pad_to_multiple=groups.sequence_multiple)
    padded = sum(mb.tokens_BL.numel() for mb in micro_batches)
    padding_fraction = 1.0 - sum(len(s) for s in sequences) / padded
    outputs = next_token_logprobs_and_entropy(model_chunks, micro_batches, groups, vocab_size=vocab_size,
                                              temperature=temperature, chunk_size=chunk_tokens, check_targets=False)
    if not groups.is_last_stage:
        return None, None, padding_fraction
    lengths = exp.response_lengths_NG().flatten().tolist()
    T = max(lengths)
    logprobs = torch.zeros(len(sequences), T, device=groups.device)
    entropy = torch.zeros(len(sequences), T, device=groups.device)
    rows = iter(order)
    for logprobs_BL, entropy_BL in outputs:
        for b in range(logprobs_BL.shape[0]):
            row = next(rows)
            start, n = starts[row] - 1, lengths[row]
            logprobs[row, :n] = logprobs_BL[b, start:start + n]
            entropy[row, :n] = entropy_BL[b, start:start + n]
    shape = (exp.num_groups, exp.group_size, T)
    return logprobs.reshape(shape), entropy.reshape(shape), padding_fraction


def _all_gather_padded(tensor: torch.Tensor, group, device: torch.device) -> list[torch.Tensor]:
    """all_gather of tensors whose sizes differ across ranks in every dim (padded, then cut back), through
    `device` (the group's: an NCCL group takes no host tensors); the parts come back on the tensor's device."""
    world = dist.get_world_size(group)
    if world == 1:
        return [tensor]
    shape = torch.tensor(tensor.shape, dtype=torch.long, device=device)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    shapes = [s.cpu() for s in shapes]
    max_shape = torch.stack(shapes).max(dim=0).values
    padded = tensor.new_zeros(max_shape.tolist(), device=device)
    padded[tuple(slice(0, s) for s in tensor.shape)] = tensor
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [p[tuple(slice(0, int(s)) for s in sh)].to(tensor.device) for p, sh in zip(parts, shapes)]


def global_advantages(advantage_fn: Callable, uses_entropy: bool, exp: Experience, groups: ParallelGroups):
    """Advantages of this rank's groups, computed over the global batch (the batch-scope z-scores of GTPO span
    every DP rank's groups; group-scope ones are unaffected). Last pipeline stage only. Returns [n, G, T] or
    [n, G]."""
    # The rewards and lengths come from the host (verifier, token lists): to the training device once per step.
    rewards = _all_gather_padded(exp.rewards_NG.to(groups.device), groups.dp_group, groups.device)
    counts = [r.shape[0] for r in rewards]
    mine = slice(sum(counts[:groups.dp_rank]), sum(counts[:groups.dp_rank + 1]))
    rewards_NG = torch.cat(rewards)
    if rewards_NG.shape[0] == 0:
        return None
    if not uses_entropy:
        return advantage_fn(rewards_NG)[mine]
    # A rank that kept no group (dynamic sampling) has no entropies, yet takes part in the gathers.
    own_entropy_NGT = exp.entropy_NGT if exp.num_groups else torch.zeros(0, exp.group_size, 0, device=groups.device)
    entropy = _all_gather_padded(own_entropy_NGT, groups.dp_group, groups.device)
    lengths = _all_gather_padded(exp.response_lengths_NG().to(groups.device), groups.dp_group, groups.device)
    T = max(e.shape[-1] for e in entropy)
    entropy_NGT = torch.cat([torch.nn.functional.pad(e, (0, T - e.shape[-1])) for e in entropy])
    mask_NGT = torch.arange(T, device=groups.device) < torch.cat(lengths)[..., None]
    advantages = advantage_fn(rewards_NG, entropy_NGT, mask_NGT)[mine]
    return advantages[..., :own_entropy_NGT.shape[-1]] if advantages.ndim == 3 else advantages
