"""A rollout server's side of the channel (remote_channel.py): its sockets, its ZAP handler and the thread that reads
every message, admits trainer sessions and queues their requests for the serving loop (remote_server.py).

What it guarantees (docs/remote_rollout.md, "What the channel protects"):
- it binds the interface --listen names and no other; a non-loopback one only with a token (`Listener` refuses to
  start otherwise, in one line);
- with a token, a connection is authenticated at its handshake (CURVE on the control socket, a one-time PLAIN
  password per session on the weight socket) by the ZAP handler (`_Zap`), before ZeroMQ reads any message of it;
  every refusal is counted and logged at most once per 10 s per kind (`Tally`);
- no frame over `Bounds.max_message_bytes` is read (ZeroMQ's MAXMSGSIZE drops the connection); a message over it in
  all, requests of the session buffered over `max_buffered_bytes`, a hello over `hello_bytes`, anything that is not a
  request, and every request of a connection that holds no session are answered with one line and change nothing;
- the server's state (its sessions, their numbers and passwords, the newest admitted) lives in this process only;
  a request of a session that a newer one replaced is answered "ended".
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import secrets
import shutil
import tempfile
import threading
import time
from typing import Callable

import zmq
from zmq.utils import z85

from .remote_channel import (
    TOKEN_SETTINGS,
    ZAP_CONTROL,
    ZAP_WEIGHTS,
    configure,
    curve_keys,
    endpoint,
    is_loopback,
    mark_preempted,
    monitor,
    rendezvous,
    secure_server,
    session_store,
)
from .remote_messages import MalformedMessage, dumps, loads

log = logging.getLogger("megatron_gtpo.rollout.remote_server")
_LOG_EVERY_S = 10.0
_POLL_MS = 50
REFUSED = ""  # the op of a request the channel refused and answered itself (`Listener.take` gives it all the same)


@dataclasses.dataclass(frozen=True)
class Bounds:
    """What a server takes from a trainer (each refused with one line, remote_server.py's command line sets them):
    bytes per message (and per frame), bytes of one session's requests buffered at once (one weight bucket and the
    generations around it), a hello's bytes, responses (prompts x n) and prompt tokens per generate."""

    max_message_bytes: int = 2**30
    max_buffered_bytes: int = 2**31
    hello_bytes: int = 2**20
    max_responses: int = 2**16
    max_prompt_tokens: int = 2**24


@dataclasses.dataclass
class Request:
    op: str
    seq: int
    payload: object
    frames: list
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Admitted:
    """A session whose hello checked out: its number, its hello, and the weight socket's one-time password (None
    without a token)."""

    session: int
    hello: dict
    password: bytes | None


class Tally:
    """Counts of refused connections and messages by kind, each kind logged at most once per 10 s (with how many
    came since)."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self._logged: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def __call__(self, kind: str, detail: str) -> None:
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            last, count_then = self._logged.get(kind, (-float("inf"), 0))
            now = time.monotonic()
            if now - last < _LOG_EVERY_S:
                return
            self._logged[kind] = (now, self.counts[kind])
        since = self.counts[kind] - count_then - 1
        log.warning("refused %s: %s%s", kind, detail, f" (and {since} more since the last such line)" if since else "")


class _Zap(threading.Thread):
    """ZeroMQ's authentication handler for the server's sockets (ZAP, RFC 27): the control socket admits the token's
    client key (CURVE); the weight socket admits a connection of the newest session with its one-time password
    (PLAIN; `passwords`, each popped when used), or the client key (CURVE, --encrypt-weights). Without a token
    (loopback) every connection is admitted."""

    def __init__(self, context: zmq.Context, token: bytes, tally: Tally, newest: Callable[[], int]):
        super().__init__(name="rollout server ZAP", daemon=True)
        self.client_key = curve_keys(token).client_public if token else None
        self.tally, self.newest = tally, newest
        self.passwords: dict[int, bytes] = {}
        self.lock = threading.Lock()
        self.socket = context.socket(zmq.REP)
        self.socket.linger = 0
        self.socket.bind("inproc://zeromq.zap.01")
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            if not self.socket.poll(_POLL_MS):
                continue
            request = self.socket.recv_multipart()
            version, request_id, domain, address, _, mechanism, *credentials = request + [b""] * (6 - len(request))
            user, why = self.check(domain, mechanism, credentials)
            if why is not None:
                self.tally("connection", f"{address.decode(errors='replace')}: {why}")
            self.socket.send_multipart([b"1.0", request_id, b"200" if why is None else b"400",
                                        b"OK" if why is None else why.encode(), user, b""])

    def check(self, domain: bytes, mechanism: bytes, credentials: list[bytes]) -> tuple[bytes, str | None]:
        """(the user id, None) for a connection admitted, (b"", why) for one refused."""
        if self.client_key is None:
            return b"", None if mechanism == b"NULL" else f"mechanism {mechanism.decode(errors='replace')}"
        if mechanism == b"CURVE" and credentials and len(credentials[0]) == 32:
            if secrets.compare_digest(z85.encode(credentials[0]), self.client_key):
                return b"trainer", None
            return b"", f"a CURVE key not derived from this server's token ({TOKEN_SETTINGS})"
        if domain == ZAP_WEIGHTS and mechanism == b"PLAIN" and len(credentials) == 2:
            user, password = credentials
            number = int(user[len(b"session-"):]) if user.startswith(b"session-") and user[8:].isdigit() else -1
            with self.lock:
                expected = self.passwords.get(number)
                if expected is not None and number == self.newest() and secrets.compare_digest(expected, password):
                    del self.passwords[number]  # one connection per session
                    return user, None
            return b"", "a weight connection without the password of the newest session (or with it used)"
        return b"", f"mechanism {mechanism.decode(errors='replace')} on {domain.decode(errors='replace')}"


class Listener(threading.Thread):
    """The server's sockets and the thread that reads them (module doc). `check_hello(payload)` raises ValueError
    for a hello that does not fit the server. The serving loop takes sessions from `admitted`, their requests in
    order (`wait_request`, `peek`, `take`), and answers with `reply` (from any thread); `end` tells a replaced
    session's trainer."""

    def __init__(self, host: str, port: int, token: bytes, bounds: Bounds, check_hello: Callable[[object], None], *,
                 encrypt_weights: bool = False):
        super().__init__(name="rollout server channel", daemon=True)
        if not token and not is_loopback(host):
            raise ValueError(f"--listen {host}:{port} is not a loopback address: a server reachable from other hosts "
                             f"needs a token ({TOKEN_SETTINGS}; examples/slurm makes one per job)")
        self.bounds, self.check_hello, self.tally = bounds, check_hello, Tally()
        self.context = zmq.Context()
        self.zap = _Zap(self.context, token, self.tally, lambda: self.newest)
        self.zap.start()
        mechanism = "curve" if token else "null"
        self.weights_mechanism = ("curve" if encrypt_weights else "plain") if token else "null"
        self.control = self._socket(token, mechanism, ZAP_CONTROL)
        self.control.bind(endpoint(host, port or "*"))  # 0: a port of the system's choosing (tests)
        self.port = int(self.control.last_endpoint.decode().rpartition(":")[2])
        self.weights = self._socket(token, self.weights_mechanism, ZAP_WEIGHTS)
        self.weights.bind(endpoint(host, "*"))
        self.weights_port = int(self.weights.last_endpoint.decode().rpartition(":")[2])
        failed = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        self.monitors = [monitor(s, failed) for s in (self.control, self.weights)]
        self._outbox_address = f"inproc://gtpo-outbox-{id(self)}"
        self.outbox = self.context.socket(zmq.PULL)
        self.outbox.bind(self._outbox_address)
        self._senders = threading.local()
        self._stores: str | None = None  # the directory of the sessions' stores, made by store_path when needed
        self._stores_lock = threading.Lock()
        self.admitted: queue.SimpleQueue[Admitted] = queue.SimpleQueue()
        self.newest = 0  # the newest session admitted (written by this thread only)
        self._numbers = 0
        self._identities: dict[bytes, int] = {}  # control connection -> its session
        self._control_of: dict[int, bytes] = {}
        self._pending: dict[int, Request] = {}  # the newest session's requests not yet taken, by seq
        self._buffered = 0
        self._ended: dict[int, str] = {}
        self._changed = threading.Condition()
        self.stopped = threading.Event()

    def _socket(self, token: bytes, mechanism: str, domain: bytes) -> zmq.Socket:
        sock = self.context.socket(zmq.ROUTER)
        configure(sock, max_message_bytes=self.bounds.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, 4)  # messages ZeroMQ holds per connection before this thread reads them
        secure_server(sock, token, mechanism=mechanism, domain=domain)
        return sock

    # --- the thread

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.control, self.weights, self.outbox, *self.monitors):
            poller.register(sock, zmq.POLLIN)
        try:
            while not self.stopped.is_set():
                for sock, _ in poller.poll(_POLL_MS):
                    try:
                        self._handle(sock)
                    except Exception:  # noqa: BLE001 - a bug of this thread's: logged, and the server serves on
                        log.exception("the channel's thread failed on a message; serving on")
        finally:  # the replies posted last (a shutdown's) leave before the sockets close
            while self.outbox.poll(0):
                target, *frames = self.outbox.recv_multipart(copy=False)
                self.control.send_multipart([target.bytes, *frames], copy=False)
            self.control.close(linger=2000)
            for sock in (self.weights, self.outbox, *self.monitors):
                sock.close(0)

    def _handle(self, sock: zmq.Socket) -> None:
        if sock is self.outbox:
            target, *frames = self.outbox.recv_multipart(copy=False)
            self.control.send_multipart([target.bytes, *frames], copy=False)
        elif sock in self.monitors:
            event = sock.recv_multipart()
            self.tally("connection", f"a handshake that failed (ZeroMQ event {event[0][:2].hex()})")
        else:
            self._receive(sock)

    def _receive(self, sock: zmq.Socket) -> None:
        identity, *frames = sock.recv_multipart(copy=False)
        nbytes = sum(len(f.buffer) for f in frames)
        body, why = None, None
        try:
            body = _request_body(frames)
        except MalformedMessage as e:
            why = str(e)
        if why is None and nbytes > self.bounds.max_message_bytes:
            why = (f"a message of {nbytes} bytes exceeds the {self.bounds.max_message_bytes} this server takes "
                   f"(--max-message-bytes)")
        if why is not None:  # answered where the sender reads: its control connection
            self.tally("message", why)
            origin = identity.bytes if sock is self.control else \
                self._control_of.get(body.get("session")) if body is not None else None
            if origin is not None:
                self._send(origin, None if body is None else body["seq"], "error", f"refused: {why}")
                if body is not None:
                    self._skip(self._identities.get(origin), body["seq"])
            return
        if sock is self.weights:
            self._weights_request(frames[0], body, frames[1:], nbytes)
        else:
            self._control_request(identity.bytes, body, frames[1:], nbytes)

    def _control_request(self, identity: bytes, body: dict, frames: list, nbytes: int) -> None:
        op, seq, payload = body["op"], body["seq"], body["payload"]
        session = self._identities.get(identity)
        if session is None:
            if op != "hello":
                self.tally("message", f"{op[:40]!r} from a connection without a session")
                return self._send(identity, seq, "no_session", "refused: this connection has no session (a session "
                                                               "starts with hello)")
            return self._hello(identity, seq, payload, nbytes + sum(len(f.buffer) for f in frames))
        if session in self._ended:
            return self._send(identity, seq, "ended", self._ended[session])
        if op == "rendezvous":
            return self._rendezvous(identity, session, seq, payload)
        if frames:
            self.tally("message", f"{op[:40]!r} with tensor frames on the control socket")
            self._send(identity, seq, "error", "refused: tensors travel on the weight socket")
            return self._skip(session, seq)
        self._queue(session, Request(op, seq, payload, [], nbytes))

    def _weights_request(self, first: zmq.Frame, body: dict, frames: list, nbytes: int) -> None:
        session = body.get("session")
        user = first.get("User-Id") if self.weights_mechanism == "plain" else None
        identity = self._control_of.get(session) if isinstance(session, int) else None
        if identity is None or (user is not None and user != f"session-{session}") or body["op"] != "bucket":
            self.tally("message", f"a weight message of session {str(session)[:20]} ({body['op'][:20]!r}) that is "
                                  f"not its newest session's bucket")
            return
        if session in self._ended:
            return self._send(identity, body["seq"], "ended", self._ended[session])
        self._queue(session, Request("bucket", body["seq"], body["payload"], frames, nbytes))

    def _queue(self, session: int, request: Request) -> None:
        identity = self._control_of[session]
        with self._changed:
            if request.seq in self._pending:
                why = f"request {request.seq} was sent twice"
            elif self._buffered + request.nbytes > self.bounds.max_buffered_bytes:
                why = (f"the server holds {self._buffered} bytes of this session's requests; {request.nbytes} more "
                       f"exceed its bound of {self.bounds.max_buffered_bytes} (--max-buffered-bytes)")
            else:
                self._pending[request.seq] = request
                self._buffered += request.nbytes
                self._changed.notify_all()
                return
        self.tally("message", why)
        self._send(identity, request.seq, "error", f"refused: {why}")
        self._skip(session, request.seq)

    def _skip(self, session: int | None, seq: int) -> None:
        """Request `seq` of `session` was refused here (and answered): the serving loop passes over it in order."""
        with self._changed:
            if session == self.newest and seq not in self._pending:
                self._pending[seq] = Request(REFUSED, seq, None, [], 0)
                self._changed.notify_all()

    def _hello(self, identity: bytes, seq: int, hello, nbytes: int) -> None:
        try:
            if nbytes > self.bounds.hello_bytes:
                raise ValueError(f"a hello of {nbytes} bytes exceeds {self.bounds.hello_bytes}")
            self.check_hello(hello)
        except Exception as e:  # noqa: BLE001 - refused: the trainer is told, the active session untouched
            self.tally("hello", str(e))
            return self._send(identity, seq, "error", f"refused: {e}")
        self._numbers += 1
        number = self._numbers
        password = secrets.token_hex(32).encode() if self.weights_mechanism == "plain" else None
        with self.zap.lock:
            self.zap.passwords = {number: password} if password is not None else {}
        for older in self._identities.values():  # their workers' weight broadcasts stop (remote_channel.NewerSession)
            if older not in self._ended and self._stores is not None and os.path.exists(self.store_path(older)):
                mark_preempted(self.store_path(older))
        with self._changed:
            for older in self._identities.values():
                self._ended.setdefault(older, f"a newer trainer (session {number}) took this rollout server")
            self._pending.clear()
            self._buffered = 0
            self._identities[identity], self._control_of[number] = number, identity
            self.newest = number
            self._changed.notify_all()
        self.admitted.put(Admitted(number, hello, password))

    def store_path(self, session: int) -> str:
        """The file of `session`'s weight-group store (remote_channel.session_store), in a directory of the server's
        user alone (mode 0700), made when the first weight group needs it: a server whose weights come in the
        messages leaves nothing in the temporary directory, even when it is killed."""
        with self._stores_lock:
            if self._stores is None:
                self._stores = tempfile.mkdtemp(prefix="gtpo-rollout-sessions-")
        return os.path.join(self._stores, f"session-{session}")

    def _rendezvous(self, identity: bytes, session: int, seq: int, payload) -> None:
        """A weight group's rendezvous (remote_channel.ChannelStore) on the session's store, answered at once."""
        try:
            if not (isinstance(payload, list) and len(payload) == 2 and isinstance(payload[0], str)
                    and isinstance(payload[1], list)):
                raise ValueError(f"a rendezvous request is [method, args], got {str(payload)[:60]}")
            store = session_store(self.store_path(session))
            self._send(identity, seq, "ok", rendezvous(store, payload[0], payload[1]), op="rendezvous")
        except Exception as e:  # noqa: BLE001
            self._send(identity, seq, "error", f"{type(e).__name__}: {e}", op="rendezvous")

    # --- the serving loop's side

    def wait_request(self, session: int, seq: int, timeout_s: float) -> bool:
        """Whether request `seq` of `session` arrived, waited for at most `timeout_s`."""
        with self._changed:
            return self._changed.wait_for(lambda: self._arrived(session, seq), timeout_s)

    def _arrived(self, session: int, seq: int) -> bool:
        return self.newest != session or seq in self._pending

    def peek(self, session: int, seq: int) -> str | None:
        """The op of request `seq` of `session` once it arrived (None before), left to be taken."""
        with self._changed:
            request = self._pending.get(seq) if self.newest == session else None
            return None if request is None else request.op

    def take(self, session: int, seq: int) -> Request | None:
        """Request `seq` of `session` (None unless it arrived and the session is the newest), no longer buffered."""
        with self._changed:
            if self.newest != session or seq not in self._pending:
                return None
            request = self._pending.pop(seq)
            self._buffered -= request.nbytes
            return request

    def reply(self, session: int, seq: int, status: str, payload) -> None:
        """Answer request `seq` of `session` (from any thread); TypeError for a payload a message cannot hold."""
        body = dumps({"seq": seq, "status": status, "payload": payload})
        self._push([self._control_of[session], body])

    def end(self, session: int, reason: str) -> None:
        with self._changed:
            self._ended.setdefault(session, reason)
        self._push([self._control_of[session], dumps({"seq": None, "status": "ended", "payload": reason})])

    def _send(self, identity: bytes, seq, status: str, payload, op: str | None = None) -> None:
        """Answer on this thread (the I/O thread's own sends)."""
        body = {"seq": seq, "status": status, "payload": payload}
        if op is not None:
            body["op"] = op
        self.control.send_multipart([identity, dumps(body)])

    def _push(self, frames: list) -> None:
        sender = getattr(self._senders, "socket", None)
        if sender is None:
            sender = self._senders.socket = self.context.socket(zmq.PUSH)
            sender.linger = 1000
            sender.connect(self._outbox_address)
        sender.send_multipart(frames)

    def close(self) -> None:
        self.stopped.set()
        self.zap.stopped.set()
        if self.is_alive():
            self.join(5)
        self.zap.join(5)
        if self._stores is not None:
            shutil.rmtree(self._stores, ignore_errors=True)
        self.context.destroy(linger=0)


def _request_body(frames: list) -> dict:
    """The body of a request's frames (its first): {"op": str, "seq": int, "payload", and "session" on the weight
    socket}; MalformedMessage for anything else."""
    if not frames:
        raise MalformedMessage("an empty message")
    body = loads(frames[0].bytes)
    if not (isinstance(body, dict) and {"op", "seq", "payload"} <= set(body) <= {"op", "seq", "payload", "session"}
            and isinstance(body["op"], str) and isinstance(body["seq"], int)):
        raise MalformedMessage(f"a request is {{'op': str, 'seq': int, 'payload': ...}}, got {str(body)[:80]}")
    return body
