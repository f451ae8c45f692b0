"""One optimizer step over micro-batches through megatron-core's pipeline schedule.

The loss of a micro-batch is a SUM of terms already divided by the global normaliser of the whole mini-batch (the
loss contract in algorithms/losses.py). megatron-core divides each micro-batch loss by the number of micro-batches
and DDP averages gradients over data-parallel ranks, so `run_train_step` multiplies by both: the gradient is then
exactly the full mini-batch gradient for any micro-batch split and any DP size.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_gtpo.distributed import ParallelGroups, Truncation

from .forward import MicroBatch, next_token_logprobs_and_entropy, on_context_rank, run_pipeline
from .model_setup import PolicyModel
from .step_batch import MicroBatchColumns, PlannedMicroBatch, StepBatch


@dataclass
class UpdateMicroBatch:
    """A planned micro-batch with what the loss needs, response-aligned [B, T] (B: the micro-batch's sequences,
    T: its longest response; column t is response token t, whatever the model inputs' layout). On pipeline stages
    other than the last only `inputs`, `columns` and `loss_mask_BT` are filled; the padding micro-batch of a rank
    without sequences has B = 0."""

    inputs: MicroBatch
    columns: MicroBatchColumns  # gathers the model's [B_rows, L] next-token outputs into [B, T]
    loss_mask_BT: torch.Tensor  # bool: the response tokens in the loss
    old_logprobs_BT: torch.Tensor | None = None
    advantages: torch.Tensor | None = None  # [B, T] per token or [B] per sequence
    ref_logprobs_BT: torch.Tensor | None = None
    pg_weights: torch.Tensor | None = None  # [B, T] or [B]: rollout-mismatch weights, 0 where a selection drops
    kl_penalty_BT: torch.Tensor | None = None  # bool: KL-Cov's penalised tokens


# loss_fn(micro_batch, logprobs_BT, entropy_BT) -> (loss_mb under the loss contract, metrics dict of tensors)
LossFn = Callable[[UpdateMicroBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]


def update_micro_batch(batch: StepBatch, planned: PlannedMicroBatch) -> UpdateMicroBatch:
    """The update's view of one planned micro-batch: the step batch's fields of its sequences, on the device."""
    columns = planned.columns

    def select(values):
        return None if values is None else columns.select(values)

    mask = batch.loss_mask_ST if batch.loss_mask_ST is not None else batch.mask_ST
    return UpdateMicroBatch(planned.inputs, columns, columns.select(mask), select(batch.old_logprobs_ST),
                            select(batch.advantages), select(batch.ref_logprobs_ST), select(batch.pg_weights),
                            select(batch.kl_penalty_ST))


def run_train_step(policy: PolicyModel, micro_batches: list[UpdateMicroBatch], parallel: ParallelGroups,
                   loss_fn: LossFn, *, vocab_size: int, temperature: float = 1.0,
                   truncation: Truncation | None = None, lr: float | None = None,
                   chunk_tokens: int | None = None) -> dict:
    """Forward+backward over the micro-batches, then one optimizer and LR-schedule step. Returns
    {"grad_norm", "update_successful", "micro_batch_metrics" (last stage: one dict per micro-batch)}.
    `lr` fixes the learning rate of this step and leaves the LR schedule where it is (the warm-start).
    `temperature`, `truncation`: the sampling distribution the log-probs are of (training/forward.py).
    `chunk_tokens`: the vocab-parallel op's chunk (None: all tokens at once)."""
    num_micro_batches = len(micro_batches)
    scale = num_micro_batches * parallel.dp_size  # undo megatron's /num_microbatches and DDP's DP average

    def loss_on_last_stage(mb: UpdateMicroBatch, logits_BLV):
        # The op runs on the micro-batch's own layout (packed rows included); the loss reads its response tokens.
        # No id-range check: a host sync per micro-batch; the ids are the step batch's (forward.py).
        logprobs_BL, entropy_BL = next_token_logprobs_and_entropy(
            logits_BLV, mb.inputs.tokens_BL, parallel, vocab_size=vocab_size, temperature=temperature,
            truncation=truncation, chunk_size=chunk_tokens, scored_from=mb.inputs.scored_from)
        if not mb.columns.sequences_S.numel():  # a rank without sequences: zero loss, still in the backward graph
            return (logprobs_BL * 0).sum(), {}
        loss, metrics = loss_fn(mb, mb.columns.gather(logprobs_BL), mb.columns.gather(entropy_BL))
        return loss * scale, {k: v.detach() for k, v in metrics.items()}

    for chunk in policy.ddp_chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    with warnings.catch_warnings():  # megatron-core's DistributedOptimizer reads .grad of its shard views (non-leaf)
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor")
        policy.optimizer.zero_grad()
    metrics = run_pipeline(policy.ddp_chunks, micro_batches, loss_on_last_stage, forward_only=False,
                           inputs=lambda mb: on_context_rank(mb.inputs, parallel))
    if lr is not None:
        for param_group in policy.optimizer.param_groups:
            param_group["lr"] = lr
    update_successful, grad_norm, _ = policy.optimizer.step()
    if lr is None:
        policy.scheduler.step(increment=1)
    return {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "update_successful": bool(update_successful), "micro_batch_metrics": metrics}


def supervised_loss_fn(normalizer: float) -> LossFn:
    """Negative log-likelihood of the response tokens, summed and divided by the mini-batch's token count
    (the warm-start's loss; same contract as the policy losses)."""

    def loss_fn(mb: UpdateMicroBatch, logprobs_BT, entropy_BT):
        mask = mb.loss_mask_BT
        nll = -torch.where(mask, logprobs_BT, 0.0).sum() / normalizer
        return nll, {"sft_loss": nll.detach(), "num_tokens": mask.sum()}

    return loss_fn
