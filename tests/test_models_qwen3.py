"""A Qwen3 dense policy update at TP=2 equals one on a single process: the q/k norms' gradients, partial on each TP
rank, are summed (invariance_runs.py's step and comparison; the logits and the weight sync of every family
are in test_models_parity.py and test_models_weight_sync.py)."""
import pytest
import torch

from distributed_harness import run_distributed
from invariance_runs import BY_COUNT, LOSS_LEVELS, assert_same, merge, one_step
from tiny_models import TINY_QWEN3, make_tiny_model


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    """(path, transformers model) of an untied tiny Qwen3 (head_dim 32, q/k norm weights away from 1)."""
    path = tmp_path_factory.mktemp("qwen3_untied")
    return path, make_tiny_model(path, "qwen3", tie=False, seed=11, **TINY_QWEN3)


def test_policy_update_at_tp2_matches_one_process(qwen3_model):
    path, hf = qwen3_model
    single = run_distributed(one_step, 1, args=(str(path), 1, 1, [BY_COUNT]), timeout_s=300)
    tp2 = run_distributed(one_step, 2, args=(str(path), 2, 1, [BY_COUNT]), timeout_s=300)
    for level in LOSS_LEVELS:
        reference, ours = merge(single, (level, BY_COUNT)), merge(tp2, (level, BY_COUNT))
        assert not torch.equal(reference[2]["model.layers.0.self_attn.q_norm.weight"],
                               hf.model.layers[0].self_attn.q_norm.weight.detach())  # the update reached it
        assert_same(reference, ours, f"{level} loss, TP=2 vs one process")
