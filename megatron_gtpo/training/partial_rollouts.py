"""How engine answers become sampled groups: whole responses, or partial rollouts (rollout.schedule.partial_rollouts).
Both implement one interface (`RolloutRequests`): `request(continued, prompts, params)` gives the engine call that
starts G responses for each new prompt (and continues `continued`'s unfinished ones), `merge(continued, prompts,
rollout, version)` gives (complete groups, groups still unfinished or None). The rollout queue (rollout_queue.py) and
the trainer use only this interface.

With partial rollouts every engine call generates at most `segment_tokens` (rollout.schedule.partial_segment_tokens)
tokens per response. A group of G responses is complete when each of them is finished (it sampled a stop token, or
max_new_tokens in all); only complete groups are rewarded and trained on. A group with an unfinished response waits, and
the next batch asked for continues each of its unfinished responses for one more segment under the weights of then: the
engine's prompt is the response's prompt followed by its tokens so far. Tokens keep the policy version that sampled them
and their behaviour log-probs, so the rollout correction weighs each token against the policy that sampled it. A
response spans at most max_new_tokens / segment_tokens engine calls, so that many versions.

This is Kimi k1.5's scheme (a fixed budget of output tokens per step; the unfinished rest continues in the next)
rather than slime's (abort the unfinished responses once enough groups are done): with a budget, which tokens each
policy version samples depends on the responses only, not on the engines' speed, so a run is reproducible and a
resumed run trains on what an uninterrupted one does (docs/algorithms.md, "Partial rollouts").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_gtpo.rollout.engine import Rollout, SamplingParams
from megatron_gtpo.rollout.responses import FINISH_LENGTH_CODE, Responses, concat_per_response

from .sampled_groups import SampledGroups, filled, sampled_versions

__all__ = ["PartialRollouts", "RolloutRequests", "WholeResponses"]


class RolloutRequests(Protocol):
    """The engine calls of a batch and the groups their answers make (module doc)."""

    def request(self, continued: SampledGroups | None, prompts: list, params: SamplingParams) \
            -> tuple[list[list[int]], SamplingParams]:
        ...

    def merge(self, continued: SampledGroups | None, prompts: list, rollout: Rollout, version: int) \
            -> tuple[SampledGroups, SampledGroups | None]:
        ...

    def metrics(self, unfinished: SampledGroups | None) -> dict:
        """The step's metrics of the groups left unfinished (reduction.METRICS)."""
        ...


@dataclass(frozen=True)
class WholeResponses:
    """Each engine call generates whole responses: every group it answers is complete, none continues."""

    def request(self, continued: SampledGroups | None, prompts: list, params: SamplingParams) \
            -> tuple[list[list[int]], SamplingParams]:
        """One engine prompt per new prompt, params.n responses each (`continued` is always None here)."""
        return [list(p.prompt_token_ids) for p in prompts], params

    def merge(self, continued: SampledGroups | None, prompts: list, rollout: Rollout, version: int) \
            -> tuple[SampledGroups, None]:
        return SampledGroups.sampled(prompts, rollout, version), None

    def metrics(self, unfinished: SampledGroups | None) -> dict:
        return {}


@dataclass(frozen=True)
class PartialRollouts:
    """The engine requests of partial rollouts and the groups they complete (module doc)."""

    group_size: int  # G
    max_new_tokens: int  # a response's budget, over all its segments
    segment_tokens: int  # one engine call's, per response

    def __post_init__(self):
        # Decided by the configuration (config.RolloutConfig.check, rollout.schedule.partial_segment_tokens): a segment
        # in [1, max_new_tokens) that divides it, so every unfinished response has a whole number of segments left.
        assert 1 <= self.segment_tokens < self.max_new_tokens and not self.max_new_tokens % self.segment_tokens, \
            "rollout.schedule.partial_segment_tokens: RolloutConfig.check's rule"

    def unfinished_R(self, responses: Responses) -> torch.Tensor:
        """bool [R]: the response stopped at a segment's end, short of max_new_tokens and of a stop token."""
        return (responses.finish_R == FINISH_LENGTH_CODE) & (responses.lengths_R < self.max_new_tokens)

    def request(self, continued: SampledGroups | None, prompts: list, params: SamplingParams) \
            -> tuple[list[list[int]], SamplingParams]:
        """The engine call (prompts, params) that continues `continued`'s unfinished responses (its first rows, in
        record order) and starts G responses for each of `prompts` (the following rows, G each): one response per
        row, at most one segment each. Row seeds follow from `params.seed` as for any call (engine.response_seed)."""
        rows = []
        if continued is not None:
            unfinished = self.unfinished_R(continued.responses).tolist()
            groups = continued.responses.responses_per_prompt_P.tolist()
            owners = [i for i, count in enumerate(groups) for _ in range(count)]
            for r, ids in enumerate(continued.responses.token_id_lists()):
                if unfinished[r]:
                    rows.append(list(continued.prompts[owners[r]].prompt_token_ids) + ids)
        rows += [list(p.prompt_token_ids) for p in prompts for _ in range(self.group_size)]
        return rows, dataclasses.replace(params, n=1, max_new_tokens=self.segment_tokens)

    def merge(self, continued: SampledGroups | None, prompts: list, rollout: Rollout, version: int) \
            -> tuple[SampledGroups, SampledGroups]:
        """(complete groups, groups with an unfinished response) after the call `request(continued, prompts, ...)`
        answered with `rollout` (no routing: config_rules refuses routing replay with partial rollouts), sampled by
        the weights of `version`: `continued`'s groups first, then the new ones, each in the order they were asked
        for."""
        record = rollout.responses
        device = record.device
        continuing = record.num_prompts - len(prompts) * self.group_size  # rows that continue responses
        rows = record.select_prompts(torch.arange(continuing))
        fresh = record.select_prompts(torch.arange(continuing, record.num_prompts))
        fresh = dataclasses.replace(fresh, responses_per_prompt_P=filled(len(prompts), self.group_size, device))
        parts = [SampledGroups.sampled(prompts, Rollout(fresh), version)]
        if continued is not None:
            parts.insert(0, self._continue(continued.to(device), rows, version))
        groups = SampledGroups.cat(parts)
        done_N = ~self.unfinished_R(groups.responses).view(groups.num_groups, self.group_size).any(dim=1)
        return groups.select(done_N.nonzero().flatten()), groups.select((~done_N).nonzero().flatten())

    def metrics(self, unfinished: SampledGroups | None) -> dict:
        return {"groups_unfinished": unfinished.num_groups if unfinished is not None else 0}

    def _continue(self, groups: SampledGroups, rows: Responses, version: int) -> SampledGroups:
        """`groups` with each unfinished response followed by its row of `rows` (in order), sampled by `version`;
        finished responses get an empty continuation."""
        responses = groups.responses
        where_U = self.unfinished_R(responses).nonzero().flatten()
        lengths_R = torch.zeros_like(responses.lengths_R).index_copy(0, where_U, rows.lengths_R)
        finish_R = responses.finish_R.index_copy(0, where_U, rows.finish_R)
        continuation = Responses(responses_per_prompt_P=responses.responses_per_prompt_P, lengths_R=lengths_R,
                                 finish_R=finish_R, token_ids_T=rows.token_ids_T, logprobs_T=rows.logprobs_T,
                                 weight_updates_T=rows.weight_updates_T)
        versions_T = concat_per_response(groups.versions_T, responses.lengths_R, sampled_versions(rows, version),
                                         lengths_R)
        return SampledGroups(groups.prompts, responses.extend(continuation), versions_T, groups.start_versions_R)


