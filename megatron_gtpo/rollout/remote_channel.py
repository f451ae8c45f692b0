"""The channel between a trainer and a vLLM rollout server (docs/remote_rollout.md has the protocol).

Control messages are pickled (trusted networks only) under store keys of the server's TCPStore, all under `ROOT`;
`post_message` / `take_message` write and read one. Weights travel in a process group of their own over the same
store (`weight_group`: gloo for CPU tensors, NCCL for CUDA ones; rank 0 the trainer, rank 1 + i vLLM worker i),
broadcast from the trainer (`broadcast_from_trainer`). Imports no vllm.
"""
from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

PROTOCOL = 4  # 2: generate carries first_prompt; 3: generate answers a rollout record (responses.py);
# 4: generate_routed, and hello says whether the server returns routed experts
ROOT = "gtpo_remote"
_CHUNK_BYTES = 4 * 2**20  # the libuv TCPStore refuses values over 8 MiB


def session_key(session: int, seq: int) -> str:
    """The key prefix of request `seq` of trainer session `session` (its request and reply live under it)."""
    return f"{ROOT}/{session}/{seq}"


def weights_prefix(session: int) -> str:
    return f"{ROOT}/{session}/weights"


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a vLLM server address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def post_message(store, key: str, message) -> None:
    """Write a pickled message in chunks; the header key (the chunk count) is written last, so it marks completion."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    chunks = [data[i:i + _CHUNK_BYTES] for i in range(0, len(data), _CHUNK_BYTES)]
    for i, chunk in enumerate(chunks):
        store.set(f"{key}/{i}", chunk)
    store.set(key, str(len(chunks)))


def take_message(store, key: str, timeout_s: float):
    """Wait for a message, read it and delete its keys."""
    store.wait([key], timedelta(seconds=timeout_s))
    count = int(store.get(key))
    data = b"".join(store.get(f"{key}/{i}") for i in range(count))
    for k in [key] + [f"{key}/{i}" for i in range(count)]:
        store.delete_key(k)
    return pickle.loads(data)


def weight_group(store, prefix: str, rank: int, world_size: int, device: torch.device, timeout_s: float):
    """A torch process-group backend of its own (registered with no torch.distributed world) over `store`: gloo for
    CPU tensors, NCCL for CUDA tensors. Rank 0 is the trainer, rank 1 + i is vLLM worker i."""
    prefixed = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cpu":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"weights can be broadcast from and to cpu or cuda devices, not {device}")


def join_weight_group(host: str, port: int, prefix: str, rank: int, world_size: int, device: torch.device,
                      timeout_s: float):
    """`weight_group` for a vLLM worker: it opens its own connection to the server's store."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return weight_group(store, prefix, rank, world_size, device, timeout_s)


def close_weight_group(group) -> None:
    """Shut a weight group (or None) down now: NCCL's communicator and its GPU buffers freed, gloo's connections
    closed, rather than whenever garbage collection gets to it. Such a group belongs to no torch.distributed world,
    so destroy_process_group does not know it: it is the backend's own shutdown."""
    if group is not None:
        group.shutdown()


def broadcast_from_trainer(group, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` from rank 0 (the trainer) into the same-shaped tensors of the other ranks."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()
