"""One step's experience: sampled groups with their rewards, dynamic sampling included. The step batch
(step_batch.py) is built from it; the informative groups it did not need are its surplus, which the rollout queue
carries over to the next step (rollout_queue.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megatron_gtpo.algorithms import informative_groups
from megatron_gtpo.distributed import ParallelGroups
from megatron_gtpo.rollout.engine import SamplingParams
from megatron_gtpo.rollout.responses import Responses

from .sampled_groups import SampledGroups


@dataclass
class RewardedGroups:
    """Sampled groups with their rewards ([N, G] on the host, as `collect_experience` computed them)."""

    groups: SampledGroups
    correct_NG: torch.Tensor
    rewards_NG: torch.Tensor

    @classmethod
    def cat(cls, parts: list[RewardedGroups]) -> RewardedGroups:
        return cls(SampledGroups.cat([p.groups for p in parts]), torch.cat([p.correct_NG for p in parts]),
                   torch.cat([p.rewards_NG for p in parts]))

    @property
    def num_groups(self) -> int:
        return self.groups.num_groups

    def select(self, index_N: torch.Tensor) -> RewardedGroups:
        """Groups `index_N` (long indices), in that order."""
        index_N = index_N.cpu()
        return RewardedGroups(self.groups.select(index_N), self.correct_NG[index_N], self.rewards_NG[index_N])

    def to(self, device) -> RewardedGroups:
        """The groups' tensors on `device` (the rewards stay on the host)."""
        return dataclasses.replace(self, groups=self.groups.to(device))


@dataclass
class Experience:
    """This DP rank's prompt groups kept for training (n groups of G responses): what the rollout and the rewards
    produce, from which the step batch (step_batch.py) is built."""

    prompt_token_ids: list[tuple[int, ...]]  # [n]
    responses: Responses  # the n groups' G responses each, as the engine left them (the training device)
    correct_NG: torch.Tensor  # float {0, 1}: the verifier's reward
    rewards_NG: torch.Tensor  # correctness plus the length penalty (if any): what the advantages see
    stats: dict = field(default_factory=dict)
    prompts: list = field(default_factory=list)  # [n] the loader's items (ids, answers) of the kept groups
    # int64: the policy version that sampled each response token, and each response's first token (its oldest;
    # partial_rollouts.SampledGroups)
    versions_T: torch.Tensor | None = None
    start_versions_R: torch.Tensor | None = None
    # Routing replay (algorithm.routing_replay: rollout): per response of `responses` (prompt-major), the experts
    # [P + R - 1, M, k] its fed tokens went to at this rank's MoE layers (the engine's generate_routed: the built-in
    # engine's on the device, vLLM's on the host until the step batch). Rank-local: each pipeline stage keeps its own
    # layers, so it never goes through the transport with the record.
    routed_experts: list[torch.Tensor] | None = None
    continued_R: torch.Tensor | None = None  # bool: sampled by more than one version (SampledGroups.continued_R)
    surplus: RewardedGroups | None = None  # informative groups beyond the step's need, in the order sampled

    @property
    def num_prompt_groups(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def group_size(self) -> int:
        return self.correct_NG.shape[1]  # G even when this rank kept no group ([0, G])


def collect_experience(sample_round: Callable[[int], Callable[[], SampledGroups]],
                       reward_groups: Callable[[list, Responses], torch.Tensor],
                       params: SamplingParams, parallel: ParallelGroups, *, target_prompt_groups: int,
                       dynamic_sampling: bool, max_extra_rounds: int,
                       length_penalty: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                       stand_by: Callable[[], None] | None = None,
                       carried: RewardedGroups | None = None) -> Experience:
    """Sample G responses per prompt and reward them. `sample_round(round_index)` draws a round's prompts and gives
    the function that returns its groups (called only when the round is needed: the engine is asked then, unless
    the round was asked for ahead, as round 0 always is); `reward_groups(prompts, responses) -> [N, G]` verifier
    rewards in {0, 1}, on the host. `carried`: groups rewarded in an earlier step (the rollout queue's), kept first.
    With dynamic sampling, groups whose rewards are all equal (algorithms.informative_groups) are dropped and
    more prompts are drawn (at most `max_extra_rounds` more rounds, the same number on every DP rank so data loaders
    stay aligned) until `target_prompt_groups` informative groups are kept; then train on what there is. Round 0 is
    always rewarded (it was generated ahead); the groups it would keep (with dynamic sampling the informative ones)
    beyond the target are the surplus. A round's groups come in the order the engine was asked for them: with
    partial rollouts the continued (older) ones first, so they are kept first. `length_penalty(lengths_NG,
    correct_NG) -> penalty_NG` is added to the rewards. The kept groups' responses are selected and concatenated as
    tensors where the engine left them; only their lengths and finish reasons come to the host (rewards, stats).
    `stand_by()` is called in the rounds where this rank has enough groups and generates nothing (the built-in
    engine then takes part in its expert-parallel peers' generation)."""
    kept: list[RewardedGroups] = []
    surplus: list[RewardedGroups] = []
    all_correct, all_rewards, all_lengths, all_truncated = [], [], [], []
    rounds = 0

    def kept_groups():
        return sum(k.num_groups for k in kept)

    def keep(groups: RewardedGroups, chosen_K: torch.Tensor) -> None:
        need = target_prompt_groups - kept_groups()
        kept.append(groups.select(chosen_K[:need]))
        surplus.append(groups.select(chosen_K[need:]))

    if carried is not None:
        keep(carried, torch.arange(carried.num_groups))
    while True:
        wait = sample_round(rounds)
        if not rounds or kept_groups() < target_prompt_groups:
            groups = wait()
            correct_NG = reward_groups(groups.prompts, groups.responses)
            lengths_NG = groups.responses.lengths_NG().cpu().float()
            rewards_NG = correct_NG + (length_penalty(lengths_NG, correct_NG) if length_penalty else 0.0)
            # Filter on correctness, before length penalties (DAPO's rule).
            keep_N = informative_groups(correct_NG) if dynamic_sampling \
                else torch.ones(groups.num_groups, dtype=torch.bool)
            keep(RewardedGroups(groups, correct_NG, rewards_NG), keep_N.nonzero().flatten())
            all_correct.append(correct_NG.flatten())
            all_rewards.append(rewards_NG.flatten())
            all_lengths.append(lengths_NG.flatten())
            all_truncated.append(groups.responses.truncated_R().cpu().float())
        elif stand_by is not None:
            stand_by()
        rounds += 1
        # Collectives run on the process groups' device: an NCCL group takes no host tensors.
        short = torch.tensor([float(kept_groups() < target_prompt_groups)], device=parallel.device)
        dist.all_reduce(short, op=dist.ReduceOp.MAX, group=parallel.dp_group)
        if not dynamic_sampling or short.item() == 0 or rounds > max_extra_rounds:
            break
    G = params.n
    stats = {
        "reward_mean": torch.cat(all_rewards).mean().item(),
        "accuracy": torch.cat(all_correct).mean().item(),
        "response_length_mean": torch.cat(all_lengths).mean().item(),
        "response_length_max": torch.cat(all_lengths).max().item() if sum(map(len, all_lengths)) else float("nan"),
        "response_clip_ratio": torch.cat(all_truncated).mean().item(),
        "sampling_rounds": rounds,
        "groups_generated": sum(len(c) for c in all_correct) // G,
        "groups_kept": kept_groups(),
        "groups_from_carry": min(carried.num_groups, target_prompt_groups) if carried is not None else 0,
    }
    chosen = RewardedGroups.cat(kept)
    groups = chosen.groups
    return Experience([p.prompt_token_ids for p in groups.prompts], groups.responses, chosen.correct_NG,
                      chosen.rewards_NG, stats, groups.prompts, groups.versions_T, groups.start_versions_R,
                      groups.routed_experts, groups.continued_R(), RewardedGroups.cat(surplus))
