"""The step batch's micro-batch plan and layouts (training/step_batch.py) against hand-computed cases, on the host."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from hand_built import rewarded_groups
from megatron_gtpo.distributed import ParallelGroups
from megatron_gtpo.rollout.responses import Response, Responses
from megatron_gtpo.training.step_batch import build_step_batch, plan_micro_batches

HOST = ParallelGroups.data_parallel_rank(None, torch.device("cpu"))

LENGTHS = [5, 9, 2, 7, 7, 3]


def test_plan_by_sequence_count_sorts_longest_first_within_each_mini_batch():
    plan = plan_micro_batches(LENGTHS, [[0, 1, 2], [3, 4, 5]], max_sequences=2, max_tokens=None)
    assert plan == [[[1, 0], [2]], [[3, 4], [5]]]


def test_plan_by_token_budget_counts_padding_to_the_longest():
    # Sorted: 9, 7, 7, 5, 3, 2. Budget 16: [9] (2 x 9 > 16), [7, 7], [5, 3, 2] (3 x 5 = 15).
    assert plan_micro_batches(LENGTHS, [list(range(6))], max_sequences=8, max_tokens=16) == [[[1], [3, 4], [0, 5, 2]]]
    # Padded to a multiple of 4 (sequence parallelism): 12, 8, 8, 8, 4, 4 -> [12], [8, 8], [8, 4] (2 x 8), [4, ...]
    assert plan_micro_batches(LENGTHS, [list(range(6))], max_sequences=8, max_tokens=16, pad_to_multiple=4) == [
        [[1], [3, 4], [0, 5], [2]]]
    # Both limits apply.
    assert plan_micro_batches(LENGTHS, [list(range(6))], max_sequences=2, max_tokens=100) == [[[1, 3], [4, 0], [5, 2]]]


def test_plan_gives_an_empty_mini_batch_one_empty_micro_batch():
    assert plan_micro_batches(LENGTHS, [[], [0]], max_sequences=2, max_tokens=None) == [[[]], [[0]]]


def test_a_sequence_longer_than_the_budget_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="data.max_tokens_per_micro_batch = 8 is smaller than a sequence of 9"):
        plan_micro_batches(LENGTHS, [list(range(6))], max_sequences=8, max_tokens=8)


def test_packed_plan_is_first_fit_decreasing_under_the_token_budget():
    # Sorted: 9, 7, 7, 5, 3, 2 into rows of 16: 9 -> row 0, 7 -> row 0 (16), 7 -> row 1, 5 -> row 1 (12),
    # 3 -> row 1 (15), 2 -> row 2 (row 1 would reach 17).
    assert plan_micro_batches(LENGTHS, [list(range(6))], max_sequences=1, max_tokens=16, pack=True) == [
        [[1, 3], [4, 0, 5], [2]]]
    # Rows are padded to a multiple of 4 (sequence parallelism): 9 + 7 = 16 fits; 7 + 5 + 3 = 15 -> 16 fits, + 2 not.
    assert plan_micro_batches(LENGTHS, [list(range(6))], max_sequences=1, max_tokens=16, pack=True,
                              pad_to_multiple=4) == [[[1, 3], [4, 0, 5], [2]]]
    assert plan_micro_batches(LENGTHS, [[], [0]], max_sequences=1, max_tokens=16, pack=True) == [[[]], [[0]]]
    with pytest.raises(ValueError, match="data.pack_sequences needs data.max_tokens_per_micro_batch"):
        plan_micro_batches(LENGTHS, [[0]], max_sequences=1, max_tokens=None, pack=True)
    with pytest.raises(ValueError, match="data.max_tokens_per_micro_batch = 8 is smaller than a sequence of 9"):
        plan_micro_batches(LENGTHS, [list(range(6))], max_sequences=8, max_tokens=8, pack=True)


def _batch(max_sequences=2, max_tokens=None, pack=False):
    prompts = [(1, 2, 3), (4,)]
    responses = Responses.from_lists([
        [Response([5, 6], [-0.5, -0.6], "stop"), Response([7], [-0.7], "stop")],
        [Response([8, 9, 10], [-0.8, -0.9, -1.0], "length"), Response([11, 12], [-1.1, -1.2], "stop")]])
    correct = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    return build_step_batch(rewarded_groups(prompts, responses, correct), HOST,
                            mini_batches=[[0, 1]], max_sequences=max_sequences, max_tokens=max_tokens, pack=pack)


def test_fields_are_response_aligned_and_read_through_the_group_index():
    batch = _batch()
    assert batch.sequence_lengths == [5, 4, 4, 3] and batch.response_lengths == [2, 1, 3, 2]
    assert batch.group_index_S.tolist() == [0, 0, 1, 1] and batch.response_index_S.tolist() == [0, 1, 0, 1]
    assert batch.mask_ST.tolist() == [[True, True, False], [True, False, False], [True, True, True],
                                      [True, True, False]]
    assert torch.allclose(batch.rollout_logprobs_ST[2], torch.tensor([-0.8, -0.9, -1.0]))
    values_ST = torch.arange(12.0).view(4, 3)
    assert torch.equal(batch.per_group_NGT(values_ST), values_ST.view(2, 2, 3))
    assert torch.equal(batch.per_sequence(values_ST.view(2, 2, 3)), values_ST)


def test_next_token_columns_gather_and_select():
    batch = _batch()
    # Plan: longest first, two per micro-batch: sequences 0 (5 tokens) and 1 (4) / 2 (4) and 3 (3).
    assert [mb.rows for mb in batch.plan[0]] == [[0, 1], [2, 3]]
    first = batch.plan[0][0]
    assert first.inputs.tokens_BL.tolist() == [[1, 2, 3, 5, 6], [1, 2, 3, 7, 0]]
    assert first.inputs.cu_seqlens is None
    # Column k scores token k + 1: sequence 0's response tokens (positions 3, 4) at columns 2, 3; sequence 1's at 2.
    scores_BL = torch.tensor([[10.0, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    assert first.columns.gather(scores_BL).tolist() == [[12.0, 13.0], [22.0, 0.0]]
    values_ST = torch.tensor([[1.0, 2, 99], [3, 99, 99], [4, 5, 6], [7, 8, 99]])
    assert first.columns.select(values_ST).tolist() == [[1.0, 2], [3, 99]]
    assert batch.plan[0][1].columns.select(torch.tensor([0.5, 1.5, 2.5, 3.5])).tolist() == [2.5, 3.5]


def test_packed_rows_restart_positions_and_confine_attention():
    from megatron_gtpo.training.forward import block_causal_mask

    batch = _batch(max_tokens=9, pack=True)
    # First-fit decreasing into rows of 9: 5 + 4 = 9 (sequences 0, 1), 4 + 3 = 7 (sequences 2, 3).
    assert [mb.rows for mb in batch.plan[0]] == [[0, 1], [2, 3]]
    second = batch.plan[0][1]
    assert second.inputs.tokens_BL.tolist() == [[4, 8, 9, 10, 4, 11, 12]]
    assert second.inputs.position_ids_BL.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert second.inputs.cu_seqlens.tolist() == [0, 4, 7] and second.inputs.max_segment == 4
    # Sequence 2 (prompt 1 token) scores its response at columns 0, 1, 2; sequence 3 (starts at 4) at 4, 5.
    scores_BL = torch.tensor([[10.0, 11, 12, 13, 14, 15, 16]])
    assert second.columns.gather(scores_BL).tolist() == [[10.0, 11, 12], [14, 15, 0]]
    # Padded to a multiple of 4: the padding tail is a segment of its own.
    from megatron_gtpo.training.forward import pack_sequences

    packed = pack_sequences([[1, 2, 3], [4, 5]], device=torch.device("cpu"), pad_to_multiple=4)
    assert packed.tokens_BL.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]] and packed.cu_seqlens.tolist() == [0, 3, 5, 8]
    visible = ~block_causal_mask(packed.cu_seqlens, 8)[0, 0]
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for start, stop in ((0, 3), (3, 5), (5, 8)):
        expected[start:stop, start:stop] = torch.ones(stop - start, stop - start, dtype=torch.bool).tril()
    assert torch.equal(visible, expected)


def test_packing_on_the_local_spec_with_the_fused_softmax_is_refused():
    # megatron's fused causal softmax ignores a given mask: packed rows would attend across sequences.
    from megatron_gtpo.training.forward import model_forward, pack_sequences

    model = SimpleNamespace(config=SimpleNamespace(masked_softmax_fusion=True))
    packed = pack_sequences([[1, 2], [3]], device=torch.device("cpu"))
    with pytest.raises(ValueError, match="data.pack_sequences on megatron-core's local layer spec needs "
                                         "masked_softmax_fusion off"):
        model_forward(model, packed, local_attention=True)


def test_token_rows_and_rollout_logprobs_come_from_the_flat_record():
    from megatron_gtpo.training.step_batch import sequence_tokens_SL

    prompts = [(1, 2, 3), (4,)]
    responses = Responses.from_lists([[Response([5, 6], [-0.5, -0.25], "stop"), Response([], [], "length")],
                                      [Response([8, 9, 10], [-1.0, -2.0, -4.0], "length"),
                                       Response([11], [-0.125], "stop")]])
    assert sequence_tokens_SL(prompts, 2, responses, [5, 3, 4, 2]).tolist() == [
        [1, 2, 3, 5, 6], [1, 2, 3, 0, 0], [4, 8, 9, 10, 0], [4, 11, 0, 0, 0]]
    correct = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    kept = rewarded_groups(prompts, responses, correct)
    # The tokens' policy versions (partial rollouts: sequence 2's last token by a newer one than its first two).
    kept.groups = dataclasses.replace(kept.groups, versions_T=torch.tensor([3, 3, 2, 2, 4, 5]))
    batch = build_step_batch(kept, HOST, mini_batches=[[0, 1]], max_sequences=4, max_tokens=None, trained_version=5)
    assert batch.rollout_logprobs_ST.tolist() == [[-0.5, -0.25, 0.0], [0.0, 0.0, 0.0], [-1.0, -2.0, -4.0],
                                                  [-0.125, 0.0, 0.0]]
    assert batch.staleness_ST.tolist() == [[2, 2, 0], [0, 0, 0], [3, 3, 1], [0, 0, 0]]
    assert batch.mask_ST.sum(1).tolist() == [2, 0, 3, 1]
    # One micro-batch, longest first: sequences 0 (5 tokens), 2 (4), 1 (3), 3 (2).
    (only,) = batch.plan[0]
    assert only.rows == [0, 2, 1, 3]
    assert only.inputs.tokens_BL.tolist() == [[1, 2, 3, 5, 6], [4, 8, 9, 10, 0], [1, 2, 3, 0, 0], [4, 11, 0, 0, 0]]
    assert only.inputs.lengths_B.tolist() == [5, 4, 3, 2]
