import contextlib


def get_cpu_offload_context(enabled=False, *args, **kwargs):
    """TE's activation / weight offloading: the stand-in runs without it (megatron-core asks with enabled=False)."""
    if enabled:
        raise NotImplementedError("CPU offloading is not part of the Transformer Engine stand-in (tests/te_standin)")
    return contextlib.nullcontext(), (lambda tensor: tensor)
