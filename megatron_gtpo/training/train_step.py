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
import torch.nn.functional as F

from megatron_gtpo.distributed import ParallelGroups, vocab_parallel_logprobs_and_entropy

from .forward import MicroBatch
from .model_setup import PolicyModel


@dataclass
class UpdateMicroBatch:
    """A micro-batch with what the loss needs, aligned with next-token positions: column k scores token k+1."""

    inputs: MicroBatch
    loss_mask_BL: torch.Tensor  # bool: True where column k predicts a response token
    old_logprobs_BL: torch.Tensor | None = None
    advantages: torch.Tensor | None = None  # [B, L] per token or [B] per sequence
    ref_logprobs_BL: torch.Tensor | None = None


# loss_fn(micro_batch, logprobs_BL, entropy_BL) -> (loss_mb under the loss contract, metrics dict of tensors)
LossFn = Callable[[UpdateMicroBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]


def build_update_micro_batch(sequences: list[list[int]], response_starts: list[int], *, device: torch.device,
                             pad_to_multiple: int = 1, old_logprobs: list[torch.Tensor] | None = None,
                             advantages: list[torch.Tensor] | None = None,
                             ref_logprobs: list[torch.Tensor] | None = None) -> UpdateMicroBatch:
    """`sequences` are prompt+response token ids, response_starts[i] the prompt length. Per-sequence tensors in
    `old_logprobs` / `ref_logprobs` / per-token `advantages` are response-aligned (one entry per response token);
    per-sequence advantages are 0-dim tensors. Everything is built on `device` (the training device), where the loss
    meets the model's log-probs."""
    from .forward import make_micro_batches

    (inputs,) = make_micro_batches(sequences, len(sequences), device=device, pad_to_multiple=pad_to_multiple)
    B, L = inputs.tokens_BL.shape
    starts_B1 = torch.tensor(response_starts, device=device)[:, None]
    columns_1L = torch.arange(L, device=device)[None, :]
    mask = (columns_1L >= starts_B1 - 1) & (columns_1L < inputs.lengths_B[:, None] - 1)

    def place(values: list[torch.Tensor] | None):
        if values is None:
            return None
        if values[0].ndim == 0:
            return torch.stack(values).float().to(device)
        out = torch.zeros(B, L, dtype=torch.float32, device=device)
        for i, (start, v) in enumerate(zip(response_starts, values)):
            out[i, start - 1:start - 1 + v.numel()] = v
        return out

    return UpdateMicroBatch(inputs, mask, place(old_logprobs), place(advantages), place(ref_logprobs))


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
        targets_BL = F.pad(mb.inputs.tokens_BL[:, 1:], (0, 1))
        logprobs_BL, entropy_BL = vocab_parallel_logprobs_and_entropy(
            logits_BLV, targets_BL, tp_group=groups.tp_group, vocab_size=vocab_size, temperature=temperature,
            chunk_size=chunk_tokens, check_targets=False)  # a host sync per micro-batch otherwise; see forward.py
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
