"""One step's experience: sampled groups with their rewards, dynamic sampling included. The step batch
(step_batch.py) is built from it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megatron_gtpo.algorithms import informative_groups
from megatron_gtpo.distributed import ParallelGroups
from megatron_gtpo.rollout.engine import Response, SamplingParams


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

    def prompt_lengths(self) -> list[int]:
        """Per sequence, its prompt's length: where its response starts."""
        return [len(p) for p, group in zip(self.prompt_token_ids, self.responses) for _ in group]


def collect_experience(generate: Callable[[list[list[int]], int], list[list[Response]]],
                       next_prompts: Callable[[], list],
                       score_groups: Callable[[list, list[list[Response]]], torch.Tensor],
                       params: SamplingParams, parallel: ParallelGroups, *, target_prompt_groups: int,
                       dynamic_sampling: bool, max_extra_rounds: int,
                       length_penalty: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                       stand_by: Callable[[], None] | None = None) -> Experience:
    """Sample G responses per prompt (`generate(prompts, round_index)`) and score them (`score_groups(prompts,
    responses) -> [N, G]` verifier rewards in {0, 1}). With dynamic sampling, groups whose rewards are all equal
    (algorithms.informative_groups) are dropped and more prompts are drawn (at most `max_extra_rounds` more rounds,
    the same number on every DP rank so data loaders stay aligned) until `target_prompt_groups` informative groups
    are kept; then train on what there is. `length_penalty(lengths_NG, correct_NG) -> penalty_NG` is added to the
    rewards. `stand_by()` is called in the rounds where this rank has enough groups and generates nothing (the
    built-in engine then takes part in its expert-parallel peers' generation)."""
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
            keep_N = informative_groups(correct_NG) if dynamic_sampling else torch.ones(len(prompts), dtype=torch.bool)
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
        elif stand_by is not None:
            stand_by()
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
