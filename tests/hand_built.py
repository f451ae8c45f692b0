"""Hand-built inputs of the training side: rewarded groups for the tests that build step batches from them (the
loader's items for prompt token ids, an engine's record wrapped as its `Rollout`, sampled at one policy version), and
a rollout queue over a scripted engine."""
import torch

from megatron_gtpo.config import ScheduleConfig
from megatron_gtpo.data.records import PromptSample
from megatron_gtpo.distributed import ParallelGroups
from megatron_gtpo.rollout.engine import Rollout, SamplingParams
from megatron_gtpo.rollout.responses import Responses
from megatron_gtpo.training.experience import GroupSelection, RewardedGroups
from megatron_gtpo.training.rollout_queue import RolloutQueue
from megatron_gtpo.training.rollout_source import RolloutSource
from megatron_gtpo.training.sampled_groups import SampledGroups


def prompt_samples(prompt_token_ids: list, first_index: int = 0) -> list[PromptSample]:
    """The loader's items of these prompts (ids "p<index>", no answer)."""
    return [PromptSample(first_index + i, f"p{first_index + i}", tuple(ids), "")
            for i, ids in enumerate(prompt_token_ids)]


def rewarded_groups(prompt_token_ids: list, record: Responses, correct_NG: torch.Tensor,
                    rewards_NG: torch.Tensor | None = None, *, version: int = 0,
                    routed_experts: list | None = None, entropies_T: torch.Tensor | None = None) -> RewardedGroups:
    """The groups of `record` (prompt-major, one group per prompt) sampled by `version`, with the verifier's
    rewards `correct_NG` and the rewards `rewards_NG` (the same by default); the engine's routing and sampling
    entropies where given."""
    groups = SampledGroups.sampled(prompt_samples(prompt_token_ids),
                                   Rollout(record, routed_experts, entropies_T=entropies_T), version)
    return RewardedGroups(groups, correct_NG, correct_NG.clone() if rewards_NG is None else rewards_NG)


class ScriptedEngine:
    """A rollout engine (rollout/engine.RolloutEngine's submit and stand_by) whose answers `answer(prompts, params)
    -> Rollout` gives; it keeps the calls' params and counts its stand-bys."""

    def __init__(self, answer):
        self.answer = answer
        self.asked: list[SamplingParams] = []
        self.stand_bys = 0
        self.idle_answers: list[bool] = []

    def submit(self, prompts: list[list[int]], params: SamplingParams):
        self.asked.append(params)
        rollout = self.answer(prompts, params)
        return lambda: rollout

    def idle(self) -> bool:
        """The next of `idle_answers` (set by a test of rollout.schedule.ahead_schedule when_idle)."""
        return self.idle_answers.pop(0)

    def stand_by(self) -> None:
        self.stand_bys += 1


def scripted_queue(answer, requests, *, max_staleness: int, steps: int, group_size: int, prompts_per_draw: int = 1,
                   selection: GroupSelection | None = None, reward=None, dp_group=None, rounds_ahead: int = 0,
                   first_draw: int = 0, when_idle: bool = False) -> RolloutQueue:
    """A rollout queue over a `ScriptedEngine` (`queue.source.engine`): draw i (from `first_draw`, as a resumed
    loader) gives prompts 1000 + i x `prompts_per_draw` ... (one token each, ids "p<index>"), round r of step k is
    asked with seed 10 k + r. `selection`, `reward(prompts, responses) -> [N, G]` and the data-parallel group
    `dp_group` for its `experience` (by default one group a step, every response correct, no group);
    `rounds_ahead` as rollout.schedule.rounds_ahead, `when_idle` as its schedule "when_idle"."""
    draws = iter(range(first_draw, 10**6))

    def draw_prompts():
        first = next(draws) * prompts_per_draw
        return prompt_samples([(1000 + first + i,) for i in range(prompts_per_draw)], first)

    source = RolloutSource(draw_prompts, requests, lambda step, round_index: SamplingParams(
        n=group_size, max_new_tokens=8, seed=10 * step + round_index), oversample_batches=0)
    source.engine = ScriptedEngine(answer)
    return RolloutQueue(source, selection or GroupSelection(1, True, 0, None),
                        reward or (lambda prompts, responses: torch.ones(responses.num_prompts, group_size)),
                        ParallelGroups.data_parallel_rank(dp_group, torch.device("cpu")),
                        schedule=ScheduleConfig(max_staleness=max_staleness, rounds_ahead=rounds_ahead,
                                                ahead_schedule="when_idle" if when_idle else "fixed"), steps=steps)
