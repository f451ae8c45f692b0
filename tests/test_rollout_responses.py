"""The rollout record (rollout/responses.py) against a hand-computed case: sizes, per-group views, selection and
concatenation of whole prompt groups (ragged ones too), the list view both ways, and the consistency checks."""
import pytest
import torch

from megatron_gtpo.rollout.responses import FINISH_LENGTH, FINISH_STOP, Response, Responses

# Three prompts, two responses each: lengths 2, 1 | 0, 3 | 1, 2; log-probs exact in float32.
GROUPS = [[Response([5, 6], [-0.5, -0.25], FINISH_STOP), Response([7], [-1.0], FINISH_LENGTH)],
          [Response([], [], FINISH_LENGTH), Response([8, 9, 10], [-2.0, -0.125, -4.0], FINISH_STOP)],
          [Response([11], [-0.75], FINISH_STOP), Response([12, 13], [-3.0, -0.0625], FINISH_LENGTH)]]


def _fields(record):
    names = ("counts", "lengths", "finish", "tokens", "logprobs")
    return {name: t.tolist() for name, t in zip(names, record.tensors())}


def test_from_lists_lays_the_responses_out_flat():
    record = Responses.from_lists(GROUPS)
    assert (record.num_prompts, record.num_responses, record.num_tokens) == (3, 6, 9)
    assert _fields(record) == {"counts": [2, 2, 2], "lengths": [2, 1, 0, 3, 1, 2], "finish": [0, 1, 1, 0, 0, 1],
                               "tokens": [5, 6, 7, 8, 9, 10, 11, 12, 13],
                               "logprobs": [-0.5, -0.25, -1.0, -2.0, -0.125, -4.0, -0.75, -3.0, -0.0625]}
    assert [t.dtype for t in record.tensors()] == [torch.int64] * 3 + [torch.int32, torch.float32, torch.int32]
    assert record.weight_updates_T.tolist() == [0] * 9  # list-view responses were sampled by the call's weights
    record.check()


def test_per_group_views():
    record = Responses.from_lists(GROUPS)
    assert record.lengths_NG().tolist() == [[2, 1], [0, 3], [1, 2]]
    assert record.truncated_R().tolist() == [False, True, True, False, False, True]
    assert record.token_starts_R().tolist() == [0, 2, 3, 3, 6, 7]
    assert record.token_id_lists() == [[5, 6], [7], [], [8, 9, 10], [11], [12, 13]]
    assert record.to_lists() == GROUPS
    assert Responses.empty().lengths_NG().shape == (0, 0)
    with pytest.raises(ValueError, match="3 responses do not make 2 equal groups"):
        Responses.from_lists([GROUPS[0], GROUPS[1][:1]]).lengths_NG()


def test_select_and_cat_move_whole_groups():
    record = Responses.from_lists(GROUPS)
    picked = record.select_prompts(torch.tensor([2, 0]))
    assert _fields(picked) == {"counts": [2, 2], "lengths": [1, 2, 2, 1], "finish": [0, 1, 0, 1],
                               "tokens": [11, 12, 13, 5, 6, 7], "logprobs": [-0.75, -3.0, -0.0625, -0.5, -0.25, -1.0]}
    joined = Responses.cat([record.select_prompts([1]), Responses.empty(), record.select_prompts([0])])
    assert joined.to_lists() == [GROUPS[1], GROUPS[0]]
    assert Responses.cat([record.select_prompts([]), record]).to_lists() == GROUPS
    assert record.select_prompts([]).num_prompts == 0 and record.select_prompts([]).num_tokens == 0
    # Ragged groups (1 and 3 responses, an empty response among them) select the same way.
    ragged = Responses.from_lists([GROUPS[0][:1], GROUPS[1] + GROUPS[2][:1], GROUPS[2]])
    assert ragged.select_prompts([1, 1]).to_lists() == [GROUPS[1] + GROUPS[2][:1]] * 2
    for select in ([0], [1, 2], [2, 1, 0]):
        assert ragged.select_prompts(select).to_lists() == [ragged.to_lists()[i] for i in select]
        picked = ragged.select_prompts(select)
        picked.check()


def test_lists_that_the_record_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="finish reason 'abort'"):
        Responses.from_lists([[Response([1, 2], [-0.1, -0.2], "abort")]])
    with pytest.raises(ValueError, match="2 tokens and 1 log-probs"):
        Responses.from_lists([[Response([1, 2], [-0.1], FINISH_STOP)]])


@pytest.mark.parametrize("change,message", [
    (dict(lengths_R=torch.tensor([2, 1, 0, 3, 1, 3])), "lengths_R sums to 10, the record holds 9 tokens"),
    (dict(responses_per_prompt_P=torch.tensor([2, 2, 1])), "sums to 5, the record holds 6 responses"),
    (dict(finish_R=torch.tensor([0, 1, 1, 0, 0, 2])), r"finish codes outside .* \[0, 1, 2\]"),
    (dict(logprobs_T=torch.zeros(9, dtype=torch.float64)), "logprobs_T must be a contiguous 1-D torch.float32"),
    (dict(token_ids_T=torch.zeros(8, dtype=torch.int32)), "logprobs_T has 9 elements, the record 8 along T"),
    (dict(token_ids_T=torch.zeros(18, dtype=torch.int32)[::2]), "token_ids_T must be a contiguous"),
    (dict(token_ids_T=torch.zeros(9, dtype=torch.int64)), "token_ids_T must be a contiguous 1-D torch.int32"),
])
def test_check_names_what_is_inconsistent(change, message):
    import dataclasses

    with pytest.raises(ValueError, match=message):
        dataclasses.replace(Responses.from_lists(GROUPS), **change).check()
