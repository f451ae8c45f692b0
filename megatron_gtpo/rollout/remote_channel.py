"""The channel between a trainer and a rollout server (docs/remote_rollout.md has the protocol).

Control messages live under keys of the server's TCPStore, all under `ROOT`, in the declared format of
remote_messages.py (no pickle), each signed (HMAC-SHA256) with the shared token over the server's nonce, its key and
its bytes (`Channel`), so that only a holder of the token can ask a server for anything, and no message verifies
under another key or another server's lifetime. The token is GTPO_REMOTE_TOKEN, or the contents of the file
GTPO_REMOTE_TOKEN_FILE names (`read_token`), on both sides; never on a command line. Weights travel in a process group
of their own over the same store (`weight_group`: gloo for CPU tensors, NCCL for CUDA ones; rank 0 the trainer,
rank 1 + i vLLM worker i), broadcast from the trainer (`broadcast_from_trainer`); the store and that group are not
authenticated. A server's work for a session stops once it admitted a newer session (`NewerSession`, `Preempted`).
Imports no vllm.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .remote_messages import MalformedMessage, dumps, loads

PROTOCOL = 8  # 2: generate carries first_prompt; 3: generate answers a rollout record (responses.py);
# 4: generate_routed, and hello says whether the server returns routed experts; 5: a request's op readable on its own
# (`peek_request`), hello says whether the trainer sends weight updates during generation; 6: messages in the
# declared format of remote_messages.py, signed with the shared token (no pickle); 7: one generate op (no
# generate_routed), answered with the record, its routing where hello asked for it (`routed`), and the version;
# 8: generate's answer also holds the seconds the server spent generating (remote_messages.check_generate_reply)
ROOT = "gtpo_remote"
MAX_REQUEST_BYTES = 2**30  # what a server reads of one request at most (a generation's prompts are far smaller)
TOKEN_SETTINGS = "GTPO_REMOTE_TOKEN or GTPO_REMOTE_TOKEN_FILE"
_TOKEN_ENV, _TOKEN_FILE_ENV = "GTPO_REMOTE_TOKEN", "GTPO_REMOTE_TOKEN_FILE"
_NONCE_KEY = f"{ROOT}/nonce"
_ACTIVE_KEY = f"{ROOT}/active"  # the newest session the server admitted (its hello checked out)
_SIGNATURE_BYTES = 32
_CHUNK_BYTES = 4 * 2**20  # the libuv TCPStore refuses values over 8 MiB
_CHECK_EVERY_S = 0.05  # how often work for a session looks for a newer one
_WAIT_STEP_S = 0.001
_POLL_CAP_S = 0.005  # the longest pause between two looks for a message


class Preempted(RuntimeError):
    """A newer trainer session was admitted: the work for the older one was abandoned."""


class Unsigned(MalformedMessage):
    """A message not signed with the channel's token (another token, or none)."""


class NewerSession:
    """Called while a server works for trainer session `session` (between decode steps, while it waits for a
    broadcast): raises `Preempted` once the server admitted a newer session (`admit`). Asks the store at most every
    50 ms."""

    def __init__(self, store, session: int):
        self.store, self.session = store, session
        self._checked = -float("inf")

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self._checked < _CHECK_EVERY_S:
            return
        self._checked = now
        newest = admitted_session(self.store)
        if newest > self.session:
            raise Preempted(f"a newer trainer (session {newest}) took this rollout server from session {self.session}")


def admitted_session(store) -> int:
    """The newest session the server admitted (0: none yet)."""
    return store.add(_ACTIVE_KEY, 0)


def admit(store, session: int) -> None:
    """Record `session` as the newest admitted (a newer one than `admitted_session`): the older session's work stops
    (`NewerSession`)."""
    store.add(_ACTIVE_KEY, session - admitted_session(store))


def ended_key(session: int) -> str:
    """Where the server says why it ended session `session` for good (a newer trainer took it)."""
    return f"{ROOT}/{session}/ended"


def session_key(session: int, seq: int) -> str:
    """The key prefix of request `seq` of trainer session `session` (its request and reply live under it)."""
    return f"{ROOT}/{session}/{seq}"


def weights_prefix(session: int) -> str:
    return f"{ROOT}/{session}/weights"


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a rollout server address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


class Channel:
    """Signed messages under keys of a server's store (module doc). `token`: the shared secret (`read_token`; empty:
    none, and anyone who reaches the store can sign); `nonce`: the server's, published in its store at start
    (`publish_nonce`), so that no message of another server's lifetime verifies here."""

    def __init__(self, store, token: bytes, nonce: bytes):
        self.store, self.token, self.nonce = store, token, nonce

    @classmethod
    def connect(cls, store, token: bytes, timeout_s: float) -> Channel:
        """The channel of a client of the server whose store this is (waits for the server's nonce)."""
        store.wait([_NONCE_KEY], timedelta(seconds=timeout_s))
        return cls(store, token, store.get(_NONCE_KEY))

    def post(self, key: str, message) -> None:
        """Write `message` (remote_messages grammar) in chunks, signed; the header key (the chunk count) is written
        last, so it marks completion."""
        body = dumps(message)
        data = self._signature(key, body) + body
        chunks = [data[i:i + _CHUNK_BYTES] for i in range(0, len(data), _CHUNK_BYTES)]
        for i, chunk in enumerate(chunks):
            self.store.set(f"{key}/{i}", chunk)
        self.store.set(key, str(len(chunks)))

    def arrived(self, key: str, timeout_s: float) -> bool:
        """Whether the message under `key` is complete, waited for at most `timeout_s`. Polled, at first every
        0.5 ms and then at most every `_POLL_CAP_S` (a message is seen soon after it is written), not waited for
        with the store's own timed wait, which logs a warning each time it times out."""
        deadline, pause = time.monotonic() + timeout_s, _WAIT_STEP_S / 2
        while not self.store.check([key]):
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, _POLL_CAP_S)
        return True

    def take(self, key: str, max_bytes: int | None = None):
        """The message under `key` (complete: `arrived`), its keys deleted. `MalformedMessage` for one that is
        truncated, over `max_bytes`, unsigned or not of the declared format; its keys are deleted all the same."""
        header = self.store.get(key)
        self.store.delete_key(key)
        count = int(header) if header.isdigit() and len(header) < 12 else None
        if count is None:
            raise MalformedMessage(f"the header under {key} is not a chunk count: {header[:40]!r}")
        if max_bytes is not None and count > -(-max_bytes // _CHUNK_BYTES):
            raise MalformedMessage(f"a message of {count} chunks of up to {_CHUNK_BYTES} bytes exceeds the "
                                   f"{max_bytes} bytes a request may have")
        chunk_keys = [f"{key}/{i}" for i in range(count)]
        try:
            if count and not self.store.check(chunk_keys):
                raise MalformedMessage(f"the message under {key} is truncated (a chunk of {count} is missing)")
            data = b"".join(self.store.get(k) for k in chunk_keys)
        finally:
            for k in chunk_keys:
                self.store.delete_key(k)
        signature, body = data[:_SIGNATURE_BYTES], data[_SIGNATURE_BYTES:]
        if not hmac.compare_digest(signature, self._signature(key, body)):
            raise Unsigned(f"the message under {key} is not signed with this channel's token ({TOKEN_SETTINGS})")
        return loads(body)

    def post_request(self, key: str, op: str, payload) -> None:
        """Request `op` under `key` (a `session_key`): its op first, readable without the payload (`peek_request`;
        unsigned, a hint: the op that counts is the signed one)."""
        self.store.set(f"{key}/op", op)
        self.post(f"{key}/req", {"op": op, "payload": payload})

    def peek_request(self, key: str) -> str | None:
        """The op of the request under `key` once it is complete (None before, and for a request without its op),
        leaving it to be taken."""
        complete = self.store.check([f"{key}/req", f"{key}/op"])
        return self.store.get(f"{key}/op").decode(errors="replace") if complete else None

    def take_request(self, key: str, max_bytes: int | None = MAX_REQUEST_BYTES) -> tuple[str, object]:
        """(op, payload) of the complete request under `key`, its keys deleted; MalformedMessage for anything
        that is not a request."""
        if self.store.check([f"{key}/op"]):
            self.store.delete_key(f"{key}/op")
        request = self.take(f"{key}/req", max_bytes)
        if not isinstance(request, dict) or set(request) != {"op", "payload"} or not isinstance(request["op"], str):
            raise MalformedMessage(f"a request must be {{'op': str, 'payload': ...}}, got {str(request)[:80]}")
        return request["op"], request["payload"]

    def _signature(self, key: str, body: bytes) -> bytes:
        return hmac.new(self.token, self.nonce + b"\0" + key.encode() + b"\0" + body, hashlib.sha256).digest()


def publish_nonce(store) -> bytes:
    """A server's nonce, fresh for its lifetime, written where its clients read it (`Channel.connect`)."""
    nonce = secrets.token_hex(16).encode()
    store.set(_NONCE_KEY, nonce)
    return nonce


def read_token() -> bytes:
    """The shared token (module doc) from GTPO_REMOTE_TOKEN, or from the file GTPO_REMOTE_TOKEN_FILE names (its
    surrounding whitespace dropped); b"" when neither is set. ValueError naming the variable when both are set or
    the file is unreadable or empty."""
    value, path = os.environ.get(_TOKEN_ENV), os.environ.get(_TOKEN_FILE_ENV)
    if value is not None and path is not None:
        raise ValueError(f"set one of {_TOKEN_ENV} and {_TOKEN_FILE_ENV}, not both")
    if path is None:
        return (value or "").encode()
    try:
        with open(path, "rb") as f:
            token = f.read().strip()
    except OSError as e:
        raise ValueError(f"{_TOKEN_FILE_ENV}={path}: cannot read the token ({e.strerror})") from None
    if not token:
        raise ValueError(f"{_TOKEN_FILE_ENV}={path}: the file is empty")
    return token


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
    box = [group]
    del group
    threading.Thread(target=_bury, args=(box,), name="abandoned weight group", daemon=True).start()


# A gloo group's destructor joins its threads, so it waits for a pending broadcast until the group's timeout
# (measured: the whole timeout): each abandoned group is released on a thread of its own, neither on the serving
# loop's nor after another abandoned group's.
def _bury(box: list) -> None:
    group = box.pop()
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
