"""The token-selection phase (Clip-Cov, KL-Cov, the high-entropy fraction; algorithms/token_selection.py): once per
step, after the advantages, over each mini-batch's valid tokens on EVERY data-parallel rank, from the old-policy pass.

Scope. The statistics (covariance means, top fractions, Clip-Cov's random pick) span the whole mini-batch: each rank
flattens its mini-batch sequences' valid tokens in sequence order (not in the micro-batch plan's order), all ranks
gather them, and every rank computes the same selection and keeps its own part. So the update does not depend on the
micro-batch split, the packing, TP or PP (the loss contract). Clip-Cov's random keys come from a generator seeded by
(run seed, step, mini-batch): a resumed run draws what the uninterrupted one drew; across DP layouts they follow the
gathered order (DP rank order), the same whenever the ranks hold consecutive parts of the batch.

The result goes into the step batch: `pg_weights` times 0 where a token loses its policy gradient, `kl_penalty_ST`
where KL-Cov penalises (None without KL-Cov, so the loss logs KL-Cov's metric for KL-Cov only). Last pipeline stage
only (the loss's).
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron_gtpo.algorithms.token_selection import TokenSelection
from megatron_gtpo.distributed import ParallelGroups

from .advantages import all_gather_padded
from .reduction import MetricReducer
from .step_batch import StepBatch


def selection_seed(seed: int, step: int, mini_batch: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + mini_batch * 104_729 + 17) % 2**63


def global_token_selection(select_tokens: Callable[..., TokenSelection], batch: StepBatch,
                           parallel: ParallelGroups, metrics: MetricReducer, *, seed: int, step: int) -> None:
    """Applies `select_tokens` (ConfiguredAlgorithm.select_tokens) to each mini-batch of the step (module doc) and
    records its metrics, weighted by the mini-batch's tokens."""
    if batch.advantages is None:  # no group kept on any rank
        return
    mask_ST = batch.loss_mask_ST if batch.loss_mask_ST is not None else batch.mask_ST
    advantages_ST = batch.advantages if batch.advantages.ndim == 2 else batch.advantages[:, None].expand(mask_ST.shape)
    keep_ST = torch.ones_like(mask_ST)
    penalise_ST = None  # KL-Cov's only
    for k, planned in enumerate(batch.plan):
        rows = torch.tensor([i for mb in planned for i in mb.rows], dtype=torch.long, device=mask_ST.device)
        where_ST = torch.zeros_like(mask_ST)
        where_ST[rows] = mask_ST[rows]  # this mini-batch's valid tokens, flattened row-major below
        own_K3 = torch.stack([advantages_ST[where_ST], batch.old_logprobs_ST[where_ST], batch.entropy_ST[where_ST]],
                             dim=-1).float()
        parts = all_gather_padded(own_K3, parallel.dp_group, parallel.device)
        start = sum(p.shape[0] for p in parts[:parallel.dp_rank])
        values_K3 = torch.cat(parts)
        K = values_K3.shape[0]
        keys_K = torch.rand(K, generator=torch.Generator().manual_seed(selection_seed(seed, step, k)),
                            dtype=torch.float64).to(mask_ST.device)
        selection = select_tokens(*values_K3.unbind(dim=-1), keys_K)
        mine = slice(start, start + own_K3.shape[0])
        keep_ST[where_ST] = selection.keep_K[mine]
        if selection.penalise_K is not None:
            if penalise_ST is None:
                penalise_ST = torch.zeros_like(mask_ST)
            penalise_ST[where_ST] = selection.penalise_K[mine]
        metrics.add(selection.metrics, {"selected_tokens": K})
    weights = batch.pg_weights
    weights_ST = 1.0 if weights is None else (weights if weights.ndim == 2 else weights[:, None])
    batch.pg_weights = torch.where(keep_ST, weights_ST, 0.0).float()
    batch.kl_penalty_ST = penalise_ST
