"""Where a colocated vLLM engine runs on CUDA (rollout/server_engine.colocated_cuda_devices): on its own model
replica's GPUs, from the sync destination's. Pure arithmetic on device lists, checked by hand; no GPU needed."""
from types import SimpleNamespace

import pytest

from megatron_gtpo.rollout.server_engine import colocated_cuda_devices, replica_devices_from_destination


def test_each_replica_engine_gets_its_own_gpus():
    # 8 GPUs, training TP=4 x DP=2: the destinations sit on GPUs 0 and 4; vLLM TP=4 each.
    assert colocated_cuda_devices(device_index=0, device_count=8, engine_tp=4, replica_devices=4,
                                  visible=None) == "0,1,2,3"
    assert colocated_cuda_devices(device_index=4, device_count=8, engine_tp=4, replica_devices=4,
                                  visible=None) == "4,5,6,7"
    # A scheduler's own CUDA_VISIBLE_DEVICES: indices are positions in it, the result names the same devices.
    assert colocated_cuda_devices(device_index=2, device_count=4, engine_tp=2, replica_devices=2,
                                  visible="3, 5,6,7") == "6,7"


@pytest.mark.parametrize("kwargs,message", [
    (dict(device_index=0, device_count=8, engine_tp=8, replica_devices=4), "spill over the 4 GPU"),
    (dict(device_index=6, device_count=8, engine_tp=4, replica_devices=8), "from GPU 6 needs more than the 8 GPUs"),
])
def test_engines_that_do_not_fit_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        colocated_cuda_devices(visible=None, **kwargs)


def test_replica_devices_follow_megatron_rank_order():
    # TP adjacent; PP stages at a stride of TP x DP, so consecutive only with one data-parallel replica.
    assert replica_devices_from_destination(SimpleNamespace(tp_size=4, pp_size=2, dp_size=2)) == 4
    assert replica_devices_from_destination(SimpleNamespace(tp_size=2, pp_size=2, dp_size=1)) == 4


def _release_before_wake(rank, world_size):
    import time

    import torch

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.rollout.engine import Response, SamplingParams
    from megatron_gtpo.rollout.server_engine import ServerEngine

    groups = initialize_parallel(2, 1)
    events = []
    torch.cuda.empty_cache = lambda: events.append(("empty_cache", time.monotonic()))

    class Server:  # the colocated vLLM server as ServerEngine sees it: waking happens inside generate
        def generate(self, prompts, params):
            events.append(("wake", time.monotonic()))
            return [[Response([1], [-0.5], "length")] for _ in prompts]

    engine = ServerEngine(Server() if groups.tp_rank == 0 else None, groups,
                          SimpleNamespace(vocab_size=100, max_position_embeddings=64))
    if rank == 1:
        time.sleep(1.0)  # the rank that is late to release must still release before the engine wakes
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    return events


def test_every_rank_releases_cached_memory_before_the_engine_wakes():
    """A colocated engine's KV cache and weights wake on every GPU of the model replica: each rank's caching
    allocator must have given its cached blocks back first (torch.cuda.empty_cache on all ranks, then the wake)."""
    from distributed_harness import run_distributed

    destination, other = run_distributed(_release_before_wake, 2, timeout_s=120)
    wake = [t for name, t in destination if name == "wake"]
    releases = [t for events in (destination, other) for name, t in events if name == "empty_cache"]
    assert len(wake) == 1 and len(releases) == 2
    assert max(releases) < wake[0]
