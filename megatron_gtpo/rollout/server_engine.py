"""A `RolloutEngine` for one model-parallel group whose generation runs in rollout servers (`RolloutServer`, the
protocol below) held by the group's engine hosts (rollout/placement.py: by default one, TP rank 0 of the first
pipeline stage; colocated vLLM runs one per pipeline stage or per TP slice of one). Imports neither vllm nor megatron.
Before the servers wake, every rank of the group empties its caching allocator (`_release_cached_memory`).

A server is a `vllm_engine.VLLMServer` in the same process (colocated mode) or a `remote_client.RemoteClient`
talking to a rollout server on another node or process (remote mode), which itself drives a `VLLMServer` or a
`builtin_server.BuiltinServer` through the same protocol (remote_server.py). Colocated on CUDA, a `VLLMServer` also
takes buckets by CUDA IPC (`load_ipc_bucket`, cuda_ipc.py).

`generate` and `sync_weights` are collective over the model-parallel group: each host calls its server, and its
outcome (result or error text) is broadcast to every rank, which returns it or raises. The records travel as
tensors to the group's device (rollout/transport.py), the small outcomes of a sync as objects. With routing replay
the experts follow each record, every layer's to every rank of the replica (in slices of at most
`_ROUTING_SLICE_BYTES` on the device), and each rank keeps its own MoE layers' on the host until the step batch.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from megatron_gtpo.distributed import warm_up_communicators
from megatron_gtpo.models.moe_routing import EXPERT_INDEX_DTYPE

from .engine import Rollout, SamplingParams, check_prompts
from .placement import split_prompts
from .responses import Responses
from .transport import broadcast_responses
from .weight_sync import DEFAULT_BUCKET_BYTES, SINGLE_DESTINATION, hf_weight_buckets, is_sync_destination, \
    pack_on_device, policy_checksum_names, tensor_checksum

_ROUTING_SLICE_BYTES = 2**26  # routing crosses the device in slices of this size: a transient, not a copy


class RolloutServer(Protocol):
    """A rollout server: what a `ServerEngine` drives on each of its engine hosts (module doc), and the remote serving
    loop on its own node (remote_server.ServedServer adds the weight group)."""

    dtype: torch.dtype  # the weights' dtype: a sync's expected checksums are taken after a cast to it
    policy_version: int  # the weight updates it took (0: the weights it started from)

    def submit(self, prompts: list[list[int]], params: SamplingParams, *, first_prompt: int = 0,
               between_steps: Callable[[], int] | None = None) -> Callable[[], Rollout]:
        """Ask for params.n responses per prompt; the returned function waits for them and gives the rollout: the
        record (responses.py), the seconds the server spent generating it (`Rollout.generation_s`) and, from a
        server that returns routing (a VLLMServer built with `return_routed_experts`, a RemoteClient of such a
        server), per response the experts its fed tokens went to at every layer of the model, int16
        [P + R - 1, num_layers, k] on the host (else None). `first_prompt`: the index of prompts[0] among the
        replica's prompts (seeds differ across engines). A server in this process generates within the call; a
        RemoteClient's generates meanwhile on its own node. `between_steps` (a server
        that generates in this process): called before every decode step; it may take weight updates and returns
        how many (the later tokens count them: `Responses.weight_updates_T`), and what it raises abandons the
        generation (a remote server's pre-emption by a newer trainer). None: nothing runs between the steps."""
        ...

    def idle(self) -> bool:
        """Whether it has answered every generation asked of it (a server in this process: always)."""
        ...

    def begin_weight_update(self) -> None:
        ...

    def load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Load these (Hugging Face name, tensor) weights; the others keep theirs."""
        ...

    def finish_weight_update(self, expected_checksums: dict[str, tuple[float, float]]) -> int:
        """The new policy version; raises unless the weights have these (sum, sum of squares) checksums."""
        ...


class IPCRolloutServer(RolloutServer, Protocol):
    """A rollout server that also takes buckets by CUDA IPC (a colocated `vllm_engine.VLLMServer` on CUDA): what a
    `ServerEngine` with `ipc_members` drives."""

    def load_ipc_bucket(self, names: list[str], dtype_names: list[str], shapes: list[list[int]],
                        handles: dict) -> None:
        """Load the bucket whose members exported it on their GPUs (cuda_ipc.py): `handles`, by member rank, the
        handles of each worker's own GPU's copy; laid out as `weight_sync.pack_on_device`."""
        ...


class RolloutEngineError(ConnectionError, RuntimeError):
    """A rollout engine (its server, its processes, the connection to it) failed: raised alike on every rank of the
    model replica. An OSError, so the command line reports it in one line (cli.py) for the user to act on."""


class ServerEngine:
    """`RolloutEngine` backed by the server objects of one model-parallel group, one per engine host (`hosts`:
    (pp_rank, tp_rank) pairs in engine order, rollout/placement.engine_hosts; by default a single server on TP
    rank 0 of the first pipeline stage).

    `generate` and `sync_weights` are collective over the model-parallel group: the prompts are split across the
    engines (placement.split_prompts), every rank returns one record of all responses in prompt order, on the
    group's device, and every rank raises if any server failed. Every host receives the full weights.
    `policy_version` is the servers' policy version after the last successful sync (0 before any).
    """

    def __init__(self, server: RolloutServer | IPCRolloutServer | None, parallel, shape, *, hosts=SINGLE_DESTINATION,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, ipc_members=None,
                 routed_layers: tuple[int, ...] | None = None):
        """`server`: this rank's `RolloutServer` on an engine host (an `IPCRolloutServer` with `ipc_members`), None
        elsewhere. `routed_layers`: this rank's MoE layers (models/moe_routing.routed_layers): with them the servers
        must return routing, and `submit`'s rollouts carry each response's experts at those layers, as the built-in
        engine records them (int16 [P + R - 1, M, k], `Rollout`), but on the host (module doc)."""
        self.hosts = [tuple(h) for h in hosts]
        # Colocated on CUDA: each engine's member ranks (placement.engine_members, host first), which hand their
        # engine's workers the buckets by CUDA IPC; None: the buckets go to the hosts' servers (`load_bucket`).
        self.ipc_members = None if ipc_members is None else [[tuple(m) for m in ms] for ms in ipc_members]
        if (server is not None) != is_sync_destination(parallel, self.hosts):
            raise ValueError(f"a rollout server must live on each engine host {self.hosts} (pp_rank, tp_rank) of CP "
                             f"rank 0 and only there; this rank is ({parallel.pp_rank}, {parallel.tp_rank}), CP rank "
                             f"{parallel.cp_rank}")
        self.server = server
        self.parallel = parallel
        self.shape = shape
        self.bucket_bytes = bucket_bytes
        self.routed_layers = routed_layers
        self.policy_version = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Responses:
        return self.submit(prompts, params)().responses

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> Callable[[], Rollout]:
        """`generate` in two halves, both collective: this call hands every host's server its part of the prompts
        (`RolloutServer.submit`), the returned function waits for the answers and shares them, with the routing of
        this rank's MoE layers when the engine was built for routing replay (`routed_layers`), and the longest of
        the servers' generation seconds (`Rollout.generation_s`, in the records' broadcast). A remote server
        generates in between; a server in this process answers within this call."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_prompts(prompts, vocab_size=self.shape.vocab_size, max_positions=self.shape.max_position_embeddings,
                      max_new_tokens=params.max_new_tokens)
        self._release_cached_memory()
        parts = split_prompts(prompts, len(self.hosts))
        me = (self.parallel.pp_rank, self.parallel.tp_rank)
        answered, waiting = None, None  # this host's outcome, or the function that waits for it
        if self.server is not None:  # every host asks for its part at once, before any answer is shared
            index = self.hosts.index(me)
            if not parts[index]:
                answered = ("ok", Rollout(Responses.empty(), []))
            else:
                answered = attempt(partial(self.server.submit, parts[index], params,
                                           first_prompt=sum(len(p) for p in parts[:index])))
                if answered[0] == "ok":
                    answered, waiting = None, answered[1]

        def wait() -> Rollout:
            mine, experts, my_seconds = None, None, 0.0
            if self.server is not None:
                outcome = attempt(waiting) if waiting is not None else answered
                mine, experts = self._checked(outcome, parts[self.hosts.index(me)], params.n)
                my_seconds = outcome[1].generation_s if outcome[0] == "ok" else 0.0
            records, routes, failures, generation_s = [], [], [], 0.0
            for index, host in enumerate(self.hosts):
                # Every engine's answer goes to every rank of the replica, failed or not, so the collectives match.
                status, payload, seconds = broadcast_responses(
                    mine if host == me else None, self._global_rank(host), self.parallel.mp_group,
                    self.parallel.device, generation_s=my_seconds if host == me else 0.0)
                generation_s = max(generation_s, seconds)  # the hosts generate at once: the call's is the longest
                if status == "ok":
                    records.append(payload)
                    if self.routed_layers is not None:
                        routes += self._share_routing(experts if host == me else None, self._global_rank(host),
                                                      parts[index], params.n, payload.lengths_R.tolist())
                else:
                    failures.append(f"engine {index} (host pp_rank, tp_rank = {host}): {payload}")
            if failures:
                raise RolloutEngineError(f"the rollout engine failed on {len(failures)} of {len(self.hosts)} host "
                                         f"rank(s): " + "; ".join(failures))
            return Rollout(Responses.cat(records), routes if self.routed_layers is not None else None, generation_s)

        return wait

    def idle(self) -> bool:
        """This rank's server's `RolloutServer.idle` (True on a rank that hosts none); not collective."""
        return self.server is None or self.server.idle()

    def stand_by(self) -> None:
        """Nothing to take part in: a server's engine has no expert-parallel peers among the trainer's ranks."""

    def _checked(self, outcome, prompts: list[list[int]], n: int):
        """A host's ("ok", rollout) as ("ok", its record) and, with routing replay, its experts as one tensor; an
        error outcome (and None) when the server failed or, with routing replay, its experts are not one int16
        [P + R - 1, num_layers, k] per response of the record."""
        if outcome[0] != "ok":
            return outcome, None
        record, experts = outcome[1].responses, outcome[1].routed_experts
        if self.routed_layers is None:
            return ("ok", record), None
        layers, k = self.shape.num_layers, self.shape.moe.topk
        expected = [(len(p) + r - 1, layers, k)
                    for p, r in zip([p for p in prompts for _ in range(n)], record.lengths_R.tolist())]
        got = [tuple(e.shape) if isinstance(e, torch.Tensor) and e.dtype == EXPERT_INDEX_DTYPE else type(e).__name__
               for e in experts] if isinstance(experts, list) else type(experts).__name__
        if got != expected:
            return ("error", f"the engine's routed experts {str(got)[:200]} are not int16 {str(expected)[:200]} (per "
                             f"response, every fed position of it, every layer, top-k)"), None
        return ("ok", record), torch.cat(experts) if experts else torch.empty(0, layers, k, dtype=EXPERT_INDEX_DTYPE)

    def _share_routing(self, experts, src: int, prompts: list[list[int]], n: int, lengths: list[int]) \
            -> list[torch.Tensor]:
        """A host's experts (`experts`, every layer's, on the host; None elsewhere) on every rank of the replica, each
        rank keeping its own MoE layers (`routed_layers`) of each response, on the host. Collective over the
        replica."""
        layers, k, device = self.shape.num_layers, self.shape.moe.topk, self.parallel.device
        rows_per_response = [len(p) + r - 1 for p, r in zip([p for p in prompts for _ in range(n)], lengths)]
        rows = sum(rows_per_response)
        index = torch.tensor([layer - 1 for layer in self.routed_layers], device=device)  # vLLM's layers: 0-based
        kept = torch.empty(rows, len(self.routed_layers), k, dtype=EXPERT_INDEX_DTYPE)
        step = max(1, _ROUTING_SLICE_BYTES // (layers * k * kept.element_size()))
        for start in range(0, rows, step):
            piece = experts[start:start + step].to(device) if experts is not None else \
                torch.empty(min(step, rows - start), layers, k, dtype=EXPERT_INDEX_DTYPE, device=device)
            dist.broadcast(piece.view(torch.uint8), src=src, group=self.parallel.mp_group)  # NCCL, gloo: no int16
            kept[start:start + step] = piece.index_select(1, index).cpu()
        return list(kept.split(rows_per_response))

    def _global_rank(self, host: tuple[int, int]) -> int:
        """A host's global rank (on CP rank 0 of the replica)."""
        return self.parallel.replica_global_rank(*host)

    def _release_cached_memory(self) -> None:
        """Before a colocated engine wakes (its KV cache, its weights) on the model replica's GPUs: every rank of
        the replica hands the blocks its caching allocator keeps back to the driver, and none goes on before all
        have, so the engine finds that memory free. A no-op on the CPU platform, harmless for a remote engine."""
        torch.cuda.empty_cache()
        dist.barrier(group=self.parallel.mp_group)

    def sync_weights(self, model_chunks: list, parallel) -> None:
        """Stream the weights into every engine (all of them to each) and check their checksums. Host path: each host
        hands its server every bucket (`load_bucket`). IPC path (`ipc_members`): every member rank receives every
        bucket on its GPU and exports it (cuda_ipc.py); the handles are gathered over the replica and each host
        hands its server those of its members (`load_ipc_bucket`)."""
        checksum_names = set(policy_checksum_names(self.shape))
        expected: dict[str, tuple[float, float]] = {}
        failure = None
        self._release_cached_memory()
        if self.server is not None:
            failure = _error_of(self.server.begin_weight_update)
        destinations = self.hosts if self.ipc_members is None else [m for ms in self.ipc_members for m in ms]
        for bucket in hf_weight_buckets(model_chunks, parallel, self.shape, bucket_bytes=self.bucket_bytes,
                                        destinations=destinations):
            # Only the destinations get buckets. After a failure the stream is still drained: the other ranks are
            # gathering and sending into it.
            if self.server is not None:
                for name, tensor in bucket:
                    if name in checksum_names:
                        expected[name] = tensor_checksum(tensor.to(self.server.dtype))
            if self.ipc_members is None:
                if failure is None:
                    failure = _error_of(partial(self.server.load_bucket, bucket))
            else:
                failure = self._load_by_ipc(bucket, failure)
            del bucket
        if self.ipc_members is not None:
            from . import cuda_ipc

            cuda_ipc.collect()
        outcome = None
        if self.server is not None:
            outcome = ("error", failure) if failure else attempt(lambda: self.server.finish_weight_update(expected))
        outcomes = [share_outcome(outcome if host == (parallel.pp_rank, parallel.tp_rank) else None,
                                  self._global_rank(host), self.parallel.mp_group) for host in self.hosts]
        versions = [unwrap(o) for o in outcomes]  # after every broadcast: all ranks raise together
        if len(set(versions)) != 1:
            raise RuntimeError(f"the rollout engines report different policy versions {versions} after a sync")
        self.policy_version = versions[0]

    def _load_by_ipc(self, bucket: list, failure: str | None) -> str | None:
        """One bucket by CUDA IPC (collective over the engines' members: the TP x PP ranks of CP rank 0, the only
        ones that receive buckets). Returns the first failure so far (this rank's export or, on a host, its server's
        load)."""
        from . import cuda_ipc

        names, dtype_names, shapes, flat = pack_on_device(bucket)
        exported = attempt(partial(cuda_ipc.export_buffer, flat))
        members_group = self.parallel.cp_slice_group
        everyone: list = [None] * dist.get_world_size(members_group)
        dist.all_gather_object(everyone, exported, group=members_group)
        me = (self.parallel.pp_rank, self.parallel.tp_rank)
        if self.server is not None and failure is None:
            members = next(ms for ms in self.ipc_members if ms[0] == me)
            mine = [everyone[p * self.parallel.tp_size + t] for p, t in members]
            errors = [payload for status, payload in mine if status != "ok"]
            failure = f"exporting a bucket by CUDA IPC: {errors[0]}" if errors else _error_of(partial(
                self.server.load_ipc_bucket, names, dtype_names, shapes, dict(payload for _, payload in mine)))
        dist.barrier(group=members_group)  # every rank keeps its buffer until its engine has loaded it
        del flat
        return failure


def start_colocated_servers(parallel, hosts, start_server):
    """Start this rank's server (`start_server()`, on an engine host; None elsewhere) once the GPUs are ready for it,
    and return only when every engine of the job is up. Collective over the default group; every rank raises if any
    engine failed to start.

    A colocated vLLM engine sizes its KV cache from the GPU's free memory while it starts, and asserts that no other
    process frees memory meanwhile (vLLM 0.32, v1/worker/gpu_worker.py). So every rank first gives its cached blocks
    back and creates the NCCL communicators of its process groups (NCCL makes them at a group's first collective:
    made later, they would take memory the engine counted as free); then the hosts start their engines, and no rank
    goes on (to a weight sync that empties its cache, say) before all are up."""
    torch.cuda.empty_cache()
    warm_up_communicators(parallel)
    dist.barrier()
    outcome = attempt(start_server) if is_sync_destination(parallel, hosts) else ("ok", None)
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, outcome[1] if outcome[0] == "error" else None)
    failed = [f"rank {rank}: {error}" for rank, error in enumerate(errors) if error]
    if failed:
        raise RolloutEngineError(f"{len(failed)} rollout engine(s) failed to start: " + "; ".join(failed))
    return outcome[1]


def share_outcome(outcome, src: int, group):
    """A host's small (status, payload), e.g. a policy version, on every rank of `group` (`src`: the host's global
    rank; other ranks pass None)."""
    box = [outcome]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def attempt(fn):
    """("ok", fn()) or ("error", description): failures on the server rank are re-raised on every rank."""
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - reported to the whole group, then raised there
        return "error", f"{type(e).__name__}: {e}"


def _error_of(fn) -> str | None:
    status, payload = attempt(fn)
    return payload if status == "error" else None


def unwrap(outcome):
    status, payload = outcome
    if status != "ok":
        raise RolloutEngineError(f"the rollout engine failed on the weight-sync destination rank: {payload}")
    return payload
