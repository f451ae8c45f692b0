"""A weight bucket from a training rank to the vLLM worker on the SAME GPU through a CUDA IPC handle: no host copy.

`export_buffer` gives a packed bucket's handle, keyed by the GPU's UUID (the trainer and vLLM number devices
differently); `import_buffer`, in the vLLM worker, maps the buffer exported on its own GPU (a view of the exporter's
memory). The exporter keeps the buffer alive until every consumer has loaded it, and calls `collect` after a sync to
free what the consumers released. Needs CUDA in both processes; tests/gpu/test_gpu_ipc.py checks it. docs/vllm.md
("Weight sync") has the path a bucket takes.
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
