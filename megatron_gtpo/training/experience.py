"""One step's experience: sampled groups with their rewards, dynamic sampling included, and the statistics of the
rounds that gave them. The step batch (step_batch.py) is built from its kept groups; the informative groups it did not
need are the surplus, which the rollout queue carries over to the next step (rollout_queue.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megatron_gtpo.algorithms import informative_groups
from megatron_gtpo.distributed import ParallelGroups
from megatron_gtpo.rollout.responses import Responses

from .reduction import MetricReducer
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

    @property
    def group_size(self) -> int:
        return self.correct_NG.shape[1]  # G even without groups ([0, G])

    def select(self, index_N: torch.Tensor) -> RewardedGroups:
        """Groups `index_N` (long indices), in that order."""
        index_N = index_N.cpu()
        return RewardedGroups(self.groups.select(index_N), self.correct_NG[index_N], self.rewards_NG[index_N])

    def to(self, device) -> RewardedGroups:
        """The groups' tensors on `device` (the rewards stay on the host)."""
        return dataclasses.replace(self, groups=self.groups.to(device))


@dataclass(frozen=True)
class GroupSelection:
    """Which groups a step keeps, decided once for the run: `target_prompt_groups` per data-parallel rank; with
    `dynamic_sampling` only informative ones (algorithms.informative_groups), drawing at most `max_extra_rounds` more
    rounds for them; `length_penalty(lengths_NG, correct_NG) -> penalty_NG` (None: none) is added to the rewards."""

    target_prompt_groups: int
    dynamic_sampling: bool
    max_extra_rounds: int
    length_penalty: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None


@dataclass
class Experience:
    """This data-parallel rank's groups kept for one step (n groups of G responses), from which the step batch
    (step_batch.py) is built, and the statistics of the step's rollout: reduction.METRICS by name, the rollout queue's
    included (rollout_queue.py)."""

    kept: RewardedGroups
    stats: dict

    def record(self, metrics: MetricReducer, step: int) -> None:
        """The statistics, and how many versions before `step` the kept responses were sampled (step - the version
        of their first token; 0 on policy), the fraction continued by a later version, and the fraction of their
        tokens an earlier version sampled, as totals over the kept responses and tokens (device tensors)."""
        groups = self.kept.groups
        metrics.add(self.stats, {"responses": self.stats["groups_generated"] * self.kept.group_size})
        metrics.add_totals({"staleness_mean": (step - groups.start_versions_R).double().sum(),
                            "continued_fraction": groups.continued_R().double().sum(),
                            "stale_token_fraction": (groups.versions_T < step).double().sum()},
                           {"kept_responses": groups.responses.num_responses,
                            "kept_tokens": groups.responses.num_tokens})
        if groups.num_groups:
            metrics.add({"staleness_max": int((step - groups.start_versions_R).max())})


def collect_experience(sample_round: Callable[[int], tuple[Callable[[], SampledGroups], bool]],
                       reward_groups: Callable[[list, Responses], torch.Tensor], selection: GroupSelection,
                       parallel: ParallelGroups, *, stand_by: Callable[[], None],
                       carried: RewardedGroups | None) -> tuple[Experience, RewardedGroups]:
    """Sample G responses per prompt and reward them: (the experience, its surplus). `sample_round(round_index)` draws a
    round's prompts and gives (the function that returns its groups, whether the round was asked for ahead): a round
    asked for ahead (round 0 always; with rollout.schedule.rounds_ahead further rounds too) is always rewarded, another
    is waited for only when needed (the engine is asked then); `reward_groups(prompts, responses) -> [N, G]` verifier
    rewards in {0, 1}, on the host. `carried`: groups rewarded in an earlier step (the rollout queue's), kept first.
    With dynamic sampling (`selection`), groups whose rewards are all equal (algorithms.informative_groups) are dropped
    and more prompts are drawn (at most `max_extra_rounds` more rounds, the same number on every DP rank so data loaders
    stay aligned) until `target_prompt_groups` informative groups are kept; then train on what there is. The groups a
    rewarded round would keep (with dynamic sampling the informative ones) beyond the target are the surplus. A round's
    groups come in the order the engine was asked for them: with partial rollouts the continued (older) ones first, so
    they are kept first. The length penalty is added to the rewards. The kept groups' responses are selected and
    concatenated as tensors where the engine left them; only their lengths and finish reasons come to the host (rewards,
    stats). `stand_by()` is called in the rounds where this rank has enough groups and generates nothing (the built-in
    engine then takes part in its expert-parallel peers' generation)."""
    target = selection.target_prompt_groups
    kept: list[RewardedGroups] = []
    surplus: list[RewardedGroups] = []
    all_correct, all_rewards, all_lengths, all_truncated = [], [], [], []
    rounds = 0

    def kept_groups():
        return sum(k.num_groups for k in kept)

    def keep(groups: RewardedGroups, chosen_K: torch.Tensor) -> None:
        need = target - kept_groups()
        kept.append(groups.select(chosen_K[:need]))
        surplus.append(groups.select(chosen_K[need:]))

    if carried is not None:
        keep(carried, torch.arange(carried.num_groups))
    while True:
        wait, asked_ahead = sample_round(rounds)
        if asked_ahead or kept_groups() < target:
            groups = wait()
            correct_NG = reward_groups(groups.prompts, groups.responses)
            lengths_NG = groups.responses.lengths_NG().cpu().float()
            penalty = selection.length_penalty
            rewards_NG = correct_NG + (penalty(lengths_NG, correct_NG) if penalty else 0.0)
            # Filter on correctness, before length penalties (DAPO's rule).
            keep_N = informative_groups(correct_NG) if selection.dynamic_sampling \
                else torch.ones(groups.num_groups, dtype=torch.bool)
            keep(RewardedGroups(groups, correct_NG, rewards_NG), keep_N.nonzero().flatten())
            all_correct.append(correct_NG)
            all_rewards.append(rewards_NG.flatten())
            all_lengths.append(lengths_NG.flatten())
            all_truncated.append(groups.responses.truncated_R().cpu().float())
        else:
            stand_by()
        rounds += 1
        # Collectives run on the process groups' device: an NCCL group takes no host tensors.
        short = torch.tensor([float(kept_groups() < target)], device=parallel.device)
        dist.all_reduce(short, op=dist.ReduceOp.MAX, group=parallel.dp_group)
        if not selection.dynamic_sampling or short.item() == 0 or rounds > selection.max_extra_rounds:
            break
    stats = {"sampling_rounds": rounds, "groups_generated": sum(len(c) for c in all_correct),
             "groups_kept": kept_groups(),
             "groups_from_carry": min(carried.num_groups, target) if carried is not None else 0}
    if stats["groups_generated"]:  # partial rollouts may complete no group in a step: then there is no mean
        lengths = torch.cat(all_lengths)
        stats.update(reward_mean=torch.cat(all_rewards).mean().item(),
                     accuracy=torch.cat([c.flatten() for c in all_correct]).mean().item(),
                     response_length_mean=lengths.mean().item(),
                     response_length_max=lengths.max().item(),
                     response_clip_ratio=torch.cat(all_truncated).mean().item())
    return Experience(RewardedGroups.cat(kept), stats), RewardedGroups.cat(surplus)
