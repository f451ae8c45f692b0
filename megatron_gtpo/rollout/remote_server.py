"""A rollout server on a node (or process) of its own, serving one trainer session at a time
(docs/remote_rollout.md):

    python -m megatron_gtpo.rollout.remote_server --hf-dir DIR --listen HOST:PORT [--engine vllm|builtin] \
        [--tensor-parallel-size K] [--gpu-memory-utilization F] [--dtype D] [--max-model-len N] [--enforce-eager] \
        [--return-routed-experts] [--encrypt-weights] [--max-message-bytes B] [--max-buffered-bytes B] \
        [--max-responses N] [--max-prompt-tokens N]

`--engine vllm` (default; `rollout.engine: vllm_remote`) serves a vLLM engine (vllm_engine.VLLMServer);
`--engine builtin` (`rollout.engine: builtin_remote`) the built-in Megatron engine (builtin_server.BuiltinServer),
which needs no vLLM; both are `ServedServer`s. `--return-routed-experts` (vLLM on GPUs): the server also answers
each response's experts to a trainer that asks for them at its hello (routing replay, model.moe.routing_replay:
rollout). The server listens on HOST:PORT and on HOST only (remote_listener.py: ZeroMQ, authenticated with the token
in GTPO_REMOTE_TOKEN or in the file GTPO_REMOTE_TOKEN_FILE names, which a non-loopback HOST requires), answers the
requests of the newest admitted trainer session (a newer session whose hello checks out replaces an older one and
pre-empts its generation or weight update), and runs until a trainer asks it to shut down. The trainer's side is
remote_client.py. Nothing from the network is unpickled (remote_messages.py); a request that is not one of the
protocol, or over a bound (the flags above), is answered with an error and changes nothing.

Requests are answered in order. Before every decode step of a generation the session (`_Session.between_steps`, the
callback its generation passes to the server) checks for a newer session, and, for a session whose trainer sends weight
updates during generation (hello's `update_during_generation`, rollout.schedule.update_during_generation), looks ahead
among the requests already sent, past further generations, for a weight update, and takes it there
(`server.pause_generation`, its begin / bucket / finish, `server.resume_generation`). The generation goes on under the
new weights; its later tokens count the update (`Responses.weight_updates_T`), and a generation asked for before the
update but started after it counts it on all its tokens. Each generation is answered with the policy version it was
asked for with (what the trainer's client checks) and the seconds the server spent generating it.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from typing import Protocol

import torch

from megatron_gtpo.distributed import set_nccl_environment
from megatron_gtpo.models.hf_mapping import hf_tensor_shape
from megatron_gtpo.models.qwen import ModelShape

from .engine import check_prompts
from .remote_channel import PROTOCOL, TOKEN_SETTINGS, Preempted, frame_tensors, parse_address, read_token
from .remote_listener import REFUSED, Admitted, Bounds, Listener, Request
from .remote_messages import check_request
from .server_engine import RolloutServer
from .weight_sync import sync_units

_POLL_S = 0.05  # how often an idle server, or one waiting inside a weight update, looks for a newer session
_UPDATE_OPS = ("begin", "bucket", "finish")
_WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
_SHAPE_FIELDS_IGNORED = ("init_std",)  # not used by inference
log = logging.getLogger(__name__)


class ServedServer(RolloutServer, Protocol):
    """A rollout server the serving loop drives (vllm_engine.VLLMServer, builtin_server.BuiltinServer): the rollout
    server protocol (whose `load_bucket` takes the buckets that arrive in messages), the NCCL weight group of a trainer
    session through which a GPU trainer's buckets may come instead (remote_channel.py), and a pause for the weight
    updates taken during a generation."""

    num_workers: int  # the server's processes in the weight group (each receives every bucket)
    device_type: str  # where they hold the weights: "cpu" or "cuda" (only these join an NCCL weight group)
    return_routed_experts: bool  # its rollouts carry routing (RolloutServer.submit)

    def join_weight_group(self, store_path: str, session: int, timeout_s: float = 300.0) -> list[int]:
        """Join session `session`'s NCCL weight group, whose rendezvous is the session's store file
        (remote_channel.session_store); the probe value each worker received."""
        ...

    def receive_bucket(self, names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> None:
        """Load the bucket of these tensors, broadcast by the trainer in the weight group."""
        ...

    def leave_weight_group(self, *, abandoned: bool = False) -> None:
        """Shut the group down, if any (`abandoned`: a broadcast may be pending; remote_channel.close_weight_group)."""
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
    (module doc). `seq` is the next request to answer in order; `answered` the later ones already answered. Session 0
    is no trainer's (the server before its first one)."""

    def __init__(self, server: ServedServer, shape: ModelShape, listener: Listener, admitted: Admitted | None,
                 request_timeout_s: float = 600.0):
        self.server, self.shape, self.listener, self.admitted = server, shape, listener, admitted
        self.session = 0 if admitted is None else admitted.session
        self.request_timeout_s = request_timeout_s
        self.seq = 1  # request 0 is the hello, answered by `start`
        self.active = admitted is not None
        self.answered: set[int] = set()
        self.finished_ahead: list[int] = []  # the seqs of the weight updates' finishes taken ahead of order
        hello = {} if admitted is None else admitted.hello
        self.update_during_generation = hello.get("update_during_generation", False)
        self.routed = hello.get("routed", False)  # the trainer takes each response's routing (routing replay)
        self.weights = hello.get("weights", "channel")  # how its buckets travel: in its messages, or over NCCL
        self.joined = False  # its NCCL weight group
        self.generating: int | None = None  # the seq of the generation in progress
        self.tensor_shapes = {n: list(hf_tensor_shape(n, shape)) for unit in sync_units(shape) for m in unit
                              for n in m.hf_names}

    def newer(self) -> None:
        """Raise `Preempted` once the server admitted a newer session."""
        if self.listener.newest > self.session:
            raise Preempted(f"a newer trainer (session {self.listener.newest}) took this rollout server from session "
                            f"{self.session}")

    def start(self) -> None:
        """Answer the session's hello (checked at admission: `check_hello`): the server's state, where its weights
        go, and the bounds it holds the session to."""
        listener, bounds = self.listener, self.listener.bounds
        self.listener.reply(self.session, 0, "ok", dict(
            session=self.session, version=self.server.policy_version,
            dtype=str(self.server.dtype).removeprefix("torch."), num_workers=self.server.num_workers,
            routed_experts=self.server.return_routed_experts, weights_port=listener.weights_port,
            weights_mechanism=listener.weights_mechanism,
            weights_password=None if self.admitted.password is None else self.admitted.password.decode(),
            max_message_bytes=bounds.max_message_bytes, max_buffered_bytes=bounds.max_buffered_bytes,
            max_responses=bounds.max_responses, max_prompt_tokens=bounds.max_prompt_tokens))

    def ready(self, timeout_s: float) -> bool:
        """Whether the next request in order (past those answered ahead) arrived, waited for at most `timeout_s`."""
        while self.seq in self.answered:
            self.answered.remove(self.seq)
            self.seq += 1
        return self.listener.wait_request(self.session, self.seq, timeout_s)

    def answer(self, seq: int) -> tuple[str | None, bool]:
        """Take request `seq`, handle it and answer it (an error for one that fails: nothing else changed);
        (its op, whether it succeeded), (None, False) when the session was replaced meanwhile."""
        request = self.listener.take(self.session, seq)
        if request is None or request.op == REFUSED:  # replaced meanwhile; refused (and answered) by the channel
            return None, False
        try:
            outcome = "ok", self.handle(request)
        except Exception as e:  # noqa: BLE001 - whatever a request does, the trainer is told and the server serves on
            outcome = "error", f"{type(e).__name__}: {e}"
            log.warning("session %d, %r failed: %s", self.session, request.op[:40], outcome[1][:300])
        try:
            self.listener.reply(self.session, seq, *outcome)
        except TypeError as e:  # a handler answered what a message cannot hold: a bug, reported, not fatal
            outcome = "error", f"the server's answer to {request.op!r} cannot be sent: {e}"
            self.listener.reply(self.session, seq, *outcome)
        return request.op, outcome[0] == "ok"

    def handle(self, request: Request):
        server, op, payload = self.server, request.op, request.payload
        check_request(op, payload)
        if request.frames and op != "bucket":
            raise ValueError(f"{op!r} carries no tensors")
        if op == "hello":
            raise ValueError("hello is only a session's first request")
        if op == "join":
            if self.weights != "nccl":
                raise ValueError("this session's weights travel in its messages (hello's weights: channel): no join")
            probes = server.join_weight_group(self.listener.store_path(self.session), self.session,
                                               timeout_s=payload)
            self.joined = True
            if any(p != self.session for p in probes):
                raise RuntimeError(f"the weight group probe reached the workers as {probes}, sent {self.session}")
            return None
        if op == "generate":
            self.check_generate(*payload)
            return self.generate(*payload)
        if op == "begin":
            return server.begin_weight_update()
        if op == "bucket":
            names, dtype_names, shapes = payload
            self.check_bucket(names, dtype_names, shapes)
            if self.weights == "nccl":
                if request.frames:
                    raise ValueError("this session's weights travel over NCCL: a bucket carries no tensors")
                return server.receive_bucket(names, dtype_names, shapes)
            return server.load_bucket(list(zip(names, frame_tensors(request.frames, dtype_names, shapes))))
        if op == "finish":
            return server.finish_weight_update(payload)
        if op in ("close", "shutdown"):
            server.leave_weight_group()
            self.active = False
            return None
        raise AssertionError(op)  # check_request knows every op

    def check_generate(self, prompts: list[list[int]], params, first_prompt: int) -> None:
        """ValueError, naming the bound, for a generation over the server's bounds or outside the model."""
        bounds = self.listener.bounds
        if len(prompts) * params.n > bounds.max_responses:
            raise ValueError(f"{len(prompts)} prompts x n={params.n} responses exceed the {bounds.max_responses} a "
                             f"request may ask for (--max-responses)")
        tokens = sum(len(p) for p in prompts)
        if tokens > bounds.max_prompt_tokens:
            raise ValueError(f"{tokens} prompt tokens exceed the {bounds.max_prompt_tokens} a request may hold "
                             f"(--max-prompt-tokens)")
        check_prompts(prompts, vocab_size=self.shape.vocab_size, max_positions=self.shape.max_position_embeddings,
                      max_new_tokens=params.max_new_tokens)

    def check_bucket(self, names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> None:
        """ValueError unless every tensor is one of the model's, of its shape, in a floating dtype."""
        for name, dtype_name, shape in zip(names, dtype_names, shapes):
            expected = self.tensor_shapes.get(name)
            if expected != list(shape):
                raise ValueError(f"{name[:80]!r} of shape {list(shape)[:8]} is no tensor of this server's model"
                                 + (f" (its shape is {expected})" if expected is not None else ""))
            if dtype_name not in _WEIGHT_DTYPES:
                raise ValueError(f"{name!r} arrives as {dtype_name[:20]}; weights are one of {_WEIGHT_DTYPES}")

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
            op = None if seq in self.answered else self.listener.peek(self.session, seq)
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
                self._wait_for_request(seq)
                op, _ = self.answer(seq)
                self.answered.add(seq)
                if op not in _UPDATE_OPS:
                    raise RuntimeError(f"the trainer left a weight update unfinished (sent {op!r} before its finish)")
                if op == "finish":
                    self.finished_ahead.append(seq)
                    return 1
                seq += 1
        finally:
            self.server.resume_generation()

    def _wait_for_request(self, seq: int) -> None:
        deadline = time.monotonic() + self.request_timeout_s
        while not self.listener.wait_request(self.session, seq, _POLL_S):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request of the weight update in {self.request_timeout_s:g} s")
        self.newer()


def check_hello(payload, shape: dict, device_type: str) -> None:
    """ValueError, in one line, unless a trainer's hello fits this server (protocol, model, how the weights come)."""
    if isinstance(payload, dict) and payload.get("protocol") != PROTOCOL:  # first: an older hello has other fields
        raise ValueError(f"protocol {payload.get('protocol')!r} is not this server's {PROTOCOL}: update both")
    if not isinstance(payload, dict) or not isinstance(payload.get("shape"), dict) \
            or not isinstance(payload.get("update_during_generation"), bool) \
            or not isinstance(payload.get("routed"), bool) or payload.get("weights") not in ("channel", "nccl"):
        raise ValueError(f"a hello must be a dict with protocol, shape, weights (channel or nccl), "
                         f"update_during_generation and routed; got {str(payload)[:80]}")
    diff = {k: (payload["shape"].get(k), v) for k, v in shape.items()
            if k not in _SHAPE_FIELDS_IGNORED and payload["shape"].get(k) != v}
    if diff:
        raise ValueError(f"the trainer's model differs from the server's in {{field: (trainer, server)}} {diff}")
    if payload["weights"] == "nccl" and device_type != "cuda":
        raise ValueError(f"the trainer sends weights over NCCL, the server's workers are on {device_type}: "
                         f"rollout.remote.weights: channel")


ENGINES = ("vllm", "builtin")


def start_server(engine: str, model_dir: str, **server_kwargs):
    """The server object of `engine` on `model_dir`, and the model's shape (models.qwen.ModelShape)."""
    from megatron_gtpo.checkpoint.sources import ModelSource

    shape = ModelShape.from_hf(ModelSource.detect(model_dir).hf_config())
    if engine == "vllm":
        from .vllm_engine import VLLMServer

        return VLLMServer(model_dir, sleeps=False, **server_kwargs), shape  # nothing to share memory with
    if engine == "builtin":
        from .builtin_server import BuiltinServer

        return BuiltinServer(model_dir, **server_kwargs), shape
    raise ValueError(f"unknown rollout server engine {engine!r}; expected one of {ENGINES}")


def default_bounds(shape: ModelShape, **given) -> Bounds:
    """The server's bounds: those `given` (not None), else a message fits the model's largest tensor in float32
    (a weight bucket's message holds at least one) and at least 1 GiB, and twice that may wait to be answered."""
    largest = max(torch.Size(hf_tensor_shape(n, shape)).numel() for unit in sync_units(shape) for m in unit
                  for n in m.hf_names)
    message = given.get("max_message_bytes") or max(2**30, 4 * largest + 2**20)
    defaults = dict(max_message_bytes=message, max_buffered_bytes=2 * message)
    return Bounds(**{**defaults, **{k: v for k, v in given.items() if v is not None}})


def serve(listen: str, engine: str, model_dir: str, *, bounds: dict | None = None, encrypt_weights: bool = False,
          **server_kwargs) -> None:
    """Run a rollout server until a trainer asks it to shut down (docs/remote_rollout.md: protocol). A bad token
    setting, or a non-loopback `listen` without a token, fails before the engine starts."""
    host, port = parse_address(listen)
    token = read_token()
    from megatron_gtpo.checkpoint.sources import ModelSource

    shape = ModelShape.from_hf(ModelSource.detect(model_dir).hf_config())
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    listener = Listener(host, port, token, default_bounds(shape, **(bounds or {})),
                        lambda hello: check_hello(hello, dataclasses.asdict(shape), device_type),
                        encrypt_weights=encrypt_weights)
    listener.start()  # trainers' handshakes and hellos are taken while the engine starts
    if not token:
        log.warning("no token (%s): any process on this host can use this server (it listens on loopback only)",
                    TOKEN_SETTINGS)
    log.info("listening on %s (weights on port %d, %s); starting the %s engine from %s", listen,
             listener.weights_port, listener.weights_mechanism, engine, model_dir)
    try:
        server, shape = start_server(engine, model_dir, **server_kwargs)
        log.info("%s ready (%d worker(s) on %s)", engine, server.num_workers, server.device_type)
        try:
            serve_sessions(server, shape, listener)
        finally:
            server.close()
    finally:
        listener.close()


def serve_sessions(server, shape: ModelShape, listener: Listener) -> None:
    """The serving loop: answer the requests of the newest admitted trainer session (module doc) until one asks the
    server to shut down (a shutdown that fails changes nothing). Starts `listener`'s thread unless started."""
    if listener.ident is None:
        listener.start()
    session = _Session(server, shape, listener, None)
    while True:
        session = _next_session(session)
        if not session.active or not session.ready(_POLL_S):
            if not session.active:
                time.sleep(_POLL_S)
            continue
        op, ok = session.answer(session.seq)
        session.seq += 1
        if op == "shutdown" and ok:
            log.info("shutdown requested by session %d", session.session)
            return


def _next_session(session: _Session) -> _Session:
    """The newest session admitted since `session`, or `session`. The sessions it replaces end (`session`, and any
    admitted in between): their trainers are told, and `session`'s weight group is abandoned."""
    listener, newer = session.listener, []
    while not listener.admitted.empty():
        newer.append(listener.admitted.get())
    if not newer:
        return session
    admitted, server = newer[-1], session.server
    reason = f"a newer trainer (session {admitted.session}) took this rollout server"
    for ended in [a.session for a in newer[:-1]] + ([session.session] if session.active else []):
        listener.end(ended, reason)
    if session.active:
        server.leave_weight_group(abandoned=True)  # a broadcast of it may still be pending
    log.info("serving trainer session %d", admitted.session)
    successor = _Session(server, session.shape, listener, admitted, session.request_timeout_s)
    successor.start()
    return successor


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True,
                        help="Hugging Face directory the engine starts from (builtin: or a megatron_gtpo checkpoint)")
    parser.add_argument("--listen", required=True,
                        help="HOST:PORT the server listens on, on that interface only (not loopback: needs a token)")
    parser.add_argument("--engine", choices=ENGINES, default="vllm")
    parser.add_argument("--dtype", default=None, help="parameters' dtype (default: vllm auto, builtin float32)")
    parser.add_argument("--seed", type=int, default=0)
    channel = parser.add_argument_group("channel (docs/remote_rollout.md)")
    channel.add_argument("--encrypt-weights", action="store_true",
                         help="weights under CURVE encryption too (the control socket always is, with a token)")
    channel.add_argument("--max-message-bytes", type=int, default=None,
                         help="bytes of one message at most (default: the model's largest float32 tensor, >= 1 GiB)")
    channel.add_argument("--max-buffered-bytes", type=int, default=None,
                         help="bytes of a session's requests waiting at once (default: twice a message)")
    channel.add_argument("--max-responses", type=int, default=Bounds.max_responses,
                         help="prompts x n of one generate request at most")
    channel.add_argument("--max-prompt-tokens", type=int, default=Bounds.max_prompt_tokens,
                         help="prompt tokens of one generate request at most")
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
        kwargs = dict(dtype=args.dtype or "float32", max_batch_rows=args.max_batch_rows,
                      max_batch_tokens=args.max_batch_tokens, seed=args.seed)
    bounds = dict(max_message_bytes=args.max_message_bytes, max_buffered_bytes=args.max_buffered_bytes,
                  max_responses=args.max_responses, max_prompt_tokens=args.max_prompt_tokens)
    try:
        serve(args.listen, args.engine, args.hf_dir, bounds=bounds, encrypt_weights=args.encrypt_weights, **kwargs)
    except ValueError as e:  # a bad token setting, a listen address that needs one: one line
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
