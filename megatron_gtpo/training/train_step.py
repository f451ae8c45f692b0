"""One optimizer step over micro-batches through megatron-core's pipeline schedule.

The loss of a micro-batch is a SUM of terms already divided by the global normaliser of the whole mini-batch (the
loss contract in algorithms/losses.py). megatron-core divides each micro-batch loss by the number of micro-batches
and DDP averages gradients over data-parallel ranks, so `run_train_step` multiplies by both: the gradient is then
exactly the full mini-batch gradient for any micro-batch split and any DP size.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from megatron_gtpo.distributed import ParallelGroups, vocab_parallel_logprobs_and_entropy

from .forward import MicroBatch, next_token_targets
from .model_setup import PolicyModel
from .step_batch import PlannedMicroBatch, StepBatch


@dataclass
class UpdateMicroBatch:
    """A micro-batch with what the loss needs, aligned with next-token positions: column k scores token k+1. On
    pipeline stages other than the last only `inputs` and `loss_mask_BL` are filled."""

    inputs: MicroBatch
    loss_mask_BL: torch.Tensor  # bool: True where column k predicts a response token that is in the loss
    old_logprobs_BL: torch.Tensor | None = None
    advantages: torch.Tensor | None = None  # [B, L] per token or [B] per sequence
    ref_logprobs_BL: torch.Tensor | None = None
    pg_weights: torch.Tensor | None = None  # [B, L] or [B]: rollout-mismatch importance weights


# loss_fn(micro_batch, logprobs_BL, entropy_BL) -> (loss_mb under the loss contract, metrics dict of tensors)
LossFn = Callable[[UpdateMicroBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]


def update_micro_batch(batch: StepBatch, planned: PlannedMicroBatch) -> UpdateMicroBatch:
    """The update's view of one planned micro-batch: the step batch's fields placed in its [B, L] layout, on the
    device. The empty micro-batch of a rank without sequences has an all-False mask and no fields."""
    tokens_BL = planned.inputs.tokens_BL
    if planned.columns is None:
        return UpdateMicroBatch(planned.inputs, torch.zeros(tokens_BL.shape, dtype=torch.bool,
                                                            device=tokens_BL.device))
    L = tokens_BL.shape[1]
    columns = planned.columns

    def place(values):  # [S, T] -> [B, L]; [S] -> [B]
        if values is None:
            return None
        return columns.scatter_BL(values, L) if values.ndim == 2 else values.index_select(0, columns.rows_B)

    mask = batch.loss_mask_ST if batch.loss_mask_ST is not None else batch.mask_ST
    return UpdateMicroBatch(planned.inputs, place(mask), place(batch.old_logprobs_ST), place(batch.advantages),
                            place(batch.ref_logprobs_ST), place(batch.pg_weights))


def run_train_step(policy: PolicyModel, micro_batches: list[UpdateMicroBatch], groups: ParallelGroups,
                   loss_fn: LossFn, *, vocab_size: int, temperature: float = 1.0, lr: float | None = None,
                   chunk_tokens: int | None = None) -> dict:
    """Forward+backward over the micro-batches, then one optimizer and LR-schedule step. Returns
    {"grad_norm", "update_successful", "micro_batch_metrics" (last stage: one dict per micro-batch)}.
    `lr` fixes the learning rate of this step and leaves the LR schedule where it is (the warm-start).
    `chunk_tokens`: the vocab-parallel op's chunk (None: all tokens at once)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    num_micro_batches = len(micro_batches)
    scale = num_micro_batches * groups.dp_size  # undo megatron's /num_microbatches and DDP's DP average

    def loss_on_last_stage(mb: UpdateMicroBatch, logits_BLV):
        # No id-range check (check_targets): a host sync per micro-batch; the ids are the step batch's (forward.py).
        logprobs_BL, entropy_BL = vocab_parallel_logprobs_and_entropy(
            logits_BLV, next_token_targets(mb.inputs.tokens_BL), tp_group=groups.tp_group, vocab_size=vocab_size,
            temperature=temperature, chunk_size=chunk_tokens, check_targets=False)
        loss, metrics = loss_fn(mb, logprobs_BL, entropy_BL)
        return loss * scale, {k: v.detach() for k, v in metrics.items()}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        logits = model(mb.inputs.tokens_BL, mb.inputs.position_ids_BL, attention_mask=None)
        return logits, partial(loss_on_last_stage, mb)

    for chunk in policy.ddp_chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    with warnings.catch_warnings():  # megatron-core's DistributedOptimizer reads .grad of its shard views (non-leaf)
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor")
        policy.optimizer.zero_grad()
    iterators = ([iter(micro_batches) for _ in policy.ddp_chunks] if len(policy.ddp_chunks) > 1
                 else iter(micro_batches))
    metrics = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators, model=policy.ddp_chunks,
        num_microbatches=num_micro_batches, seq_length=max(m.inputs.tokens_BL.shape[1] for m in micro_batches),
        micro_batch_size=max(m.inputs.tokens_BL.shape[0] for m in micro_batches), forward_only=False)
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

    def loss_fn(mb: UpdateMicroBatch, logprobs_BL, entropy_BL):
        mask = mb.loss_mask_BL
        nll = -torch.where(mask, logprobs_BL, 0.0).sum() / normalizer
        return nll, {"sft_loss": nll.detach(), "num_tokens": mask.sum()}

    return loss_fn
