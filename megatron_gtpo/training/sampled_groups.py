"""Sampled groups: prompt groups of G responses each as the engine left them, with the policy version of every token.

The record's path: engine (a `Rollout`, rollout/engine.py) -> rollout source (rollout_source.py; whole responses or
partial rollouts) -> groups (here) -> experience (experience.py, rewarded and filtered) -> step batch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_gtpo.rollout.engine import Rollout
from megatron_gtpo.rollout.responses import Responses


@dataclass
class SampledGroups:
    """Prompt groups of G responses each, as sampled so far: the loader's items, their record (prompt-major), per
    token the policy version (steps trained) whose weights sampled it, and per response the version of its first
    segment (its oldest). With routing replay, per response the experts the engine routed its tokens to
    (rank-local; experience.py); where the engine records them, per token the entropy it was sampled with
    (`Rollout.entropies_T`; none for groups continued over several calls)."""

    prompts: list  # [N]
    responses: Responses
    versions_T: torch.Tensor  # int64, on the record's device
    start_versions_R: torch.Tensor  # int64, on the record's device
    routed_experts: list[torch.Tensor] | None = None
    entropies_T: torch.Tensor | None = None  # float32, on the record's device

    @classmethod
    def sampled(cls, prompts: list, rollout: Rollout, version: int) -> SampledGroups:
        """One engine call's groups, made with the weights of `version` (each token sampled by those or, where the
        engine took updates during the call, later ones)."""
        responses, routes = rollout.responses, rollout.routed_experts
        return cls(prompts, responses, sampled_versions(responses, version),
                   filled(responses.num_responses, version, responses.device), routes, rollout.entropies_T)

    @classmethod
    def cat(cls, parts: list[SampledGroups]) -> SampledGroups:
        """The groups of `parts` one after the other (at least one part; routing and entropies with none or all
        parts)."""
        routes = None if any(p.routed_experts is None for p in parts) else \
            [r for p in parts for r in p.routed_experts]
        entropies = None if any(p.entropies_T is None for p in parts) else torch.cat([p.entropies_T for p in parts])
        return cls([x for p in parts for x in p.prompts], Responses.cat([p.responses for p in parts]),
                   torch.cat([p.versions_T for p in parts]), torch.cat([p.start_versions_R for p in parts]), routes,
                   entropies)

    @property
    def num_groups(self) -> int:
        return len(self.prompts)

    def select(self, index_N) -> SampledGroups:
        """Groups `index_N` (long indices), in that order."""
        index = self.responses.prompt_index(index_N)
        routes = None if self.routed_experts is None else [self.routed_experts[r] for r in index["R"].tolist()]
        entropies = None if self.entropies_T is None else self.entropies_T.index_select(0, index["T"])
        return SampledGroups([self.prompts[i] for i in index["P"].tolist()], self.responses.gather(index),
                             self.versions_T.index_select(0, index["T"]),
                             self.start_versions_R.index_select(0, index["R"]), routes, entropies)

    def to(self, device) -> SampledGroups:
        """The groups' tensors on `device` (the routing is rank-local and not moved)."""
        return dataclasses.replace(self, responses=self.responses.to(device), versions_T=self.versions_T.to(device),
                                   start_versions_R=self.start_versions_R.to(device),
                                   entropies_T=None if self.entropies_T is None else self.entropies_T.to(device))

    def last_versions_R(self) -> torch.Tensor:
        """int64 [R]: the version that sampled each response's last token (its first segment's when it is empty)."""
        return self._token_versions_R(self.responses.lengths_R - 1)

    def continued_R(self) -> torch.Tensor:
        """bool [R]: the response was sampled by more than one version (its last token's is newer than its first
        token's; versions never decrease along a response): continued by a later engine call (partial rollouts), or
        across a weight update the engine took while generating it. Not a response whose every token a version newer
        than its batch's sampled (a generation started after an update it was asked for before)."""
        return (self.responses.lengths_R > 0) & (self.last_versions_R() > self._token_versions_R(0))

    def _token_versions_R(self, offset_R) -> torch.Tensor:
        """int64 [R]: the version of token `offset_R` (from the response's first) of each response; its first
        segment's for an empty response."""
        lengths_R = self.responses.lengths_R
        token_R = (self.responses.token_starts_R() + offset_R).clamp(min=0)
        versions_R = self.versions_T[token_R] if self.versions_T.numel() else self.start_versions_R
        return torch.where(lengths_R > 0, versions_R, self.start_versions_R)

    def newest_versions_N(self) -> torch.Tensor:
        """int64 [N]: per group, the newest version that sampled one of its tokens (when it was completed)."""
        counts_P = self.responses.responses_per_prompt_P
        owner_R = torch.repeat_interleave(torch.arange(self.num_groups, device=counts_P.device), counts_P)
        return torch.zeros(self.num_groups, dtype=torch.int64, device=counts_P.device).scatter_reduce(
            0, owner_R, self.last_versions_R(), "amax", include_self=False)


def filled(size: int, value: int, device) -> torch.Tensor:
    """int64 [size] of `value` (a policy version per token or response)."""
    return torch.full((size,), value, dtype=torch.int64, device=device)


def sampled_versions(responses: Responses, version: int) -> torch.Tensor:
    """int64 [T]: the policy version that sampled each token of an engine call made with the weights of `version`
    (plus the weight updates the engine took before the token)."""
    return responses.weight_updates_T.to(torch.int64) + version

