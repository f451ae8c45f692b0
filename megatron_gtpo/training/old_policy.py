"""The old-policy values of a step: the log-probs and full-vocabulary entropies of every response token under the
weights that train it (before its update), at the training TP/PP, with the rollout mismatch correction computed from
them and, with a KL term, the reference's log-probs. They come from one of two places (step_batch.py's fields):

- the old-policy pass (`old_policy_pass`): a forward-only pass over the step batch's micro-batch plan before the
  update, then the correction over the whole batch (`correct_rollout`);
- the update's own forward (`OldPolicyFromUpdate`), where the step batch takes one optimizer step and nothing before
  the update reads them (`pass_reason` None). That optimizer step's forward runs the weights the pass would run on
  the micro-batches it would run, so its log-probs, detached, are the old ones (the importance ratio is exactly 1,
  as after the pass); the correction's weights and rejections, functions of each token's or each whole sequence's
  old and rollout log-probs (a sequence lies in one micro-batch), are computed micro-batch by micro-batch before its
  loss, and the mismatch metrics over the whole batch once the update has filled in its old log-probs. The pass is
  not run: one forward over every sequence less per step. GTPO's and GRPO-S's entropies, which their advantages
  read before the update, then come from the built-in engine's sampling pass (the trainer's own model and weights
  at its layout: `engine_entropies`); the step batch holds the update's own for the metrics.

`pass_reason` names what makes a step run the pass (docs/step_batch.md lists every case and why).
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from megatron_gtpo.algorithms import ConfiguredAlgorithm
from megatron_gtpo.algorithms.rollout_correction import rollout_correction
from megatron_gtpo.distributed import ParallelGroups, Truncation
from megatron_gtpo.engine_table import ENGINES, engines_that, one_of

from .forward import next_token_logprobs_and_entropy, on_context_rank, run_pipeline
from .step_batch import StepBatch


def pass_reason(cfg, algorithm: ConfiguredAlgorithm, *, optimizer_steps: int) -> str | None:
    """Why a step of the run `cfg` (a TrainConfig) whose step batch takes `optimizer_steps` optimizer steps runs the
    old-policy pass, or None where the update's own forward gives the old-policy values (module doc). The first
    reason that applies."""
    r, correction = cfg.rollout, cfg.algorithm.rollout_correction
    reads = algorithm.reads_old_policy
    reasons = (
        (cfg.data.old_policy_pass == "always", "data.old_policy_pass is always"),
        (optimizer_steps > 1, f"the step batch takes {optimizer_steps} optimizer steps (data.mini_batches_per_step x "
                              "data.epochs_per_step): after the first, the update's forward is no longer the old "
                              "policy's"),
        (reads == "log-probs", "the token selection (Clip-Cov, KL-Cov, algorithm.entropy_token_fraction) reads the old "
                               "log-probs and entropies of the whole mini-batch before its first loss"),
        (correction.rollout_rs != "none" and algorithm.loss_agg_mode == "token-mean",
         "algorithm.rollout_correction.rollout_rs rejects tokens, and the token-mean loss normaliser counts the tokens "
         "the whole mini-batch keeps before its first loss"),
        (reads == "entropies" and not ENGINES[r.engine].trainers_model,
         f"the advantages read the old policy's entropies, and the {r.engine} engine does not sample with the "
         f"trainer's own model and weights (only rollout.engine {one_of(engines_that('trainers_model'))} does)"),
        (reads == "entropies" and r.schedule.holds_rollouts,
         "the advantages read the old policy's entropies, and rollouts may be stale (rollout.schedule.max_staleness, "
         "rollout.schedule.partial_rollouts): the engine's are an older policy's"),
    )
    return next((why for applies, why in reasons if applies), None)


def configured_optimizer_steps(cfg) -> int:
    """The optimizer steps of a step batch of `cfg`: one per mini-batch (the trainer always splits the kept groups
    into data.mini_batches_per_step of them) and epoch."""
    return cfg.data.mini_batches_per_step * cfg.data.epochs_per_step


def engine_entropies(cfg, algorithm: ConfiguredAlgorithm) -> bool:
    """Whether the built-in engine records its sampling distributions' entropies, for advantages that read the old
    policy's entropies in runs whose steps run no old-policy pass."""
    return algorithm.reads_old_policy == "entropies" and \
        pass_reason(cfg, algorithm, optimizer_steps=configured_optimizer_steps(cfg)) is None


def forward_passes_before_update(cfg) -> int:
    """The forward-only passes over a step's sequences before its update in the run `cfg`: the old policy's (none
    where the update's forward gives its values) and the KL reference's (the planner's phase-time model)."""
    from megatron_gtpo.algorithms import configure_algorithm

    from .reference import ReferencePolicy

    algorithm = configure_algorithm(cfg.algorithm, max_new_tokens=cfg.rollout.max_new_tokens)
    policy = pass_reason(cfg, algorithm, optimizer_steps=configured_optimizer_steps(cfg)) is not None
    return int(policy) + int(ReferencePolicy.wanted(cfg))


def old_policy_pass(model_chunks: list | None, batch: StepBatch, parallel: ParallelGroups, *, vocab_size: int,
                    temperature: float, truncation: Truncation | None = None, chunk_tokens: int | None = None,
                    reference_chunks: list | None = None) -> None:
    """The forward-only pass over the step batch's micro-batch plan: adds old_logprobs_ST and entropy_ST (the
    old-policy log-probs and full-vocabulary entropies of every response token, at the training TP/PP) unless
    `model_chunks` is None (the update's forward gives them) and, with `reference_chunks`, ref_logprobs_ST.
    Log-probs are those of the sampling distribution: temperature and `truncation` (the rollout's top-k / top-p),
    the reference's too. On the last pipeline stage only (the only place the loss needs them)."""
    micro_batches = batch.micro_batches()
    if not micro_batches:
        return
    score = partial(_response_logprobs_and_entropy, batch=batch, micro_batches=micro_batches, parallel=parallel,
                    vocab_size=vocab_size, temperature=temperature, truncation=truncation, chunk_tokens=chunk_tokens)
    if model_chunks is not None:
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
            truncation=truncation, chunk_size=chunk_tokens, scored_from=mb.inputs.scored_from)
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


class OldPolicyFromUpdate:
    """The old-policy values of a step batch that takes one optimizer step, from that step's forward (module doc):
    called by the update's loss with each micro-batch (train_step.UpdateMicroBatch, its loss mask still every
    response token) and its log-probs and entropies, it records them, detached, into the step batch's old_logprobs_ST
    and entropy_ST, and returns the micro-batch with its old log-probs and, where the rollout correction weighs or
    rejects (`settings`: its settings, as for `correct_rollout`), its importance weights and its loss mask after
    rejection. After the update `correct_rollout` on the filled batch gives the mismatch metrics the pass would
    have given (and the batch's mask and weights). Last pipeline stage only (where the loss is), with micro-batches
    to score (as the pass)."""

    def __init__(self, batch: StepBatch, **settings):
        self.batch, self.settings = batch, settings
        self.corrects = settings["rollout_is"] != "none" or settings["rollout_rs"] != "none"
        batch.old_logprobs_ST = torch.zeros(batch.mask_ST.shape, device=batch.mask_ST.device)
        batch.entropy_ST = torch.zeros_like(batch.old_logprobs_ST)

    def __call__(self, mb, logprobs_BT: torch.Tensor, entropy_BT: torch.Tensor):
        batch, columns = self.batch, mb.columns
        old_BT = logprobs_BT.detach()
        width = columns.valid_ST.shape[1]
        batch.old_logprobs_ST[columns.sequences_S, :width] = old_BT
        batch.entropy_ST[columns.sequences_S, :width] = entropy_BT.detach()
        if not self.corrects:
            return replace(mb, old_logprobs_BT=old_BT)
        correction = rollout_correction(old_BT, columns.select(batch.rollout_logprobs_ST), columns.valid_ST,
                                        **self.settings)
        return replace(mb, old_logprobs_BT=old_BT, loss_mask_BT=correction.keep_ST, pg_weights=correction.weights)
