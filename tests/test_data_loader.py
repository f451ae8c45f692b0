"""PromptLoader: per-epoch seeded shuffling, whole prompts per DP rank, exact resume."""
from __future__ import annotations

import collections
import json

import pytest

from megatron_gtpo.data import PromptLoader


def _loaders(num_prompts: int, prompts_per_step: int, dp_size: int, seed: int = 3, shuffle: bool = True):
    items = [f"prompt-{i}" for i in range(num_prompts)]
    return [
        PromptLoader(items, prompts_per_step=prompts_per_step, dp_rank=rank, dp_size=dp_size, seed=seed,
                     shuffle=shuffle)
        for rank in range(dp_size)
    ]


def _global_batches(loaders, num_steps: int) -> list[list[str]]:
    """Per step, the ranks' prompts concatenated in rank order; checks every rank is at the same position."""
    steps = []
    for _ in range(num_steps):
        batches = [loader.next_batch() for loader in loaders]
        assert len({(batch.epoch, batch.batch_index) for batch in batches}) == 1
        assert all(len(batch.items) == loaders[0].prompts_per_rank for batch in batches)
        steps.append([item for batch in batches for item in batch.items])
    return steps


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4, 6])
def test_every_prompt_once_per_epoch_on_exactly_one_rank(dp_size):
    num_prompts, prompts_per_step = 36, 12
    loaders = _loaders(num_prompts, prompts_per_step, dp_size)
    steps_per_epoch = num_prompts // prompts_per_step
    for epoch in range(3):
        epoch_steps = []
        for _ in range(steps_per_epoch):
            batches = [loader.next_batch() for loader in loaders]
            assert {batch.epoch for batch in batches} == {epoch}
            owners = collections.defaultdict(list)
            for rank, batch in enumerate(batches):
                for item in batch.items:
                    owners[item].append(rank)
            # a prompt (and so its whole group of G responses) belongs to exactly one rank in a step
            assert all(len(ranks) == 1 for ranks in owners.values())
            epoch_steps.extend(owners)
        assert sorted(epoch_steps) == sorted(f"prompt-{i}" for i in range(num_prompts))


def test_global_batches_do_not_depend_on_the_dp_size():
    reference = _global_batches(_loaders(36, 12, dp_size=1), 7)
    for dp_size in (2, 3, 4, 6, 12):
        assert _global_batches(_loaders(36, 12, dp_size), 7) == reference


def test_shuffling_is_seeded_and_differs_across_epochs():
    loader = _loaders(50, 10, 1, seed=11)[0]
    orders = [loader.epoch_order(epoch) for epoch in range(4)]
    assert all(sorted(order) == list(range(50)) for order in orders)
    assert len({tuple(order) for order in orders}) == 4  # each epoch reshuffles
    # same seed, same orders
    assert orders == [_loaders(50, 10, 1, seed=11)[0].epoch_order(epoch) for epoch in range(4)]
    assert orders[0] != _loaders(50, 10, 1, seed=12)[0].epoch_order(0)
    assert orders[0] != list(range(50))
    unshuffled = _loaders(50, 10, 1, shuffle=False)[0]
    assert [batch.items for batch in (unshuffled.next_batch(), unshuffled.next_batch())] == [
        [f"prompt-{i}" for i in range(10)], [f"prompt-{i}" for i in range(10, 20)]
    ]


def test_incomplete_last_batch_is_dropped_each_epoch():
    loaders = _loaders(26, 8, dp_size=2)
    assert loaders[0].batches_per_epoch == 3
    for epoch in range(2):
        steps = _global_batches(loaders, 3)
        seen = [item for step in steps for item in step]
        assert len(seen) == len(set(seen)) == 24
    assert loaders[0].state_dict()["epoch"] == 2


@pytest.mark.parametrize("resume_dp_size", [2, 4])
def test_resume_yields_exactly_the_uninterrupted_batches(resume_dp_size):
    uninterrupted = _loaders(30, 8, dp_size=2, seed=5)
    _global_batches(uninterrupted, 5)  # 3 batches per epoch: this crosses an epoch boundary
    saved = json.loads(json.dumps(uninterrupted[0].state_dict()))  # what a checkpoint stores
    assert saved == uninterrupted[1].state_dict()  # the position is the same on every rank
    assert (saved["epoch"], saved["batch_index"]) == (1, 2)
    expected = _global_batches(uninterrupted, 8)

    resumed = _loaders(30, 8, dp_size=resume_dp_size, seed=5)
    for loader in resumed:
        loader.load_state_dict(saved)
    assert _global_batches(resumed, 8) == expected


def test_bad_arguments_and_mismatched_state():
    items = list(range(20))
    with pytest.raises(ValueError, match="prompts_per_step must be a positive multiple of dp_size=3"):
        PromptLoader(items, prompts_per_step=8, dp_size=3)
    with pytest.raises(ValueError, match=r"dp_rank must be an int in \[0, 2\)"):
        PromptLoader(items, prompts_per_step=8, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="the dataset has 20 prompts, fewer than prompts_per_step=24"):
        PromptLoader(items, prompts_per_step=24)
    loader = PromptLoader(items, prompts_per_step=4, seed=1)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="saved loader state has seed=1 but this loader has 2"):
        PromptLoader(items, prompts_per_step=4, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="saved loader state has num_prompts=20 but this loader has 21"):
        PromptLoader(list(range(21)), prompts_per_step=4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"batch_index=5, outside \[0, 5\)"):
        loader.load_state_dict({**state, "batch_index": 5})
