"""The memory plan's terms, bytes on one GPU: each pipeline stage's training state and transient allocations
(`StageMemory`: parameters, gradients and optimizer state exactly as megatron-core's DDP + distributed Adam allocate
them; activations, logits, workspaces and dispatcher buffers as estimates), and what the rollout engine takes
(`RolloutMemory`: a colocated vLLM engine's share of the GPU, or the built-in engine's KV cache)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_gtpo.distributed.vocab_parallel import WORKSPACE_BYTES_PER_ELEMENT, chunk_tokens_for_budget
from megatron_gtpo.layout import ParallelLayout
from megatron_gtpo.models.moe_routing import EXPERT_INDEX_DTYPE
from megatron_gtpo.models.qwen import ModelShape, padded_vocab_size
from megatron_gtpo.rollout.placement import engine_hosts

from .activations import context_kv_bytes, layer_activation_bytes, pipeline_micro_batches_in_flight
from .counts import (expert_data_parallel_size, expert_parameter_count, parameter_count, stage_layer_counts,
                     total_parameter_count)
from .inputs import BYTES_PER_ELEMENT, GIB, Settings, Workload

def vllm_tensor_parallel(shape: ModelShape, layout: ParallelLayout, settings: Settings) -> int:
    """The given vLLM TP size, else the largest divisor of the training TP (within a node) that divides the attention
    heads: colocated engines then tile every GPU, TP / vLLM TP of them per pipeline stage (rollout/placement.py)."""
    if settings.vllm_tensor_parallel is not None:
        return settings.vllm_tensor_parallel
    limit = min(layout.tensor, settings.gpus_per_node)
    return max(v for v in range(1, limit + 1) if layout.tensor % v == 0 and shape.num_attention_heads % v == 0)


def rollout_engines(layout: ParallelLayout, vllm_tp: int) -> int:
    """Colocated vLLM engines of the whole job: rollout/placement.engine_hosts per TP x PP ranks of each replica's
    context-parallel rank 0 (the trainer starts engines there only: rollout/weight_sync.is_sync_destination), times
    DP. At CP > 1 the other CP ranks' GPUs do not generate."""
    return layout.data * len(engine_hosts(tp=layout.tensor, pp=layout.pipeline, engine_tp=vllm_tp))


def vllm_weight_bytes(shape: ModelShape, vllm_tp: int) -> float:
    """The weights on one GPU of a vLLM engine: the whole model in bf16, split over the engine's TP."""
    return total_parameter_count(shape) * 2.0 / vllm_tp


def vllm_kv_bytes_per_token(shape: ModelShape, vllm_tp: int) -> int:
    """K and V of one cached token on one GPU of a vLLM engine (bf16); vLLM replicates KV heads when TP > groups."""
    kv_heads_per_gpu = max(1, shape.num_query_groups // vllm_tp)
    return 2 * shape.num_layers * kv_heads_per_gpu * shape.head_dim * 2


@dataclass
class StageMemory:
    """Bytes on one GPU of a pipeline stage."""

    pp_rank: int
    params: int
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    logits: float  # the last stage's logits shard and its gradient, in the model dtype
    logprob_workspaces: float  # the vocab-parallel op's two fp32 [chunk, V/TP] workspaces
    # A mixture-of-experts layer's all-to-all: the k copies of the micro-batch's tokens sent and received, while one
    # layer's forward or backward runs (0 for a dense model)
    dispatcher: float = 0.0
    # Routing replay's record of the step's routing on this rank (routing_record_bytes; 0 without replay)
    routing_record: float = 0.0
    # Context parallelism's keys and values in flight while one layer's attention runs (activations.context_kv_bytes)
    context_kv: float = 0.0

    @property
    def persistent(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def transient(self) -> float:
        return self.activations + self.logits + self.logprob_workspaces + self.dispatcher + self.context_kv


def stage_memory(shape: ModelShape, layout: ParallelLayout, workload: Workload, settings: Settings, pp_rank: int, *,
                 distributed_optimizer: bool, recompute: bool) -> StageMemory:
    """One GPU of pipeline stage `pp_rank` at the training peak of one micro-batch. Under context parallelism
    (CP = C) a rank holds L / C tokens of each sequence: its activations, logits, log-prob workspaces and dispatcher
    buffers are those of L / C tokens, plus the keys and values the attention exchanges (context_kv_bytes)."""
    e = BYTES_PER_ELEMENT[settings.params_dtype]
    params = parameter_count(shape, layout, pp_rank)
    optimizer = optimizer_bytes(shape, layout, settings, pp_rank, distributed_optimizer=distributed_optimizer)
    t, s, b, c = layout.tensor, workload.max_sequence_tokens, workload.micro_batch_size, layout.context
    tokens = s * b / c / (t if layout.sequence_parallel else 1)
    dispatcher = 2.0 * tokens * shape.moe.topk * shape.hidden_size * e if shape.moe else 0.0
    logits, workspaces = _logits_and_workspaces(shape, layout, workload, settings, pp_rank)
    context_kv = context_kv_bytes(shape, seq_len=s, micro_batch_size=b, tensor_parallel=t, context_parallel=c,
                                  kernels=settings.kernels, bytes_per_element=e)
    return StageMemory(pp_rank, params, params * e, params * 4.0, optimizer,
                       _activation_bytes(shape, layout, workload, settings, pp_rank, recompute=recompute), logits,
                       workspaces, dispatcher,
                       routing_record_bytes(shape, layout, workload, pp_rank) if settings.routing_replay else 0.0,
                       context_kv)


def routing_record_bytes(shape: ModelShape, layout: ParallelLayout, workload: Workload, pp_rank: int) -> int:
    """Routing replay's record on one rank of stage `pp_rank`, at the maximum lengths: every sequence of its replica
    (the built-in engine generates the replica's share of the step on every rank of it) with, per fed token (its
    prompt and all its tokens but the last), the top-k experts of each MoE layer of the stage, in the dtype the
    record is kept in (rollout.engine.Rollout's routing, models/moe_routing.EXPERT_INDEX_DTYPE; vLLM's routing
    becomes the same record, on the GPU from the step batch on). 0 for a dense model."""
    if shape.moe is None:
        return 0
    sequences = workload.sequences_per_step // layout.data
    return sequences * (workload.max_sequence_tokens - 1) * stage_layer_counts(shape, layout)[pp_rank] \
        * shape.moe.topk * EXPERT_INDEX_DTYPE.itemsize


def optimizer_bytes(shape: ModelShape, layout: ParallelLayout, settings: Settings, pp_rank: int, *,
                    distributed_optimizer: bool) -> float:
    """Adam's moments in fp32; bf16 models add an fp32 master copy (fp32 models step their own weights). The
    distributed optimizer shards the dense parameters' state over DP x CP (megatron-core reduces the gradients and
    shards the state over the data-parallel group with the context-parallel ranks), the experts' over the
    expert-DP group."""
    params = parameter_count(shape, layout, pp_rank)
    experts = expert_parameter_count(shape, layout, pp_rank)
    optimizer_bytes_per_param = 8 + (4 if settings.params_dtype != "float32" else 0)
    return ((params - experts) / (layout.data * layout.context if distributed_optimizer else 1)
            + experts / (expert_data_parallel_size(layout) if distributed_optimizer else 1)) \
        * optimizer_bytes_per_param


def _activation_bytes(shape: ModelShape, layout: ParallelLayout, workload: Workload, settings: Settings,
                      pp_rank: int, *, recompute: bool) -> float:
    """The activations the stage keeps for the micro-batches in flight at its peak; under full recompute, one
    layer's full activations on top (backward re-runs one layer at a time)."""
    b, e = workload.micro_batch_size, BYTES_PER_ELEMENT[settings.params_dtype]
    sequences_per_rank = workload.sequences_per_step // (layout.data * workload.mini_batches_per_step)
    micro_batches = math.ceil(sequences_per_rank / b)
    layers = stage_layer_counts(shape, layout)[pp_rank]

    def per_layer(recomputed: bool) -> int:
        return layer_activation_bytes(shape, seq_len=workload.max_sequence_tokens, micro_batch_size=b,
                                      tensor_parallel=layout.tensor, sequence_parallel=layout.sequence_parallel,
                                      kernels=settings.kernels, bytes_per_element=e,
                                      recompute=recomputed, expert_tensor_parallel=layout.expert_tensor_size,
                                      context_parallel=layout.context)

    activations = pipeline_micro_batches_in_flight(layout, pp_rank, micro_batches) * layers * per_layer(recompute)
    if recompute:
        activations += per_layer(False)
    return activations


def _logits_and_workspaces(shape: ModelShape, layout: ParallelLayout, workload: Workload, settings: Settings,
                           pp_rank: int) -> tuple[float, float]:
    """The last stage's: the vocab-parallel log-prob/entropy op keeps this micro-batch's logits shard for backward
    and returns a gradient of the same size and dtype; its own two fp32 workspaces are chunk-sized (the trainer's
    chunk), both for the L / CP tokens of a sequence a context-parallel rank holds (the log-probs are computed where
    the logits are, never gathered). Other stages: none."""
    if pp_rank != layout.pipeline - 1:
        return 0.0, 0.0
    t, s, b = layout.tensor, workload.max_sequence_tokens, workload.micro_batch_size
    vocab_local = padded_vocab_size(shape.vocab_size, t) // t
    local_tokens = math.ceil(s * b / layout.context)
    logits = 2.0 * local_tokens * vocab_local * BYTES_PER_ELEMENT[settings.params_dtype]
    chunk = min(local_tokens, chunk_tokens_for_budget(settings.logprob_workspace_mib * 2**20, vocab_local))
    return logits, 2.0 * chunk * vocab_local * WORKSPACE_BYTES_PER_ELEMENT


@dataclass(frozen=True)
class RolloutMemory:
    """What the rollout engine takes on one GPU. A colocated vLLM engine (`colocated`): its share of every GPU
    (`budget`: its weights, bf16, every engine holding the whole model split over vLLM's TP; its `overhead`; the KV
    cache that is left), of which level-1 sleep keeps the overhead (`asleep`) while training runs. Without vLLM the
    built-in engine generates on the training model, with a static KV cache of its replica's rows (or of
    builtin_max_batch_tokens token slots per batch) on each stage's layers, its KV heads split over TP; at CP > 1
    it does not (rollout servers generate: no KV cache here)."""

    colocated: bool
    vllm_tp: int
    engines: int
    budget: float
    weights: float
    overhead: float
    kv_bytes: float  # vLLM's KV cache (negative: it does not fit)
    kv_bytes_per_token: int
    kv_tokens: int
    full_sequences: int  # full-length sequences vLLM's KV cache holds at once
    sequences_per_engine: int
    builtin_tokens: int
    builtin_kv: float

    @property
    def asleep(self) -> float:
        return self.overhead


def rollout_memory(shape: ModelShape, layout: ParallelLayout, workload: Workload, settings: Settings) -> RolloutMemory:
    """The rollout engine's memory on one GPU of `layout` (RolloutMemory)."""
    colocated = settings.vllm_memory_fraction is not None
    vllm_tp = vllm_tensor_parallel(shape, layout, settings)
    engines = rollout_engines(layout, vllm_tp) if colocated else 0
    budget = settings.vllm_memory_fraction * (settings.gpu_memory_gib * GIB) if colocated else 0.0
    weights = vllm_weight_bytes(shape, vllm_tp) if colocated else 0.0
    overhead = settings.vllm_overhead_gib * GIB if colocated else 0.0
    kv_bytes = budget - weights - overhead
    kv_bytes_per_token = vllm_kv_bytes_per_token(shape, vllm_tp)
    kv_tokens = max(0, int(kv_bytes // kv_bytes_per_token)) if colocated else 0
    # Without vLLM at CP > 1, rollout servers generate: the built-in engine does not run in the trainer's processes
    builtin = not colocated and layout.context == 1
    builtin_tokens = workload.sequences_per_step // layout.data * workload.max_sequence_tokens if builtin else 0
    if settings.builtin_max_batch_tokens is not None:
        builtin_tokens = min(builtin_tokens, settings.builtin_max_batch_tokens)
    builtin_kv = builtin_tokens * max(stage_layer_counts(shape, layout)) * 2 \
        * max(1, shape.num_query_groups // layout.tensor) * shape.head_dim * BYTES_PER_ELEMENT[settings.params_dtype]
    return RolloutMemory(colocated=colocated, vllm_tp=vllm_tp, engines=engines, budget=budget, weights=weights,
                         overhead=overhead, kv_bytes=kv_bytes, kv_bytes_per_token=kv_bytes_per_token,
                         kv_tokens=kv_tokens, full_sequences=kv_tokens // workload.max_sequence_tokens,
                         sequences_per_engine=math.ceil(workload.sequences_per_step / engines) if colocated else 0,
                         builtin_tokens=builtin_tokens, builtin_kv=builtin_kv)
