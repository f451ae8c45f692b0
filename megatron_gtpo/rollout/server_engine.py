"""A `RolloutEngine` for one model-parallel group whose generation runs in a server object held by the group's
weight-sync destination rank (TP rank 0 of the first pipeline stage). Imports neither vllm nor megatron.
Before the server wakes, every rank of the group empties its caching allocator (`_release_cached_memory`).

The server object is a `vllm_engine.VLLMServer` in the same process (colocated mode) or a
`vllm_remote.RemoteVLLMClient` talking to a vLLM server on another node (remote mode). Either way it offers:

    generate(prompts, SamplingParams) -> list[list[Response]]
    begin_weight_update() -> None
    load_bucket(bucket: list[(hf_name, tensor)]) -> None
    finish_weight_update(expected_checksums: {hf_name: (sum, sum of squares)}) -> int (the new policy version;
        raises if the engine's weights do not have these checksums)
    dtype: torch.dtype (the engine's weight dtype: the expected checksums are taken after a cast to it)

`generate` and `sync_weights` are collective over the model-parallel group: the destination calls the server,
and its outcome (result or error text) is broadcast to every rank, which returns it or raises. Responses travel as
tensors (rollout/transport.py), the small outcomes of a sync as objects.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from .engine import Response, SamplingParams, check_prompts
from .transport import broadcast_responses
from .weight_sync import DEFAULT_BUCKET_BYTES, hf_weight_buckets, is_sync_destination, policy_checksum_names, \
    tensor_checksum


class ServerEngine:
    """`RolloutEngine` backed by one server object per model-parallel group (on its sync destination rank).

    `generate` and `sync_weights` are collective over the model-parallel group; every rank returns the same
    responses, and every rank raises if the server failed. `policy_version` is the server's policy version after
    the last successful sync (0 before any).
    """

    def __init__(self, server, groups, shape, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if (server is not None) != is_sync_destination(groups):
            raise ValueError("the rollout server must live on the weight-sync destination (TP rank 0 of the first "
                             "pipeline stage) and only there")
        self.server = server
        self.groups = groups
        self.shape = shape
        self.bucket_bytes = bucket_bytes
        self.policy_version = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Response]]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_prompts(prompts, vocab_size=self.shape.vocab_size, max_positions=self.shape.max_position_embeddings,
                      max_new_tokens=params.max_new_tokens)
        self._release_cached_memory()
        outcome = None
        if self.server is not None:
            outcome = attempt(lambda: self.server.generate(prompts, params))
        destination = dist.get_global_rank(self.groups.mp_group, 0)  # lowest rank of the replica: TP 0 of stage 0
        return unwrap(broadcast_responses(outcome, destination, self.groups.mp_group, self.groups.device))

    def _release_cached_memory(self) -> None:
        """Before a colocated engine wakes (its KV cache, its weights) on the model replica's GPUs: every rank of
        the replica hands the blocks its caching allocator keeps back to the driver, and none goes on before all
        have, so the engine finds that memory free. A no-op on the CPU platform, harmless for a remote engine."""
        torch.cuda.empty_cache()
        dist.barrier(group=self.groups.mp_group)

    def sync_weights(self, model_chunks: list, groups) -> None:
        checksum_names = set(policy_checksum_names(self.shape))
        expected: dict[str, tuple[float, float]] = {}
        failure = None
        self._release_cached_memory()
        if self.server is not None:
            failure = _error_of(self.server.begin_weight_update)
        for bucket in hf_weight_buckets(model_chunks, groups, self.shape, bucket_bytes=self.bucket_bytes):
            # Only the destination gets buckets. After a failure the stream is still drained: the other ranks are
            # gathering and sending into it.
            for name, tensor in bucket:
                if name in checksum_names:
                    expected[name] = tensor_checksum(tensor.to(self.server.dtype))
            if failure is None:
                failure = _error_of(partial(self.server.load_bucket, bucket))
            del bucket
        outcome = None
        if self.server is not None:
            outcome = ("error", failure) if failure else attempt(lambda: self.server.finish_weight_update(expected))
        self.policy_version = unwrap(share_outcome(outcome, self.groups))


def replica_devices_from_destination(groups) -> int:
    """How many consecutive devices of a node, from the sync destination's on, belong to its model replica: in
    megatron's rank order (tp-cp-ep-dp-pp, TP adjacent) its TP group; with a single data-parallel replica the
    pipeline stages follow at a stride of TP, so the whole replica (TP x PP, as far as the node reaches)."""
    return groups.tp_size if groups.dp_size > 1 else groups.tp_size * groups.pp_size


def colocated_cuda_devices(*, device_index: int, device_count: int, engine_tp: int, replica_devices: int,
                           visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for the colocated vLLM engine of one model replica: `engine_tp` devices from the sync
    destination's own (`device_index` among this process's `device_count` visible devices; `visible` the current
    CUDA_VISIBLE_DEVICES, if set). vLLM numbers its workers' devices from 0 of what it is given, so without this the
    engines of every replica on a node would share devices 0..engine_tp-1."""
    if engine_tp > replica_devices:
        raise ValueError(f"a colocated vLLM engine at tensor parallel size {engine_tp} would spill over the "
                         f"{replica_devices} GPU(s) of its model replica onto another replica's; use "
                         f"rollout.vllm_tensor_parallel <= {replica_devices}")
    if device_index + engine_tp > device_count:
        raise ValueError(f"a colocated vLLM engine at tensor parallel size {engine_tp} from GPU {device_index} needs "
                         f"more than the {device_count} GPUs of this node")
    ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(device_count)]
    if len(ids) < device_count:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} names fewer than the {device_count} visible GPUs")
    return ",".join(ids[device_index:device_index + engine_tp])


def share_outcome(outcome, groups):
    """The destination's small (status, payload), e.g. a policy version, on every rank of the model-parallel group: a broadcast within the first
    stage's TP group, then along each pipeline group. Other ranks pass None."""
    box = [outcome]
    if groups.pp_rank == 0 and groups.tp_size > 1:
        dist.broadcast_object_list(box, src=dist.get_global_rank(groups.tp_group, 0), group=groups.tp_group)
    if groups.pp_size > 1:
        dist.broadcast_object_list(box, src=dist.get_global_rank(groups.pp_group, 0), group=groups.pp_group)
    return box[0]


def attempt(fn):
    """("ok", fn()) or ("error", description): failures on the server rank are re-raised on every rank."""
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - reported to the whole group, then raised there
        return "error", f"{type(e).__name__}: {e}"


def _error_of(fn) -> str | None:
    status, payload = attempt(fn)
    return payload if status == "error" else None


def unwrap(outcome):
    status, payload = outcome
    if status != "ok":
        raise RuntimeError(f"the rollout engine failed on the weight-sync destination rank: {payload}")
    return payload
