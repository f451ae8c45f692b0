"""Rollouts asked for ahead of training (rollout.schedule.max_staleness = N), the groups partial rollouts left
unfinished, and the complete groups carried over from one step to the next.

Step k trains on batch k: the prompts the loader gave for it and the engine's responses to them. Batch k is asked for at
step max(0, k - N), once that step's own batch has arrived, so it is generated with the policy of version max(0, k - N)
(the weights after that many steps) while the trainer trains the steps in between, and no batch is trained on more than
N versions after the weights that sampled it. The schedule is fixed, so a run is the same whatever the engines' speed.
N = 0 asks for batch k and waits for it at once: the on-policy trainer, call for call. Dynamic sampling's further rounds
of a step (`rounds`) are asked for on the spot, with the weights of now, or with rollout.schedule.rounds_ahead = K
served from the rounds asked for ahead (`ahead`): after each step's rounds, further rounds are asked for with the
weights of then until K rounds young enough for the next step are held, and the next steps take them oldest first while
at most N versions old (older ones are waited for and dropped, their groups counted). That schedule is fixed too: what
is asked, with which version and seeds, depends on the rewards only. With rollout.schedule.ahead_schedule "when_idle"
the rounds ahead are asked for one at a time instead, at the end of the step's rounds and of its phases POLLED_PHASES
(`poll`: the step's phase timer calls it), whenever every rollout server of the run has answered all it was asked, up
to K held: what each version samples then depends on the engines' speed (a resumed run trains on other rounds).

With partial rollouts (partial_rollouts.py) each batch asked for also continues the groups left unfinished by the
batches and rounds waited for until then. A step waits for its batch before it asks for the next, so the
unfinished responses of batch k continue in batch k + N, sampled N versions later (N = 0: in batch k + 1, one
version later): a response of s segments is trained at most (s - 1) x max(N, 1) + N versions after its first token
was sampled (s x N at N >= 1).

Complete informative groups that a step's dynamic sampling did not need (experience.py's surplus) are carried over
to the next step (`carry_over`), trained there before any new group, while their newest token is at most N versions old
then; older ones are dropped and counted. At N = 0 none is young enough, so nothing is carried: the on-policy
trainer is unchanged.

The queue hands the trainer each step's experience (`experience`: experience.collect_experience over the carried
groups and the step's rounds) with its statistics, the queue's own among them (a step's counts, in the one `StepCounts`
its `take` hands out): the tokens the engines generated in
the answers the step waited for, the groups carried over, dropped as too old and left unfinished, and with K the
further rounds served from those asked for ahead and asked for on the spot, and the groups held ahead. The step's
wait for its rounds is its "generate" phase, the rewards its "reward" phase. What a round is served from stays inside
the queue: a batch asked for ahead (`asked`), a further round asked for ahead (`ahead`) or on the spot (`rounds`).

A checkpoint holds the batches and further rounds asked for and not yet trained on (`state_dict` waits for them: the
prompts, the version that generated them, their rollouts and the groups they continue), the unfinished groups and
the carried ones, so a resumed run trains on the very batches an uninterrupted one would, in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megatron_gtpo.config import ScheduleConfig
from megatron_gtpo.distributed import ParallelGroups
from megatron_gtpo.rollout.engine import Rollout
from megatron_gtpo.rollout.responses import Responses

from .experience import Experience, GroupSelection, RewardedGroups, collect_experience
from .metrics import PhaseTimer
from .rollout_source import AskedBatch, RolloutSource
from .sampled_groups import SampledGroups

__all__ = ["AskedBatch", "POLLED_PHASES", "RolloutQueue", "StepCounts", "carry_over"]

# The phases after which an idle server may be asked a round ahead (ahead_schedule when_idle): the old-policy pass and
# the update, where the servers may have answered meanwhile; never after the weight sync, whose weights are the next
# step's version, not this one's.
POLLED_PHASES = ("old_logprob", "update")


@dataclass
class StepCounts:
    """What one step's rollouts did, counted from its `take` on: every token of the engine answers it folded in
    (continued segments and groups later dropped, carried over or left unfinished included, each counted once) and
    the seconds the engine spent generating them; the further rounds asked for ahead during it (their seeds' indices),
    served to it from those asked for ahead, and the groups of rounds asked for ahead dropped as too old for it."""

    tokens_generated: int = 0
    generation_s: float = 0.0
    asked_ahead: int = 0
    served_ahead: int = 0
    dropped_ahead: int = 0


class RolloutQueue:
    """The batches asked for and not yet trained on, the unfinished groups and the carried ones (module doc). `source`
    draws a round's prompts and asks the engine for its responses (and the continuation of unfinished ones: its
    `requests` say how answers merge into groups); `selection`: which groups a step keeps; `reward(prompts, responses)
    -> [N, G]` the verifier's rewards on the host; `parallel`: this rank's groups (the data-parallel ranks agree on a
    step's rounds; a restored state goes to the training device); `schedule` (rollout.schedule): how far ahead
    batches are asked for (max_staleness), the further rounds kept asked for ahead (rounds_ahead) and when
    (ahead_schedule: "when_idle" asks them when the servers are idle, not on the fixed schedule); `steps`: the run's
    (no batch is asked for beyond its last step)."""

    def __init__(self, source: RolloutSource, selection: GroupSelection,
                 reward: Callable[[list, Responses], torch.Tensor], parallel: ParallelGroups, *,
                 schedule: ScheduleConfig, steps: int):
        self.source = source
        self.requests = source.requests
        self.selection = selection
        self.reward = reward
        self.parallel = parallel
        self.max_staleness = schedule.max_staleness
        self.steps = steps
        self.rounds_ahead = schedule.rounds_ahead
        self.when_idle = schedule.ahead_schedule == "when_idle"
        self.asked: dict[int, AskedBatch] = {}
        self.ahead: list[AskedBatch] = []  # further rounds asked for ahead, oldest first
        self.unfinished: SampledGroups | None = None  # waiting for the next batch asked for
        self.carried: RewardedGroups | None = None  # complete groups kept for the next step
        self.counts = StepCounts()  # the step's, since its `take`

    def experience(self, step: int, timer: PhaseTimer) -> Experience:
        """Step `step`'s experience (experience.collect_experience): the groups carried over to it first, then its
        rounds (`rounds`); the informative groups it did not need are carried over to the next step, those young
        enough for it (`carry_over`); with `rounds_ahead`, further rounds are then asked for ahead (`_ask_ahead`). Its
        statistics include the queue's: the tokens generated, the groups carried over, dropped as too old, and left
        unfinished; with `rounds_ahead` the further rounds served from those asked for ahead and asked for on the
        spot, and the groups held ahead. Times the "generate" and "reward" phases."""
        def reward(prompts, responses):
            with timer("reward"):
                return self.reward(prompts, responses)

        sample_round = self.rounds(step, timer)
        carried, self.carried = self.carried, None
        exp, surplus = collect_experience(sample_round, reward, self.selection, self.parallel,
                                          stand_by=self.source.stand_by, carried=carried)
        self.carried, dropped = carry_over(surplus, step + 1, self.max_staleness)
        counts = self.counts
        exp.stats.update(tokens_generated=counts.tokens_generated, rollout_busy_s=counts.generation_s,
                         groups_dropped_stale=dropped + counts.dropped_ahead,
                         groups_carried=self.carried.num_groups if self.carried is not None else 0,
                         **self.requests.metrics(self.unfinished))
        if self.rounds_ahead:
            if self.when_idle:
                self._ask_if_idle(step, timer)
            else:
                self._ask_ahead(step)
            exp.stats.update(rounds_served_ahead=counts.served_ahead,
                             rounds_on_the_spot=exp.stats["sampling_rounds"] - 1 - counts.served_ahead,
                             groups_asked_ahead=sum(len(asked.prompts) for asked in self.ahead))
        return exp

    def take(self, step: int) -> tuple[SampledGroups, StepCounts]:
        """The groups of batch `step`, waited for (asked for now if it was not: N = 0, or the first step); then every
        batch up to step + N (and before the run's end) not asked for yet is asked for, with the weights of now (version
        `step`): the engine generates those while this one trains. Waiting first lets the asked batches continue the
        responses this one left unfinished (partial rollouts) N versions after it, not N + 1; at N >= 1 it costs no
        time, since the batch was generated before the weight update that ended the last step (the update drains the
        engine; with rollout.schedule.update_during_generation it need not, and the wait is for the rest of the batch,
        sampled by the newer weights). Hands out the step's counts (`StepCounts`), from here on."""
        counts = self.counts = StepCounts()
        if step not in self.asked:
            self._ask(step, step)
        groups = self.groups(self.asked.pop(step))
        for later in range(step + 1, min(step + self.max_staleness + 1, self.steps)):
            if later not in self.asked:
                self._ask(later, step)
        return groups, counts

    def rounds(self, step: int, timer: PhaseTimer) -> Callable[[int], tuple[Callable[[], SampledGroups], bool]]:
        """Step `step`'s sampling rounds for experience.collect_experience: round 0 is batch `step` (`take`, waited
        for now); round r >= 1 is the oldest round asked for ahead (`ahead`) or else draws its prompts when called and
        is generated by the weights of now when waited for. The rounds asked for ahead that are more than
        max_staleness versions old for this step are dropped first (`_dropped`). The waits are timed as the
        "generate" phase."""
        with timer("generate"):
            first, counts = self.take(step)
            stale = [asked for asked in self.ahead if asked.version < step - self.max_staleness]
            self.ahead = self.ahead[len(stale):]  # oldest first, so the stale ones lead
            counts.dropped_ahead = sum(self._dropped(asked) for asked in stale)

        def sample_round(round_index: int) -> tuple[Callable[[], SampledGroups], bool]:
            if not round_index:
                return (lambda: first), True
            asked_ahead = bool(self.ahead)
            if asked_ahead:
                counts.served_ahead += 1
                asked = self.ahead.pop(0)
            else:
                asked = self.source.ask(step, step, None, round_index, on_the_spot=True)

            def wait():
                with timer("generate"):
                    return self.groups(asked)
            return wait, asked_ahead
        return sample_round

    def _dropped(self, asked: AskedBatch) -> int:
        """Waits for a round asked for ahead and too old to train on (its tokens counted in `tokens_generated`) and
        drops its groups, those left unfinished by partial rollouts too: how many."""
        self._count(asked.wait())
        return len(asked.prompts)

    def _count(self, rollout: Rollout) -> Rollout:
        """`rollout`'s tokens and generation seconds counted in the step's counts."""
        self.counts.tokens_generated += rollout.responses.num_tokens
        self.counts.generation_s += rollout.generation_s
        return rollout

    def poll(self, step: int) -> Callable[[str, PhaseTimer], None]:
        """Step `step`'s phase timer's `after_phase`: after each phase of POLLED_PHASES, `_ask_if_idle`."""
        def after_phase(phase: str, timer: PhaseTimer) -> None:
            if phase in POLLED_PHASES:
                self._ask_if_idle(step, timer)
        return after_phase

    def _ask_if_idle(self, step: int, timer: PhaseTimer) -> None:
        """With `when_idle`, at the end of step `step`'s rounds or of a phase (`poll`): one further round asked for
        ahead, as `_ask_ahead` asks them, if fewer than `rounds_ahead` young enough for the next step are held and
        every rollout server of the run has answered all it was asked. The servers are asked on every rank and the
        answer agreed over all of them, so that every data-parallel rank draws the same rounds and the loaders stay
        aligned: collective over every rank (nothing, and no collective, without `when_idle`). Timed as
        "generate"."""
        if not self.when_idle or step + 1 >= self.steps or self._held(step) >= self.rounds_ahead:
            return
        with timer("generate"):
            idle = torch.tensor(int(self.source.engine.idle()), device=self.parallel.device)
            dist.all_reduce(idle, op=dist.ReduceOp.MIN, group=dist.group.WORLD)
            if idle.item():
                self._ask_ahead(step, rounds=1)

    def _ask_ahead(self, step: int, rounds: int | None = None) -> None:
        """Asks for `rounds` further rounds (default: until `rounds_ahead` young enough for the next step are held)
        with the weights of now (version `step`), unless `step` is the run's last. The engine generates them while
        this step trains; the next steps take them (`rounds`). Their seeds are those of rounds max_extra_rounds + 1,
        + 2, ... of step `step`, which its own rounds never use."""
        if step + 1 >= self.steps:
            return
        first_index = self.selection.max_extra_rounds + 1
        for _ in range(self.rounds_ahead - self._held(step) if rounds is None else rounds):
            self.ahead.append(self.source.ask(step, step, None, first_index + self.counts.asked_ahead))
            self.counts.asked_ahead += 1

    def _held(self, step: int) -> int:
        """The rounds asked for ahead young enough for step `step` + 1."""
        return sum(asked.version >= step + 1 - self.max_staleness for asked in self.ahead)

    def _ask(self, step: int, version: int) -> None:
        continued, self.unfinished = self.unfinished, None
        self.asked[step] = self.source.ask(step, version, continued)

    def groups(self, asked: AskedBatch) -> SampledGroups:
        """The complete groups of a round, waited for (its tokens counted in `tokens_generated`); groups with an
        unfinished response (partial rollouts) wait for the next batch asked for."""
        rollout = self._count(asked.wait())
        complete, unfinished = self.requests.merge(asked.continued, asked.prompts, rollout, asked.version)
        if unfinished is not None:
            self.unfinished = unfinished if self.unfinished is None else SampledGroups.cat([self.unfinished,
                                                                                             unfinished])
        return complete

    def state_dict(self) -> dict:
        """Every batch and further round asked for, waited for (collective over the model replica), the unfinished
        groups and the carried ones, on the host."""
        cpu = torch.device("cpu")
        batches = {}
        for step, batch in sorted(self.asked.items()):
            self.asked[step], batches[step] = _answered(batch)
        answered = [_answered(asked) for asked in self.ahead]
        self.ahead, ahead = [asked for asked, _ in answered], [held for _, held in answered]
        state = {"batches": batches, "unfinished": _moved(self.unfinished, cpu), "carried": _moved(self.carried, cpu)}
        return {**state, "ahead": ahead} if self.rounds_ahead else state

    def load_state_dict(self, state: dict) -> None:
        """From `state_dict()`'s host state, moved to the training device (a checkpoint written before groups were
        carried, or rounds asked for ahead, holds none)."""
        device = self.parallel.device
        self.asked = {step: _restored(b, step, device) for step, b in state["batches"].items()}
        self.ahead = [_restored(b, b["step"], device) for b in state.get("ahead", [])]
        self.unfinished = _moved(state["unfinished"], device)
        self.carried = _moved(state.get("carried"), device)


def carry_over(surplus: RewardedGroups | None, step: int, max_staleness: int) -> tuple[RewardedGroups | None, int]:
    """(the groups of `surplus` that step `step` may train on: each group's newest token sampled at most
    `max_staleness` versions before `step`, in their order (None if none), how many are too old)."""
    if surplus is None or not surplus.num_groups:
        return None, 0
    young_N = surplus.groups.newest_versions_N() >= step - max_staleness
    kept = surplus.select(young_N.nonzero().flatten())
    return (kept if kept.num_groups else None), surplus.num_groups - kept.num_groups


def _answered(batch: AskedBatch) -> tuple[AskedBatch, dict]:
    """(`batch` waited for, its answer kept; the same on the host, for a checkpoint)."""
    cpu = torch.device("cpu")
    rollout = batch.wait()
    answered = AskedBatch(batch.step, batch.version, batch.prompts, lambda: rollout, batch.continued)
    return answered, {"step": batch.step, "version": batch.version, "prompts": batch.prompts,
                      "responses": rollout.responses.to(cpu), "routed_experts": _routes_to_host(rollout.routed_experts),
                      "generation_s": rollout.generation_s, "continued": _moved(batch.continued, cpu)}


def _restored(held: dict, step: int, device: torch.device) -> AskedBatch:
    """`_answered`'s host copy of a batch, answered, on `device`."""
    rollout = Rollout(held["responses"].to(device), held.get("routed_experts"), held.get("generation_s", 0.0))
    return AskedBatch(step, held["version"], held["prompts"], lambda: rollout, _moved(held["continued"], device))


def _routes_to_host(routes: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    """A rollout's routing (routing replay: per response, this rank's MoE layers) on the host, where it stays until
    the step batch (rank-local, like the file it is saved in)."""
    return None if routes is None else [r.cpu() for r in routes]


def _moved(groups: SampledGroups | None, device: torch.device) -> SampledGroups | None:
    return None if groups is None else groups.to(device)
