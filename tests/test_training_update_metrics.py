"""How one RL step's update metrics combine over micro-batches, optimizer steps and data-parallel ranks
(training/run.combine_update_metrics), against hand-computed values on 2 gloo ranks."""
import pytest

from distributed_harness import run_distributed


def _mb(num_tokens, clip_frac_low, approx_kl, pg_loss, ratio_max, ratio_min, num_sequences=None):
    mb = dict(num_tokens=num_tokens, clip_frac_low=clip_frac_low, approx_kl=approx_kl, pg_loss=pg_loss,
              ratio_max=ratio_max, ratio_min=ratio_min)
    return mb if num_sequences is None else {**mb, "num_sequences": num_sequences}


# Per rank: two optimizer steps (mini-batches) of one micro-batch each; grad norms are DP-wide, so equal on both.
def _results(rank, sequence_level):
    seqs = (lambda n: n) if sequence_level else (lambda n: None)
    mbs = {0: [_mb(10, 0.5, 0.1, 0.5, 1.3, 0.8, seqs(2)), _mb(30, 1.0, 0.3, 0.25, 1.1, 0.7, seqs(1))],
           1: [_mb(20, 0.0, 0.2, 0.5, 1.2, 0.9, seqs(1)), _mb(40, 0.25, 0.4, 0.25, 1.4, 0.75, seqs(4))]}[rank]
    return [{"grad_norm": g, "update_successful": True, "micro_batch_metrics": [mb]} for g, mb in zip((1.0, 3.0), mbs)]


def _combine(rank, world_size, sequence_level):
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from megatron_gtpo.training.run import combine_update_metrics

    groups = SimpleNamespace(is_last_stage=True, dp_size=world_size, dp_group=dist.group.WORLD,
                             device=torch.device("cpu"))
    return combine_update_metrics(_results(rank, sequence_level), groups)


@pytest.mark.parametrize("sequence_level", [False, True])
def test_update_metrics_combine_over_steps_and_ranks(sequence_level):
    rank0, rank1 = run_distributed(_combine, 2, args=(sequence_level,), timeout_s=120)
    assert rank0 == rank1
    out = rank0
    # Token-weighted (tokens 10, 30, 20, 40): approx_kl.
    assert out["approx_kl"] == pytest.approx((10 * 0.1 + 30 * 0.3 + 20 * 0.2 + 40 * 0.4) / 100)
    # The clip fraction is per token for the token loss, per sequence (2, 1, 1, 4) for the sequence loss.
    if sequence_level:
        assert out["clip_frac_low"] == pytest.approx((2 * 0.5 + 1 * 1.0 + 1 * 0.0 + 4 * 0.25) / 8)
        assert out["num_sequences"] == 8
    else:
        assert out["clip_frac_low"] == pytest.approx((10 * 0.5 + 30 * 1.0 + 20 * 0.0 + 40 * 0.25) / 100)
    # Each micro-batch holds its share of its optimizer step's loss: summed, then per optimizer step.
    assert out["pg_loss"] == pytest.approx((0.5 + 0.25 + 0.5 + 0.25) / 2)
    assert out["num_tokens"] == 100 and out["ratio_max"] == 1.4 and out["ratio_min"] == 0.7
    assert out["grad_norm"] == pytest.approx(2.0) and out["grad_norm_max"] == 3.0
    assert out["update_successful"] is True
