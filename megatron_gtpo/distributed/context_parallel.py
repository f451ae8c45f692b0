"""Context parallelism's sequence layout: which positions of a row a context-parallel rank holds, and the row put
back together from all of them.

megatron-core's load-balanced layout: a row of L tokens is cut into 2 C chunks (C ranks), and rank r holds chunks r
and 2 C - 1 - r, back to back. Under a causal mask, early chunks attend to few keys and late ones to many: pairing
them gives every rank the same work. L must be a multiple of 2 C.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def load_balanced_positions(length: int, cp_rank: int, cp_size: int, *, device=None) -> torch.Tensor:
    """long [length / cp_size]: the row positions rank `cp_rank` of `cp_size` holds, in its order."""
    if length % (2 * cp_size):
        raise ValueError(f"a row of {length} tokens cannot be split over {cp_size} context-parallel ranks: the "
                         f"length must be a multiple of 2 x {cp_size}")
    chunk = length // (2 * cp_size)
    starts = (cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk)
    return torch.cat([torch.arange(start, start + chunk, device=device) for start in starts])


def gather_sequence(local_LX: torch.Tensor, group: dist.ProcessGroup, *, same_use_on_every_rank: bool = False
                    ) -> torch.Tensor:
    """The whole row [L, ...] in position order from every rank's load-balanced part [L / C, ...] (dimension 0 the
    sequence). Differentiable: a part's gradient is the sum of what every rank's use of the row sends back to it
    (megatron's all-gather, whose backward is a reduce-scatter: the attention's keys and values, which each rank's
    own queries use). `same_use_on_every_rank`: every rank computes the same thing from the whole row (the loss from
    the log-probs), so a part's gradient is already whole on its own rank; the backward keeps this rank's slice, and
    megatron's schedule (which multiplies the loss by CP) and DDP (which averages over DP x CP) give the gradient of
    CP = 1."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    cp_size = group.size()
    length = local_LX.shape[0] * cp_size
    gathered_LX = gather_from_sequence_parallel_region(local_LX, tensor_parallel_output_grad=not same_use_on_every_rank,
                                                       group=group)
    held_by_rank = torch.cat([load_balanced_positions(length, r, cp_size, device=local_LX.device)
                              for r in range(cp_size)])  # the row position of each gathered entry
    return gathered_LX.index_select(0, torch.argsort(held_by_rank))
