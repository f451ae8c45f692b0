"""Carrying informative groups over to the next step (training/rollout_queue.carry_over, RolloutQueue.carry) on
hand-built groups: which groups are young enough for the next step (their newest token's version against
rollout.max_staleness), what is dropped and counted, and the carried groups through a checkpoint's state."""
from types import SimpleNamespace

import torch

from megatron_gtpo.rollout.responses import Response, Responses
from megatron_gtpo.training.experience import RewardedGroups
from megatron_gtpo.training.rollout_queue import RolloutQueue, carry_over
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
    groups = SampledGroups([SimpleNamespace(prompt_token_ids=(i,), id=i) for i in (10, 20, 30)], record,
                           versions_T=torch.tensor([3, 5, 2, 2]), start_versions_R=torch.tensor([3, 4, 2, 2, 6, 6]))
    return RewardedGroups(groups, torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]),
                          torch.tensor([[0.8, -0.1], [-0.1, 0.9], [1.0, 0.0]]))


def test_a_group_is_as_new_as_its_newest_token():
    assert _surplus().groups.newest_versions_N().tolist() == [5, 2, 6]


def test_groups_young_enough_for_the_next_step_are_carried_in_order_and_the_others_counted():
    carried, dropped = carry_over(_surplus(), 6, 1)  # step 6 at staleness 1 takes versions >= 5
    assert [p.id for p in carried.groups.prompts] == [10, 30] and dropped == 1
    assert carried.correct_NG.tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert torch.equal(carried.rewards_NG, torch.tensor([[0.8, -0.1], [1.0, 0.0]]))
    assert carried.groups.responses.token_ids_T.tolist() == [1, 2] and carried.groups.versions_T.tolist() == [3, 5]
    assert carry_over(_surplus(), 6, 4)[1] == 0  # versions >= 2: all three
    assert carry_over(_surplus(), 7, 0) == (None, 3)  # on policy: nothing sampled before step 7 is young enough
    assert carry_over(None, 7, 2) == (None, 0)


def test_the_queue_carries_once_and_its_checkpoint_state_holds_the_carried_groups():
    queue = RolloutQueue(1, None, steps=10)
    metrics = queue.carry(_surplus(), 5)
    assert metrics == {"groups_carried": 2, "groups_dropped_stale": 1}  # whole responses: no unfinished groups
    state = queue.state_dict()
    restored = RolloutQueue(1, None, steps=10, device=torch.device("cpu"))
    restored.load_state_dict(state)
    for q in (queue, restored):
        carried = q.take_carried()
        assert [p.id for p in carried.groups.prompts] == [10, 30]
        assert carried.groups.start_versions_R.tolist() == [3, 4, 6, 6]
        assert torch.equal(carried.groups.responses.logprobs_T, torch.tensor([-0.1, -0.2]))
        assert q.take_carried() is None
