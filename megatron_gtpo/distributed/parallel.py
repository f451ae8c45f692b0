"""Distributed start-up: torch.distributed from torchrun or SLURM, then megatron-core's model-parallel state.

This module (with the rest of distributed/) is the only place that reads `megatron.core.parallel_state`. What the
rest of the code needs of it travels in the explicit `ParallelGroups` object returned by `initialize_parallel`.
"""
from __future__ import annotations

import datetime
import os
import re
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gtpo.layout import ParallelLayout, check_layout
from megatron_gtpo.process_lifetime import end_with_the_run

from .platform import activate_cpu_platform

BACKENDS = ("nccl", "gloo")

# NCCL's settings that every process of one communicator must share. NCCL_CUMEM_ENABLE (NCCL's cuMem-allocated
# buffers): ranks of one node with different settings fail to connect. A weight-sync group joins the trainer with the
# workers of a vLLM server, and vLLM turns cuMem off in its processes where it is unset (with CUDA graphs it costs
# 1-2 GiB, NVIDIA/nccl#1234), while NCCL's own default is on. So every process of the project (trainer, evaluation,
# rollout servers, and vLLM's workers, which inherit it) starts with it off before any communicator exists; a value
# set in the environment is inherited by all of them alike and wins.
NCCL_ENVIRONMENT = {"NCCL_CUMEM_ENABLE": "0"}


def set_nccl_environment() -> None:
    """NCCL_ENVIRONMENT's defaults in os.environ (for this process and those it starts)."""
    for key, value in NCCL_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as torchrun or srun describe it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "single"


def first_host_in_nodelist(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[003-005,010],cpu1' -> 'gpu003' (zero padding kept)."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if head is None or not head.group(1):
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = head.group(1), head.group(3)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def free_local_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_launch_env(environ=None) -> LaunchEnv:
    """torchrun's variables win; otherwise srun's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, node list); otherwise
    one process alone, on MASTER_PORT or else a free port (two single-process runs on one machine do not collide on
    torch's default 29500)."""
    env = os.environ if environ is None else environ
    port = int(env.get("MASTER_PORT", "29500"))
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")),
                         env.get("MASTER_ADDR", "127.0.0.1"), port, "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        addr = env.get("MASTER_ADDR") or (first_host_in_nodelist(nodelist) if nodelist else None)
        if addr is None:
            raise RuntimeError("SLURM launch without MASTER_ADDR or SLURM_JOB_NODELIST: cannot find rank 0's host")
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", "0")),
                         addr, port, "slurm")
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    return LaunchEnv(0, 1, 0, addr, port if "MASTER_PORT" in env else free_local_port(), "single")


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups and coordinates of this rank. Passed explicitly to everything that communicates."""

    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    # The ranks holding one model replica: tensor x context x pipeline (CP ranks hold the same weights and see the
    # same batch). They generate, reward and sync as one (the rollout engine, the reward broadcast).
    mp_group: dist.ProcessGroup
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    vpp_size: int | None
    sequence_parallel: bool
    world_rank: int
    world_size: int
    device: torch.device
    # The experts of a mixture-of-experts model (layout.ParallelLayout): this rank holds experts
    # [ep_rank * E / ep_size, (ep_rank + 1) * E / ep_size), each split over the etp_size ranks of its expert-TP group.
    # A dense model has ep_size 1, etp = tp and the groups of a world of one expert rank.
    ep_group: dist.ProcessGroup | None = None
    ep_rank: int = 0
    ep_size: int = 1
    etp_group: dist.ProcessGroup | None = None
    etp_rank: int = 0
    etp_size: int = 1
    # Context parallelism: every sequence is split over the cp_size ranks of cp_group, rank r holding chunks r and
    # 2 cp_size - 1 - r of its 2 cp_size chunks (megatron's load-balanced layout; distributed/context_parallel.py).
    cp_group: dist.ProcessGroup | None = None
    cp_rank: int = 0
    cp_size: int = 1
    # The TP x PP ranks of this rank's CP slice of the replica (megatron's model-parallel group; `mp_group` at CP =
    # 1): on CP rank 0 the members of the replica's colocated engines.
    cp_slice_group: dist.ProcessGroup | None = None

    @classmethod
    def data_parallel_rank(cls, dp_group: dist.ProcessGroup | None, device: torch.device) -> ParallelGroups:
        """This process as a rank of `dp_group` (None: a world of one) that holds a whole model replica: no model
        parallelism, so no model-parallel group (None), which such a rank never communicates over. For step batches
        and experience built without megatron-core's parallel state (benchmarks, tests)."""
        rank, size = (dist.get_rank(dp_group), dist.get_world_size(dp_group)) if dp_group is not None else (0, 1)
        world_rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return cls(tp_group=None, pp_group=None, dp_group=dp_group, mp_group=None, tp_rank=0, tp_size=1, pp_rank=0,
                   pp_size=1, dp_rank=rank, dp_size=size, vpp_size=None, sequence_parallel=False,
                   world_rank=world_rank, world_size=world_size, device=device)

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def sequence_multiple(self) -> int:
        """Token rows must be padded to a multiple of this: TP with sequence parallelism (megatron splits the
        sequence over the TP ranks), times 2 x CP with context parallelism (2 CP chunks of a row, each rank's two
        then split over TP), else 1."""
        return (self.tp_size if self.sequence_parallel else 1) * (2 * self.cp_size if self.cp_size > 1 else 1)

    def replica_global_rank(self, pp_rank: int, tp_rank: int) -> int:
        """The global rank of this replica's rank (pp_rank, tp_rank) of CP rank 0 (where a rollout engine's host
        lives): torch orders a group by global rank, and megatron's order (tp-cp-ep-dp-pp) puts the stage first, then
        the CP rank, then the TP rank."""
        return dist.get_global_rank(self.mp_group, pp_rank * self.cp_size * self.tp_size + tp_rank)

    @property
    def last_stage_global_rank(self) -> int:
        return dist.get_global_rank(self.pp_group, self.pp_size - 1)

    @property
    def expert_lockstep_group(self) -> dist.ProcessGroup | None:
        """The expert-parallel group when it spans more than this rank (EP > 1), else None. Its ranks exchange
        tokens by all-to-all inside every MoE layer, so they must run their forward (and backward) passes in
        lockstep: the same number of micro-batches and of generation steps, whatever their own data (ranks with
        less take part with empty work)."""
        return self.ep_group if self.ep_size > 1 else None


def _pick_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"unknown distributed backend {backend!r}; expected one of {BACKENDS}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, and this machine has none; use 'gloo'")
    return backend


def initialize_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1, *,
                        virtual_pipeline_parallel: int | None = None, sequence_parallel: bool = False,
                        expert_parallel: int = 1, expert_tensor_parallel: int | None = None,
                        context_parallel: int = 1, backend: str | None = None, seed: int = 1234,
                        timeout_minutes: float = 30.0) -> ParallelGroups:
    """Start torch.distributed (unless already started) and megatron's model-parallel state; seed the RNGs.

    Rank layout is megatron's default order (tp-cp-ep-dp-pp): TP ranks are adjacent. The experts of a
    mixture-of-experts model at `expert_parallel` (EP) and `expert_tensor_parallel` (ETP, None: TP): megatron lays
    every stage's ranks out again as etp-ep-edp, so with ETP = TP an EP group is EP consecutive data-parallel
    replicas. `context_parallel` (CP) ranks split every sequence; they sit between the TP and the DP ranks, and the
    data-parallel group (`dp_group`) leaves them out. On a machine without CUDA the CPU platform layer is activated
    first, so megatron-core runs unmodified on gloo. megatron-core's checkpoint writer processes end with the rank, and
    the rank with its torchrun agent, even after a SIGKILL (process_lifetime.py).
    """
    activate_cpu_platform()
    set_nccl_environment()
    end_with_the_run()
    backend = _pick_backend(backend)
    launch = read_launch_env()
    check_layout(ParallelLayout.from_world_size(launch.world_size, tensor=tensor_parallel, pipeline=pipeline_parallel,
                                                virtual_pipeline=virtual_pipeline_parallel,
                                                sequence_parallel=sequence_parallel, expert=expert_parallel,
                                                expert_tensor=expert_tensor_parallel, context=context_parallel))
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
        os.environ.setdefault("MASTER_PORT", str(launch.master_port))
        dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    elif dist.get_world_size() != launch.world_size:
        raise RuntimeError(f"torch.distributed already initialised with world size {dist.get_world_size()}, "
                           f"but the launch environment says {launch.world_size}")

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline_parallel,
        context_parallel_size=context_parallel,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,
    )
    # As Megatron-LM does: stages get different seeds (different layers), DP replicas the same one.
    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)
    return ParallelGroups(
        tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(), mp_group=_replica_group(ps, tensor_parallel, pipeline_parallel,
                                                                       context_parallel, launch.world_size),
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tensor_parallel,
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=pipeline_parallel,
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        vpp_size=virtual_pipeline_parallel, sequence_parallel=sequence_parallel,
        world_rank=dist.get_rank(), world_size=dist.get_world_size(),
        # On the CPU platform too: there the "cuda" device is the CPU, and the device audit tracks what lives on it.
        device=torch.device("cuda", torch.cuda.current_device()),
        ep_group=ps.get_expert_model_parallel_group(), ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=expert_parallel, etp_group=ps.get_expert_tensor_parallel_group(),
        etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
        cp_group=ps.get_context_parallel_group(), cp_rank=ps.get_context_parallel_rank(), cp_size=context_parallel,
        cp_slice_group=ps.get_model_parallel_group(),
    )


def _replica_group(ps, tp: int, pp: int, cp: int, world_size: int) -> dist.ProcessGroup:
    """The TP x CP x PP ranks of this rank's data-parallel replica: megatron's model-parallel group (TP x PP) at
    CP = 1; megatron-core has none with CP, so at CP > 1 one made here (every rank creates every replica's group, in
    the same order, as torch requires)."""
    if cp == 1:
        return ps.get_model_parallel_group()
    ranks = ps.RankGenerator(tp=tp, ep=1, dp=world_size // (tp * cp * pp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    mine = None
    for members in ranks.get_ranks("tp-cp-pp"):
        group = dist.new_group(members)
        if dist.get_rank() in members:
            mine = group
    return mine


def warm_up_communicators(parallel: ParallelGroups | None = None) -> list:
    """One small all-reduce on every process group training communicates over, in the same order on every rank;
    returns those groups. NCCL creates a group's communicator, and its device buffers, lazily at the group's first
    collective; a colocated rollout engine sizes its KV cache from the free GPU memory when it starts, so the
    communicators must exist before that (rollout/server_engine.start_colocated_servers). Only these groups: each
    communicator costs GPU memory, and megatron-core creates many groups a dense model never uses. (Mixture-of-experts
    models run on the built-in engine only, which sizes nothing from free memory.)
    tests/test_device_audit.py checks that a training step communicates over no other group. Under context
    parallelism (`parallel`'s CP > 1) also the CP group and the replica's TP x CP x PP group
    (ParallelGroups.mp_group)."""
    from megatron.core import parallel_state as ps

    groups = [dist.group.WORLD, ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
              ps.get_data_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True),
              ps.get_intra_distributed_optimizer_instance_group(), ps.get_model_parallel_group()]
    if ps.is_rank_in_embedding_group():  # tied embeddings across the first and last stage
        groups.append(ps.get_embedding_group())
    if parallel is not None and parallel.cp_size > 1:
        groups += [parallel.cp_group, parallel.mp_group]
    probe = torch.zeros(1, device=torch.cuda.current_device())
    for group in groups:
        dist.all_reduce(probe, group=group)
    torch.cuda.synchronize()
    return groups


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
