"""The old-policy pass: a forward-only pass of the step batch under the weights that sampled it (or, with a
reference, the KL reference's), at the training TP/PP, then the rollout mismatch correction. Both add fields to the
step batch (step_batch.py)."""
from __future__ import annotations

from functools import partial

import torch

from megatron_gtpo.algorithms.rollout_correction import rollout_correction
from megatron_gtpo.distributed import ParallelGroups, Truncation

from .forward import next_token_logprobs_and_entropy, on_context_rank, run_pipeline
from .step_batch import StepBatch


def old_policy_pass(model_chunks: list, batch: StepBatch, parallel: ParallelGroups, *, vocab_size: int,
                     temperature: float, truncation: Truncation | None = None, chunk_tokens: int | None = None,
                     reference_chunks: list | None = None) -> None:
    """The forward-only pass over the step batch's micro-batch plan: adds old_logprobs_ST and entropy_ST (the
    old-policy log-probs and full-vocabulary entropies of every response token, at the training TP/PP) and, with
    `reference_chunks`, ref_logprobs_ST. Log-probs are those of the sampling distribution: temperature and
    `truncation` (the rollout's top-k / top-p), the reference's too. On the last pipeline stage only (the only place
    the loss needs them)."""
    micro_batches = batch.micro_batches()
    if not micro_batches:
        return
    score = partial(_response_logprobs_and_entropy, batch=batch, micro_batches=micro_batches, parallel=parallel,
                    vocab_size=vocab_size, temperature=temperature, truncation=truncation, chunk_tokens=chunk_tokens)
    batch.old_logprobs_ST, batch.entropy_ST = score(model_chunks)
    if reference_chunks is not None:
        batch.ref_logprobs_ST, _ = score(reference_chunks)


def _response_logprobs_and_entropy(model_chunks, *, batch: StepBatch, micro_batches: list, parallel: ParallelGroups,
                                   vocab_size: int, temperature: float, truncation: Truncation | None,
                                   chunk_tokens: int | None):
    """Response-aligned [S, T] float32 log-probs and entropies on the device (None, None off the last stage)."""

    def on_last_stage(mb, logits_BLV):
        logprobs_BL, entropy_BL = next_token_logprobs_and_entropy(  # no id check: no host sync per micro-batch
            logits_BLV, mb.inputs.tokens_BL, parallel, vocab_size=vocab_size, temperature=temperature,
            truncation=truncation, chunk_size=chunk_tokens)
        return logprobs_BL.float(), entropy_BL.float()

    for model in model_chunks:
        model.eval()
    outputs = run_pipeline(model_chunks, micro_batches, on_last_stage, forward_only=True,
                           inputs=lambda mb: on_context_rank(mb.inputs, parallel))
    if not parallel.is_last_stage:
        return None, None
    logprobs_ST = torch.zeros(batch.mask_ST.shape, device=parallel.device)
    entropy_ST = torch.zeros_like(logprobs_ST)
    for mb, (logprobs_BL, entropy_BL) in zip(micro_batches, outputs):
        width = mb.columns.valid_ST.shape[1]
        logprobs_ST[mb.columns.sequences_S, :width] = mb.columns.gather(logprobs_BL)
        entropy_ST[mb.columns.sequences_S, :width] = mb.columns.gather(entropy_BL)
    return logprobs_ST, entropy_ST


def correct_rollout(batch: StepBatch, **settings) -> None:
    """Adds loss_mask_ST, pg_weights and mismatch_sums (algorithms/rollout_correction.py; `settings` are its
    rollout_is / rollout_is_cap / rollout_rs / rollout_rs_bounds; with the batch's staleness_ST, the sums by
    staleness too). Last pipeline stage only."""
    if batch.old_logprobs_ST is None:
        return
    correction = rollout_correction(batch.old_logprobs_ST, batch.rollout_logprobs_ST, batch.mask_ST,
                                    staleness_ST=batch.staleness_ST, **settings)
    batch.loss_mask_ST, batch.pg_weights, batch.mismatch_sums = correction.keep_ST, correction.weights, \
        correction.metric_sums
