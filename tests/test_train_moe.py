"""The trainer on a tiny Qwen3-MoE under torchrun on CPU: GTPO at EP=2 (each of the 2 data-parallel replicas holds 2
of the 4 experts of every layer), and with routing replay under activation recompute at TP=2 with sequence
parallelism and EP=2 (each of the 2 tensor-parallel ranks holds 2 whole experts and routes its half of the tokens),
logging the routing metrics; its checkpoint resumes exactly, and at EP=1 (docs/checkpoints.md)."""
import math

import pytest

from trainer_runs import assert_resumed_run_equals, comparable, copy_checkpoint, read_metrics, run_train
from tiny_models import make_tiny_model

pytestmark = pytest.mark.slow  # whole training runs under torchrun

NUM_LAYERS, EXPERTS, TOPK = 2, 4, 2
# The synthetic addition task (16-character vocabulary) on a HF Qwen3-MoE directory instead of the tiny dense model.
MOE = ["model.tiny_synthetic=false", "parallel.tensor=1", "steps=2", "warm_start.steps=10", "data.prompts_per_step=8",
       "checkpoint.save_every=0"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_synthetic")
    make_tiny_model(path, "qwen3_moe", vocab_size=16, hidden_size=64, num_layers=NUM_LAYERS, num_heads=4,
                    num_kv_heads=2, head_dim=16, max_positions=64, seed=5, num_experts=EXPERTS,
                    num_experts_per_tok=TOPK)
    return path


TP2_SP = ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert_tensor=1"]
# The recomputed layers replay as their forward did (models/moe_routing.py).
RECOMPUTED = ["model.recompute_activations=true"]


@pytest.mark.parametrize("replay,layout", [("none", []), ("rollout", TP2_SP + RECOMPUTED)],
                         ids=["ep2", "replayed-recomputed-tp2-sp-ep2"])
def test_gtpo_trains_a_moe_model_at_ep2_and_logs_its_routing(tmp_path, moe_dir, replay, layout):
    res = run_train(tmp_path, 2, [*MOE, f"model.hf_dir={moe_dir}", "parallel.expert=2", "algorithm.name=gtpo",
                                  f"model.moe.routing_replay={replay}", *layout])
    assert res.returncode == 0, res.stderr[-4000:]
    warm, *rows = read_metrics(tmp_path)
    assert warm["step"] == -1 and [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["update_successful"] and math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
        # The engine's sampling log-probs and the old-policy pass's agree (same weights, fp32; with replay the
        # pass routes every token as the engine did: tests/test_moe_routing_replay.py).
        assert row["rollout_logprob_mismatch"] < 1e-5
        for layer in range(1, NUM_LAYERS + 1):
            imbalance = row[f"expert_load_imbalance/layer_{layer:02d}"]
            entropy = row[f"router_entropy/layer_{layer:02d}"]
            assert 1.0 <= imbalance <= EXPERTS / TOPK  # balanced .. every token to the same k experts
            assert 0.0 < entropy <= math.log(EXPERTS) + 1e-9
        assert row["expert_load_imbalance_max"] == max(row[f"expert_load_imbalance/layer_{i:02d}"]
                                                       for i in range(1, NUM_LAYERS + 1))


RESUME = [*MOE, "model.moe.routing_replay=rollout", "checkpoint.save_every=2", "data.mini_batches_per_step=2",
          "optim.lr_decay_style=constant"]


def _resume_from_step_2(full, out, overrides) -> str:
    """A run in `out` resumed from the step-2 checkpoint of the run in `full` (copied); returns its stderr."""
    copy_checkpoint(full, out, "step_00000002")
    res = run_train(out, 2, overrides)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resumed from" in res.stderr
    return res.stderr


def test_resume_is_exact_and_works_at_another_expert_layout(tmp_path, moe_dir):
    """A 3-step run at EP=2 checkpoints after step 2; its step-2 checkpoint resumed at EP=2 trains step 2 and writes
    the step-3 checkpoint exactly as the uninterrupted run did."""
    full, part, other = tmp_path / "full", tmp_path / "part", tmp_path / "other"
    common = [*RESUME, f"model.hf_dir={moe_dir}", "steps=3"]
    res = run_train(full, 2, [*common, "parallel.expert=2"])
    assert res.returncode == 0, res.stderr[-4000:]
    _resume_from_step_2(full, part, [*common, "parallel.expert=2"])
    full_rows, tensors = assert_resumed_run_equals(full, part, "step_00000003", resumed_at=2)
    assert [r["step"] for r in full_rows] == [2] and any("experts" in k for k in tensors)

    # The step-2 checkpoint resumed with every expert on each replica (EP=1): weights and optimizer state reshard,
    # and the next step is the uninterrupted run's up to float rounding (sampling does not depend on the RNG states,
    # which a new layout re-seeds: each response has a stream of its own).
    assert "at a different layout" in _resume_from_step_2(full, other, [*common, "parallel.expert=1"])
    (resumed,) = read_metrics(other)
    expected = comparable(full_rows[0])
    assert resumed["step"] == expected["step"] == 2
    for k in ("reward_mean", "entropy_mean", "pg_loss", "grad_norm", "ratio_mean", "lr",
              "expert_load_imbalance/layer_01", "router_entropy/layer_02"):
        assert resumed[k] == pytest.approx(expected[k], rel=1e-4, abs=1e-6), k
