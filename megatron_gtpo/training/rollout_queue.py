"""Rollouts asked for ahead of training: bounded staleness (rollout.max_staleness = N).

Step k trains on batch k: the prompts the loader gave for it and the engine's responses to them. Batch k is asked
for when step max(0, k - N) begins, so it is generated with the policy of version max(0, k - N) (the weights after
that many steps) while the trainer trains the steps in between, and no batch is trained on more than N versions
after the weights that sampled it. The schedule is fixed, so a run is the same whatever the engines' speed.
N = 0 asks for batch k and waits for it at once: the on-policy trainer, call for call.

A checkpoint holds the batches asked for and not yet trained on (`state_dict` waits for them: the prompts, the
version that generated them and their rollout records), so a resumed run trains on the very batches an
uninterrupted one would, in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron_gtpo.rollout.responses import Responses


@dataclass
class AskedBatch:
    """One step's first sampling round: its prompts (the loader's items), the policy version (steps trained) whose
    weights generate it, and the function that waits for its record (collective over the model replica)."""

    step: int
    version: int
    prompts: list
    wait: Callable[[], Responses]


class RolloutQueue:
    """The batches asked for and not yet trained on (module doc). `ask(step, version)` draws a batch's prompts and
    asks the engine for its responses."""

    def __init__(self, max_staleness: int, ask: Callable[[int, int], AskedBatch], *, steps: int):
        self.max_staleness = max_staleness
        self.ask = ask
        self.steps = steps  # the run's: no batch is asked for beyond its last step
        self.asked: dict[int, AskedBatch] = {}

    def take(self, step: int) -> AskedBatch:
        """Batch `step`, after asking for every batch up to step + N (and before the run's end) not asked for yet,
        with the weights of now (version `step`): the engine generates those while this one trains."""
        for later in range(step, max(step + 1, min(step + self.max_staleness + 1, self.steps))):
            if later not in self.asked:
                self.asked[later] = self.ask(later, step)
        return self.asked.pop(step)

    def state_dict(self) -> dict:
        """Every batch asked for, waited for (collective over the model replica), on the host."""
        state = {}
        for step, batch in sorted(self.asked.items()):
            responses = batch.wait()
            self.asked[step] = AskedBatch(step, batch.version, batch.prompts, lambda r=responses: r)
            state[step] = {"version": batch.version, "prompts": batch.prompts,
                           "responses": responses.to(torch.device("cpu"))}
        return state

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.asked = {step: AskedBatch(step, b["version"], b["prompts"], lambda r=b["responses"].to(device): r)
                      for step, b in state.items()}
