"""The advantage phase: the configured algorithm's advantages over the GLOBAL batch (every data-parallel rank's
groups), added to the step batch (step_batch.py)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megatron_gtpo.distributed import ParallelGroups

from .step_batch import StepBatch


def all_gather_padded(tensor: torch.Tensor, group, device: torch.device) -> list[torch.Tensor]:
    """all_gather of tensors whose sizes differ across ranks in every dim (padded, then cut back), on `device` (the
    group's: an NCCL group takes no host tensors)."""
    world = dist.get_world_size(group)
    if world == 1:
        return [tensor]
    shape = torch.tensor(tensor.shape, dtype=torch.long, device=device)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    shapes = torch.stack(shapes).tolist()  # the one host sync of the gather: the parts' sizes
    padded = tensor.new_zeros([max(dims) for dims in zip(*shapes)], device=device)
    padded[tuple(slice(0, s) for s in tensor.shape)] = tensor
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [p[tuple(slice(0, s) for s in sh)] for p, sh in zip(parts, shapes)]


def global_advantages(advantage_fn: Callable, uses_entropy: bool, batch: StepBatch, parallel: ParallelGroups) -> None:
    """Adds batch.advantages ([S, T] per token or [S] per sequence), computed on the device over the GLOBAL batch
    (the batch-scope z-scores of GTPO span every DP rank's groups; group-scope ones are unaffected). The entropies
    are read into [n, G, T] through the group index. Last pipeline stage only."""
    rewards = all_gather_padded(batch.rewards_NG, parallel.dp_group, parallel.device)
    counts = [r.shape[0] for r in rewards]
    mine = slice(sum(counts[:parallel.dp_rank]), sum(counts[:parallel.dp_rank + 1]))
    rewards_NG = torch.cat(rewards)
    if rewards_NG.shape[0] == 0:
        return
    if not uses_entropy:
        batch.advantages = batch.per_sequence(advantage_fn(rewards_NG)[mine])
        return
    # A rank that kept no group (dynamic sampling) has no entropies, yet takes part in the gathers.
    own_entropy_NGT = (batch.per_group_NGT(batch.entropy_ST) if batch.num_prompt_groups
                       else torch.zeros(0, batch.group_size, 0, device=parallel.device))
    own_lengths_NG = batch.per_group_NGT(batch.mask_ST.sum(dim=-1, keepdim=True))[..., 0]
    entropy = all_gather_padded(own_entropy_NGT, parallel.dp_group, parallel.device)
    lengths = all_gather_padded(own_lengths_NG, parallel.dp_group, parallel.device)
    T = max(e.shape[-1] for e in entropy)
    entropy_NGT = torch.cat([torch.nn.functional.pad(e, (0, T - e.shape[-1])) for e in entropy])
    mask_NGT = torch.arange(T, device=parallel.device) < torch.cat(lengths)[..., None]
    advantages = advantage_fn(rewards_NG, entropy_NGT, mask_NGT)[mine]
    if advantages.ndim == 3:
        advantages = advantages[..., :own_entropy_NGT.shape[-1]]
    batch.advantages = batch.per_sequence(advantages)
