"""Rollouts asked for ahead of training (rollout.max_staleness = N), and the groups partial rollouts left unfinished.

Step k trains on batch k: the prompts the loader gave for it and the engine's responses to them. Batch k is asked
for at step max(0, k - N), once that step's own batch has arrived, so it is generated with the policy of version
max(0, k - N) (the weights after that many steps) while the trainer trains the steps in between, and no batch is
trained on more than N versions after the weights that sampled it. The schedule is fixed, so a run is the same
whatever the engines' speed. N = 0 asks for batch k and waits for it at once: the on-policy trainer, call for call.

With partial rollouts (partial_rollouts.py) each batch asked for also continues the groups left unfinished by the
batches and rounds waited for until then. A step waits for its batch before it asks for the next, so the
unfinished responses of batch k continue in batch k + N, sampled N versions later (N = 0: in batch k + 1, one
version later): a response of s segments is trained at most (s - 1) x max(N, 1) + N versions after its first token
was sampled (s x N at N >= 1).

A checkpoint holds the batches asked for and not yet trained on (`state_dict` waits for them: the prompts, the
version that generated them, their rollout records and the groups they continue) and the unfinished groups, so a
resumed run trains on the very batches an uninterrupted one would, in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .partial_rollouts import PartialRollouts, SampledGroups


@dataclass
class AskedBatch:
    """One sampling round asked of the engine: its new prompts (the loader's items), the policy version (steps
    trained) whose weights generate it, the function that waits for the engine's answer (collective over the model
    replica), and with partial rollouts the groups whose unfinished responses it continues."""

    step: int
    version: int
    prompts: list
    wait: Callable
    continued: SampledGroups | None = None


class RolloutQueue:
    """The batches asked for and not yet trained on, and the unfinished groups (module doc). `ask(step, version,
    continued)` draws a batch's prompts and asks the engine for its responses (and the continuation of
    `continued`'s unfinished responses). `device`: the training device, where a restored state's tensors go."""

    def __init__(self, max_staleness: int, ask: Callable[[int, int, SampledGroups | None], AskedBatch], *,
                 steps: int, partial: PartialRollouts | None = None, device: torch.device | None = None):
        self.max_staleness = max_staleness
        self.ask = ask
        self.steps = steps  # the run's: no batch is asked for beyond its last step
        self.partial = partial
        self.device = device
        self.asked: dict[int, AskedBatch] = {}
        self.unfinished: SampledGroups | None = None  # waiting for the next batch asked for

    def take(self, step: int) -> SampledGroups:
        """The groups of batch `step`, waited for (asked for now if it was not: N = 0, or the first step); then every
        batch up to step + N (and before the run's end) not asked for yet is asked for, with the weights of now
        (version `step`): the engine generates those while this one trains. Waiting first lets the asked batches
        continue the responses this one left unfinished (partial rollouts) N versions after it, not N + 1; at
        N >= 1 it costs no time, since the batch was generated before the weight update that ended the last step
        (the update drains the engine)."""
        if step not in self.asked:
            self._ask(step, step)
        groups = self.groups(self.asked.pop(step))
        for later in range(step + 1, min(step + self.max_staleness + 1, self.steps)):
            if later not in self.asked:
                self._ask(later, step)
        return groups

    def _ask(self, step: int, version: int) -> None:
        continued, self.unfinished = self.unfinished, None
        self.asked[step] = self.ask(step, version, continued)

    def groups(self, asked: AskedBatch) -> SampledGroups:
        """The groups of a round, waited for: with partial rollouts only the complete ones; the others wait for the
        next batch asked for."""
        rollout = asked.wait()
        if self.partial is None:
            return SampledGroups.sampled(asked.prompts, rollout, asked.version)
        complete, unfinished = self.partial.merge(asked.continued, asked.prompts, rollout, asked.version)
        self.unfinished = unfinished if self.unfinished is None else SampledGroups.cat([self.unfinished, unfinished])
        return complete

    def state_dict(self) -> dict:
        """Every batch asked for, waited for (collective over the model replica), and the unfinished groups, on the
        host."""
        cpu = torch.device("cpu")
        batches = {}
        for step, batch in sorted(self.asked.items()):
            responses = batch.wait()
            self.asked[step] = AskedBatch(step, batch.version, batch.prompts, lambda r=responses: r, batch.continued)
            batches[step] = {"version": batch.version, "prompts": batch.prompts,
                             "responses": _rollout_to(responses, cpu),
                             "continued": _moved(batch.continued, cpu)}
        return {"batches": batches, "unfinished": _moved(self.unfinished, cpu)}

    def load_state_dict(self, state: dict) -> None:
        """From `state_dict()`'s host state, moved to the training device."""
        device = self.device
        self.asked = {step: AskedBatch(step, b["version"], b["prompts"],
                                       lambda r=_rollout_to(b["responses"], device): r,
                                       _moved(b["continued"], device))
                      for step, b in state["batches"].items()}
        self.unfinished = _moved(state["unfinished"], device)


def _rollout_to(rollout, device: torch.device):
    """An engine's answer with its record on `device`: a record, or with routing replay (record, per response its
    routing), whose routing goes to the host (rank-local, like the file it is saved in)."""
    if isinstance(rollout, tuple):
        record, routes = rollout
        return record.to(device), [r.cpu() for r in routes]
    return rollout.to(device)


def _moved(groups: SampledGroups | None, device: torch.device) -> SampledGroups | None:
    return None if groups is None else groups.to(device)
