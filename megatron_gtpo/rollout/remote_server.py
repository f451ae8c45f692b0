"""A rollout server on a node (or process) of its own, serving one trainer session at a time
(docs/remote_rollout.md):

    python -m megatron_gtpo.rollout.remote_server --hf-dir DIR --listen HOST:PORT [--engine vllm|builtin] \
        [--tensor-parallel-size K] [--gpu-memory-utilization F] [--dtype D] [--max-model-len N] [--enforce-eager] \
        [--return-routed-experts]

`--engine vllm` (default; `rollout.engine: vllm_remote`) serves a vLLM engine (vllm_engine.VLLMServer);
`--engine builtin` (`rollout.engine: builtin_remote`) the built-in Megatron engine (builtin_server.BuiltinServer),
which needs no vLLM. `--return-routed-experts` (vLLM on GPUs): the server also answers each response's experts, for
a trainer's routing replay (algorithm.routing_replay: rollout). The server hosts the rendezvous TCPStore at
HOST:PORT, answers the requests of the newest trainer session (a newer session replaces an older one and pre-empts
its generation or weight update), and runs until a trainer asks it to shut down. The trainer's side is
remote_client.py.

Requests are answered in order, but for a session whose trainer sends weight updates during generation (hello's
`update_during_generation`, rollout.update_during_generation): before every decode step of a generation the session
looks ahead among the requests already sent, past further generations, for a weight update, and takes it there
(`server.pause_generation`, its begin / bucket / finish, `server.resume_generation`). The generation goes on under
the new weights; its later tokens count the update (`Responses.weight_updates_T`), and a generation asked for before
the update but started after it counts it on all its tokens. Each generation is answered with the policy version
it was asked for with (what the trainer's client checks).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from megatron_gtpo.distributed import set_nccl_environment

from .remote_channel import (
    PROTOCOL,
    ROOT,
    NewerSession,
    parse_address,
    peek_request,
    post_message,
    session_key,
    take_request,
    wait_for_request,
)
from .server_engine import attempt

_POLL_S = 0.05  # how often an idle server, or one waiting inside a weight update, looks for a newer session
_UPDATE_OPS = ("begin", "bucket", "finish")
_GENERATE_OPS = ("generate", "generate_routed")
_SHAPE_FIELDS_IGNORED = ("init_std",)  # not used by inference
log = logging.getLogger(__name__)


class _Session:
    """Server side of one trainer session: the request handlers, and the weight updates taken during a generation
    (module doc). `seq` is the next request to read in order; `answered` the later ones already answered."""

    def __init__(self, server, shape: dict, store, store_host: str, store_port: int, session: int,
                 request_timeout_s: float = 600.0):
        self.server, self.shape, self.store = server, shape, store
        self.store_host, self.store_port, self.session = store_host, store_port, session
        self.request_timeout_s = request_timeout_s
        self.seq = 0
        self.answered: set[int] = set()
        self.finished_ahead: list[int] = []  # the seqs of the weight updates' finishes taken ahead of order
        self.update_during_generation = False
        self.generating: int | None = None  # the seq of the generation in progress

    def next_request(self) -> str:
        """The key of the next request to read in order (past those answered ahead)."""
        while self.seq in self.answered:
            self.answered.remove(self.seq)
            self.seq += 1
        return session_key(self.session, self.seq)

    def handle(self, op: str, payload):
        server = self.server
        if op == "hello":
            return self.hello(payload)
        if op == "join":
            probes = server.join_weight_group(self.store_host, self.store_port, self.session, timeout_s=payload)
            if any(p != self.session for p in probes):
                raise RuntimeError(f"the weight group probe reached the workers as {probes}, sent {self.session}")
            return None
        if op == "generate":
            return self.generate(payload)
        if op == "generate_routed":
            return server.generate_routed(*payload), server.policy_version
        if op == "begin":
            return server.begin_weight_update()
        if op == "bucket":
            return server.receive_bucket(*payload)
        if op == "finish":
            return server.finish_weight_update(payload)
        raise ValueError(f"unknown request {op!r}")

    def generate(self, payload):
        """(the record, the policy version the request was made with): the current one, less the updates taken
        ahead of it (whose tokens count them all)."""
        self.finished_ahead = [f for f in self.finished_ahead if f > self.seq]
        ahead = len(self.finished_ahead)
        made_with = self.server.policy_version - ahead
        self.generating = self.seq
        try:
            record = self.server.generate(*payload)
        finally:
            self.generating = None
        if ahead:  # started under weights newer than asked for: every token counts those updates
            record = dataclasses.replace(record, weight_updates_T=record.weight_updates_T + ahead)
        return record, made_with

    def between_steps(self) -> int:
        """Before each decode step: pre-emption by a newer session, and (update_during_generation) the next weight
        update sent so far, taken now; the number of updates taken."""
        self.server.interrupt()
        if not self.update_during_generation or self.generating is None:
            return 0
        seq = self.generating + 1
        while True:  # past the generations asked for after this one, to the first update
            op = None if seq in self.answered else peek_request(self.store, session_key(self.session, seq))
            if op in _UPDATE_OPS:
                return self._take_update(seq)
            if op not in _GENERATE_OPS and seq not in self.answered:
                return 0
            seq += 1

    def _take_update(self, seq: int) -> int:
        """Answer the weight update whose first request is `seq` (the generation waits); 1."""
        self.server.pause_generation()
        try:
            while True:
                key = session_key(self.session, seq)
                op = self._wait_for_request(key)
                if op not in _UPDATE_OPS:
                    raise RuntimeError(f"the trainer left a weight update unfinished (sent {op!r} before its finish)")
                _, payload = take_request(self.store, key, self.request_timeout_s)
                outcome = attempt(lambda: self.handle(op, payload))
                post_message(self.store, f"{key}/rep", outcome)
                self.answered.add(seq)
                if outcome[0] == "error":
                    raise RuntimeError(f"a weight update during generation failed in {op!r}: {outcome[1]}")
                if op == "finish":
                    self.finished_ahead.append(seq)
                    return 1
                seq += 1
        finally:
            self.server.resume_generation()

    def _wait_for_request(self, key: str) -> str:
        deadline = time.monotonic() + self.request_timeout_s
        while not wait_for_request(self.store, key, _POLL_S):
            self.server.interrupt()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request of the weight update in {self.request_timeout_s:g} s")
        return peek_request(self.store, key)

    def hello(self, payload: dict) -> dict:
        if payload.get("protocol") != PROTOCOL:
            raise ValueError(f"protocol {payload.get('protocol')!r} is not this server's {PROTOCOL}: update both")
        diff = {k: (payload["shape"].get(k), v) for k, v in self.shape.items()
                if k not in _SHAPE_FIELDS_IGNORED and payload["shape"].get(k) != v}
        if diff:
            raise ValueError(f"the trainer's model differs from the server's in {{field: (trainer, server)}} {diff}")
        if payload["device_type"] != self.server.device_type:
            raise ValueError(f"the trainer sends weights from {payload['device_type']} tensors, the vLLM workers "
                             f"are on {self.server.device_type}: both must be cpu (gloo) or cuda (NCCL)")
        self.update_during_generation = bool(payload["update_during_generation"])
        return dict(version=self.server.policy_version, dtype=str(self.server.dtype).removeprefix("torch."),
                    num_workers=self.server.num_workers,
                    routed_experts=getattr(self.server, "return_routed_experts", False))


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
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    log.info("listening on %s; starting the %s engine from %s", listen, engine, model_dir)
    server, shape = start_server(engine, model_dir, **server_kwargs)
    shape = dataclasses.asdict(shape)
    log.info("%s ready (%d worker(s) on %s)", engine, server.num_workers, server.device_type)
    session, active = _Session(server, shape, store, host, port, 0), False  # no trainer yet
    try:
        while True:
            newest = store.add(f"{ROOT}/sessions", 0)
            if newest > session.session:  # a newer trainer connected: it replaces the current one
                if active:
                    key = session.next_request()
                    store.delete_key(f"{key}/req")  # a request it may have left unread
                    post_message(store, f"{key}/rep", ("error", "a newer trainer session replaced it"))
                    server.leave_weight_group(abandoned=True)  # a broadcast of it may still be pending
                log.info("serving trainer session %d", newest)
                server.interrupt = NewerSession(store, newest)
                session = _Session(server, shape, store, host, port, newest)
                server.between_steps = session.between_steps
                active = True
            key = session.next_request()
            if not active:
                time.sleep(_POLL_S)
                continue
            if not wait_for_request(store, key, _POLL_S):
                continue
            op, payload = take_request(store, key, 60.0)
            if op in ("close", "shutdown"):
                server.leave_weight_group()
                active = False
                outcome = ("ok", None)
            else:
                outcome = attempt(lambda: session.handle(op, payload))
                if outcome[0] == "error":
                    log.warning("session %d, %r failed: %s", session.session, op, outcome[1])
            reply_key = f"{key}/rep"
            post_message(store, reply_key, outcome)
            session.seq += 1
            if op == "shutdown":
                log.info("shutdown requested by session %d", session.session)
                deadline = time.monotonic() + 10.0  # the store dies with this process: let the trainer read first
                while store.check([reply_key]) and time.monotonic() < deadline:
                    time.sleep(_POLL_S)
                return
    finally:
        server.close()


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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


if __name__ == "__main__":
    main()
