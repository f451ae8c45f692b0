"""The built-in Megatron engine as a rollout server on a process of its own (`rollout.engine: builtin_remote`).

`BuiltinServer` is a server object the remote serving loop drives (rollout/remote_server.py `serve`, the protocol in
docs/remote_rollout.md), a `remote_server.ServedServer` as `vllm_engine.VLLMServer` is: it generates with a
`BuiltinEngine` on a model of its own (TP = PP = 1, in a torch.distributed world of one process that listens on no
network: its store is in memory and its gloo device on loopback, `own_world`), and takes weight updates from the
trainer in the channel's messages (or its NCCL weight group), in Hugging Face names through the one mapping
(models/hf_mapping.py), so the trainer's side is the one vLLM servers use. It is what lets engines generate while
the trainer trains (`rollout.schedule.max_staleness`) on a machine without vLLM, and the CPU tests run that path.

A weight update is whole: `receive_bucket` keeps each bucket's tensors, `finish_weight_update` loads them all into
the model (every parameter must be covered) and checks the trainer's checksums against what arrived, then bumps
the policy version. Memory: one host copy of the model during an update.

A generation runs the `between_steps` its call passes (`submit`) before every decode step: the serving loop's
session passes its own (remote_server.py), which abandons the generation (`Preempted`) once a newer trainer session
was admitted, and takes the weight updates sent meanwhile where its trainer sends them during generation
(rollout.schedule.update_during_generation); the engine then prefills its rows in flight again under the new weights
(builtin.py), and `pause_generation` / `resume_generation` have nothing to do: the engine waits inside
`between_steps` meanwhile. A broadcast of the weight group is abandoned the same way (the group's own
`NewerSession`, remote_channel.join_weight_group); `leave_weight_group(abandoned=True)` then drops what an
unfinished update received.
"""
from __future__ import annotations

import math
import os
from typing import Callable

import torch
import torch.distributed as dist

from .builtin import BuiltinEngine
from .engine import Rollout, SamplingParams
from .remote_channel import broadcast_from_trainer, close_weight_group, join_weight_group
from .weight_sync import tensor_checksum

_CHECKSUM_RTOL = 1e-6


class _UpdateTensors:
    """The tensors of one weight update as a checkpoint `load_hf_weights` reads (`get(name)`, `shape`)."""

    def __init__(self, tensors: dict[str, torch.Tensor], shape):
        self.tensors, self.shape = tensors, shape

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"the weight update did not send {name!r}")
        return self.tensors[name]


class BuiltinServer:
    """A built-in engine serving one trainer session at a time (module doc). `model_dir`: a HF directory or a
    megatron_gtpo checkpoint the model starts from; `dtype`: its parameters' dtype."""

    num_workers = 1
    return_routed_experts = False  # its engine's routing would be of the server's own rank (a trainer's is replayed)

    def __init__(self, model_dir: str, *, dtype: str = "float32", max_batch_rows: int | None = None,
                 max_batch_tokens: int | None = None, seed: int = 0):
        from megatron_gtpo.checkpoint.sources import ModelSource
        from megatron_gtpo.distributed import initialize_parallel
        from megatron_gtpo.models.qwen import ModelShape, build_model

        source = ModelSource.detect(model_dir)
        hf_config = source.hf_config()
        self.shape = ModelShape.from_hf(hf_config)
        own_world()
        self.parallel = initialize_parallel(1, 1, seed=seed)
        self.dtype = getattr(torch, dtype)
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.chunks = build_model(hf_config, tensor_parallel=1, pipeline_parallel=1, pp_rank=0,
                                  params_dtype=self.dtype)
        source.load_into(self.chunks, self.parallel)
        self.engine = BuiltinEngine(self.chunks, self.parallel, self.shape.vocab_size, max_batch_size=max_batch_rows,
                                    max_batch_tokens=max_batch_tokens)
        self.max_model_len = self.shape.max_position_embeddings
        self.policy_version = 0
        self.group = None
        self._interrupt: Callable[[], None] | None = None  # the weight group's session check (module doc)
        self._update: dict[str, torch.Tensor] | None = None

    def submit(self, prompts: list[list[int]], params: SamplingParams, *, first_prompt: int = 0,
               between_steps: Callable[[], int] | None = None) -> Callable[[], Rollout]:
        """`server_engine.RolloutServer.submit`: generated within the call; no routing (the built-in engine's
        stays on the trainer's ranks)."""
        if first_prompt != 0:  # one server per replica: the whole replica's prompts come in one call
            raise ValueError(f"a built-in rollout server serves all of its replica's prompts, got first_prompt="
                             f"{first_prompt}")
        return self.engine.submit(prompts, params, between_steps=between_steps)

    def idle(self) -> bool:
        """True: generated within the call."""
        return True

    def pause_generation(self) -> None:
        """Nothing: the engine waits inside `between_steps` while the update is taken."""

    def resume_generation(self) -> None:
        """Nothing: the engine prefills its rows again when `between_steps` reports the update (builtin.py)."""

    def join_weight_group(self, store_path: str, session: int, timeout_s: float = 300.0) -> list[int]:
        self.group, self._interrupt = join_weight_group(store_path, session, 1, 1 + self.num_workers, self._device,
                                                        timeout_s)
        probe = torch.zeros(1, dtype=torch.int64, device=self._device)
        broadcast_from_trainer(self.group, probe, self._interrupt)
        return [int(probe.item())]

    def leave_weight_group(self, *, abandoned: bool = False) -> None:
        close_weight_group(self.group, abandoned=abandoned)
        self.group, self._interrupt, self._update = None, None, None

    def begin_weight_update(self) -> None:
        self._update = {}

    def receive_bucket(self, names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> None:
        """The bucket the trainer broadcasts in the weight group, kept (`load_bucket`)."""
        bucket = []
        for name, dtype_name, shape in zip(names, dtype_names, shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self._device)
            broadcast_from_trainer(self.group, tensor, self._interrupt)
            bucket.append((name, tensor))
        self.load_bucket(bucket)

    def load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Keep the bucket's tensors for `finish_weight_update` (module doc)."""
        if self._update is None:
            raise RuntimeError("a weight bucket arrived outside a weight update (no begin)")
        self._update.update(bucket)

    def finish_weight_update(self, expected_checksums: dict[str, tuple[float, float]]) -> int:
        """Load the update into the model, check the checksums of what arrived; the new policy version."""
        from megatron_gtpo.models.hf_checkpoint import load_hf_weights

        update, self._update = self._update, None
        if update is None:
            raise RuntimeError("finish_weight_update without a weight update (no begin)")
        bad = [n for n, expected in expected_checksums.items()
               if n not in update or not all(math.isclose(a, b, rel_tol=_CHECKSUM_RTOL, abs_tol=1e-12)
                                             for a, b in zip(tensor_checksum(update[n].to(self.dtype)), expected))]
        if bad:
            raise RuntimeError(f"after the weight sync {bad[:3]} hold other values than were sent")
        load_hf_weights(self.chunks, _UpdateTensors(update, self.shape), tp_rank=0, tp_size=1)
        self.policy_version += 1
        return self.policy_version

    def close(self) -> None:
        self.leave_weight_group()

    @property
    def _device(self) -> torch.device:
        return self.parallel.device if self.device_type == "cuda" else torch.device("cpu")


def own_world() -> None:
    """The built-in engine's torch.distributed world: this process alone, opened on a store in its own memory (no
    TCPStore on MASTER_PORT) with gloo's device on loopback, so that it listens on no interface another host
    reaches. Said in torchrun's variables too, which the start-up prefers (distributed.read_launch_env) to srun's: a
    server that srun starts on each of several rollout nodes inherits SLURM_PROCID / SLURM_NTASKS, and would otherwise
    wait for the other nodes' servers as ranks of one world. (On GPUs, NCCL's own bootstrap is NCCL's.)"""
    from megatron_gtpo.distributed import activate_cpu_platform

    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"  # before the CPU platform names the host "cuda"
    activate_cpu_platform()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GLOO_SOCKET_IFNAME=_loopback())
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _loopback() -> str:
    """The name of the loopback interface (gloo's devices bind an interface by name)."""
    import socket

    for _, name in socket.if_nameindex():
        if name == "lo" or name.startswith("lo0"):
            return name
    return "lo"
