"""The rollout engine the config names (rollout.engine): the builtin Megatron generator on the policy's own chunks,
a colocated vLLM engine, or rollout servers (vLLM or built-in) on nodes of their own, one per data-parallel
replica."""
from __future__ import annotations

from megatron_gtpo.config import RemoteEngineConfig, TrainConfig, VLLMEngineConfig
from megatron_gtpo.engine_table import ENGINES
from megatron_gtpo.distributed import ParallelGroups

from .model_setup import PolicyModel
from .task import Task


def build_engine(cfg: TrainConfig, task: Task, shape, policy: PolicyModel, parallel: ParallelGroups, *,
                 entropies: bool = False):
    """The engine of rollout.engine started from the policy's weights, built from its own section of the rollout
    config (rollout.builtin, rollout.vllm or rollout.remote; the others are not read). For routing replay
    (model.moe.routing_replay: rollout) the built-in engine records each token's experts, vLLM engines return them
    (their rollouts carry them). `entropies` (the built-in engine only: old_policy.engine_entropies): its rollouts
    carry each token's sampling entropy."""
    from megatron_gtpo.models.moe_routing import routed_layers
    from megatron_gtpo.rollout.builtin import BuiltinEngine

    r = cfg.rollout
    replay = cfg.model.moe.replays_routing
    layers = routed_layers(policy.chunks) if replay else None
    # Built from its own section (engine_table.Engine.section): the engines that share one share its builder.
    return {"builtin": lambda: BuiltinEngine(policy.chunks, parallel, vocab_size=shape.vocab_size,
                                             max_batch_tokens=r.builtin.max_batch_tokens, record_routing=replay,
                                             record_entropies=entropies),
            "vllm": lambda: _vllm_engine(r.vllm, cfg, parallel, layers),
            "remote": lambda: _remote_engine(r.remote, r.schedule.update_during_generation, shape, parallel,
                                             layers)}[ENGINES[r.engine].section]()


def _vllm_engine(options: VLLMEngineConfig, cfg: TrainConfig, parallel: ParallelGroups, routed_layers):
    """Colocated vLLM engines of `options` (rollout.vllm), started from the model's HF directory unless the section
    names one, in the model's dtype and seeded by the run's seed."""
    from megatron_gtpo.rollout import import_vllm_engine

    vllm_engine = import_vllm_engine("rollout.engine: vllm", "rollout.engine: builtin")
    return vllm_engine.VLLMEngine.create(options.hf_dir or cfg.model.hf_dir, parallel, dtype=cfg.model.dtype,
                                         gpu_memory_utilization=options.gpu_memory_utilization,
                                         kv_cache_memory_bytes=options.kv_cache_memory_bytes,
                                         tensor_parallel_size=options.tensor_parallel, seed=cfg.seed,
                                         routed_layers=routed_layers)


def _remote_engine(options: RemoteEngineConfig, update_during_generation: bool, shape, parallel: ParallelGroups,
                   routed_layers):
    """This data-parallel replica's rollout server of `options` (rollout.remote)."""
    from megatron_gtpo.rollout.remote_channel import parse_address
    from megatron_gtpo.rollout.remote_client import RemoteEngine

    for address in options.addresses:
        parse_address(address)  # every rank fails alike on a malformed address
    return RemoteEngine.connect(options.addresses[parallel.dp_rank], parallel, shape,
                                connect_timeout_s=options.connect_timeout_s,
                                request_timeout_s=options.request_timeout_s, routed_layers=routed_layers,
                                update_during_generation=update_during_generation,
                                reconnect_timeout_s=options.reconnect_timeout_s, weights=options.weights)
