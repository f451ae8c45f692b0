"""The update phase: epochs over the step batch's mini-batches, one optimizer step each, on the micro-batch plan the
old-policy pass ran (train_step.py runs one optimizer step through megatron-core's pipeline schedule), or, where the
step ran no old-policy pass, whose forward gives the old-policy values (old_policy.py)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megatron_gtpo.algorithms import ConfiguredAlgorithm, local_loss_normalizer
from megatron_gtpo.distributed import ParallelGroups, Truncation

from .model_setup import PolicyModel
from .reduction import MetricReducer
from .step_batch import StepBatch
from .train_step import run_train_step, update_micro_batch

# The loss reports these beside its metrics: the weights of its means, and the updating policy's entropy (the step
# logs the old policy's, entropy_mean).
_LOSS_WEIGHTS, _NOT_LOGGED = ("num_tokens", "num_sequences"), ("entropy",)


def update_policy(policy: PolicyModel, batch: StepBatch, parallel: ParallelGroups, algorithm: ConfiguredAlgorithm,
                  metrics: MetricReducer, *, epochs: int, vocab_size: int, temperature: float,
                  truncation: Truncation | None = None, chunk_tokens: int | None,
                  old_policy: Callable | None = None) -> None:
    """`epochs` epochs over the step batch's mini-batches, one optimizer step each, recording the update's metrics.
    A mini-batch without a response token on any DP rank (dynamic sampling came up short) takes no optimizer and no
    LR-schedule step: Adam would still move the weights on its momentum. `old_policy` (old_policy.OldPolicyFromUpdate,
    on the last pipeline stage of a step batch of one optimizer step): called with each micro-batch and its log-probs
    and entropies before its loss, it gives the micro-batch its old-policy values."""
    mini_batches = [[update_micro_batch(batch, planned) for planned in mini] for mini in batch.plan]
    # Per mini-batch: [the loss normaliser (loss contract), response tokens before rejection], summed over this
    # rank's micro-batches (a padding micro-batch adds none), then over DP ranks: one all-reduce, one host read.
    counts = torch.tensor([[0, sum(batch.response_lengths[i] for mb in planned for i in mb.rows)]
                           for planned in batch.plan], dtype=torch.float64, device=parallel.device)
    for k, (mini, planned) in enumerate(zip(mini_batches, batch.plan)):
        for mb, plan_mb in zip(mini, planned):
            if plan_mb.rows:
                counts[k, 0] += local_loss_normalizer(mb.loss_mask_BT, algorithm.loss_agg_mode)
    dist.all_reduce(counts, group=parallel.dp_group)
    normalizers = counts[:, 0].clamp(min=1)
    response_tokens = counts[:, 1].tolist()
    empty = response_tokens.count(0)
    optimizer_steps = epochs * (len(response_tokens) - empty)
    assert old_policy is None or epochs * len(response_tokens) == 1, "old_policy.pass_reason: one optimizer step"
    for _epoch in range(epochs):
        for micro_batches, normalizer, tokens in zip(mini_batches, normalizers, response_tokens):
            if tokens == 0:
                continue

            def loss_fn(mb, logprobs_BT, entropy_BT, normalizer=normalizer):
                if old_policy is not None:
                    mb = old_policy(mb, logprobs_BT, entropy_BT)
                selected = {} if mb.kl_penalty_BT is None else {"kl_penalty_BT": mb.kl_penalty_BT}
                return algorithm.policy_loss(logprobs_BT, mb.old_logprobs_BT, mb.advantages, mb.loss_mask_BT,
                                             loss_normalizer=normalizer, entropy_BT=entropy_BT,
                                             ref_logprobs_BT=mb.ref_logprobs_BT, pg_weights=mb.pg_weights,
                                             **selected)

            result = run_train_step(policy, micro_batches, parallel, loss_fn, vocab_size=vocab_size,
                                    temperature=temperature, truncation=truncation, chunk_tokens=chunk_tokens)
            record_optimizer_step(metrics, result, optimizer_steps)
    padded = sum(mb.inputs.tokens_BL.numel() for mini in batch.plan for mb in mini if mb.rows)
    real = sum(batch.sequence_lengths)
    metrics.add({"optimizer_steps": optimizer_steps, "empty_mini_batches": empty,
                 "padding_fraction": 1.0 - real / padded if padded else 0.0}, {"padded_tokens": padded})


def record_optimizer_step(metrics: MetricReducer, result: dict, optimizer_steps: int) -> None:
    """One optimizer step's metrics (run_train_step's result): its micro-batches' loss metrics, each micro-batch's
    share of the step's loss divided by `optimizer_steps` (so that the sum is the mean loss per optimizer step)."""
    for mb in result["micro_batch_metrics"]:
        if not mb:  # the padding micro-batch of a rank without sequences
            continue
        weights = {"tokens": mb["num_tokens"], "loss_terms": mb.get("num_sequences", mb["num_tokens"])}
        values = {k: v for k, v in mb.items() if k not in _LOSS_WEIGHTS + _NOT_LOGGED}
        for loss in ("pg_loss", "sft_loss"):
            if loss in values:
                values[loss] = values[loss] / optimizer_steps
        metrics.add(values, weights)
    grad_norm = result["grad_norm"]
    metrics.add({"grad_norm": grad_norm, "grad_norm_max": grad_norm, "update_successful": result["update_successful"]},
                {"optimizer_steps": 1})
