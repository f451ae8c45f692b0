"""The channel between a trainer and a rollout server: ZeroMQ through pyzmq (libzmq and libsodium inside its wheel).
docs/remote_rollout.md has the protocol, why ZeroMQ, and what is protected against whom (its threat table).

A server binds two ROUTER sockets on the one interface its --listen names, nothing else: the control socket at
HOST:PORT, and the weight socket at HOST and a port of the system's choosing, which the hello reply names. A trainer
connects a DEALER socket to each (`connect_socket`).

With a token (GTPO_REMOTE_TOKEN, or the file GTPO_REMOTE_TOKEN_FILE names, alike on both sides: `read_token`):
- the control socket runs ZeroMQ's CURVE mechanism, both key pairs derived from the token (`curve_keys`); the server's
  ZAP handler (remote_listener.py) admits only the client key at the handshake, so a peer without the token is
  refused before any message of it is read, and all that crosses (requests, prompts, responses, replies) is
  authenticated and encrypted, each connection under keys of its own;
- the weight socket runs PLAIN with a password of one session's, sent in that session's (encrypted) hello reply: the
  ZAP handler admits one connection per admitted session at the handshake, and the weights cross in clear (their
  speed) unless the server runs with --encrypt-weights (CURVE there too: benchmarks/results/remote_transport.md).
Without a token (a server whose --listen is loopback): the NULL mechanism, and any local process can use it.

Every message is multipart: a body in the declared format of remote_messages.py (no pickle), then raw tensor bytes
(a weight bucket's tensors, one frame each; `tensor_frames` / `frame_tensors`), each frame's length checked against
the dtype and shape the body declares. Requests are {"op", "seq", "payload"}; replies {"seq", "status", "payload"}
(status "ok", "error", "ended": the server gave the session to a newer trainer, or "no_session": the connection
holds no session on this server). GPU weights may instead go over
NCCL (`weight_group`), whose rendezvous crosses this channel (`ChannelStore`) to a store of that session's on the
server's own disk: NCCL itself is not authenticated. Imports no vllm.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import os
import socket
import sys
import threading
import time
import warnings
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import zmq
from zmq.utils import z85

from .remote_messages import MalformedMessage

PROTOCOL = 10  # 2: generate carries first_prompt; 3: generate answers a rollout record (responses.py); 4:
# generate_routed, and hello says whether the server returns routed experts; 5: a request's op readable on its own;
# 6: messages in the declared format of remote_messages.py, signed with the shared token (no pickle); 7: one generate
# op, answered with the record, its routing where hello asked for it, and the version; 8: generate's answer also holds
# the server's generation seconds; 9: ZeroMQ (CURVE, a weight socket, bounds in the hello reply), no TCPStore; 10: a
# request on a connection without a session is answered "no_session" (ZeroMQ reconnects a trainer's socket to a
# relaunched server by itself: the trainer learns from that reply that its server is gone)
TOKEN_SETTINGS = "GTPO_REMOTE_TOKEN or GTPO_REMOTE_TOKEN_FILE"
_TOKEN_ENV, _TOKEN_FILE_ENV = "GTPO_REMOTE_TOKEN", "GTPO_REMOTE_TOKEN_FILE"
ZAP_CONTROL, ZAP_WEIGHTS = b"gtpo-control", b"gtpo-weights"  # the sockets' ZAP domains
HEARTBEAT_MS, HEARTBEAT_TIMEOUT_MS = 2_000, 20_000  # a peer that answers no heartbeat for 20 s is disconnected
HANDSHAKE_MS = 10_000  # a connection that has not finished its handshake within 10 s is dropped
_CHECK_EVERY_S = 0.05  # how often a receiver of a weight broadcast looks for a newer session
_WAIT_STEP_S = 0.001


class Preempted(RuntimeError):
    """A newer trainer session was admitted: the work for the older one was abandoned."""


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


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a rollout server address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def endpoint(host: str, port: int | str) -> str:
    """ZeroMQ's TCP endpoint of HOST:PORT (an IPv6 address in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """The CURVE key pairs of a token (Z85 text, as ZeroMQ takes them): the server's and the client's."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def curve_keys(token: bytes) -> CurveKeys:
    """Both key pairs, each secret key an HMAC-SHA256 of the token: whoever holds the token can derive them, nobody
    else (a CURVE secret key is any 32 bytes)."""
    def secret(role: bytes) -> bytes:
        return z85.encode(hmac.new(token, b"gtpo-remote curve " + role, hashlib.sha256).digest())

    server, client = secret(b"server"), secret(b"client")
    return CurveKeys(zmq.curve_public(server), server, zmq.curve_public(client), client)


def configure(sock: zmq.Socket, *, max_message_bytes: int | None = None) -> None:
    """The options every socket of the channel has: heartbeats (a dead peer is noticed without traffic), a bounded
    handshake, no lingering at close, IPv6 where asked for, and a bound on the frames it takes in."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)
    if max_message_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)


def monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A socket that receives `sock`'s ZeroMQ `events`, over a pipe without a bound. libzmq's I/O thread sends each
    event with a blocking send: on the bounded pipe of `get_monitor_socket`, events that nobody reads (a peer that
    refuses this socket reconnects about 7 times a second) fill it within two minutes, and then every socket of the
    context stops. Unread events here cost memory until the reader drains them."""
    address = f"inproc://gtpo-monitor-{id(sock)}-{time.monotonic_ns()}"
    sock.monitor(address, events)
    reader = sock.context.socket(zmq.PAIR)
    reader.rcvhwm = 0  # with either side's bound 0, libzmq's inproc pipe has none
    reader.linger = 0
    reader.connect(address)
    return reader


def secure_client(sock: zmq.Socket, token: bytes, *, mechanism: str, password: bytes = b"", user: bytes = b"") -> None:
    """Set a trainer's socket up for the server's `mechanism` ("curve", "plain" or "null")."""
    if mechanism == "curve":
        keys = curve_keys(token)
        sock.curve_secretkey, sock.curve_publickey = keys.client_secret, keys.client_public
        sock.curve_serverkey = keys.server_public
    elif mechanism == "plain":
        sock.plain_username, sock.plain_password = user, password
    elif mechanism != "null":
        raise ValueError(f"unknown ZeroMQ mechanism {mechanism!r}")


def secure_server(sock: zmq.Socket, token: bytes, *, mechanism: str, domain: bytes) -> None:
    """Set a server socket up for `mechanism` ("curve", "plain" or "null"), its ZAP handler asked under `domain`."""
    sock.zap_domain = domain
    if mechanism == "curve":
        keys = curve_keys(token)
        sock.curve_secretkey, sock.curve_publickey = keys.server_secret, keys.server_public
        sock.curve_server = True
    elif mechanism == "plain":
        sock.plain_server = True
    elif mechanism != "null":
        raise ValueError(f"unknown ZeroMQ mechanism {mechanism!r}")


def tensor_frames(tensors) -> list:
    """Each tensor's bytes, as a frame ZeroMQ sends without a copy (host tensors; others are copied to the host)."""
    return [t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy() for t in tensors]


def frame_tensors(frames, dtype_names: list[str], shapes: list[list[int]]) -> list[torch.Tensor]:
    """Tensors over `frames` (no copy; read-only memory of ZeroMQ's), each of its declared dtype and shape;
    MalformedMessage for a frame whose length is not that."""
    if len(frames) != len(shapes):
        raise MalformedMessage(f"the message declares {len(shapes)} tensors and holds {len(frames)} frames")
    tensors = []
    for frame, dtype_name, shape in zip(frames, dtype_names, shapes):
        dtype = getattr(torch, dtype_name)
        numel = 1
        for n in shape:
            numel *= n
        buffer = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
        if buffer.nbytes != numel * dtype.itemsize:
            raise MalformedMessage(f"a {dtype_name} tensor of shape {list(shape)} is {numel * dtype.itemsize} bytes, "
                                   f"its frame {buffer.nbytes}")
        if numel == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
            continue
        with warnings.catch_warnings():  # ZeroMQ's frames are read-only: what arrived is never written to
            warnings.simplefilter("ignore", UserWarning)
            tensors.append(torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape))
    return tensors


class ChannelStore(dist.Store):
    """A torch store whose keys live on the rollout server, in the store of this trainer's session there (a file of
    the server's own, which its workers open: `session_store`), reached through the channel: what a weight group's
    rendezvous (NCCL's unique id) needs, and nothing that an outsider could reach. `call(method, args)` is the
    client's request of op "rendezvous"; a `get` or `wait` for a key not yet set polls."""

    def __init__(self, call: Callable, timeout_s: float):
        super().__init__()
        self._call, self._timeout_s = call, timeout_s

    def set(self, key, value):
        self._call("set", [key, bytes(value.encode() if isinstance(value, str) else value).hex()])

    def get(self, key):
        self.wait([key])
        return bytes.fromhex(self._call("get", [key]))

    def add(self, key, amount):
        return self._call("add", [key, int(amount)])

    def check(self, keys):
        return self._call("check", [list(keys)])

    def delete_key(self, key):
        return self._call("delete_key", [key])

    def num_keys(self):
        return self._call("num_keys", [])

    def wait(self, keys, timeout=None):
        limit = self._timeout_s if timeout is None else timeout.total_seconds()
        deadline, pause = time.monotonic() + limit, _WAIT_STEP_S
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"the rendezvous keys {list(keys)} were not set within {limit:g} s")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)


def rendezvous(store: dist.Store, method: str, args: list):
    """What a server answers a "rendezvous" request with: `method` on its session's store (ChannelStore's calls)."""
    if method == "set" and len(args) == 2 and isinstance(args[0], str) and isinstance(args[1], str):
        store.set(args[0], bytes.fromhex(args[1]))
        return None
    if method == "get" and len(args) == 1 and isinstance(args[0], str):
        return store.get(args[0]).hex()
    if method == "add" and len(args) == 2 and isinstance(args[0], str) and isinstance(args[1], int):
        return store.add(args[0], args[1])
    if method == "check" and len(args) == 1 and isinstance(args[0], list) and all(isinstance(k, str) for k in args[0]):
        return store.check(args[0])
    if method == "delete_key" and len(args) == 1 and isinstance(args[0], str):
        return store.delete_key(args[0])
    if method == "num_keys" and not args:
        return store.num_keys()
    raise ValueError(f"a rendezvous request is set/get/add/check/delete_key/num_keys with its arguments, got "
                     f"{method!r} {str(args)[:60]}")


_PREEMPTED_KEY = "gtpo/preempted"  # in a session's store: a newer session was admitted


def session_store(path: str) -> dist.Store:
    """The store of one trainer session on the server's disk (a file in a directory only the server's user can
    read): its weight group's rendezvous, and the mark that a newer session pre-empted it (`NewerSession`)."""
    return dist.FileStore(path, -1)


def mark_preempted(path: str) -> None:
    session_store(path).set(_PREEMPTED_KEY, b"1")


class NewerSession:
    """Called while a worker receives a weight broadcast of session `store`'s: raises `Preempted` once the server
    marked the session pre-empted (`mark_preempted`). Looks at most every 50 ms."""

    def __init__(self, store: dist.Store, session: int):
        self.store, self.session = store, session
        self._checked = -float("inf")

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self._checked < _CHECK_EVERY_S:
            return
        self._checked = now
        if self.store.check([_PREEMPTED_KEY]):
            raise Preempted(f"a newer trainer took this rollout server from session {self.session}")


def weight_group(store, rank: int, world_size: int, device: torch.device, timeout_s: float):
    """A torch process-group backend of its own (registered with no torch.distributed world) over `store`: NCCL for
    CUDA tensors, gloo for CPU ones. Rank 0 is the trainer, rank 1 + i is the server's worker i."""
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cpu":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"weights can be broadcast from and to cpu or cuda devices, not {device}")


def join_weight_group(store_path: str, session: int, rank: int, world_size: int, device: torch.device,
                      timeout_s: float):
    """`weight_group` of trainer session `session` for a server's worker, over that session's store file
    (`session_store`); with the `NewerSession` that interrupts its broadcasts."""
    store = session_store(store_path)
    return weight_group(store, rank, world_size, device, timeout_s), NewerSession(store, session)


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
