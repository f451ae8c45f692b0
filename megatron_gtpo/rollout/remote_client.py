"""The trainer's side of a rollout server on another node or process (docs/remote_rollout.md): `RemoteEngine.connect`
gives a `RolloutEngine` with the semantics of the colocated `vllm_engine.VLLMEngine` (both are
`server_engine.ServerEngine`): the weight-sync destination rank talks to the server through a `RemoteClient`;
every rank of the model-parallel group gets the responses, or raises when the server failed. After a transport
failure a client refuses further calls; after an error the server reported, the session stays usable.

`submit` asks for responses without waiting for them. By default the server answers requests in order, so a weight
update sent after a submitted generation waits until that generation is done (the update drains it, never interrupts
it), and the generation is of the weights that were current when it was submitted. With `update_during_generation`
(rollout.update_during_generation) the server takes a weight update between the decode steps of the generations in
flight instead: their later tokens are sampled by the new weights, and each token says how many updates came before
it (`Responses.weight_updates_T`, counted from the weights the request was made with). Imports no vllm.
"""
from __future__ import annotations

import dataclasses
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from .engine import SamplingParams
from .remote_channel import (
    PROTOCOL,
    ROOT,
    TOKEN_SETTINGS,
    Channel,
    Unsigned,
    broadcast_from_trainer,
    close_weight_group,
    ended_key,
    parse_address,
    read_token,
    session_key,
    weight_group,
    weights_prefix,
)
from .responses import Responses
from .server_engine import ServerEngine, attempt, share_outcome, unwrap
from .weight_sync import DEFAULT_BUCKET_BYTES, is_sync_destination

_ENDED_CHECK_S = 0.5  # how often a client waiting for a reply looks whether the server gave its session away
_NONCE_WAIT_S = 30.0  # a store that holds no nonce this long after it answered is no server of this protocol


class RemoteClient:
    """The trainer's handle on one rollout server (vLLM or built-in): the `server` object of a ServerEngine
    (docs/remote_rollout.md has the protocol)."""

    def __init__(self, address: str, shape, device: torch.device, *, connect_timeout_s: float = 300.0,
                 request_timeout_s: float = 1800.0, routed: bool = False, update_during_generation: bool = False):
        """`routed` (routing replay): ConnectionError unless the server returns routed experts.
        `update_during_generation`: the server takes weight updates while it generates (module doc)."""
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
        token = read_token()
        try:
            self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=connect_timeout_s))
        except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError or DistStoreError, by version
            raise ConnectionError(f"no rollout server answered at {address} within {connect_timeout_s:g} s "
                                  f"({type(e).__name__}: {_first_line(e)})") from None
        try:  # a server publishes its nonce as soon as its store listens, before its engine starts
            self.channel = Channel.connect(self.store, token, min(connect_timeout_s, _NONCE_WAIT_S))
        except Exception:  # noqa: BLE001
            raise ConnectionError(f"the store at {address} holds no rollout server's nonce after "
                                  f"{min(connect_timeout_s, _NONCE_WAIT_S):g} s: not a server of protocol {PROTOCOL} "
                                  f"(an older one? update both)") from None
        self.session = self.store.add(f"{ROOT}/sessions", 1)
        self._seq = 0
        hello = dict(protocol=PROTOCOL, shape=dataclasses.asdict(shape), device_type=device.type,
                     update_during_generation=update_during_generation)
        info = self._call("hello", hello, connect_timeout_s)
        if routed and not info["routed_experts"]:
            raise ConnectionError(f"the rollout server at {address} does not return routed experts, which "
                                  f"algorithm.routing_replay: rollout takes over: start it with "
                                  f"--return-routed-experts (a vLLM server on GPUs)")
        self.dtype = getattr(torch, info["dtype"])
        self.policy_version = info["version"]
        reply_key = self._request("join", connect_timeout_s)
        try:  # the server's workers join at the same time; then a probe checks that the group works
            self.group = weight_group(self.store, weights_prefix(self.session), 0, 1 + info["num_workers"],
                                      device, connect_timeout_s)
            broadcast_from_trainer(self.group, torch.tensor([self.session], dtype=torch.int64, device=device))
        except Exception as e:  # noqa: BLE001 - the server's own account, if it has one, says more
            raise self._broke("joining the weight broadcast group", e, reply_key) from None
        self._reply(reply_key, "join", connect_timeout_s)

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, first_prompt: int = 0) -> Responses:
        """The server's record (responses.py), on the host: its tensors cross the channel as their bytes
        (remote_messages.py)."""
        return self.submit(prompts, params, first_prompt=first_prompt)()

    def submit(self, prompts: list[list[int]], params: SamplingParams, *, first_prompt: int = 0,
               op: str = "generate") -> Callable[[], Responses]:
        """Send the request now; the returned function waits for its record (module doc: what it is generated
        with), or with op "generate_routed" (`submit_routed`) for the record and its routed experts."""
        reply_key, version = self._request(op, (prompts, params, first_prompt)), self.policy_version

        def wait() -> Responses:
            responses, made_with = self._reply(reply_key, op, self.request_timeout_s)
            if made_with != version:
                raise RuntimeError(f"policy version mismatch: the rollout server at {self.address} took the request "
                                   f"as made with policy version {made_with}, the last one synced before it is "
                                   f"{version}")
            return responses

        return wait

    def submit_routed(self, prompts: list[list[int]], params: SamplingParams, *,
                      first_prompt: int = 0) -> Callable[[], tuple[Responses, torch.Tensor]]:
        """`submit` of the record and its routed experts (vllm_engine.VLLMServer.generate_routed), on the host."""
        return self.submit(prompts, params, first_prompt=first_prompt, op="generate_routed")

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
            raise RuntimeError(f"policy version mismatch after the weight sync: the rollout server at {self.address} "
                               f"reports {version}, expected {self.policy_version + 1}")
        self.policy_version = version
        return version

    def close(self, *, shutdown_server: bool = False) -> None:
        """End the session (the server then waits for the next trainer), or stop the server."""
        if self._broken is None:
            self._call("shutdown" if shutdown_server else "close", None, self.connect_timeout_s)
            self._broken = "the session was closed"
        close_weight_group(self.group)
        self.group = None

    def _call(self, op: str, payload, timeout_s: float):
        return self._reply(self._request(op, payload), op, timeout_s)

    def _request(self, op: str, payload) -> str:
        if self._broken is not None:
            raise RuntimeError(f"the connection to the rollout server at {self.address} is unusable: {self._broken}")
        key = session_key(self.session, self._seq)
        self._seq += 1
        try:
            self.channel.post_request(key, op, payload)
        except Exception as e:  # noqa: BLE001
            raise self._broke(f"sending {op!r}", e) from None
        return f"{key}/rep"

    def _reply(self, reply_key: str, op: str, timeout_s: float):
        """The payload of the reply under `reply_key`, waited for at most `timeout_s`; RuntimeError with the
        server's error, or, marking the connection unusable, when the server gave this session to a newer trainer
        or the reply did not come."""
        deadline, ended = time.monotonic() + timeout_s, None
        try:
            while not self.channel.arrived(reply_key, _ENDED_CHECK_S):
                if self.store.check([ended_key(self.session)]):
                    ended = self.channel.take(ended_key(self.session))
                    break
                if time.monotonic() > deadline:
                    raise dist.DistStoreError(f"no reply in {timeout_s:g} s")
            else:
                status, payload = self.channel.take(reply_key)
        except Exception as e:  # noqa: BLE001
            raise self._broke(f"waiting for the reply to {op!r}", e) from None
        if ended is not None:
            self._broken = f"{ended}; this trainer's session {self.session} ended"
            raise RuntimeError(f"rollout server at {self.address}: {self._broken}")
        if status != "ok":
            raise RuntimeError(f"the rollout server at {self.address} failed in {op!r}: {payload}")
        return payload

    def _broke(self, what: str, error: Exception, reply_key: str | None = None) -> RuntimeError:
        """Mark the connection unusable and describe why (with the server's own error when it sent one)."""
        if isinstance(error, dist.DistNetworkError):
            cause = "lost the connection (did the server die?)"
        elif isinstance(error, dist.DistStoreError):
            cause = "no answer in time (is the server hung, busy, or serving another trainer?)"
        elif isinstance(error, Unsigned):
            cause = f"not signed with this trainer's token (set {TOKEN_SETTINGS} to the server's)"
        else:
            cause = "failed"
        self._broken = f"{what}: {cause}: {type(error).__name__}: {_first_line(error)}"
        if reply_key is not None and not isinstance(error, dist.DistNetworkError):
            try:
                if self.store.check([reply_key]):
                    self._broken += f"; the server reported: {self.channel.take(reply_key)[1]}"
            except Exception:  # noqa: BLE001 - the original failure is what gets reported
                pass
        return RuntimeError(f"rollout server at {self.address}, {self._broken}")


def _first_line(error: Exception) -> str:
    """An error's own line, without the C++ stack torch's errors append to it."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


class RemoteEngine(ServerEngine):
    """`RolloutEngine` for one model-parallel group backed by a rollout server on another node or process."""

    @classmethod
    def connect(cls, address: str, parallel, shape, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                connect_timeout_s: float = 300.0, request_timeout_s: float = 1800.0,
                routed_layers: tuple[int, ...] | None = None, update_during_generation: bool = False) -> RemoteEngine:
        """Collective over the model-parallel group: the sync destination connects (waiting up to
        `connect_timeout_s` for the server to answer and be ready); every rank raises if that failed.
        `routed_layers` (this rank's MoE layers, routing replay): the server must return routed experts.
        `update_during_generation`: the server takes weight updates while it generates (module doc)."""
        client, outcome = None, None
        if is_sync_destination(parallel):
            outcome = attempt(lambda: RemoteClient(address, shape, parallel.device,
                                                       connect_timeout_s=connect_timeout_s,
                                                       request_timeout_s=request_timeout_s,
                                                       routed=routed_layers is not None,
                                                       update_during_generation=update_during_generation))
            if outcome[0] == "ok":
                client = outcome[1]
                outcome = ("ok", client.policy_version)
        version = unwrap(share_outcome(outcome, dist.get_global_rank(parallel.mp_group, 0), parallel.mp_group))
        engine = cls(client, parallel, shape, bucket_bytes=bucket_bytes, routed_layers=routed_layers)
        engine.policy_version = version
        return engine

    def close(self, *, shutdown_server: bool = False) -> None:
        """End this trainer's session (every rank may call it; only the destination talks to the server)."""
        if self.server is not None:
            self.server.close(shutdown_server=shutdown_server)
