"""training/run.update_policy on one process with the tiny synthetic model: a step whose mini-batch is empty
(dynamic sampling came up short) takes no optimizer and no LR-schedule step, so Adam's momentum from the step before
cannot move the weights."""
from distributed_harness import run_distributed


def _experience(num_groups, G=2):
    import torch

    from megatron_gtpo.rollout.engine import Response
    from megatron_gtpo.training.experience import Experience

    prompts = [tuple(range(3, 7))] * num_groups
    responses = [[Response([5 + g, 6, 7][:2 + g], [-1.0] * (2 + g), "stop") for g in range(G)]
                 for _ in range(num_groups)]
    correct = torch.tensor([[1.0, 0.0]] * num_groups).reshape(num_groups, G)
    exp = Experience(prompts, responses, correct, correct.clone())
    exp.old_logprobs_NGT = torch.full((num_groups, G, 3), -1.0)
    exp.entropy_NGT = torch.ones(num_groups, G, 3)
    return exp


def _update_twice(rank, world_size):
    from types import SimpleNamespace

    import torch

    from megatron_gtpo.algorithms import resolve_algorithm
    from megatron_gtpo.config import load_config
    from megatron_gtpo.data.synthetic import tiny_model_hf_config
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.qwen2 import Qwen2Shape
    from megatron_gtpo.training.model_setup import build_chunks, wrap_for_training
    from megatron_gtpo.training.run import update_policy

    groups = initialize_parallel(1, 1)
    cfg = load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", "optim.lr=0.01"])
    policy = wrap_for_training(cfg, build_chunks(cfg, tiny_model_hf_config(), groups), train_steps=4)
    spec = resolve_algorithm("grpo")
    run = SimpleNamespace(cfg=cfg, groups=groups, policy=policy, loss_agg_mode=spec.loss_agg_mode,
                          policy_loss=spec.policy_loss,
                          vocab_size=Qwen2Shape.from_hf(tiny_model_hf_config()).vocab_size)
    full = _experience(2)
    first = update_policy(run, full, torch.tensor([[1.0, -1.0], [1.0, -1.0]]))
    weights = [p.detach().clone() for p in policy.chunks[0].parameters()]
    schedule_steps = policy.scheduler.num_steps
    second = update_policy(run, _experience(0), torch.zeros(0, 2))
    unchanged = all(torch.equal(a, b) for a, b in zip(weights, policy.chunks[0].parameters()))
    return (first["optimizer_steps"], second["optimizer_steps"], second["empty_mini_batches"], unchanged,
            policy.scheduler.num_steps == schedule_steps)


def test_an_empty_mini_batch_skips_the_optimizer_and_the_lr_schedule():
    (result,) = run_distributed(_update_twice, 1, timeout_s=240)
    first_steps, second_steps, empty, unchanged, schedule_unchanged = result
    assert first_steps == 1 and second_steps == 0 and empty == 1
    assert unchanged, "an empty mini-batch moved the weights"
    assert schedule_unchanged, "an empty mini-batch stepped the LR schedule"
