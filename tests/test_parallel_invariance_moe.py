"""The loss contract with experts: one policy-update step of a tiny Qwen3-MoE on a fixed batch gives the same loss,
gradient norm and updated weights (every expert's included) on one process (EP 1) as at EP 2 over two data-parallel
replicas, whose tokens cross replicas to their experts and whose micro-batch counts differ (the lockstep padding),
with and without routing replay, for the token- and the sequence-level loss (invariance_runs.py's step);
and at TP=2 with sequence parallelism and EP=2 (ETP=1), where each TP rank routes and replays its half of every
padded or packed row; at CP=2 with EP=2, where each CP rank routes its two chunks of every row; and replay under
activation recompute at PP 2 as one process without recompute."""
import pytest

from distributed_harness import run_distributed
from invariance_runs import BUDGETS, BY_COUNT, LOSS_LEVELS, ONE_BY_ONE, PACKED, assert_same, merge, one_step
from tiny_models import make_tiny_model

UNEVEN = BUDGETS[0]  # a token budget: the two replicas cut their sequences into different numbers of micro-batches


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("inv_moe")
    make_tiny_model(path, "qwen3_moe", vocab_size=1000, num_layers=2, head_dim=32, seed=61)
    return path, {replay: run_distributed(one_step, 1, args=(str(path), 1, 1, [BY_COUNT]),
                                          kwargs={"replay": replay}, timeout_s=300) for replay in (False, True)}


@pytest.mark.parametrize("replay", [False, True], ids=["routed", "replayed"])
@pytest.mark.parametrize("plan", [BY_COUNT, UNEVEN], ids=["by_count", "token_budget"])
def test_expert_parallel_update_matches_one_process(moe_reference, plan, replay):
    path, references = moe_reference
    base = references[replay]
    results = run_distributed(one_step, 2, args=(str(path), 1, 1, [plan]), kwargs={"ep": 2, "replay": replay},
                              timeout_s=300)
    if plan == UNEVEN:
        counts = {r[LOSS_LEVELS[0], plan]["micro_batches"] for r in results}
        assert counts == {max(counts)}  # padded to the same count on both EP ranks
    if replay:  # replaying other experts than the routers choose changes the update
        assert merge(base, (LOSS_LEVELS[0], BY_COUNT))[0] != merge(references[False], (LOSS_LEVELS[0], BY_COUNT))[0]
    for level in LOSS_LEVELS:
        reference, ours = merge(base, (level, BY_COUNT)), merge(results, (level, plan))
        assert any("experts" in name for name in ours[2])
        assert_same(reference, ours, f"{level} loss, EP=2 over DP=2 vs one process, plan {plan}")


@pytest.mark.slow
def test_tensor_and_sequence_parallel_update_matches_one_process(moe_reference):
    path, references = moe_reference
    plans = [BUDGETS[1], PACKED[1]]
    results = run_distributed(one_step, 2, args=(str(path), 2, 1, plans),
                              kwargs={"ep": 2, "etp": 1, "replay": True, "sp": True}, timeout_s=300)
    for level in LOSS_LEVELS:
        for plan in plans:
            assert any("experts" in name for name in merge(results, (level, plan))[2])
            assert_same(merge(references[True], (level, BY_COUNT)), merge(results, (level, plan)),
                         f"{level} loss, TP=2 SP EP=2 vs one process, plan {plan}")


@pytest.mark.slow
def test_context_parallel_update_matches_one_process(moe_reference):
    """CP=2 x EP=2 on two processes (the experts' EP group spans the CP ranks, megatron's expert layout of TP x CP x
    DP), padded and packed rows (each sequence padded to a multiple of 2 x CP), against one process."""
    path, references = moe_reference
    plans = [BUDGETS[1], PACKED[1]]
    results = run_distributed(one_step, 2, args=(str(path), 1, 1, plans), kwargs={"ep": 2, "etp": 1, "cp": 2},
                              timeout_s=300)
    for level in LOSS_LEVELS:
        for plan in plans:
            assert any("experts" in name for name in merge(results, (level, plan))[2])
            assert_same(merge(references[False], (level, BY_COUNT)), merge(results, (level, plan)),
                         f"{level} loss, CP=2 EP=2 vs one process, plan {plan}")


@pytest.mark.slow
def test_replay_under_activation_recompute_at_pp2(moe_reference):
    """Replay with full activation recompute (model.recompute_activations) at PP 2, one sequence per micro-batch:
    1F1B runs a later micro-batch's forward before an earlier one's backward, whose recompute must replay the
    earlier one's choices (models/moe_routing.py). The same update as one process without recompute."""
    path, references = moe_reference
    results = run_distributed(one_step, 2, args=(str(path), 1, 2, [ONE_BY_ONE]),
                              kwargs={"replay": True, "recompute": True}, timeout_s=300)
    assert {r[LOSS_LEVELS[0], ONE_BY_ONE]["micro_batches"] for r in results} == {8}
    for level in LOSS_LEVELS:
        assert_same(merge(references[True], (level, BY_COUNT)), merge(results, (level, ONE_BY_ONE)),
                     f"{level} loss, replay with recompute at PP=2 vs one process without")
