import contextlib


def activation_recompute_forward(activation_recompute: bool = False, recompute_phase: bool = False):
    """TE's marker of a recomputed forward, which only its FP8 scaling reads: nothing to mark without FP8."""
    return contextlib.nullcontext()


class CudaRNGStatesTracker:
    """Named only: megatron-core subclasses it (TECudaRNGStatesTracker), which the project never selects
    (use_te_rng_tracker stays off)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("TE's RNG tracker is not part of the stand-in (tests/te_standin)")
