"""One RL step's phases on one process with the tiny synthetic model, through the step batch (training/step_batch.py):
build, old-policy pass, rollout correction, advantages, update.

- On-policy, the update's first mini-batch runs the very micro-batches the old-policy pass ran: its importance ratio
  is exactly 1 and its approx KL exactly 0, with sequence-count, token-budget and packed plans alike; the old
  log-probs equal each sequence's scored alone.
- With rollout log-probs equal to the old ones, every rollout correction leaves the update unchanged (bit for bit).
- A step whose mini-batch is empty (dynamic sampling came up short) takes no optimizer and no LR-schedule step, so
  Adam's momentum from the step before cannot move the weights.
"""
import pytest

from distributed_harness import run_distributed
from policy_runs import policy_run, run_step, sample_experience


ON_POLICY_CASES = [(algorithm, plan) for algorithm in ("gtpo", "grpo_s")
                   for plan in ((8, None, False), (3, None, False), (8, 24, False), (8, 24, True))]
# (max_sequences, max_tokens, pack): one micro-batch, by count, by tokens, packed rows of at most 24 tokens


def _on_policy(rank, world_size):
    """Per case: the update's ratio and approx KL, the plan's micro-batch count and largest micro-batch, and the
    largest difference between the step batch's old log-probs and the scoring path's, sequence by sequence."""
    from megatron_gtpo.training.forward import forward_logprobs_and_entropy, make_micro_batches

    kept = sample_experience(4)
    out = {}
    for algorithm, (max_sequences, max_tokens, pack) in ON_POLICY_CASES:
        run = policy_run(algorithm)
        reference = []
        for sample, group in zip(kept.groups.prompts, kept.groups.responses.to_lists()):
            prompt = sample.prompt_token_ids
            for r in group:  # each sequence alone: column P - 1 + t scores response token t
                sequence = list(prompt) + r.token_ids
                ((logprobs_BL, _),) = forward_logprobs_and_entropy(
                    run.policy.chunks, make_micro_batches([sequence], 1, device=run.parallel.device), run.parallel,
                    vocab_size=run.vocab_size)
                reference.append(logprobs_BL[0, len(prompt) - 1:len(sequence) - 1])
        batch, update = run_step(run, kept, max_sequences=max_sequences, max_tokens=max_tokens, pack=pack)
        error = max(float((batch.old_logprobs_ST[s, :len(ref)] - ref).abs().max()) for s, ref in enumerate(reference))
        out[algorithm, (max_sequences, max_tokens, pack)] = (
            update["ratio_max"], update["ratio_min"], update["approx_kl"], len(batch.plan[0]),
            max(mb.inputs.tokens_BL.numel() for mb in batch.plan[0]), error,
            max(len(mb.rows) for mb in batch.plan[0]) if pack else None,
            bool((batch.old_logprobs_ST[~batch.mask_ST] == 0).all()))
    return out


@pytest.fixture(scope="module")
def on_policy():
    (result,) = run_distributed(_on_policy, 1, timeout_s=600)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("case", ON_POLICY_CASES,
                         ids=lambda c: f"{c[0]}-{c[1][0]}seq-{c[1][1]}tok" + ("-packed" if c[1][2] else ""))
def test_on_policy_first_mini_batch_has_ratio_exactly_one(on_policy, case):
    ratio_max, ratio_min, approx_kl, num_micro_batches, largest, error, most_per_row, zero_padding = on_policy[case]
    max_sequences, max_tokens, pack = case[1]
    assert ratio_max == 1.0 and ratio_min == 1.0 and approx_kl == 0.0
    assert error < 1e-5 and zero_padding  # the step batch holds the log-probs of the right tokens
    if pack:  # one row per micro-batch, several sequences in a row
        assert num_micro_batches > 1 and largest <= max_tokens and most_per_row > 1
    elif max_tokens is not None:
        assert num_micro_batches > 1 and largest <= max_tokens
    else:
        assert num_micro_batches == -(-8 // max_sequences)


CORRECTIONS = [dict(rollout_is="token", rollout_rs="token", rollout_rs_bounds=(0.99, 1.01)),
               dict(rollout_is="sequence", rollout_rs="geometric", rollout_rs_bounds=(0.99, 1.01))]


def _corrected(rank, world_size):
    """Whether each correction's updated weights equal those without correction, bit for bit; and, as a control,
    whether a correction that does bind (rollout log-probs 0.5 below the old ones, weights capped at 1.2) changes
    them."""
    import torch

    def weights_after(rollout_equals_old=True, **settings):
        run = policy_run("gtpo")
        batch, _ = run_step(run, sample_experience(3), rollout_equals_old=rollout_equals_old, **settings)
        return [p.detach().clone() for p in run.policy.chunks[0].parameters()]

    plain = weights_after()
    same = [all(torch.equal(a, b) for a, b in zip(plain, weights_after(**c))) for c in CORRECTIONS]
    # The experience's rollout log-probs are -1.0, far from the old policy's: token weights are capped at 1.2.
    binding = weights_after(rollout_equals_old=False, rollout_is="token", rollout_is_cap=1.2)
    return same, all(torch.equal(a, b) for a, b in zip(plain, binding))


@pytest.mark.slow
def test_corrections_leave_the_update_unchanged_when_rollout_equals_old():
    (result,) = run_distributed(_corrected, 1, timeout_s=300)
    same, control_same = result
    assert same == [True] * len(CORRECTIONS)
    assert not control_same  # the comparison can fail: a correction that binds changes the update


def _update_then_empty(rank, world_size):
    import torch

    run = policy_run("grpo")
    _, first = run_step(run, sample_experience(2))
    weights = [p.detach().clone() for p in run.policy.chunks[0].parameters()]
    schedule_steps = run.policy.scheduler.num_steps
    _, second = run_step(run, sample_experience(0))
    unchanged = all(torch.equal(a, b) for a, b in zip(weights, run.policy.chunks[0].parameters()))
    return (first["optimizer_steps"], second["optimizer_steps"], second["empty_mini_batches"], unchanged,
            run.policy.scheduler.num_steps == schedule_steps)


@pytest.mark.slow
def test_an_empty_mini_batch_skips_the_optimizer_and_the_lr_schedule():
    (result,) = run_distributed(_update_then_empty, 1, timeout_s=240)
    first_steps, second_steps, empty, unchanged, schedule_unchanged = result
    assert first_steps == 1 and second_steps == 0 and empty == 1
    assert unchanged, "an empty mini-batch moved the weights"
    assert schedule_unchanged, "an empty mini-batch stepped the LR schedule"
