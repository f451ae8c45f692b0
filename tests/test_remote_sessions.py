"""The rollout server's session logic (rollout/remote_server.py) in process: the real serving loop on a thread, over the
real channel (ZeroMQ on loopback, with a token; remote_listener.py), driven by real clients
(remote_client.RemoteClient), with a fake server object whose generation is a hand-computed record: each token says
which policy version sampled it, and the test decides at which decode step a request must have arrived. Covers the
orderings of generations, look-ahead and weight updates (rollout.schedule.update_during_generation), pre-emption by a
newer session, refused hellos, malformed requests, an NCCL-style weight group whose rendezvous crosses the channel (gloo
standing in for NCCL), abandoned weight groups reaped each on its own, and a client that outlives its server (killed and
relaunched at the same address, a process forked from a forkserver)."""
import dataclasses
import multiprocessing
import os
import signal
import tempfile
import threading
import time

import pytest
import torch
import zmq

from megatron_gtpo.data.synthetic import tiny_model_hf_config
from megatron_gtpo.models.qwen import ModelShape
from megatron_gtpo.rollout.engine import Rollout, SamplingParams
from megatron_gtpo.rollout.remote_channel import (
    PROTOCOL,
    ChannelStore,
    broadcast_from_trainer,
    close_weight_group,
    join_weight_group,
    monitor,
    weight_group,
)
from megatron_gtpo.rollout.remote_client import RemoteClient
from megatron_gtpo.rollout.remote_listener import Listener
from megatron_gtpo.rollout.remote_messages import dumps
from megatron_gtpo.rollout.remote_server import check_hello, default_bounds, serve_sessions
from megatron_gtpo.rollout.responses import Responses
from distributed_harness import free_port

SHAPE = ModelShape.from_hf(tiny_model_hf_config())
CPU = torch.device("cpu")
NORM = "model.norm.weight"  # a tensor of SHAPE's model: what the tests' weight updates send
GENERATION_S = 0.1 + 0.2  # not a round number: the seconds cross bit for bit


def weights(value: float) -> dict:
    """A weight bucket: the model's final norm, every element `value`."""
    return {NORM: torch.full((SHAPE.hidden_size,), float(value))}


class FakeServer:
    """A server object whose generation samples, at decode step s of every response, token id
    4 * (policy version) + s (inside the model's 16-token vocabulary); its weight updates keep the tensors that
    arrive and bump the version. `hold`: {decode step: predicate}: the generation waits (at most 10 s) before that
    step until the predicate holds, and says so (`holding`). Each generation says it took GENERATION_S seconds."""

    num_workers, device_type, dtype, return_routed_experts = 1, "cpu", torch.float32, False

    def __init__(self):
        self.policy_version = 0
        self.group, self.interrupt, self.received, self.events, self.hold = None, None, {}, [], {}
        self.holding = threading.Event()

    lie = None  # "vocab", "count", "length": the answer does not fit the request in that

    def submit(self, prompts, params, *, first_prompt=0, between_steps=None):
        steps = []
        if self.lie is not None:
            params = SamplingParams(n=params.n + (self.lie == "count"),
                                    max_new_tokens=params.max_new_tokens + (self.lie == "length"))
        for step in range(params.max_new_tokens):
            predicate = self.hold.pop(step, None)
            deadline = time.monotonic() + 10
            if predicate is not None:
                self.holding.set()
            while predicate is not None and not predicate() and time.monotonic() < deadline:
                between_steps()  # a held generation is pre-empted all the same
                time.sleep(0.01)
            between_steps()
            steps.append(self.sampler())
        rows = len(prompts) * params.n
        tokens_T = torch.tensor([4 * v + s + 16 * (self.lie == "vocab") for s, v in enumerate(steps)] * rows,
                                dtype=torch.int32)
        record = Responses(responses_per_prompt_P=torch.full((len(prompts),), params.n),
                           lengths_R=torch.full((rows,), len(steps)), finish_R=torch.ones(rows, dtype=torch.int64),
                           token_ids_T=tokens_T, logprobs_T=-tokens_T.float() / 1000,
                           weight_updates_T=torch.tensor([v - steps[0] for v in steps] * rows, dtype=torch.int32))
        routing = [_experts(prompt, len(steps)) for prompt in prompts for _ in range(params.n)] \
            if self.return_routed_experts else None
        return lambda: Rollout(record, routing, GENERATION_S)

    def sampler(self) -> int:
        """What the tokens say sampled them: the policy version."""
        return self.policy_version

    def join_weight_group(self, store_path, session, timeout_s=300.0):
        self.group, self.interrupt = join_weight_group(store_path, session, 1, 2, CPU, timeout_s)
        probe = torch.zeros(1, dtype=torch.int64)
        broadcast_from_trainer(self.group, probe, self.interrupt)
        return [int(probe.item())]

    def leave_weight_group(self, *, abandoned=False):
        close_weight_group(self.group, abandoned=abandoned)
        self.group = None

    def begin_weight_update(self):
        self.events.append("begin")

    def load_bucket(self, bucket):
        self.received.update((name, tensor.clone()) for name, tensor in bucket)

    def receive_bucket(self, names, dtype_names, shapes):
        for name, dtype_name, shape in zip(names, dtype_names, shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
            broadcast_from_trainer(self.group, tensor, self.interrupt)
            self.received[name] = tensor

    def finish_weight_update(self, expected_checksums):
        self.events.append(("finish", expected_checksums))
        self.policy_version += 1
        return self.policy_version

    def pause_generation(self):
        self.events.append("pause")

    def resume_generation(self):
        self.events.append("resume")

    def close(self):
        self.leave_weight_group()


def listen(server, port: int = 0, token: bytes = b"t", **bounds) -> Listener:
    """The channel of a server of SHAPE at 127.0.0.1:`port` (0: a free one)."""
    shape = dataclasses.asdict(SHAPE)
    return Listener("127.0.0.1", port, token, default_bounds(SHAPE, **bounds),
                    lambda hello: check_hello(hello, shape, server.device_type))


@pytest.fixture()
def token(monkeypatch):
    monkeypatch.setenv("GTPO_REMOTE_TOKEN", "t")
    monkeypatch.delenv("GTPO_REMOTE_TOKEN_FILE", raising=False)


def serve(server) -> tuple[Listener, threading.Thread]:
    """`server` served by the serving loop on a thread, behind a listener of its own."""
    listener = listen(server)
    thread = threading.Thread(target=serve_sessions, daemon=True, args=(server, SHAPE, listener))
    thread.start()
    return listener, thread


@pytest.fixture()
def served(token):
    """(the fake server, its address, its listener): the serving loop on a thread, with the token "t"."""
    server = FakeServer()
    listener, thread = serve(server)
    address = f"127.0.0.1:{listener.port}"
    yield server, address, listener
    shutdown = RemoteClient(address, SHAPE, CPU, connect_timeout_s=20)
    shutdown.close(shutdown_server=True)
    thread.join(20)
    assert not thread.is_alive()
    listener.close()


def _client(address, **kwargs):
    return RemoteClient(address, SHAPE, CPU, connect_timeout_s=20, request_timeout_s=20, **kwargs)


def _sync(client, bucket: dict):
    client.begin_weight_update()
    client.load_bucket(list(bucket.items()))
    return client.finish_weight_update({NORM: (0.1, 1 / 3)})


PARAMS = SamplingParams(n=2, max_new_tokens=4)


def _experts(prompt: list[int], length: int) -> torch.Tensor:
    """Hand-made routing of a response of `length` tokens to `prompt`: int16 [P + R - 1, 2 layers, k = 2]."""
    rows = len(prompt) + length - 1
    return (torch.arange(rows * 4).view(rows, 2, 2) + prompt[0]).to(torch.int16)


def _generate(client, prompts) -> Responses:
    return client.submit(prompts, PARAMS)().responses


def _steps(record: Responses) -> list[int]:
    """The version of each token of the first response (the fake's token ids encode it)."""
    return [t // 4 for t in record.token_ids_T[:record.lengths_R[0]].tolist()]


def _arrived(listener, client, ahead: int):
    """A predicate: the request `ahead` after the client's next one is at the server."""
    session, seq = client.session, client._seq + ahead
    return lambda: listener.peek(session, seq) is not None


def test_generations_and_weight_updates_cross_exactly_in_order(served):
    server, address, _ = served
    client = _client(address)
    record = _generate(client, [[1, 2], [3]])
    assert record.num_responses == 4 and _steps(record) == [0, 0, 0, 0]
    assert record.weight_updates_T.tolist() == [0] * 16
    bucket = {NORM: torch.randn(SHAPE.hidden_size), "model.layers.1.post_attention_layernorm.weight":
              torch.arange(SHAPE.hidden_size, dtype=torch.bfloat16)}
    pending = client.submit([[1]], PARAMS)  # answered in order: the update after it waits for it
    assert _sync(client, bucket) == 1 and client.policy_version == 1
    assert _steps(pending().responses) == [0, 0, 0, 0]
    assert all(torch.equal(server.received[n], t) for n, t in bucket.items())
    assert server.events == ["begin", ("finish", {NORM: (0.1, 1 / 3)})]
    assert _steps(_generate(client, [[1]])) == [1, 1, 1, 1]


def test_an_update_sent_during_a_generation_is_taken_between_its_decode_steps(served):
    server, address, listener = served
    client = _client(address, update_during_generation=True)
    # The generation waits before its step 2 until the update's begin is at the server (after the two generations).
    server.hold = {2: _arrived(listener, client, 2)}
    during = client.submit([[1]], PARAMS)
    queued = client.submit([[2]], PARAMS)  # asked for before the update, started after it
    assert server.holding.wait(10)  # the update is sent once the generation sampled 2 tokens
    assert _sync(client, weights(1)) == 1
    first, second = during().responses, queued().responses
    assert _steps(first) == [0, 0, 1, 1] and first.weight_updates_T[:4].tolist() == [0, 0, 1, 1]
    assert _steps(second) == [1, 1, 1, 1] and second.weight_updates_T[:4].tolist() == [1, 1, 1, 1]
    assert server.events[0] == "pause" and server.events[-1] == "resume"
    assert _steps(_generate(client, [[1]])) == [1, 1, 1, 1]  # and back in order


def test_without_update_during_generation_the_update_waits_for_the_generation(served):
    server, address, listener = served
    client = _client(address)
    server.hold = {2: _arrived(listener, client, 1)}
    during = client.submit([[1]], PARAMS)
    assert server.holding.wait(10)
    assert not client.idle()  # generating (rollout.schedule.ahead_schedule when_idle asks no round of it)
    # The begin sent while the generation runs (the client's begin_weight_update would take its answer first).
    client._call("begin", None, 20)
    client.load_bucket(list(weights(1).items()))
    assert client.finish_weight_update({NORM: (0.1, 1 / 3)}) == 1
    assert client.idle()  # the generation's answer is in, not yet taken
    assert _steps(during().responses) == [0, 0, 0, 0] and "pause" not in server.events


def test_a_newer_session_preempts_the_older_which_is_told_in_one_line(served):
    server, address, _ = served
    old = _client(address)
    newer = []
    server.hold = {1: lambda: bool(newer)}
    pending = old.submit([[1]], PARAMS)
    threading.Thread(target=lambda: newer.append(_client(address))).start()
    with pytest.raises(RuntimeError, match=r"rollout server at 127.0.0.1:\d+ failed in 'generate': Preempted: a "
                                           r"newer trainer \(session 2\) took this rollout server"):
        pending()
    deadline = time.monotonic() + 10
    while not newer and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match=r"^rollout server at 127.0.0.1:\d+: a newer trainer \(session 2\) took "
                                           r"this rollout server; this trainer's session 1 ended$"):
        _generate(old, [[1]])
    assert _steps(_generate(newer[0], [[1]])) == [0, 0, 0, 0]


def test_routing_crosses_to_the_trainers_that_ask_for_it_at_their_hello(served):
    server, address, _ = served
    with pytest.raises(ConnectionError, match="does not return routed experts"):
        _client(address, routed=True)
    server.return_routed_experts = True
    rollout = _client(address, routed=True).submit([[1, 2], [3]], PARAMS)()
    assert rollout.responses.num_responses == 4 and len(rollout.routed_experts) == 4
    assert rollout.generation_s == GENERATION_S  # the server's generation seconds come with every rollout
    for got, prompt in zip(rollout.routed_experts, [[1, 2], [1, 2], [3], [3]]):
        assert got.dtype == torch.int16 and torch.equal(got, _experts(prompt, 4))
    plain = _client(address)
    assert plain.submit([[1]], PARAMS)().routed_experts is None  # not asked for: not sent
    with pytest.raises(ValueError, match="no between_steps from the trainer"):  # the server's session runs its own
        plain.submit([[1]], PARAMS, between_steps=lambda: 0)


@pytest.mark.parametrize("lie, why", [
    ("vocab", r"token ids in \[16, 19\], outside the vocabulary \[0, 16\)"),
    ("count", r"1 prompts with \[3\] responses each, for 1 prompts x n=2"),
    ("length", r"a response of 5 tokens, over max_new_tokens=4"),
])
def test_a_reply_that_does_not_fit_its_request_is_an_error_naming_the_server(served, lie, why):
    """Token ids outside the vocabulary, other counts of responses, responses over max_new_tokens: an error naming
    the server, never a rollout; the session then goes on."""
    server, address, _ = served
    client = _client(address)
    server.lie = lie
    with pytest.raises(RuntimeError, match=rf"^the rollout server at {address} answered 'generate' outside the "
                                           rf"protocol or the request: {why}$"):
        _generate(client, [[1]])
    server.lie = None
    assert _steps(_generate(client, [[1]])) == [0, 0, 0, 0]


def test_an_older_clients_hello_is_refused_for_its_protocol():
    """A protocol 8 hello (no `weights` yet) is told to update both, not that its fields are wrong."""
    older = dict(protocol=8, shape=dataclasses.asdict(SHAPE), device_type="cpu", update_during_generation=False,
                 routed=False)
    with pytest.raises(ValueError, match=rf"^protocol 8 is not this server's {PROTOCOL}: update both$"):
        check_hello(older, dataclasses.asdict(SHAPE), "cpu")


@pytest.mark.slow  # waits 1.5 s on purpose: a refused socket's reconnections would show in that time
@pytest.mark.parametrize("refused, error, message", [
    (dict(token="wrong"), ConnectionError, r"refused this trainer at the handshake .*token is not this trainer's"),
    (dict(protocol=5), RuntimeError, f"refused: protocol 5 is not this server's {PROTOCOL}: update both"),
    (dict(shape=ModelShape.from_hf(tiny_model_hf_config(vocab_size=40))), RuntimeError,
     r"differs from the server's in .*vocab_size"),
])
def test_a_refused_hello_leaves_the_active_session_alone(served, monkeypatch, refused, error, message):
    """... and the refused trainer leaves no socket behind that reconnects (and is refused) again and again: one
    did, ~7 times a second, until its unread events stopped every socket of the process's context."""
    server, address, listener = served
    active = _client(address)
    _generate(active, [[1]])
    with monkeypatch.context() as patched, pytest.raises(error, match=message) as refusal:
        patched.setenv("GTPO_REMOTE_TOKEN", refused.get("token", "t"))
        patched.setattr("megatron_gtpo.rollout.remote_client.PROTOCOL", refused.get("protocol", PROTOCOL))
        RemoteClient(address, refused.get("shape", SHAPE), CPU, connect_timeout_s=20, request_timeout_s=20)
    time.sleep(0.5)  # the server's own account of the refusal (its monitor's event) may come after the client's
    refusals = dict(listener.tally.counts)
    time.sleep(1)  # the refused client is kept alive by its traceback (`refusal`), as a caller's handler may keep it
    assert listener.tally.counts == refusals, refusal
    assert _sync(active, weights(1)) == 1  # still this session's server
    assert _steps(_generate(active, [[1]])) == [1, 1, 1, 1]


@pytest.mark.slow  # waits 3 s on purpose: the unread events pile up in that time
def test_events_nobody_reads_never_stop_the_other_sockets_of_their_context():
    """libzmq's I/O thread sends a monitor's events with a blocking send: on pyzmq's bounded monitor pipe, ~2000
    unread events (a socket retrying a port nobody listens on, every millisecond) stop every socket of the context."""
    context = zmq.Context()
    try:
        retrying = context.socket(zmq.DEALER)
        retrying.linger, retrying.reconnect_ivl = 0, 1
        events = monitor(retrying, zmq.EVENT_ALL)
        retrying.connect(f"tcp://127.0.0.1:{free_port()}")
        time.sleep(3)  # ~3 events a retry, none read: past the 2000 a bounded pipe holds
        pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
        push.send(b"through")
        assert pull.poll(5000) and pull.recv() == b"through"
        events.close()  # held open until here: a reader closed earlier would let the events go
    finally:
        context.destroy(linger=0)


def test_malformed_requests_are_answered_with_an_error_and_the_server_serves_on(served):
    server, address, listener = served
    client = _client(address)

    def raw(frames, seq=None):  # sent on the client's own authenticated connection
        client._control.send_multipart(frames)
        return seq

    def raw_request(frames):
        seq, client._seq = client._seq, client._seq + 1
        return raw(frames, seq)

    def request(op, payload):
        seq, client._seq = client._seq, client._seq + 1
        return raw([dumps({"op": op, "seq": seq, "payload": payload})], seq)

    cases = [  # (how the request is sent: its seq, or None for a message without one; what the error says)
        (lambda: raw([b"\0" * 40]), "not a message of the declared format"),
        (lambda: raw([dumps(("generate", None))]), "a request is"),
        (lambda: raw_request([dumps({"op": "generate", "seq": client._seq, "payload": None}), b"x"]),
         "tensors travel on the weight socket"),  # in order: the serving loop passes over it
        (lambda: request("exec", "import os"), "unknown request 'exec'"),
        (lambda: request("generate", ([[1]], PARAMS)), r"'generate' takes \(prompts"),
        (lambda: request("generate", ([["1"]], PARAMS, 0)), r"'generate' takes"),
        (lambda: request("generate", ([[10**9]], PARAMS, 0)), "outside the vocabulary"),
        (lambda: request("bucket", (["a"], ["Tensor"], [[1]])), "'bucket' takes"),
        (lambda: request("bucket", (["a"], ["float32"], [[1]])), "'a' of shape \\[1\\] is no tensor of this server"),
        (lambda: request("finish", {"a": (1, 2)}), "'finish' takes"),
        (lambda: request("hello", {}), "only a session's first request"),
        (lambda: request("join", 5.0), "travel in its messages .*no join"),
    ]
    refused_before = listener.tally.counts.get("message", 0)
    for send, reply in cases:
        seq = send()
        if seq is None:  # answered under seq None: the client takes it as it comes
            deadline = time.monotonic() + 10
            while not client._control.poll(100) and time.monotonic() < deadline:
                pass
            from megatron_gtpo.rollout.remote_messages import loads
            body = loads(client._control.recv())
            assert body["seq"] is None and body["status"] == "error" and reply in body["payload"], (reply, body)
        else:
            with pytest.raises(RuntimeError, match=reply):
                client._reply(seq, "raw", 10)
        assert _steps(_generate(client, [[1]])) == [0, 0, 0, 0]
    assert listener.tally.counts.get("message", 0) - refused_before == 3  # those that the I/O thread refused


def test_a_server_whose_weights_come_in_its_messages_leaves_nothing_in_the_temporary_directory(token, tmp_path,
                                                                                                 monkeypatch):
    """Nothing to clean up after a server killed mid-run: only an NCCL weight group's rendezvous needs a file."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    listener, thread = serve(FakeServer())
    client = _client(f"127.0.0.1:{listener.port}")
    assert _sync(client, weights(1)) == 1
    assert _steps(_generate(client, [[1]])) == [1, 1, 1, 1]
    assert os.listdir(tmp_path) == []
    client.close(shutdown_server=True)
    thread.join(20)
    listener.close()


def test_a_weight_groups_rendezvous_crosses_the_channel(served, tmp_path, monkeypatch):
    """rollout.remote.weights: nccl, with gloo standing in for NCCL (the same store calls, more of them): the
    trainer's side of the group meets the server's worker through the session's store on the server (in a directory
    of the server's user alone), reached only through the channel (ChannelStore), and a broadcast reaches the
    worker."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    server, address, listener = served
    client = _client(address)
    server.device_type = "cuda"  # what check_hello asks of an NCCL session; the fake's group is gloo all the same
    client._hello["weights"] = "nccl"
    client._open_channel(20)
    info = client._call("hello", client._hello, 20)
    client.session = info["session"]
    seq = client._request("join", 20.0)
    store = ChannelStore(lambda method, args: client._call("rendezvous", [method, args], 20), 20)
    group = weight_group(store, 0, 2, CPU, 20)
    broadcast_from_trainer(group, torch.tensor([client.session], dtype=torch.int64))
    assert client._reply(seq, "join", 20) is None  # the worker received the probe: the session's number
    client.weights = "nccl"
    client.group = group
    client.begin_weight_update()
    client.load_bucket(list(weights(3).items()))
    assert client.finish_weight_update({NORM: (0.1, 1 / 3)}) == 1
    assert torch.equal(server.received[NORM], weights(3)[NORM])
    server.device_type = "cpu"
    (stores,) = os.listdir(tmp_path)
    assert stores.startswith("gtpo-rollout-sessions-") and os.stat(tmp_path / stores).st_mode & 0o777 == 0o700


def test_each_abandoned_weight_group_is_released_on_its_own():
    released, stuck = threading.Event(), threading.Event()

    class Group:
        def __init__(self, on_release):
            self.on_release = on_release

        def abort(self):
            pass

        def __del__(self):
            self.on_release()

    close_weight_group(Group(lambda: stuck.wait(30)), abandoned=True)  # its destructor waits for a broadcast
    close_weight_group(Group(released.set), abandoned=True)
    try:
        assert released.wait(5), "the second abandoned group waited for the first"
    finally:
        stuck.set()


def test_a_port_that_is_no_rollout_server_is_named_in_one_line(token):
    """A listener that takes the connection and hangs up (as any other service would): refused at the handshake."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    hang_up = threading.Thread(target=lambda: sock.accept()[0].close(), daemon=True)
    hang_up.start()
    try:
        with pytest.raises(ConnectionError, match=r"^the rollout server at 127.0.0.1:\d+ refused this trainer at "
                                                  r"the handshake"):
            RemoteClient(f"127.0.0.1:{sock.getsockname()[1]}", SHAPE, CPU, connect_timeout_s=5)
    finally:
        sock.close()


def test_a_reply_the_server_sent_before_it_went_away_is_taken(token):
    """A shutdown's reply and the end of the connection have both arrived when the client looks for the reply (a
    client slowed down on a busy machine): the server did what it was asked, and the client takes its answer rather
    than reporting the server lost."""
    listener, thread = serve(FakeServer())
    client = _client(f"127.0.0.1:{listener.port}")
    send = client._request

    def send_then_let_the_server_go(op, payload, tensors=()):
        seq = send(op, payload, tensors)
        thread.join(20)
        listener.close()  # its last reply leaves, then the connection closes
        assert client._monitor.poll(20_000)  # the connection's end is reported before the client reads the reply
        return seq

    client._request = send_then_let_the_server_go
    client.close(shutdown_server=True)
    assert not thread.is_alive()


class DyingServer(FakeServer):
    """A FakeServer whose tokens say which weights sampled them (the synced norm's value, not the version: a
    relaunched server counts its versions from 0) and which SIGKILLs its own process at `dies_at`: "generate", at
    decode step 2 of its first generation; "bucket", inside its second weight bucket (after the weights the client
    sends a new server first)."""

    def __init__(self, dies_at: str | None):
        super().__init__()
        self.buckets = 0
        if dies_at == "generate":
            self.hold = {2: lambda: os.kill(os.getpid(), signal.SIGKILL)}
        self.dies_in_bucket = 2 if dies_at == "bucket" else None

    def sampler(self) -> int:
        return int(self.received[NORM][0]) if NORM in self.received else 0

    def load_bucket(self, bucket):
        self.buckets += 1
        if self.buckets == self.dies_in_bucket:
            os.kill(os.getpid(), signal.SIGKILL)
        super().load_bucket(bucket)


def _serve_until_killed(port: int, dies_at: str | None, listening) -> None:
    """Serve a DyingServer, `listening` set once it listens; `dies_at` "update": inside a weight update taken during
    its first generation (held at its decode step 2 until the update's begin, request 6 of session 1, arrived)."""
    server = DyingServer("bucket" if dies_at == "update" else dies_at)
    listener = listen(server, port)
    listening.set()
    if dies_at == "update":
        server.hold = {2: lambda: listener.peek(1, 6) is not None}
    serve_sessions(server, SHAPE, listener)


class Relaunching(threading.Thread):
    """Serves at one port in a forked process, one process after another (`deaths`: each one's `dies_at`; "idle":
    the test kills it), a new one as soon as the last died, until the deaths run out."""

    def __init__(self, port: int, deaths: list):
        super().__init__(daemon=True)
        self.fork = multiprocessing.get_context("forkserver")  # forked from a process without the test's threads
        self.port, self.deaths, self.process, self.listening = port, deaths, None, self.fork.Event()

    def start(self):
        """Start serving; return once the first server listens. A forkserver started afresh imports torch and
        megatron.core first, which on a loaded machine may take longer than a client's 20 s connect timeout."""
        super().start()
        assert self.listening.wait(120), "the first server did not listen within 120 s"

    def run(self):
        while self.deaths:
            self.process = self.fork.Process(target=_serve_until_killed,
                                             args=(self.port, self.deaths.pop(0), self.listening), daemon=True)
            self.process.start()
            self.process.join()

    def kill(self):
        process = self.process
        os.kill(process.pid, signal.SIGKILL)
        process.join()

    def stop(self):
        """No more relaunches; the one serving now killed."""
        self.deaths.clear()
        if self.process.is_alive():
            self.kill()


def test_a_client_outlives_its_server_killed_in_a_generation_a_weight_sync_and_between_them(token, capfd):
    """Killed and relaunched at the same address, the server is sent the weights of the last sync and asked again
    for the generation in flight: every answer is what the first server would have given; each death is one line
    when lost and one when back (the third death learnt from a request that reached the next server first); past
    the bound, the error the client would have raised at once."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    servers = Relaunching(port, ["generate", "bucket", "idle", "idle"])
    servers.start()
    try:
        client = _client(address, reconnect_timeout_s=30)
        assert _sync(client, weights(1)) == 1
        in_flight = client.submit([[1]], PARAMS)  # the first server dies at its decode step 2
        assert _steps(in_flight().responses) == [1, 1, 1, 1]
        assert _sync(client, weights(2)) == 2  # the second dies inside it
        assert _steps(_generate(client, [[1]])) == [2, 2, 2, 2]
        servers.kill()  # the third dies between requests
        send = client._request

        def reaching_the_next_server_first(op, payload, tensors=()):
            """ZeroMQ reconnects the socket to the relaunched server by itself: the request reaches it, and its
            answer is in, before the client has looked at the connection's end."""
            client._request = send
            seq = send(op, payload, tensors)
            assert client._control.poll(20_000)
            return seq

        client._request = reaching_the_next_server_first
        assert _steps(_generate(client, [[1]])) == [2, 2, 2, 2] and client.policy_version == 2
        client.reconnect_timeout_s = 1
        servers.kill()  # the last: none comes back
        with pytest.raises(RuntimeError, match=rf"^rollout server at {address}, .*did the server die\?.*; no server "
                                               rf"came back at the same address within 1 s "
                                               rf"\(rollout.remote.reconnect_timeout_s\)$"):
            _generate(client, [[1]])
    finally:
        servers.stop()
    lines = capfd.readouterr().err.splitlines()
    lost = [line for line in lines if "for a rollout server at the same address" in line]
    assert len(lost) == 4 and all(line.startswith(f"rollout server at {address}, ") for line in lost), lines
    assert sum("a server is back after" in line for line in lines) == 3, lines
    assert len([line for line in lines if line.startswith("rollout server at")]) == 7, lines  # nothing in between


def test_a_generation_asked_before_an_update_is_asked_again_after_it_with_its_tokens_counting_it(token):
    """update_during_generation: the server dies inside an update it took during a generation; the new server
    takes the whole update, then the generation again, whose every token now counts that update."""
    port = free_port()
    servers = Relaunching(port, ["update", "idle"])
    servers.start()
    try:
        client = _client(f"127.0.0.1:{port}", reconnect_timeout_s=30, update_during_generation=True)
        assert _sync(client, weights(1)) == 1
        in_flight = client.submit([[1]], PARAMS)
        assert _sync(client, weights(2)) == 2
        rollout = in_flight()
        record = rollout.responses
        assert _steps(record) == [2, 2, 2, 2] and record.weight_updates_T.tolist() == [1] * 8
        assert rollout.generation_s == GENERATION_S  # the new server's, kept when its tokens are re-counted
    finally:
        servers.stop()
