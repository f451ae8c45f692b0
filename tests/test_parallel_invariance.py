"""One policy-update step on a fixed batch gives the same loss and the same updated weights at TP=1 vs 2 (with and
without sequence parallelism), PP=1 vs 2, DP=1 vs 2, micro-batch size 4 vs 1, micro-batches cut by a token budget
and sequences packed into rows (the loss contract, end to end through the step batch, update_policy, megatron's
schedule, DDP and the DistributedOptimizer), for the token-level loss (GTPO / DAPO / GRPO) and the sequence-level
one (GRPO-S, one advantage per sequence, mean over sequences)."""
import pytest
import torch

from distributed_harness import run_distributed
from invariance_runs import (BUDGETS, BY_COUNT, G, LOSS_LEVELS, NUM_GROUPS, ONE_BY_ONE, PACKED, SELECTIONS, assert_same,
                             merge, one_step)
from tiny_models import make_tiny_qwen2


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("inv")
    make_tiny_qwen2(path, tie=False, vocab_size=1000, num_layers=4, num_heads=4, num_kv_heads=2)
    results = run_distributed(one_step, 1, args=(str(path), 1, 1, [BY_COUNT, ONE_BY_ONE, *BUDGETS, *PACKED]),
                              kwargs={"selection_plans": [BY_COUNT, ONE_BY_ONE, PACKED[1]]}, timeout_s=300)
    return path, results


@pytest.mark.parametrize("level", SELECTIONS)
def test_token_selections_do_not_depend_on_the_split(reference, level):
    """Clip-Cov, KL-Cov and the high-entropy fraction select over the whole mini-batch: micro-batches of 4 or 1
    sequences, or packed rows, select the same tokens and give the same update."""
    _, results = reference
    selected = results[0][level, BY_COUNT]["selected"]
    assert len(selected) == 1 and 0 < next(iter(selected.values())) < 1
    for plan in (ONE_BY_ONE, PACKED[1]):
        assert results[0][level, plan]["selected"] == selected
        assert_same(merge(results, (level, BY_COUNT)), merge(results, (level, plan)), f"{level}, plan {plan}")


@pytest.mark.slow
@pytest.mark.parametrize("level", LOSS_LEVELS)
def test_micro_batch_size_4_vs_1(reference, level):
    _, results = reference
    assert results[0][level, BY_COUNT]["clipped"]  # the batch really exercises the clip
    assert_same(merge(results, (level, BY_COUNT)), merge(results, (level, ONE_BY_ONE)),
                 f"{level} loss, micro-batch 4 vs 1")
    # The device audit counts device -> host reads: a step's must not grow with its number of micro-batches.
    assert results[0][level, BY_COUNT]["host_syncs"] == results[0][level, ONE_BY_ONE]["host_syncs"]


def _scored(rank_results, key):
    """The old-policy pass's log-probs of every sequence, [S, 10] (DP ranks' rows in order, from the last stage)."""
    parts = {}
    for r in rank_results:
        if r[key]["scored"] is not None:
            parts.setdefault(r[key]["dp_rank"], r[key]["scored"])
    return torch.cat([torch.nn.functional.pad(parts[k], (0, 10 - parts[k].shape[1])) for k in sorted(parts)])


@pytest.mark.parametrize("level", LOSS_LEVELS)
@pytest.mark.parametrize("plan", BUDGETS + PACKED, ids=lambda b: f"{b[1]}tokens" + ("-packed" if b[2] else ""))
def test_token_budgets_and_packing_match_sequence_counts(reference, level, plan):
    _, results = reference
    split = results[0][level, plan]
    assert 1 < split["micro_batches"] < NUM_GROUPS * G and split["largest"] <= plan[1]
    assert split["most_per_row"] > 1 if plan[2] else split["most_per_row"] == 1  # packed: sequences share rows
    # The old-policy pass: every sequence gets the log-probs it gets in a row of its own (fp32 rounding).
    assert torch.allclose(_scored(results, (level, plan)), _scored(results, (level, BY_COUNT)), rtol=0, atol=2e-5)
    assert_same(merge(results, (level, BY_COUNT)), merge(results, (level, plan)),
                 f"{level} loss, micro-batches of 4 sequences vs plan {plan}")


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,sp,cp", [(2, 1, False, 1), (2, 1, True, 1), (1, 2, False, 1), (1, 1, False, 1),
                                         (2, 1, True, 2)],
                         ids=["tp2", "tp2-sequence-parallel", "pp2", "dp2", "tp2-sequence-parallel-cp2"])
def test_layouts_match_single_process(reference, tp, pp, sp, cp):
    """Sequence parallelism: each TP rank runs the norms on its half of every (odd-length: padded) sequence, and the
    norms' gradients are summed over TP. Context parallelism (with TP and SP, on 4 ranks): each CP rank runs its two
    chunks of every row (padded to a multiple of 8), the log-probs come back whole over CP, and the gradients are
    summed over DP x CP."""
    path, base = reference
    world = max(2, tp * pp * cp)  # (1, 1) on two processes is DP=2
    plans = [(2, None, False), BUDGETS[1], PACKED[1]]
    selection_plans = [] if sp else plans[:1]  # the token selections over the DP ranks, the last stage
    results = run_distributed(one_step, world, args=(str(path), tp, pp, plans),
                              kwargs={"sp": sp, "cp": cp, "selection_plans": selection_plans}, timeout_s=300)
    where = f"TP={tp} PP={pp} CP={cp} DP={world // (tp * pp * cp)} SP={sp}"
    for plan in plans:  # the old-policy pass
        assert torch.allclose(_scored(results, ("token", plan)), _scored(base, ("token", BY_COUNT)), rtol=0,
                              atol=2e-5), f"{where}, plan {plan}"
    for level in LOSS_LEVELS:
        for plan in plans:
            assert_same(merge(base, (level, BY_COUNT)), merge(results, (level, plan)),
                         f"{level} loss, {where}, plan {plan}")
    for level in SELECTIONS if selection_plans else ():
        assert_same(merge(base, (level, BY_COUNT)), merge(results, (level, plans[0])), f"{level}, {where}")
