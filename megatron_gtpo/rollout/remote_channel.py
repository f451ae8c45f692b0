"""The channel between a trainer and a vLLM rollout server (docs/remote_rollout.md has the protocol).

Control messages are pickled (trusted networks only) under store keys of the server's TCPStore, all under `ROOT`;
`post_message` / `take_message` write and read one. Weights travel in a process group of their own over the same
store (`weight_group`: gloo for CPU tensors, NCCL for CUDA ones; rank 0 the trainer, rank 1 + i vLLM worker i),
broadcast from the trainer (`broadcast_from_trainer`). A server's work for a session stops when a newer session
connects (`NewerSession`, `Preempted`). Imports no vllm.
"""
from __future__ import annotations

import pickle
import queue
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

PROTOCOL = 5  # 2: generate carries first_prompt; 3: generate answers a rollout record (responses.py);
# 4: generate_routed, and hello says whether the server returns routed experts; 5: a request's op readable on its own
# (`peek_request`), hello says whether the trainer sends weight updates during generation
ROOT = "gtpo_remote"
_CHUNK_BYTES = 4 * 2**20  # the libuv TCPStore refuses values over 8 MiB
_CHECK_EVERY_S = 0.05  # how often work for a session looks for a newer one
_WAIT_STEP_S = 0.001


class Preempted(RuntimeError):
    """A newer trainer session connected: the work for the older one was abandoned."""


class NewerSession:
    """Called while a server works for trainer session `session` (between decode steps, while it waits for a
    broadcast): raises `Preempted` once a newer session has connected to `store`. Asks the store at most every
    50 ms."""

    def __init__(self, store, session: int):
        self.store, self.session = store, session
        self._checked = -float("inf")

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self._checked < _CHECK_EVERY_S:
            return
        self._checked = now
        newest = self.store.add(f"{ROOT}/sessions", 0)
        if newest > self.session:
            raise Preempted(f"trainer session {newest} replaced session {self.session}")


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


def post_request(store, key: str, op: str, payload) -> None:
    """Request `op` under `key` (a `session_key`): its op first, readable without the payload (`peek_request`)."""
    store.set(f"{key}/op", op)
    post_message(store, f"{key}/req", (op, payload))


def peek_request(store, key: str) -> str | None:
    """The op of the request under `key` once it is complete (None before), leaving it to be taken."""
    return store.get(f"{key}/op").decode() if store.check([f"{key}/req"]) else None


def wait_for_request(store, key: str, timeout_s: float) -> bool:
    """Whether the request under `key` is complete, waited for at most `timeout_s` (it is seen as soon as it is
    written: a server that polled instead would add its polling interval to every request)."""
    try:
        store.wait([f"{key}/req"], timedelta(seconds=timeout_s))
    except dist.DistStoreError:  # the timeout
        return False
    return True


def take_request(store, key: str, timeout_s: float):
    """(op, payload) of the request under `key`, waited for, its keys deleted."""
    message = take_message(store, f"{key}/req", timeout_s)
    store.delete_key(f"{key}/op")
    return message


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


def join_weight_group(host: str, port: int, session: int, rank: int, world_size: int, device: torch.device,
                      timeout_s: float):
    """`weight_group` of trainer session `session` for a server or a vLLM worker, over a connection of its own to
    the server's store; with the `NewerSession` that interrupts its broadcasts."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return weight_group(store, weights_prefix(session), rank, world_size, device, timeout_s), \
        NewerSession(store, session)


def close_weight_group(group, *, abandoned: bool = False) -> None:
    """Shut a weight group (or None) down now: NCCL's communicator and its GPU buffers freed, gloo's connections
    closed, rather than whenever garbage collection gets to it. Such a group belongs to no torch.distributed world,
    so destroy_process_group does not know it: it is the backend's own shutdown. `abandoned`: a broadcast may still
    be pending (its trainer session was pre-empted): the group is aborted, which does not wait for it."""
    if group is None:
        return
    if not abandoned:
        group.shutdown()
        return
    group.abort()
    if _ABANDONED is None:
        _start_burying()
    _ABANDONED.put(group)


# A gloo group's destructor joins its threads, so it waits for a pending broadcast until the group's timeout
# (measured: the whole timeout): abandoned groups are released on a thread of their own, not the serving loop's.
_ABANDONED: queue.SimpleQueue | None = None


def _start_burying() -> None:
    global _ABANDONED
    _ABANDONED = queue.SimpleQueue()
    threading.Thread(target=_bury, args=(_ABANDONED,), name="abandoned weight groups", daemon=True).start()


def _bury(abandoned: queue.SimpleQueue) -> None:
    while True:
        group = abandoned.get()
        while sys.getrefcount(group) > 2:  # until this thread holds the last reference (and the call's argument)
            time.sleep(_CHECK_EVERY_S)
        del group  # the destructor runs here


def broadcast_from_trainer(group, tensor: torch.Tensor, interrupt=None) -> None:
    """Broadcast `tensor` from rank 0 (the trainer) into the same-shaped tensors of the other ranks. A receiver
    passes `interrupt` (a `NewerSession`): it is called while the broadcast is pending, and what it raises abandons
    the broadcast (the caller then shuts the group down: a trainer that died mid-sync without closing its
    connections, as on NCCL, would leave the broadcast pending until the group's timeout)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    work = group.broadcast([tensor], options)
    if interrupt is not None:
        while not work.is_completed():
            interrupt()
            time.sleep(_WAIT_STEP_S)
    work.wait()
