"""The rollout engine the config names (rollout.engine): the builtin Megatron generator on the policy's own chunks,
a colocated vLLM engine, or rollout servers (vLLM or built-in) on nodes of their own, one per data-parallel
replica."""
from __future__ import annotations

import sys

from megatron_gtpo.config import TrainConfig
from megatron_gtpo.distributed import ParallelGroups

from .model_setup import PolicyModel
from .task import Task


def build_engine(cfg: TrainConfig, task: Task, shape, policy: PolicyModel, parallel: ParallelGroups):
    """The engine of rollout.engine started from the policy's weights. For routing replay (algorithm.routing_replay:
    rollout) the built-in engine records each token's experts, vLLM engines return them (their rollouts carry them)."""
    from megatron_gtpo.models.moe_routing import routed_layers
    from megatron_gtpo.rollout.builtin import BuiltinEngine

    replay = cfg.algorithm.replays_routing
    layers = routed_layers(policy.chunks) if replay else None
    engine = {"builtin": lambda: BuiltinEngine(policy.chunks, parallel, vocab_size=shape.vocab_size,
                                               max_batch_tokens=cfg.rollout.builtin_max_batch_tokens,
                                               record_routing=replay),
              "vllm": lambda: _vllm_engine(cfg, task, parallel, layers),
              "vllm_remote": lambda: _remote_engine(cfg, shape, parallel, layers),
              "builtin_remote": lambda: _remote_engine(cfg, shape, parallel, layers)}[cfg.rollout.engine]()
    r = cfg.rollout
    if r.engine in ("vllm", "vllm_remote") and (r.top_k or r.top_p < 1) and parallel.world_rank == 0:
        print("warning: with top_k / top_p, vLLM reports log-probs of the truncated distribution, the builtin engine "
              "and the old-policy pass those of the full one (rollout/engine.py): rollout_logprob_mismatch then "
              "includes -log(kept probability mass)", file=sys.stderr)
    return engine


def _vllm_engine(cfg: TrainConfig, task: Task, parallel: ParallelGroups, routed_layers):
    from megatron_gtpo.rollout.vllm_engine import VLLMEngine

    r = cfg.rollout
    return VLLMEngine.create(r.vllm_hf_dir or cfg.model.hf_dir, parallel, dtype=cfg.model.dtype,
                             gpu_memory_utilization=r.vllm_gpu_memory_utilization,
                             kv_cache_memory_bytes=r.vllm_kv_cache_memory_bytes,
                             tensor_parallel_size=r.vllm_tensor_parallel, seed=cfg.seed, routed_layers=routed_layers)


def _remote_engine(cfg: TrainConfig, shape, parallel: ParallelGroups, routed_layers):
    from megatron_gtpo.rollout.remote_channel import parse_address
    from megatron_gtpo.rollout.remote_client import RemoteEngine

    r = cfg.rollout
    for address in r.remote_addresses:
        parse_address(address)  # every rank fails alike on a malformed address
    return RemoteEngine.connect(r.remote_addresses[parallel.dp_rank], parallel, shape,
                                connect_timeout_s=r.remote_connect_timeout_s,
                                request_timeout_s=r.remote_request_timeout_s, routed_layers=routed_layers,
                                update_during_generation=r.update_during_generation,
                                reconnect_timeout_s=r.remote_reconnect_timeout_s)
