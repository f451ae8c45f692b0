"""Carrying informative groups over to the next step (training/rollout_queue.carry_over, RolloutQueue.experience) on
hand-built groups: which groups are young enough for the next step (their newest token's version against
rollout.schedule.max_staleness), what is dropped and counted, and the carried groups through a checkpoint's state; the
statistics an experience records."""
import pytest
import torch

from hand_built import prompt_samples
from megatron_gtpo.rollout.responses import Response, Responses
from megatron_gtpo.training.experience import RewardedGroups
from megatron_gtpo.training.metrics import PhaseTimer
from megatron_gtpo.training.rollout_queue import carry_over
from megatron_gtpo.training.sampled_groups import SampledGroups


def _surplus() -> RewardedGroups:
    """Group 0 (prompt 10): a response continued at version 5 after its first token at 3, and an empty response
    started at 4: newest version 5. Group 1 (prompt 20): two one-token responses of version 2. Group 2 (prompt 30):
    two empty responses started at 6 (a stop token first): newest 6."""
    record = Responses.from_lists([
        [Response([1, 2], [-0.1, -0.2], "stop"), Response([], [], "stop")],
        [Response([3], [-0.3], "stop"), Response([4], [-0.4], "length")],
        [Response([], [], "stop"), Response([], [], "stop")],
    ])
    groups = SampledGroups(prompt_samples([(10,), (20,), (30,)]), record,
                           versions_T=torch.tensor([3, 5, 2, 2]), start_versions_R=torch.tensor([3, 4, 2, 2, 6, 6]))
    return RewardedGroups(groups, torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]),
                          torch.tensor([[0.8, -0.1], [-0.1, 0.9], [1.0, 0.0]]))


def test_a_group_is_as_new_as_its_newest_token():
    assert _surplus().groups.newest_versions_N().tolist() == [5, 2, 6]


def test_groups_young_enough_for_the_next_step_are_carried_in_order_and_the_others_counted():
    carried, dropped = carry_over(_surplus(), 6, 1)  # step 6 at staleness 1 takes versions >= 5
    assert [p.id for p in carried.groups.prompts] == ["p0", "p2"] and dropped == 1
    assert carried.correct_NG.tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert torch.equal(carried.rewards_NG, torch.tensor([[0.8, -0.1], [1.0, 0.0]]))
    assert carried.groups.responses.token_ids_T.tolist() == [1, 2] and carried.groups.versions_T.tolist() == [3, 5]
    assert carry_over(_surplus(), 6, 4)[1] == 0  # versions >= 2: all three
    assert carry_over(_surplus(), 7, 0) == (None, 3)  # on policy: nothing sampled before step 7 is young enough
    assert carry_over(None, 7, 2) == (None, 0)


def _queue(dp_group):
    """A queue at staleness 1 over 3 steps whose engine answers each prompt with one correct and one wrong response
    (every group informative); one group a step, 3 prompts a batch."""
    from hand_built import scripted_queue
    from megatron_gtpo.rollout.engine import Rollout
    from megatron_gtpo.training.experience import GroupSelection
    from megatron_gtpo.training.partial_rollouts import WholeResponses

    def answer(rows, params):
        return Rollout(Responses.from_lists([[Response([1], [-0.1], "stop"), Response([0, 0], [-0.2, -0.3], "stop")]
                                             for _ in rows]))

    return scripted_queue(answer, WholeResponses(), max_staleness=1, steps=3, group_size=2, prompts_per_draw=3,
                          selection=GroupSelection(1, True, 0, None),
                          reward=lambda prompts, responses: (responses.lengths_NG() == 1).float(), dp_group=dp_group)


def test_the_queue_carries_the_surplus_over_once_and_counts_what_it_drops(world_of_one):
    """Step 0 keeps the first of batch 0's 3 informative groups and carries the other 2 (version 0, young enough for
    step 1 at staleness 1); step 1 keeps one of them first and drops the rest with batch 1's groups (version 0: too
    old for step 2). A queue restored from the checkpoint state after step 0 gives step 1 the same experience."""
    timer = PhaseTimer()
    queue = _queue(world_of_one)
    first = queue.experience(0, timer)
    assert [p.id for p in first.kept.groups.prompts] == ["p0"]
    assert {k: first.stats[k] for k in ("groups_kept", "groups_generated", "groups_from_carry", "groups_carried",
                                        "groups_dropped_stale", "tokens_generated")} == {
        "groups_kept": 1, "groups_generated": 3, "groups_from_carry": 0, "groups_carried": 2,
        "groups_dropped_stale": 0, "tokens_generated": 9}
    assert sorted(timer.seconds) == ["generate", "reward"]
    restored = _queue(world_of_one)
    restored.load_state_dict(queue.state_dict())
    for q in (queue, restored):
        second = q.experience(1, PhaseTimer())
        assert [p.id for p in second.kept.groups.prompts] == ["p1"]
        assert second.kept.groups.start_versions_R.tolist() == [0, 0]
        assert {k: second.stats[k] for k in ("groups_generated", "groups_from_carry", "groups_carried",
                                             "groups_dropped_stale", "tokens_generated")} == {
            "groups_generated": 3, "groups_from_carry": 1, "groups_carried": 0, "groups_dropped_stale": 4,
            "tokens_generated": 9}
        assert q.carried is None


def test_an_experience_records_its_statistics_and_the_staleness_of_its_kept_groups(world_of_one):
    """Two kept groups asked for at version 3 and trained at step 5, the engine taking updates while it generated:
    response 0's tokens by versions 3, 4; response 1's by 3; response 2 is empty; response 3's by 4, 4, 5. Staleness
    counts from the version asked for (5 - 3 for each response), continued: responses 0 and 3, stale tokens: all
    but the last."""
    from megatron_gtpo.rollout.engine import Rollout
    from megatron_gtpo.training.experience import Experience
    from megatron_gtpo.training.reduction import MetricReducer

    record = Responses(responses_per_prompt_P=torch.tensor([2, 2]), lengths_R=torch.tensor([2, 1, 0, 3]),
                       finish_R=torch.zeros(4, dtype=torch.int64), token_ids_T=torch.arange(6, dtype=torch.int32),
                       logprobs_T=torch.zeros(6), weight_updates_T=torch.tensor([0, 1, 0, 1, 1, 2], dtype=torch.int32))
    groups = SampledGroups.sampled(prompt_samples([(1,), (2,)]), Rollout(record), 3)
    kept = RewardedGroups(groups, torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    metrics = MetricReducer(torch.device("cpu"))
    Experience(kept, {"groups_generated": 3, "groups_kept": 2, "reward_mean": 0.25, "tokens_generated": 17}).record(
        metrics, 5)
    reduced = metrics.reduce(world_of_one)
    assert (reduced["staleness_mean"], reduced["staleness_max"]) == (2.0, 2)
    assert reduced["continued_fraction"] == 0.5 and reduced["stale_token_fraction"] == pytest.approx(5 / 6)
    assert (reduced["groups_generated"], reduced["groups_kept"], reduced["reward_mean"], reduced["tokens_generated"]) \
        == (3, 2, 0.25, 17)
