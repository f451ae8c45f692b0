"""The split of a job's nodes between rollout servers and training (rollout.engine vllm_remote): every split that
runs, timed by the phase-time model (phases.py), against the layout on all the nodes with colocated engines."""
from __future__ import annotations

import math
from dataclasses import asdict, replace

from megatron_gtpo.layout import ParallelLayout, RolloutLayout, check_layout
from megatron_gtpo.models.qwen import ModelShape

from .inputs import GIB, Settings, Workload, check_plan
from .memory import vllm_kv_bytes_per_token, vllm_weight_bytes
from .phases import generation_phase_s, phase_assumptions, step_phases, training_phase_s, weight_sync_s
from .planner import plan


def server_tensor_parallel_sizes(shape: ModelShape, gpus_per_node: int) -> list[int]:
    """The vLLM TP sizes a rollout server can take within a node: dividing the attention heads, and dividing or
    divided by the KV heads (vLLM splits them, or replicates them when TP exceeds them)."""
    return [v for v in range(1, gpus_per_node + 1) if shape.num_attention_heads % v == 0
            and (shape.num_query_groups % v == 0 or v % shape.num_query_groups == 0)]


def _split(shape: ModelShape, layout: ParallelLayout, workload: Workload, settings: Settings, *, data_parallel: int,
           server_tp: int, max_staleness: int) -> dict:
    """`data_parallel` replicas of `layout` on training nodes of their own, one rollout server of `server_tp` GPUs
    per replica (the vllm_remote rule) on rollout nodes of their own (disaggregated.sbatch: ROLLOUT_NODES x
    SERVERS_PER_NODE servers; the caller spreads them evenly): its nodes, memory and phase times. ValueError naming
    why it cannot run."""
    gpus_per_node = settings.gpus_per_node
    training = replace(layout, data=data_parallel)
    rollout_nodes = math.ceil(data_parallel * server_tp / gpus_per_node)
    trained = plan(shape, training, workload, replace(settings, vllm_memory_fraction=None))
    peak_gib = trained.memory_gib["training_peak"]
    if peak_gib > settings.gpu_memory_gib:
        raise ValueError(f"TP={layout.tensor} PP={layout.pipeline} DP={data_parallel}: training needs "
                         f"{peak_gib:.1f} GiB per GPU, more than the {settings.gpu_memory_gib:g} GiB GPU")
    kv_bytes = settings.server_memory_fraction * settings.gpu_memory_gib * GIB - vllm_weight_bytes(shape, server_tp) \
        - settings.vllm_overhead_gib * GIB
    kv_tokens = max(0, int(kv_bytes // vllm_kv_bytes_per_token(shape, server_tp)))
    if kv_tokens < workload.max_sequence_tokens:
        raise ValueError(f"a server of TP={server_tp}: its KV cache ({max(kv_bytes, 0) / GIB:.2f} GiB per GPU) "
                         f"cannot hold one sequence of {workload.max_sequence_tokens} tokens")
    generation = generation_phase_s(shape, workload, settings, engines=data_parallel, vllm_tp=server_tp,
                                    kv_tokens_per_engine=kv_tokens)
    phases = step_phases(generation, training_phase_s(shape, workload, settings, gpus=training.world_size,
                                                       tensor_parallel=layout.tensor),
                          weight_sync_s(shape, settings), max_staleness)
    busy_s = phases["step_s"] - phases["weight_sync_s"]
    return {"training": {"nodes": math.ceil(training.world_size / gpus_per_node), "gpus": training.world_size,
                         "layout": asdict(training), "training_peak_gib": peak_gib},
            "rollout": {"nodes": rollout_nodes, "gpus": data_parallel * server_tp, "servers": data_parallel,
                        "server_tp": server_tp, "servers_per_node": data_parallel // rollout_nodes,
                        "kv_cache_gib_per_gpu": kv_bytes / GIB, "kv_tokens_per_engine": kv_tokens,
                        **{k: generation[k] for k in ("sequences_per_engine", "running_per_engine", "waves")}},
            "phases_s": phases,
            "idle_s": {"training": busy_s - phases["train_s"], "rollout": busy_s - phases["generate_s"]}}


def _colocated(shape: ModelShape, layout: ParallelLayout, workload: Workload, settings: Settings) -> dict:
    """Today's default, for comparison: `layout` on all the job's GPUs with colocated vLLM engines on the same GPUs
    (plan()'s engines and KV cache), generation then training, nothing overlapped. Its weight sync (a device-local
    reload) and the engines' sleep and wake are not counted. No phase times where it has no vLLM engine that holds a
    full-length sequence (or cannot run at all)."""
    result = {"layout": {"tensor": layout.tensor, "pipeline": layout.pipeline, "data": layout.data},
              "gpus": layout.world_size, "phases_s": None}
    try:
        colocated = plan(shape, layout, workload, settings)
    except ValueError as e:
        return {**result, "fits": False, "reasons": [str(e)]}
    kv = colocated.kv_cache
    result.update(fits=colocated.fits, reasons=colocated.reasons, engines=kv["engines"],
                  vllm_tp=kv["vllm_tensor_parallel"], kv_tokens_per_engine=kv["tokens"])
    if kv["full_length_sequences"] < 1:  # plan()'s reasons say why, unless no vLLM engine is planned
        return result
    generation = generation_phase_s(shape, workload, settings, engines=kv["engines"],
                                    vllm_tp=kv["vllm_tensor_parallel"], kv_tokens_per_engine=kv["tokens"])
    training = training_phase_s(shape, workload, settings, gpus=layout.world_size, tensor_parallel=layout.tensor)
    return {**result, "phases_s": step_phases(generation, training, None, max_staleness=0)}



def plan_disaggregated(shape: ModelShape, layout: ParallelLayout, workload: Workload, settings: Settings, *,
                       nodes: int, max_staleness: int = 1, server_tp: int | None = None,
                       model_name: str = "") -> dict:
    """The split of `nodes` nodes between training and rollout (rollout.engine vllm_remote) with the shortest step at
    rollout.schedule.max_staleness `max_staleness` (step_s), against `layout` on all of them with colocated engines.

    Training runs DP replicas of `layout` (its TP, PP and the rest; DP is the split's) on nodes of their own, and
    must fit in memory (plan()'s training peak); rollout runs one vLLM server of `server_tp` GPUs per replica (the
    vllm_remote rule; every size of server_tensor_parallel_sizes when None) on nodes of their own, each holding the
    model and a KV cache of at least one full-length sequence in server_memory_fraction of its GPUs. Ties go to
    fewer nodes, then fewer GPUs. ValueError when no split runs, with the reasons."""
    gpus_per_node = settings.gpus_per_node
    replica_gpus = layout.tensor * layout.pipeline * layout.context
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    check_plan(shape, replace(layout, data=None), workload, replace(settings, vllm_memory_fraction=None))
    # The engine's rules, at the fewest replicas the experts fit (EP x ETP must divide TP x CP x DP); each split's own
    # DP is checked by plan() and a DP that cannot hold them is one of the reasons.
    experts = layout.expert * layout.expert_tensor_size
    fewest = experts // math.gcd(layout.tensor * layout.context, experts)
    check_layout(replace(layout, data=fewest), shape=shape, rollout=RolloutLayout("vllm_remote", 1, fewest))
    allowed = server_tensor_parallel_sizes(shape, gpus_per_node)
    if server_tp is not None and server_tp not in allowed:
        raise ValueError(f"a rollout server's TP must divide the model's {shape.num_attention_heads} attention heads, "
                         f"divide or be divided by its {shape.num_query_groups} KV heads, and fit a node of "
                         f"{gpus_per_node} GPUs ({', '.join(map(str, allowed))}); got {server_tp}")
    splits, reasons = _splits(shape, layout, workload, settings, nodes=nodes, max_staleness=max_staleness,
                              server_tps=[server_tp] if server_tp is not None else allowed)
    if not splits:
        why = "; ".join(dict.fromkeys(reasons)) or (
            f"one training replica (TP x PP x CP = {replica_gpus} GPUs) and one rollout server, on nodes of their own, "
            f"need more than {nodes} node(s)")
        raise ValueError(f"no split of {nodes} node(s) x {gpus_per_node} GPUs into training and rollout runs: {why}")
    splits.sort(key=lambda s: (s["phases_s"]["step_s"], s["training"]["nodes"] + s["rollout"]["nodes"],
                               s["training"]["gpus"] + s["rollout"]["gpus"]))
    colocated = _colocated(shape, replace(layout, data=nodes * gpus_per_node // replica_gpus), workload, settings)
    return {"model": model_name, "nodes": nodes, "gpus_per_node": gpus_per_node,
            "max_staleness": max_staleness, "staleness_needed": 1,
            **splits[0], "colocated": colocated, "alternatives": splits[1:],
            "assumptions": phase_assumptions(workload, settings)}


def _splits(shape: ModelShape, layout: ParallelLayout, workload: Workload, settings: Settings, *, nodes: int,
            max_staleness: int, server_tps: list[int]) -> tuple[list[dict], list[str]]:
    """Every split (`_split`) of `nodes` nodes with servers of each of `server_tps` GPUs that fits the nodes and
    spreads its servers evenly, and the reasons the others that fit the nodes cannot run."""
    gpus_per_node = settings.gpus_per_node
    replica_gpus = layout.tensor * layout.pipeline * layout.context
    splits, reasons = [], []
    for tp in server_tps:
        for dp in range(1, nodes * gpus_per_node // replica_gpus + 1):
            rollout_nodes = math.ceil(dp * tp / gpus_per_node)
            if math.ceil(dp * replica_gpus / gpus_per_node) + rollout_nodes > nodes or dp % rollout_nodes:
                continue  # more nodes than the job's, or servers that do not spread evenly over their nodes
            try:
                splits.append(_split(shape, layout, workload, settings, data_parallel=dp, server_tp=tp,
                                     max_staleness=max_staleness))
            except ValueError as e:
                reasons.append(str(e))
    return splits, reasons
