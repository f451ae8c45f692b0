"""The RMSNorm of megatron-core's local layer spec, able to run under sequence parallelism.

megatron-core 0.16's local spec builds its norms as WrappedTorchNorm, a torch.nn.RMSNorm whose constructor asserts
that sequence parallelism is off. Nothing in the norm itself needs it off: it normalises each token on its own, so
under sequence parallelism each tensor-parallel rank simply normalises its 1/TP of the sequence (megatron's local
linear layers gather and scatter the sequence around attention and the MLP). What does change is the weight's
gradient: each TP rank's holds only its own tokens' part, and megatron's finalize_model_grads sums it over the TP
group for every parameter marked `sequence_parallel` (as Transformer Engine's and apex's norms mark theirs). The q/k
norms see the whole sequence but only their rank's heads; finalize_model_grads sums theirs by name, marked or not.
"""
from __future__ import annotations

import torch


class LocalRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm (WrappedTorchNorm's module: the same parameter, `weight`, and the same math), built from
    megatron's norm arguments, whose weight is marked for the TP gradient sum under sequence parallelism."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(f"LocalRMSNorm is a plain RMSNorm; got normalization {config.normalization!r}, "
                             f"zero-centred gamma {config.layernorm_zero_centered_gamma}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel
