"""A rollout server on a node (or process) of its own, serving one trainer session at a time
(docs/remote_rollout.md):

    python -m megatron_gtpo.rollout.remote_server --hf-dir DIR --listen HOST:PORT [--engine vllm|builtin] \
        [--tensor-parallel-size K] [--gpu-memory-utilization F] [--dtype D] [--max-model-len N] [--enforce-eager] \
        [--return-routed-experts]

`--engine vllm` (default; `rollout.engine: vllm_remote`) serves a vLLM engine (vllm_engine.VLLMServer);
`--engine builtin` (`rollout.engine: builtin_remote`) the built-in Megatron engine (builtin_server.BuiltinServer),
which needs no vLLM; both are `ServedServer`s. `--return-routed-experts` (vLLM on GPUs): the server also answers
each response's experts to a trainer that asks for them at its hello (routing replay, algorithm.routing_replay:
rollout). The server hosts the rendezvous TCPStore at
HOST:PORT, answers the requests of the newest admitted trainer session (a newer session whose hello checks out
replaces an older one and pre-empts its generation or weight update; `_Admission`), and runs until a trainer asks it
to shut down. The trainer's side is remote_client.py. The messages are signed with the token in GTPO_REMOTE_TOKEN or
in the file GTPO_REMOTE_TOKEN_FILE names, the trainer's the same (remote_channel.py); nothing from the network is
unpickled (remote_messages.py), and a request that is not one of the protocol is answered with an error.

Requests are answered in order. Before every decode step of a generation the session (`_Session.between_steps`, the
callback its generation passes to the server) checks for a newer session, and, for a session whose trainer sends
weight updates during generation (hello's `update_during_generation`, rollout.update_during_generation), looks ahead
among the requests already sent, past further generations, for a weight update, and takes it there
(`server.pause_generation`, its begin / bucket / finish, `server.resume_generation`). The generation goes on under
the new weights; its later tokens count the update (`Responses.weight_updates_T`), and a generation asked for before
the update but started after it counts it on all its tokens. Each generation is answered with the policy version
it was asked for with (what the trainer's client checks) and the seconds the server spent generating it.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import queue
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from megatron_gtpo.distributed import free_local_port, set_nccl_environment

from typing import Protocol

from .engine import check_prompts
from .remote_channel import (
    PROTOCOL,
    ROOT,
    TOKEN_SETTINGS,
    Channel,
    NewerSession,
    Unsigned,
    admit,
    ended_key,
    parse_address,
    publish_nonce,
    read_token,
    session_key,
)
from .remote_messages import check_request
from .server_engine import RolloutServer

_POLL_S = 0.05  # how often an idle server, or one waiting inside a weight update, looks for a newer session
_HELLO_WAIT_S = 60.0  # how long a session number taken without a hello is watched for one
_MAX_WATCHED = 64  # session numbers watched for a hello at most (the newest)
_UPDATE_OPS = ("begin", "bucket", "finish")
_SHAPE_FIELDS_IGNORED = ("init_std",)  # not used by inference
log = logging.getLogger(__name__)


class ServedServer(RolloutServer, Protocol):
    """A rollout server the serving loop drives (vllm_engine.VLLMServer, builtin_server.BuiltinServer): the rollout
    server protocol, with the weight group of a trainer session through which the weights come (remote_channel.py),
    and a pause for the weight updates taken during a generation."""

    num_workers: int  # the server's processes in the weight group (each receives every bucket)
    device_type: str  # where they hold the weights: "cpu" (gloo) or "cuda" (NCCL)
    return_routed_experts: bool  # its rollouts carry routing (RolloutServer.submit)

    def join_weight_group(self, host: str, port: int, session: int, timeout_s: float = 300.0) -> list[int]:
        """Join session `session`'s weight group at the store HOST:PORT; the probe value each worker received."""
        ...

    def receive_bucket(self, names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> None:
        """Load the bucket of these tensors, broadcast by the trainer in the weight group."""
        ...

    def leave_weight_group(self, *, abandoned: bool = False) -> None:
        """Shut the group down (`abandoned`: a broadcast may be pending; remote_channel.close_weight_group)."""
        ...

    def pause_generation(self) -> None:
        """Between decode steps: hold the generation in flight while a weight update is taken."""
        ...

    def resume_generation(self) -> None:
        ...

    def close(self) -> None:
        ...


class _Session:
    """Server side of one trainer session: the request handlers, and the weight updates taken during a generation
    (module doc). `seq` is the next request to read in order; `answered` the later ones already answered. Session 0
    is no trainer's (the server before its first one)."""

    def __init__(self, server: ServedServer, shape: dict, channel: Channel, store_host: str, store_port: int,
                 session: int, request_timeout_s: float = 600.0):
        self.server, self.shape, self.channel = server, shape, channel
        self.newer = NewerSession(channel.store, session)  # raises once a newer session was admitted
        self.store_host, self.store_port, self.session = store_host, store_port, session
        self.request_timeout_s = request_timeout_s
        self.seq = 0
        self.active = session > 0
        self.answered: set[int] = set()
        self.finished_ahead: list[int] = []  # the seqs of the weight updates' finishes taken ahead of order
        self.update_during_generation = False
        self.routed = False  # the trainer takes each response's routing (routing replay)
        self.generating: int | None = None  # the seq of the generation in progress

    def next_request(self) -> str:
        """The key of the next request to read in order (past those answered ahead)."""
        while self.seq in self.answered:
            self.answered.remove(self.seq)
            self.seq += 1
        return session_key(self.session, self.seq)

    def start(self, hello: dict) -> None:
        """Answer the session's hello (request 0, checked at admission: `check_hello`)."""
        self.update_during_generation, self.routed = hello["update_during_generation"], hello["routed"]
        self.channel.post(f"{session_key(self.session, 0)}/rep", ("ok", dict(
            version=self.server.policy_version, dtype=str(self.server.dtype).removeprefix("torch."),
            num_workers=self.server.num_workers, routed_experts=self.server.return_routed_experts)))
        self.seq = 1

    def answer(self, key: str) -> str | None:
        """Take the complete request under `key`, handle it and post the reply (an error for anything that is not a
        request, or that fails); the request's op (None when it was none)."""
        op = None
        try:
            op, payload = self.channel.take_request(key)
            outcome = "ok", self.handle(op, payload)
        except Exception as e:  # noqa: BLE001 - whatever a request does, the trainer is told and the server serves on
            outcome = "error", f"{type(e).__name__}: {e}"
            log.warning("session %d, %r failed: %s", self.session, op, outcome[1])
        try:
            self.channel.post(f"{key}/rep", outcome)
        except TypeError as e:  # a handler answered what a message cannot hold: a bug, reported, not fatal
            self.channel.post(f"{key}/rep", ("error", f"the server's answer to {op!r} cannot be sent: {e}"))
        return op

    def handle(self, op: str, payload):
        server = self.server
        check_request(op, payload)
        if op == "hello":
            raise ValueError("hello is only a session's first request")
        if op == "join":
            probes = server.join_weight_group(self.store_host, self.store_port, self.session, timeout_s=payload)
            if any(p != self.session for p in probes):
                raise RuntimeError(f"the weight group probe reached the workers as {probes}, sent {self.session}")
            return None
        if op == "generate":
            check_prompts(payload[0], vocab_size=self.shape["vocab_size"],
                          max_positions=self.shape["max_position_embeddings"],
                          max_new_tokens=payload[1].max_new_tokens)
            return self.generate(*payload)
        if op == "begin":
            return server.begin_weight_update()
        if op == "bucket":
            return server.receive_bucket(*payload)
        if op == "finish":
            return server.finish_weight_update(payload)
        if op in ("close", "shutdown"):
            server.leave_weight_group()
            self.active = False
            return None
        raise AssertionError(op)  # check_request knows every op

    def generate(self, prompts: list[list[int]], params, first_prompt: int) -> tuple:
        """(the record, its routing where the trainer asked for it at hello (else None), the policy version the
        request was made with: the current one, less the updates taken ahead of it (whose tokens count them all),
        the seconds the server spent generating it (`Rollout.generation_s`; the updates it took meanwhile
        included)): remote_messages.check_generate_reply."""
        self.finished_ahead = [f for f in self.finished_ahead if f > self.seq]
        ahead = len(self.finished_ahead)
        made_with = self.server.policy_version - ahead
        self.generating = self.seq
        try:
            rollout = self.server.submit(prompts, params, first_prompt=first_prompt,
                                         between_steps=self.between_steps)()
        finally:
            self.generating = None
        record = rollout.responses
        if ahead:  # started under weights newer than asked for: every token counts those updates
            record = dataclasses.replace(record, weight_updates_T=record.weight_updates_T + ahead)
        return record, rollout.routed_experts if self.routed else None, made_with, rollout.generation_s

    def between_steps(self) -> int:
        """Before each decode step of the session's generation: pre-emption by a newer session, and
        (update_during_generation) the next weight update sent so far, taken now; the number of updates taken."""
        self.newer()
        if not self.update_during_generation or self.generating is None:
            return 0
        seq = self.generating + 1
        while True:  # past the generations asked for after this one, to the first update
            op = None if seq in self.answered else self.channel.peek_request(session_key(self.session, seq))
            if op in _UPDATE_OPS:
                return self._take_update(seq)
            if op != "generate" and seq not in self.answered:
                return 0
            seq += 1

    def _take_update(self, seq: int) -> int:
        """Answer the weight update whose first request is `seq` (the generation waits); 1."""
        self.server.pause_generation()
        try:
            while True:
                key = session_key(self.session, seq)
                self._wait_for_request(key)
                op = self.answer(key)
                self.answered.add(seq)
                if op not in _UPDATE_OPS:
                    raise RuntimeError(f"the trainer left a weight update unfinished (sent {op!r} before its finish)")
                if op == "finish":
                    self.finished_ahead.append(seq)
                    return 1
                seq += 1
        finally:
            self.server.resume_generation()

    def _wait_for_request(self, key: str) -> None:
        deadline = time.monotonic() + self.request_timeout_s
        while not self.channel.arrived(f"{key}/req", _POLL_S):
            self.newer()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request of the weight update in {self.request_timeout_s:g} s")


def check_hello(payload, shape: dict, device_type: str) -> None:
    """ValueError, in one line, unless a trainer's hello fits this server (protocol, model, weight device)."""
    if isinstance(payload, dict) and payload.get("protocol") != PROTOCOL:  # first: an older hello has other fields
        raise ValueError(f"protocol {payload.get('protocol')!r} is not this server's {PROTOCOL}: update both")
    if not isinstance(payload, dict) or not isinstance(payload.get("shape"), dict) \
            or not isinstance(payload.get("update_during_generation"), bool) \
            or not isinstance(payload.get("routed"), bool):
        raise ValueError(f"a hello must be a dict with protocol, shape, device_type, update_during_generation and "
                         f"routed; got {str(payload)[:80]}")
    diff = {k: (payload["shape"].get(k), v) for k, v in shape.items()
            if k not in _SHAPE_FIELDS_IGNORED and payload["shape"].get(k) != v}
    if diff:
        raise ValueError(f"the trainer's model differs from the server's in {{field: (trainer, server)}} {diff}")
    if payload.get("device_type") != device_type:
        raise ValueError(f"the trainer sends weights from {payload.get('device_type')!r} tensors, the server's "
                         f"workers are on {device_type}: both must be cpu (gloo) or cuda (NCCL)")


class _Admission(threading.Thread):
    """Watches for trainer sessions (a session number taken from the store's counter, then a hello) on a connection
    of its own to the store, and admits a session whose hello checks out (signed with the server's token:
    `Channel`, `check_hello`) and is newer than the last admitted: `admit` stops the older session's work, and the
    serving loop takes the session from `admitted`. A refused hello is answered here and touches no session."""

    def __init__(self, channel: Channel, shape: dict, device_type: str):
        super().__init__(name="session admission", daemon=True)
        self.channel, self.shape, self.device_type = channel, shape, device_type
        self.admitted: queue.SimpleQueue = queue.SimpleQueue()  # (session, hello), in admission order
        self.newest = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        seen, watched = 0, {}  # the newest number seen; {number: until when its hello is waited for}
        while not self.stopped.wait(_POLL_S):
            numbers = self.channel.store.add(f"{ROOT}/sessions", 0)
            now = time.monotonic()
            for number in range(max(seen, numbers - _MAX_WATCHED) + 1, numbers + 1):
                watched[number] = now + _HELLO_WAIT_S
            seen = max(seen, numbers)
            for number, until in sorted(watched.items()):
                key = session_key(number, 0)
                if self.channel.store.check([f"{key}/req"]):
                    del watched[number]
                    self.consider(number, key)
                elif now > until:
                    del watched[number]

    def consider(self, number: int, key: str) -> None:
        """Admit session `number` or answer its hello (under `key`) with why not."""
        try:
            op, hello = self.channel.take_request(key)
            if op != "hello":
                raise ValueError(f"a session starts with hello, not {op[:40]!r}")
            check_hello(hello, self.shape, self.device_type)
            if number <= self.newest:
                raise ValueError(f"a newer trainer (session {self.newest}) took this server")
        except Exception as e:  # noqa: BLE001 - refused: the trainer is told, the active session untouched
            reason = f"this trainer's token is not the server's: set {TOKEN_SETTINGS} to the server's" \
                if isinstance(e, Unsigned) else str(e)
            log.warning("refused trainer session %d: %s", number, reason)
            self.channel.post(f"{key}/rep", ("error", f"refused: {reason}"))
            return
        self.newest = number
        admit(self.channel.store, number)
        self.admitted.put((number, hello))


ENGINES = ("vllm", "builtin")


def start_server(engine: str, model_dir: str, **server_kwargs):
    """The server object of `engine` on `model_dir`, and the model's shape (models.qwen.ModelShape)."""
    from megatron_gtpo.checkpoint.sources import ModelSource
    from megatron_gtpo.models.qwen import ModelShape

    shape = ModelShape.from_hf(ModelSource.detect(model_dir).hf_config())
    if engine == "vllm":
        from .vllm_engine import VLLMServer

        return VLLMServer(model_dir, sleeps=False, **server_kwargs), shape  # nothing to share memory with
    if engine == "builtin":
        from .builtin_server import BuiltinServer

        return BuiltinServer(model_dir, **server_kwargs), shape
    raise ValueError(f"unknown rollout server engine {engine!r}; expected one of {ENGINES}")


def serve(listen: str, engine: str, model_dir: str, **server_kwargs) -> None:
    """Run a rollout server until a trainer asks it to shut down (docs/remote_rollout.md: protocol)."""
    host, port = parse_address(listen)
    token = read_token()  # a bad setting fails before the engine starts
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    channel = Channel(store, token, publish_nonce(store))
    if not token:
        log.warning("no token (%s): anyone who reaches %s can use this server", TOKEN_SETTINGS, listen)
    log.info("listening on %s; starting the %s engine from %s", listen, engine, model_dir)
    server, shape = start_server(engine, model_dir, **server_kwargs)
    log.info("%s ready (%d worker(s) on %s)", engine, server.num_workers, server.device_type)
    try:
        serve_sessions(server, dataclasses.asdict(shape), channel, host, port)
    finally:
        server.close()


def serve_sessions(server, shape: dict, channel: Channel, host: str, port: int) -> None:
    """The serving loop: answer the requests of the newest admitted trainer session (module doc) until one asks the
    server to shut down. `channel`: over the master store at HOST:PORT."""
    store = channel.store
    admission = _Admission(Channel(dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60)),
                                   channel.token, channel.nonce), shape, server.device_type)
    admission.start()
    session = _Session(server, shape, channel, host, port, 0)
    try:
        while True:
            session = _next_session(session, admission.admitted)
            if not session.active:
                time.sleep(_POLL_S)
                continue
            key = session.next_request()
            if not channel.arrived(f"{key}/req", _POLL_S):
                continue
            op = session.answer(key)
            session.seq += 1
            if op == "shutdown":
                log.info("shutdown requested by session %d", session.session)
                deadline = time.monotonic() + 10.0  # the store dies with this process: let the trainer read first
                while store.check([f"{key}/rep"]) and time.monotonic() < deadline:
                    time.sleep(_POLL_S)
                return
    finally:
        admission.stopped.set()


def _next_session(session: _Session, admitted: queue.SimpleQueue) -> _Session:
    """The newest session admitted since `session`, or `session`. The sessions it replaces end (`session`, and any
    admitted in between): their trainers are told, and `session`'s weight group is abandoned."""
    newer = []
    while not admitted.empty():
        newer.append(admitted.get())
    if not newer:
        return session
    (number, hello), server = newer[-1], session.server
    reason = f"a newer trainer (session {number}) took this rollout server"
    for ended in [n for n, _ in newer[:-1]] + ([session.session] if session.active else []):
        session.channel.post(ended_key(ended), reason)
    if session.active:
        server.leave_weight_group(abandoned=True)  # a broadcast of it may still be pending
    log.info("serving trainer session %d", number)
    successor = _Session(server, session.shape, session.channel, session.store_host, session.store_port, number)
    successor.start(hello)
    return successor


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True,
                        help="Hugging Face directory the engine starts from (builtin: or a megatron_gtpo checkpoint)")
    parser.add_argument("--listen", required=True, help="HOST:PORT of the rendezvous store the trainer connects to")
    parser.add_argument("--engine", choices=ENGINES, default="vllm")
    parser.add_argument("--dtype", default=None, help="parameters' dtype (default: vllm auto, builtin float32)")
    parser.add_argument("--seed", type=int, default=0)
    vllm = parser.add_argument_group("vllm")
    vllm.add_argument("--tensor-parallel-size", type=int, default=1)
    vllm.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    vllm.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                      help="KV-cache size in bytes (instead of a memory fraction; use it on CPU)")
    vllm.add_argument("--max-model-len", type=int, default=None)
    vllm.add_argument("--enforce-eager", action="store_true")
    vllm.add_argument("--return-routed-experts", action="store_true",
                      help="answer each response's experts too, for routing replay (vLLM's V2 model runner, GPUs)")
    builtin = parser.add_argument_group("builtin")
    builtin.add_argument("--max-batch-rows", type=int, default=None)
    builtin.add_argument("--max-batch-tokens", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    set_nccl_environment()  # the trainer's, before the engine starts its workers (they join its weight group)
    if args.engine == "vllm":
        kwargs = dict(tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype or "auto",
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_model_len=args.max_model_len,
                      enforce_eager=args.enforce_eager, seed=args.seed,
                      return_routed_experts=args.return_routed_experts)
    else:
        if args.return_routed_experts:
            parser.error("--return-routed-experts: the builtin engine's routing stays on its own rank (vLLM only)")
        _own_world()
        kwargs = dict(dtype=args.dtype or "float32", max_batch_rows=args.max_batch_rows,
                      max_batch_tokens=args.max_batch_tokens, seed=args.seed)
    serve(args.listen, args.engine, args.hf_dir, **kwargs)


def _own_world() -> None:
    """The built-in engine's torch.distributed world: this process alone, on a port of its own (not a trainer's).
    Said in torchrun's variables, which the start-up prefers (distributed.read_launch_env) to srun's: a server that
    srun starts on each of several rollout nodes inherits SLURM_PROCID / SLURM_NTASKS, and would otherwise wait for
    the other nodes' servers as ranks of one world."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_local_port()))


if __name__ == "__main__":
    main()
