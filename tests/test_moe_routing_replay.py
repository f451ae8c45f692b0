"""Routing replay (model.moe.routing_replay: rollout) on CPU at EP=2: two data-parallel replicas, each holding 2 of
the 4 experts of every layer, sample different prompts with the built-in engine, which records the experts each token
went to; then
- at the sampling weights, the old-policy pass that replays them gives the engine's sampling log-probs token for
  token (up to float rounding: the engine decodes with a KV cache, the pass runs whole sequences);
- after one update (a large supervised step that moves the routers, as the second mini-batch or epoch of a step sees
  the policy), the pass still routes every token as the rollout did, while the routers left to choose send a
  measurable share of (token, layer) pairs elsewhere, which changes those tokens' log-probs by far more than float
  rounding."""
import torch

from distributed_harness import run_distributed
from tiny_models import make_tiny_model

PROMPTS = [[[5, 17, 250, 999, 3, 42, 7], [1, 2, 3]], [[900, 800, 700, 600, 500], [11, 12, 13, 14]]]  # per replica
NEW_TOKENS, SAMPLES = 8, 2


def _old_logprobs(policy, experience, groups, replay):
    from megatron_gtpo.training.old_policy import old_policy_pass
    from megatron_gtpo.training.step_batch import build_step_batch

    batch = build_step_batch(experience, groups, mini_batches=[list(range(experience.num_groups))],
                             max_sequences=8, max_tokens=None, replay=replay)
    old_policy_pass(policy.chunks, batch, groups, vocab_size=1000, temperature=1.0)
    return batch


def _fresh_routes(policy, batch):
    """The experts the routers choose by themselves for the batch's sequences (a batch built without replay): per
    sequence [length - 1, M, k] (the positions the rollout recorded), in sequence order."""
    from megatron_gtpo.models.moe_routing import recording
    from megatron_gtpo.training.forward import model_forward

    routes = {}
    with torch.no_grad(), recording(policy.chunks) as recorder:
        for planned in batch.micro_batches():
            assert planned.inputs.routed_experts is None
            model_forward(policy.chunks[0], planned.inputs, local_attention=True)
            B, L = planned.inputs.tokens_BL.shape
            chosen_TMK = recorder.take()
            chosen_LBMK = chosen_TMK.view(L, B, *chosen_TMK.shape[1:])
            routes.update({i: chosen_LBMK[:batch.sequence_lengths[i] - 1, b] for b, i in enumerate(planned.rows)})
    return [routes[i] for i in range(batch.num_sequences)]


def _replay_rank(rank, world_size, model_dir):
    from megatron_gtpo.config import load_config
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.moe_routing import routed_layers
    from megatron_gtpo.models.qwen import load_hf_config
    from megatron_gtpo.rollout import BuiltinEngine, SamplingParams
    from hand_built import rewarded_groups
    from megatron_gtpo.training.model_setup import PolicyModel
    from megatron_gtpo.training.step_batch import ReplayPlan
    from megatron_gtpo.training.train_step import run_train_step, supervised_loss_fn, update_micro_batch

    cfg = load_config(None, [f"model.hf_dir={model_dir}", "data.source=synthetic", "parallel.expert=2",
                             "model.moe.routing_replay=rollout"])
    groups = initialize_parallel(1, 1, expert_parallel=2, seed=3)
    policy = PolicyModel.build(cfg, load_hf_config(model_dir), groups)
    engine = BuiltinEngine(policy.chunks, groups, 1000, record_routing=True)
    prompts = PROMPTS[groups.dp_rank]
    # The record, and beside it the routing this rank recorded (rank-local: never through the transport).
    rollout = engine.submit(
        prompts, SamplingParams(n=SAMPLES, temperature=1.0, max_new_tokens=NEW_TOKENS, seed=17 + groups.dp_rank))()
    responses, recorded = rollout.responses, rollout.routed_experts
    assert len(recorded) == responses.num_responses
    no_reward = torch.zeros(len(prompts), SAMPLES)
    experience = rewarded_groups(prompts, responses, no_reward, routed_experts=recorded)
    replay = ReplayPlan(routed_layers(policy.chunks), 2)

    def compare():
        """Against the rollout: the old-policy pass's largest log-prob difference with replay and with the routers
        choosing, the share of (token, layer) pairs the routers send to other experts than the rollout's, and the
        largest log-prob difference between replaying and choosing."""
        replayed, chosen = (_old_logprobs(policy, experience, groups, plan) for plan in (replay, None))
        rerouted = [(torch.sort(f.long(), -1).values != torch.sort(r.long(), -1).values).any(-1).flatten()
                    for f, r in zip(_fresh_routes(policy, chosen), recorded)]
        mask = replayed.mask_ST
        return {"replay": (replayed.old_logprobs_ST - replayed.rollout_logprobs_ST).abs()[mask].max().item(),
                "choose": (chosen.old_logprobs_ST - chosen.rollout_logprobs_ST).abs()[mask].max().item(),
                "rerouted_fraction": torch.cat(rerouted).float().mean().item(),
                "replay_vs_choose": (replayed.old_logprobs_ST - chosen.old_logprobs_ST).abs()[mask].max().item()}

    out = {"sampling": compare()}
    # One supervised step on the responses at a large learning rate: every parameter moves, the routers' too.
    batch = _old_logprobs(policy, experience, groups, replay)
    run_train_step(policy, [update_micro_batch(batch, mb) for mb in batch.plan[0]], groups,
                   supervised_loss_fn(float(batch.mask_ST.sum())), vocab_size=1000, lr=0.01)
    out["updated"] = compare()
    return out


def test_replay_routes_every_token_as_the_rollout_did(tmp_path):
    make_tiny_model(tmp_path, "qwen3_moe", vocab_size=1000, num_layers=2, head_dim=32, seed=51)
    for rank in run_distributed(_replay_rank, 2, args=(str(tmp_path),), timeout_s=400):
        sampling, updated = rank["sampling"], rank["updated"]
        # At the sampling weights the routers choose what the engine recorded (the recording is aligned with the
        # sequences' tokens), and both passes give the sampling log-probs token for token up to float rounding.
        assert sampling["rerouted_fraction"] == 0.0
        assert sampling["replay"] < 1e-5 and sampling["choose"] < 1e-5
        # After the update: left to choose, the routers send a measurable share of (token, layer) pairs to other
        # experts, and those tokens' log-probs move far beyond rounding; replay keeps the rollout's routing.
        assert updated["rerouted_fraction"] > 0.02
        assert updated["replay_vs_choose"] > 1e-2
