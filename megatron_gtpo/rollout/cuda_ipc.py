"""A weight bucket from a training rank to the vLLM worker on the SAME GPU through a CUDA IPC handle: no host copy.

The colocated path on CUDA (rollout/server_engine.py): every training rank whose GPU runs a vLLM worker holds the
bucket (weight_sync.hf_weight_buckets with every engine rank as a destination), packs it into one flat uint8 buffer
on its GPU (`weight_sync.pack_on_device`), and exports that buffer (`export_buffer`: torch's `reduce_tensor`, the
same call vLLM's own IPC weight-transfer engine and the peers' colocated paths use). The handles of all ranks are
gathered to each engine's host, which hands its engine the handles keyed by GPU UUID; each vLLM worker opens the one
of its own GPU (`import_buffer`, torch's `rebuild_cuda_tensor` with the worker's device index: the worker numbers
devices from its own CUDA_VISIBLE_DEVICES) and loads views of it; vLLM's weight loaders then copy, on that GPU, only
the shard of each tensor the worker owns. Keys are UUIDs, not indices, because the trainer and vLLM number devices
differently.

Lifetime: the exporting rank keeps its buffer until its engine has loaded the bucket (a barrier over the replica
after each bucket, server_engine.py); torch's CUDA IPC reference counting keeps an exported block from being reused
while a consumer still maps it, and `torch.cuda.ipc_collect()` after a sync frees what consumers have released.
The views are not kept by the worker after the load: a bucket holds whole decoder layers, so vLLM's layerwise reload
finishes each layer within the call.

Needs CUDA in both processes; tested in tests/gpu/test_gpu_ipc.py (export and import in a second process on the
same GPU). NOT run on a GPU by the session that wrote it.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

_DEVICE_INDEX_ARG = 6  # position of the device index in reduce_tensor's rebuild arguments (as vLLM overrides it)


def gpu_uuid(device_index: int) -> str:
    return str(torch.cuda.get_device_properties(device_index).uuid)


def export_buffer(flat: torch.Tensor) -> tuple[str, tuple]:
    """(this GPU's UUID, the arguments that rebuild `flat` in another process). The caller keeps `flat` alive until
    every consumer has loaded it."""
    if not flat.is_cuda or not flat.is_contiguous():
        raise ValueError(f"only a contiguous CUDA tensor can be exported by IPC, got one on {flat.device}")
    _, args = reduce_tensor(flat)
    return gpu_uuid(flat.device.index), args


def collect() -> None:
    """Free the exported blocks that every consumer has released (after a sync)."""
    torch.cuda.ipc_collect()


def import_buffer(handles: dict[str, tuple], device: torch.device) -> torch.Tensor:
    """The buffer that was exported on `device`'s GPU, mapped into this process (a view of the exporter's memory)."""
    uuid = gpu_uuid(device.index)
    if uuid not in handles:
        raise ValueError(f"no IPC handle for this worker's GPU {uuid} (device {device}); handles are for "
                         f"{sorted(handles)}: is the engine on its host ranks' own GPUs?")
    args = list(handles[uuid])
    args[_DEVICE_INDEX_ARG] = device.index
    return rebuild_cuda_tensor(*args)
