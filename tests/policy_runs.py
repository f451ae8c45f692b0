"""One RL step's phases on the tiny synthetic model, run in spawned ranks without the Trainer: a made-up experience,
the trainer's components (`policy_run`) and its phases from the step batch to the update (`run_step`). Used by
test_training_update_policy.py and test_device_audit.py."""


G = 2


def sample_experience(num_prompt_groups, seed=0):
    import torch

    from hand_built import rewarded_groups
    from megatron_gtpo.rollout.responses import Response, Responses

    g = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(3, 16, (2 + n % 3,), generator=g).tolist()) for n in range(num_prompt_groups)]
    responses = Responses.from_lists([[Response(torch.randint(3, 16, (1 + (3 * n + j) % 5,), generator=g).tolist(),
                                                [-1.0] * (1 + (3 * n + j) % 5), "stop") for j in range(G)]
                                      for n in range(num_prompt_groups)])
    correct = torch.tensor([[1.0, 0.0]] * num_prompt_groups).reshape(num_prompt_groups, G)
    return rewarded_groups(prompts, responses, correct)


def policy_run(algorithm, overrides=(), *, tp=1, pp=1, tied=False):
    """The trainer's components for the phases of `run_step`: parallel groups, the policy, the configured algorithm."""
    from types import SimpleNamespace

    from megatron_gtpo.algorithms import configure_algorithm
    from megatron_gtpo.config import load_config
    from megatron_gtpo.data.synthetic import tiny_model_hf_config
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.qwen import ModelShape
    from megatron_gtpo.training.model_setup import build_chunks, wrap_for_training

    import torch

    parallel = initialize_parallel(tp, pp)
    torch.manual_seed(0)
    cfg = load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", "optim.lr=0.01", "steps=4",
                             f"algorithm.name={algorithm}", *overrides])
    hf_config = dict(tiny_model_hf_config(), tie_word_embeddings=tied)
    policy = wrap_for_training(cfg, build_chunks(cfg, hf_config, parallel))
    return SimpleNamespace(cfg=cfg, parallel=parallel, policy=policy,
                           algorithm=configure_algorithm(cfg.algorithm, max_new_tokens=cfg.rollout.max_new_tokens),
                           vocab_size=ModelShape.from_hf(tiny_model_hf_config()).vocab_size)


def run_step(run, kept, *, max_sequences=4, max_tokens=None, pack=False, rollout_equals_old=False, **correction):
    """The trainer's phases for one step; returns the step batch and the update's metrics."""
    from megatron_gtpo.training.advantages import global_advantages
    from megatron_gtpo.training.old_policy import correct_rollout, old_policy_pass
    from megatron_gtpo.training.reduction import MetricReducer
    from megatron_gtpo.training.step_batch import build_step_batch
    from megatron_gtpo.training.trainer import split_evenly
    from megatron_gtpo.training.update import update_policy

    batch = build_step_batch(kept, run.parallel, mini_batches=split_evenly(list(range(kept.num_groups)), 1),
                             max_sequences=max_sequences, max_tokens=max_tokens, pack=pack)
    old_policy_pass(run.policy.chunks, batch, run.parallel, vocab_size=run.vocab_size, temperature=1.0)
    if rollout_equals_old and batch.old_logprobs_ST is not None:
        batch.rollout_logprobs_ST = batch.old_logprobs_ST.clone()
    correct_rollout(batch, **correction)
    if run.parallel.is_last_stage:
        global_advantages(run.algorithm.advantages, run.algorithm.uses_entropy, batch, run.parallel)
    metrics = MetricReducer(run.parallel.device)
    update_policy(run.policy, batch, run.parallel, run.algorithm, metrics, epochs=1, vocab_size=run.vocab_size,
                  temperature=1.0, chunk_tokens=None)
    return batch, metrics.reduce(run.parallel.dp_group)
