"""The metric reducer (training/reduction.py) against hand-computed values on 2 gloo ranks with different token
counts: token- and term-weighted means, sums, max, min, counts, a per-optimizer-step loss, and a metric no rank
recorded. Each expected value is written out from the recorded numbers, not from the reducer's declarations."""
import pytest

from distributed_harness import run_distributed

# Per rank: two optimizer steps (mini-batches) of one micro-batch each, as the losses report them; grad norms are
# DP-wide, so the same on both ranks.
MICRO_BATCHES = {
    0: [dict(num_tokens=10, num_sequences=2, clip_frac_low=0.5, approx_kl=0.1, pg_loss=0.5, ratio_max=1.3,
             ratio_min=0.8),
        dict(num_tokens=30, num_sequences=1, clip_frac_low=1.0, approx_kl=0.3, pg_loss=0.25, ratio_max=1.1,
             ratio_min=0.7)],
    1: [dict(num_tokens=20, num_sequences=1, clip_frac_low=0.0, approx_kl=0.2, pg_loss=0.5, ratio_max=1.2,
             ratio_min=0.9),
        dict(num_tokens=40, num_sequences=4, clip_frac_low=0.25, approx_kl=0.4, pg_loss=0.25, ratio_max=1.4,
             ratio_min=0.75)],
}
ROLLOUT = {0: dict(responses=8, reward_mean=0.25, response_length_max=30.0, groups_kept=1),
           1: dict(responses=24, reward_mean=0.75, response_length_max=50.0, groups_kept=3)}


def _reduce(rank, world_size, sequence_level, declared_override):
    import torch
    import torch.distributed as dist

    from megatron_gtpo.training.reduction import METRICS, MetricReducer
    from megatron_gtpo.training.update import record_optimizer_step

    declared = {**METRICS, **declared_override}
    metrics = MetricReducer(torch.device("cpu"), declared=declared)
    for mb, grad_norm in zip(MICRO_BATCHES[rank], (1.0, 3.0)):
        reported = {k: torch.tensor(float(v)) for k, v in mb.items()
                    if sequence_level or k != "num_sequences"}
        record_optimizer_step(metrics, {"grad_norm": grad_norm, "update_successful": rank == 0 or grad_norm < 2,
                                        "micro_batch_metrics": [reported]}, optimizer_steps=2)
    r = ROLLOUT[rank]
    metrics.add({"reward_mean": r["reward_mean"], "response_length_max": r["response_length_max"],
                 "groups_kept": r["groups_kept"], "optimizer_steps": 2}, {"responses": r["responses"]})
    return metrics.reduce(dist.group.WORLD)


def _expected(sequence_level):
    mbs = MICRO_BATCHES[0] + MICRO_BATCHES[1]
    terms = [mb["num_sequences"] if sequence_level else mb["num_tokens"] for mb in mbs]
    return {
        "approx_kl": sum(mb["num_tokens"] * mb["approx_kl"] for mb in mbs) / 100,  # tokens 10, 30, 20, 40
        "clip_frac_low": sum(t * mb["clip_frac_low"] for t, mb in zip(terms, mbs)) / sum(terms),
        "pg_loss": (0.5 + 0.25 + 0.5 + 0.25) / 2,  # each step's loss summed over ranks, averaged over the 2 steps
        "ratio_max": 1.4, "ratio_min": 0.7,
        "grad_norm": 2.0, "grad_norm_max": 3.0, "update_successful": False, "optimizer_steps": 2,
        "reward_mean": (8 * 0.25 + 24 * 0.75) / 32, "response_length_max": 50.0, "groups_kept": 4,
    }


@pytest.mark.slow
@pytest.mark.parametrize("sequence_level", [False, True], ids=["token_loss", "sequence_loss"])
def test_metrics_reduce_over_micro_batches_steps_and_ranks(sequence_level):
    rank0, rank1 = run_distributed(_reduce, 2, args=(sequence_level, {}), timeout_s=120)
    assert rank0.keys() == rank1.keys()
    expected = _expected(sequence_level)
    for key, value in expected.items():
        assert rank0[key] == pytest.approx(value) and rank1[key] == pytest.approx(value), key
    assert type(rank0["groups_kept"]) is int and type(rank0["update_successful"]) is bool
    assert rank0["accuracy"] != rank0["accuracy"]  # declared, recorded by no rank: NaN (null in metrics.jsonl)
    assert "ref_kl" not in rank0  # optional and not recorded: left out


@pytest.mark.slow
def test_a_wrongly_declared_reduction_gives_another_value():
    """The test above catches a wrong declaration: each of these gives a value it rejects."""
    from megatron_gtpo.training.reduction import Metric, Reduce

    wrong = {"approx_kl": Metric(Reduce.MEAN, "loss_terms"),  # weighted by sequences
             "ratio_max": Metric(Reduce.MIN), "groups_kept": Metric(Reduce.MAX, kind=int),
             "pg_loss": Metric(Reduce.MEAN, "tokens"), "grad_norm": Metric(Reduce.SUM)}
    results = run_distributed(_reduce, 2, args=(True, wrong), timeout_s=120)
    expected = _expected(True)
    for key in wrong:
        assert results[0][key] != pytest.approx(expected[key]), key


def _reduce_across_stages(rank, world_size):
    """Two ranks that stand for two pipeline stages of one replica: each is alone in its data-parallel group."""
    import torch
    import torch.distributed as dist

    from megatron_gtpo.training.reduction import MetricReducer

    dp_groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    metrics = MetricReducer(torch.device("cpu"))
    metrics.add({"time_update_s": 1.0 + rank, "response_length_max": 10.0 + rank})
    if rank == 1:
        metrics.add({"time_reward_s": 5.0})  # measured on one stage only
    return metrics.reduce(dp_groups[rank])


@pytest.mark.slow
def test_phase_times_are_the_slowest_of_all_ranks_the_rest_of_the_data_parallel_group():
    """time_* is the largest over every rank (stages and TP ranks differ in time), not over the DP group only; a
    metric of the data-parallel reduction stays its own group's."""
    from megatron_gtpo.training.reduction import Metric, Reduce

    with pytest.raises(ValueError, match="only a MAX or MIN metric"):
        Metric(Reduce.MEAN, "tokens", over_world=True)
    rank0, rank1 = run_distributed(_reduce_across_stages, 2, timeout_s=120)
    for rank, reduced in enumerate((rank0, rank1)):
        assert reduced["time_update_s"] == 2.0 and reduced["time_reward_s"] == 5.0
        assert reduced["response_length_max"] == 10.0 + rank
        assert reduced["time_sync_s"] != reduced["time_sync_s"]  # recorded by no rank: NaN
