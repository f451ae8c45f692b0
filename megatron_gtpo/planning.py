"""Memory, FLOPs and phase-time planning for a Qwen2 / Qwen3 model under a TP/PP/DP layout (the logic behind
tools/plan.py).

The contract: `plan(shape, layout, workload, settings)` returns the per-stage memory (parameters, gradients and
optimizer state exactly as megatron-core's DDP + distributed Adam allocate them; activations, vLLM and allocator
slack as estimates) and the FLOPs of one RL step; `check_plan` refuses what cannot run. `plan_disaggregated` splits a
job's nodes between rollout servers and training (rollout.engine vllm_remote) by a phase-time model whose rates and
efficiencies are assumptions (Settings). docs/planning.md says which numbers are exact, which are estimates, and how
each was checked.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import partial

from megatron_gtpo.distributed.vocab_parallel import WORKSPACE_BYTES_PER_ELEMENT, chunk_tokens_for_budget
from megatron_gtpo.layout import ParallelLayout, RolloutLayout, check_layout
from megatron_gtpo.models.qwen import ModelShape, padded_vocab_size
from megatron_gtpo.rollout.placement import engine_hosts

GIB = float(2**30)
BYTES_PER_ELEMENT = {"bfloat16": 2, "float32": 4}
KERNEL_PROFILES = ("te", "local")


@dataclass(frozen=True)
class Workload:
    """One RL step: prompts x responses, each sequence at most max_prompt + max_response tokens. The phase-time
    model also needs the expected (mean) response length: `mean_response_tokens`, else half the maximum."""

    prompts_per_step: int = 128
    num_responses_per_prompt: int = 16
    max_prompt_tokens: int = 2048
    max_response_tokens: int = 4096
    micro_batch_size: int = 1  # sequences per micro-batch
    mini_batches_per_step: int = 1
    epochs_per_step: int = 1
    mean_response_tokens: int | None = None  # None: half of max_response_tokens (an assumption)

    @property
    def expected_response_tokens(self) -> int:
        """The mean response length the phase-time model uses."""
        if self.mean_response_tokens is not None:
            return self.mean_response_tokens
        return max(1, self.max_response_tokens // 2)

    @property
    def max_sequence_tokens(self) -> int:
        return self.max_prompt_tokens + self.max_response_tokens

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.num_responses_per_prompt


@dataclass(frozen=True)
class Settings:
    gpu_memory_gib: float = 80.0
    params_dtype: str = "bfloat16"
    distributed_optimizer: bool = True
    recompute_activations: bool = False
    kernels: str = "te"  # te | local (see _LAYER_ACTIVATION_TERMS)
    vllm_memory_fraction: float | None = 0.5  # None: no colocated vLLM engine
    vllm_tensor_parallel: int | None = None  # None: see vllm_tensor_parallel()
    gpus_per_node: int = 8
    vllm_overhead_gib: float = 2.0
    framework_overhead_gib: float = 3.0  # CUDA context, NCCL buffers, cuBLAS workspaces (an estimate)
    # PyTorch's caching allocator holds freed blocks and rounds sizes up; with micro-batches of varying length its
    # reserved memory runs above the live peak. Counted as this fraction of the transient allocations (activations,
    # logits, workspaces). An estimate, to be replaced by the H100 measurement (max_memory_reserved / allocated).
    allocator_slack_fraction: float = 0.15
    logprob_workspace_mib: float = 256.0  # model.logprob_workspace_mib: the vocab-parallel op's fp32 workspaces
    # Without a colocated vLLM the built-in engine generates on the training model: its static KV cache holds at
    # most this many token slots per batch (rollout.builtin_max_batch_tokens; None: every row of a replica at once).
    builtin_max_batch_tokens: int | None = None
    # The phase-time model (plan_disaggregated): one GPU's peak rates (H100 SXM datasheet: bf16 dense, HBM3) and the
    # fractions of them each phase reaches. The fractions are assumptions, not measurements.
    peak_flops_per_s: float = 989e12
    hbm_bytes_per_s: float = 3.35e12
    training_mfu: float = 0.4  # old_logprob and update model FLOPs / peak (bubbles and communication included)
    generation_mfu: float = 0.5  # prefill, and a decode step where its FLOPs outlast its reads
    decode_bandwidth_efficiency: float = 0.6  # of HBM bandwidth a decode step's weight and KV-cache reads reach
    # One replica's weight sync into its rollout server, NCCL across nodes from one destination rank: half the line
    # rate of a 400 Gb/s NIC (8 per node, one per GPU), replicas at once.
    weight_sync_bytes_per_s: float = 25e9
    server_memory_fraction: float = 0.9  # a rollout server's share of its GPUs (remote_server --gpu-memory-utilization)


def check_plan(shape: ModelShape, layout: ParallelLayout, workload: Workload | None = None,
                settings: Settings | None = None) -> None:
    """ValueError naming the problem for what cannot run: the layout's rules (layout.check_layout, with the
    colocated vLLM engines of `settings`), then the workload's and the settings' own."""
    vllm_tp = None
    if settings is not None and settings.vllm_memory_fraction is not None:
        vllm_tp = settings.vllm_tensor_parallel
    check_layout(layout, shape=shape,
                 prompts_per_step=workload.prompts_per_step if workload is not None else None,
                 mini_batches_per_step=workload.mini_batches_per_step if workload is not None else 1,
                 rollout=RolloutLayout("vllm", vllm_tp) if vllm_tp is not None else None, training=True)
    if workload is not None:
        w = workload
        for name in ("prompts_per_step", "num_responses_per_prompt", "max_prompt_tokens", "max_response_tokens",
                     "micro_batch_size", "mini_batches_per_step", "epochs_per_step"):
            if getattr(w, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(w, name)}")
        if w.mean_response_tokens is not None and not 1 <= w.mean_response_tokens <= w.max_response_tokens:
            raise ValueError(f"mean_response_tokens must be in [1, max_response_tokens = {w.max_response_tokens}], "
                             f"got {w.mean_response_tokens}")
        if w.max_sequence_tokens > shape.max_position_embeddings:
            raise ValueError(f"max_prompt_tokens + max_response_tokens = {w.max_sequence_tokens} exceeds the model's "
                             f"max_position_embeddings {shape.max_position_embeddings}")
    if settings is not None:
        if settings.params_dtype not in BYTES_PER_ELEMENT:
            raise ValueError(f"params_dtype {settings.params_dtype!r} is not one of {', '.join(BYTES_PER_ELEMENT)}")
        if settings.kernels not in KERNEL_PROFILES:
            raise ValueError(f"kernels {settings.kernels!r} is not one of {', '.join(KERNEL_PROFILES)}")
        if settings.gpu_memory_gib <= 0:
            raise ValueError(f"gpu_memory_gib must be > 0, got {settings.gpu_memory_gib}")
        if settings.vllm_memory_fraction is not None and not 0 < settings.vllm_memory_fraction < 1:
            raise ValueError(f"vllm_memory_fraction must be in (0, 1), got {settings.vllm_memory_fraction}")
        for name in ("peak_flops_per_s", "hbm_bytes_per_s", "weight_sync_bytes_per_s"):
            if getattr(settings, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(settings, name)}")
        for name in ("training_mfu", "generation_mfu", "decode_bandwidth_efficiency", "server_memory_fraction"):
            if not 0 < getattr(settings, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(settings, name)}")
        if vllm_tp is not None and vllm_tp > settings.gpus_per_node:
            raise ValueError(f"vLLM tensor parallel size {vllm_tp} exceeds the {settings.gpus_per_node} GPUs of a "
                             f"node (one engine runs on one node)")


# ---------------------------------------------------------------------------------------------- parameters


def stage_layer_counts(shape: ModelShape, layout: ParallelLayout) -> list[int]:
    """Transformer layers held by each pipeline rank (all its virtual chunks together); even splits only."""
    return [shape.num_layers // layout.pipeline] * layout.pipeline


def _attention_matrix_count(shape: ModelShape, tensor_parallel: int) -> int:
    """The weights of one decoder layer's attention matmuls on one TP rank (every matrix is split)."""
    h, t = shape.hidden_size, tensor_parallel
    qkv_out = (shape.num_attention_heads + 2 * shape.num_query_groups) * shape.head_dim // t
    return qkv_out * h + h * shape.num_attention_heads * shape.head_dim // t  # linear_qkv, attention output


def _mlp_matrix_count(shape: ModelShape, tensor_parallel: int, experts: int | None = None) -> int:
    """One decoder layer's MLP matrices on one TP rank (linear_fc1: gate and up, linear_fc2): the dense MLP split
    over `tensor_parallel`, or `experts` experts (default all) of a mixture-of-experts layer, each split over
    `tensor_parallel` (then the expert-TP size)."""
    if shape.moe is None:
        return 3 * shape.ffn_hidden_size // tensor_parallel * shape.hidden_size
    experts = shape.moe.num_experts if experts is None else experts
    return experts * 3 * shape.moe.ffn_hidden_size // tensor_parallel * shape.hidden_size


def _router_count(shape: ModelShape) -> int:
    """A mixture-of-experts layer's router [E, H] (replicated on every rank); 0 for a dense model."""
    return shape.moe.num_experts * shape.hidden_size if shape.moe else 0


def layer_parameter_count(shape: ModelShape, tensor_parallel: int, expert_parallel: int = 1,
                          expert_tensor_parallel: int | None = None) -> int:
    """One decoder layer on one TP rank: its matrices (split; a mixture-of-experts layer's E / EP experts over the
    expert-TP size, default TP), the router and RMSNorm weights (replicated) and the q/k/v bias (split)."""
    qkv_bias = (shape.num_attention_heads + 2 * shape.num_query_groups) * shape.head_dim // tensor_parallel
    experts = shape.moe.num_experts // expert_parallel if shape.moe else None
    return (_attention_matrix_count(shape, tensor_parallel)
            + _mlp_matrix_count(shape, expert_tensor_parallel or tensor_parallel, experts)
            + _router_count(shape)
            + 2 * shape.hidden_size  # input and pre-MLP RMSNorm
            + (2 * shape.head_dim if shape.qk_norm else 0)  # per-head q and k RMSNorm (Qwen3)
            + (qkv_bias if shape.qkv_bias else 0))  # Qwen2


def parameter_count(shape: ModelShape, layout: ParallelLayout, pp_rank: int) -> int:
    """Parameters on one rank of pipeline stage `pp_rank` (every TP rank of a stage holds the same number)."""
    if not 0 <= pp_rank < layout.pipeline:
        raise ValueError(f"pp_rank must be in [0, {layout.pipeline}), got {pp_rank}")
    t = layout.tensor
    table = padded_vocab_size(shape.vocab_size, t) // t * shape.hidden_size
    count = stage_layer_counts(shape, layout)[pp_rank] * layer_parameter_count(shape, t, layout.expert,
                                                                                layout.expert_tensor_size)
    first, last = pp_rank == 0, pp_rank == layout.pipeline - 1
    if first:
        count += table  # word embeddings (RoPE has no parameters)
    if last:
        count += shape.hidden_size  # final RMSNorm
        if not shape.tie_word_embeddings or not first:
            count += table  # output layer; with tied embeddings and PP > 1 the last stage keeps a synced copy
    return count


def expert_parameter_count(shape: ModelShape, layout: ParallelLayout, pp_rank: int) -> int:
    """The experts' parameters on one rank of pipeline stage `pp_rank` (E / EP experts per layer, each split over
    ETP); their gradients are reduced, and their optimizer state sharded, over the expert-data-parallel group."""
    if shape.moe is None:
        return 0
    per_layer = _mlp_matrix_count(shape, layout.expert_tensor_size, shape.moe.num_experts // layout.expert)
    return stage_layer_counts(shape, layout)[pp_rank] * per_layer


def expert_data_parallel_size(layout: ParallelLayout) -> int:
    """megatron-core's expert-data-parallel size: a stage's TP x DP ranks laid out again as ETP x EP x EDP."""
    return layout.tensor * layout.data // (layout.expert_tensor_size * layout.expert)


def total_parameter_count(shape: ModelShape) -> int:
    """The unsharded model, padded vocabulary included (the published counts have the unpadded one)."""
    return parameter_count(shape, ParallelLayout(), 0)


def active_parameter_count(shape: ModelShape) -> int:
    """The parameters one token uses, padded vocabulary included: a mixture-of-experts model's total less the
    experts a token is not routed to (num_experts - top-k per layer); a dense model's total."""
    if shape.moe is None:
        return total_parameter_count(shape)
    unused = shape.moe.num_experts - shape.moe.topk
    return total_parameter_count(shape) - shape.num_layers * _mlp_matrix_count(shape, 1, unused)


# ---------------------------------------------------------------------------------------------- activations

# Elements kept by autograd per token and per decoder layer, as (coefficient, dimension name, split):
# split "tp": divided by TP; "sp": divided by TP under sequence parallelism only; "position": replicated and kept
# once per sequence position, shared by the sequences of a micro-batch.
# Dimension names: h hidden, f ffn hidden, q = heads x head_dim, kv = query groups x head_dim, d head_dim,
# s = sequence length (softmax probabilities of unfused attention), 1 = a scalar per token.
_LAYER_ACTIVATION_TERMS = {
    # Transformer Engine: LayerNormLinear keeps its input and normalised output (2 norms); flash attention keeps
    # q, k, v (native GQA) and its output (the output projection's input); fused SwiGLU keeps fc1's output (2f)
    # and fc2 its input (f).
    "te": ((4, "h", "sp"), (2, "q", "tp"), (2, "kv", "tp"), (3, "f", "tp")),
    # megatron's local spec (measured on CPU, fp32): six hidden-sized tensors (norm inputs and outputs, residual
    # path), an rstd per norm, RoPE's cos/sin for q and k ([s, 1, 1, d] each), q plus k and v expanded to every
    # head plus the attention output, the [heads, s, s] softmax probabilities, fc1's output (2f), silu's output,
    # the SwiGLU product.
    "local": ((6, "h", "sp"), (2, "1", "sp"), (4, "d", "position"), (4, "q", "tp"), (1, "heads_s", "tp"),
              (5, "f", "tp")),
}
# What the per-head q/k norms (Qwen3) add. Both specs: the norms keep their inputs (k is a view of linear_qkv's
# output, which therefore stays alive whole: q, k and v; q is a copy where megatron's reshape of a rank's query heads
# cannot be a view, "q_copy": more than one query group per rank and more than one head per group) and an rstd per
# head ("heads_groups"). The local spec's torch norm keeps its normalised output too (for the weight's gradient).
_QK_NORM = ((1, "q", "tp"), (2, "kv", "tp"), (1, "q_copy", "tp"), (1, "heads_groups", "tp"))
_QK_NORM_ACTIVATION_TERMS = {"te": _QK_NORM, "local": _QK_NORM + ((1, "q", "tp"), (1, "kv", "tp"))}


# What a mixture-of-experts layer keeps besides its experts' MLP activations (those are the dense MLP's terms, for k
# experts per token of width moe_intermediate_size / ETP): each token's k copies as the experts' input and the
# experts' outputs before the probability-weighted sum ("topk_h"), and the router's fp32 logits and probabilities
# over E experts ("experts_fp32", in 4-byte units of the model dtype's size). An estimate, not measured (SequentialMLP
# on the CPU keeps per-expert pieces of the same tensors).
_MOE_ACTIVATION_TERMS = ((2, "topk_h", "sp"), (2, "experts_fp32", "sp"))


def layer_activation_bytes(shape: ModelShape, *, seq_len: int, micro_batch_size: int, tensor_parallel: int,
                           sequence_parallel: bool, kernels: str, bytes_per_element: int,
                           recompute: bool = False, expert_tensor_parallel: int | None = None) -> int:
    """Bytes autograd keeps for one decoder layer and one micro-batch of `micro_batch_size` sequences of
    `seq_len` tokens. With full recompute only the layer's input (the checkpoint) is kept. A mixture-of-experts
    layer: its MLP terms for the k experts each token goes to (their width split over `expert_tensor_parallel`,
    default TP), plus _MOE_ACTIVATION_TERMS."""
    if kernels not in _LAYER_ACTIVATION_TERMS:
        raise ValueError(f"kernels {kernels!r} is not one of {', '.join(_LAYER_ACTIVATION_TERMS)}")
    t = tensor_parallel
    tokens = seq_len * micro_batch_size
    if recompute:
        return tokens * shape.hidden_size * bytes_per_element // (t if sequence_parallel else 1)
    q = shape.num_attention_heads * shape.head_dim
    copies_q = shape.num_query_groups // t > 1 and shape.num_attention_heads > shape.num_query_groups
    dims = {"h": shape.hidden_size, "f": shape.ffn_hidden_size, "q": q, "kv": shape.num_query_groups * shape.head_dim,
            "d": shape.head_dim, "1": 1, "heads_s": shape.num_attention_heads * seq_len, "q_copy": q if copies_q else 0,
            "heads_groups": shape.num_attention_heads + shape.num_query_groups}
    moe_terms = ()
    if shape.moe is not None:  # "f" terms divide by TP: k experts of width F_moe / ETP per token
        etp = expert_tensor_parallel or t
        dims.update(f=shape.moe.topk * shape.moe.ffn_hidden_size * t / etp, topk_h=shape.moe.topk * shape.hidden_size,
                    experts_fp32=shape.moe.num_experts * 4 / bytes_per_element)
        moe_terms = _MOE_ACTIVATION_TERMS
    divisor = {"tp": t, "sp": t if sequence_parallel else 1, "position": micro_batch_size}
    terms = _LAYER_ACTIVATION_TERMS[kernels] + (_QK_NORM_ACTIVATION_TERMS[kernels] if shape.qk_norm else ()) \
        + moe_terms
    per_token = sum(coef * dims[name] / divisor[split] for coef, name, split in terms)
    return round(per_token * tokens * bytes_per_element)


def pipeline_micro_batches_in_flight(layout: ParallelLayout, pp_rank: int, num_micro_batches: int) -> float:
    """Micro-batches whose activations a stage holds at its peak, in units of the stage's full layer count."""
    p = layout.pipeline
    if p == 1:
        return 1.0
    v = layout.virtual_pipeline
    if v is None or v == 1:
        return float(min(p - pp_rank, num_micro_batches))
    chunks = min(2 * (p - pp_rank - 1) + (v - 1) * p + 1, num_micro_batches * v)  # megatron's warm-up + 1
    return chunks / v


# ---------------------------------------------------------------------------------------------- FLOPs


def matmul_parameters(shape: ModelShape, padded_vocab: int) -> int:
    """Weights that take part in a matmul for every token (the embedding lookup is not a matmul): a
    mixture-of-experts layer's router and the top-k experts a token is routed to."""
    experts = shape.moe.topk if shape.moe else None
    per_layer = _attention_matrix_count(shape, 1) + _mlp_matrix_count(shape, 1, experts) + _router_count(shape)
    return shape.num_layers * per_layer + padded_vocab * shape.hidden_size


def forward_flops(shape: ModelShape, *, num_tokens: int, sum_squared_lengths: int,
                  padded_vocab: int | None = None) -> float:
    """FLOPs of one forward pass over sequences with `num_tokens` tokens in total and sum of squared lengths
    `sum_squared_lengths` (causal attention is quadratic in each sequence's own length)."""
    vocab = padded_vocab or padded_vocab_size(shape.vocab_size, 1)
    attention = 2.0 * shape.num_attention_heads * shape.head_dim * shape.num_layers * sum_squared_lengths
    return 2.0 * matmul_parameters(shape, vocab) * num_tokens + attention


def generation_flops(shape: ModelShape, *, num_sequences: int, prompt_tokens: int, response_tokens: int,
                     padded_vocab: int | None = None) -> float:
    """Prefill of every prompt (no prefix sharing between a prompt's samples) plus token-by-token decoding with a
    KV cache: the decode step at context c costs the matmuls plus 4 a d c attention FLOPs per layer."""
    vocab = padded_vocab or padded_vocab_size(shape.vocab_size, 1)
    prefill = forward_flops(shape, num_tokens=prompt_tokens, sum_squared_lengths=prompt_tokens**2,
                            padded_vocab=vocab)
    r = response_tokens
    attention = 4.0 * shape.num_attention_heads * shape.head_dim * shape.num_layers \
        * (r * prompt_tokens + r * (r + 1) / 2)
    decode = 2.0 * matmul_parameters(shape, vocab) * r + attention
    return num_sequences * (prefill + decode)


def training_flops(shape: ModelShape, workload: Workload, *, response_tokens: int, padded_vocab: int) -> dict:
    """Model FLOPs of one step's training phases with every response `response_tokens` long: old_logprob, a forward
    over every sequence; update, forward and backward (3 x forward) per epoch."""
    n, length = workload.sequences_per_step, workload.max_prompt_tokens + response_tokens
    logprob = n * forward_flops(shape, num_tokens=length, sum_squared_lengths=length**2, padded_vocab=padded_vocab)
    return {"old_logprob": logprob, "update": 3.0 * logprob * workload.epochs_per_step}


# ---------------------------------------------------------------------------------------------- the plan


def vllm_tensor_parallel(shape: ModelShape, layout: ParallelLayout, settings: Settings) -> int:
    """The given vLLM TP size, else the largest divisor of the training TP (within a node) that divides the attention
    heads: colocated engines then tile every GPU, TP / vLLM TP of them per pipeline stage (rollout/placement.py)."""
    if settings.vllm_tensor_parallel is not None:
        return settings.vllm_tensor_parallel
    limit = min(layout.tensor, settings.gpus_per_node)
    return max(v for v in range(1, limit + 1) if layout.tensor % v == 0 and shape.num_attention_heads % v == 0)


def rollout_engines(layout: ParallelLayout, vllm_tp: int) -> int:
    """Colocated vLLM engines of the whole job (rollout/placement.engine_hosts per replica, times DP)."""
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

    @property
    def persistent(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def transient(self) -> float:
        return self.activations + self.logits + self.logprob_workspaces + self.dispatcher


@dataclass
class Plan:
    model: str
    layout: ParallelLayout
    workload: Workload
    settings: Settings
    params_total: int
    params_active: int  # per token (a mixture-of-experts model's top-k experts; the total for a dense one)
    params_per_stage: list[int]
    stages: list[StageMemory]
    worst_stage: int
    memory_gib: dict
    variants_gib: dict  # training peak with / without distributed optimizer and recompute
    kv_cache: dict
    flops_per_step: dict
    fits: bool
    reasons: list[str] = field(default_factory=list)

    @property
    def params_per_gpu(self) -> int:
        return max(self.params_per_stage)

    def to_json(self) -> dict:
        return {"model": self.model, "layout": {**asdict(self.layout), "world_size": self.layout.world_size},
                "workload": asdict(self.workload), "settings": asdict(self.settings),
                "params_total": self.params_total, "params_active": self.params_active,
                "params_per_gpu": self.params_per_gpu,
                "params_per_stage": self.params_per_stage, "worst_stage": self.worst_stage,
                "memory_gib": self.memory_gib, "variants_gib": self.variants_gib, "kv_cache": self.kv_cache,
                "flops_per_step": self.flops_per_step, "fits": self.fits, "reasons": self.reasons}


def _stage_memory(shape: ModelShape, layout: ParallelLayout, workload: Workload, settings: Settings, pp_rank: int, *,
                  distributed_optimizer: bool, recompute: bool) -> StageMemory:
    e = BYTES_PER_ELEMENT[settings.params_dtype]
    params = parameter_count(shape, layout, pp_rank)
    experts = expert_parameter_count(shape, layout, pp_rank)
    # Adam's moments in fp32; bf16 models add an fp32 master copy (fp32 models step their own weights). The
    # distributed optimizer shards the dense parameters' state over DP, the experts' over the expert-DP group.
    optimizer_bytes_per_param = 8 + (4 if settings.params_dtype != "float32" else 0)
    optimizer = ((params - experts) / (layout.data if distributed_optimizer else 1)
                 + experts / (expert_data_parallel_size(layout) if distributed_optimizer else 1)) \
        * optimizer_bytes_per_param
    t, s, b = layout.tensor, workload.max_sequence_tokens, workload.micro_batch_size
    sequences_per_rank = workload.sequences_per_step // (layout.data * workload.mini_batches_per_step)
    micro_batches = math.ceil(sequences_per_rank / b)
    layers = stage_layer_counts(shape, layout)[pp_rank]
    per_layer = layer_activation_bytes(shape, seq_len=s, micro_batch_size=b, tensor_parallel=t,
                                       sequence_parallel=layout.sequence_parallel, kernels=settings.kernels,
                                       bytes_per_element=e, recompute=recompute,
                                       expert_tensor_parallel=layout.expert_tensor_size)
    activations = pipeline_micro_batches_in_flight(layout, pp_rank, micro_batches) * layers * per_layer
    if recompute:  # backward re-runs one layer at a time: one layer's full activations on top
        activations += layer_activation_bytes(shape, seq_len=s, micro_batch_size=b, tensor_parallel=t,
                                              sequence_parallel=layout.sequence_parallel, kernels=settings.kernels,
                                              bytes_per_element=e, expert_tensor_parallel=layout.expert_tensor_size)
    tokens = s * b // (t if layout.sequence_parallel else 1)
    dispatcher = 2.0 * tokens * shape.moe.topk * shape.hidden_size * e if shape.moe else 0.0
    logits = workspaces = 0.0
    if pp_rank == layout.pipeline - 1:
        # The vocab-parallel log-prob/entropy op keeps this micro-batch's logits shard for backward and returns a
        # gradient of the same size and dtype; its own two fp32 workspaces are chunk-sized (the trainer's chunk).
        vocab_local = padded_vocab_size(shape.vocab_size, t) // t
        logits = 2.0 * s * b * vocab_local * e
        chunk = min(s * b, chunk_tokens_for_budget(settings.logprob_workspace_mib * 2**20, vocab_local))
        workspaces = 2.0 * chunk * vocab_local * WORKSPACE_BYTES_PER_ELEMENT
    return StageMemory(pp_rank, params, params * e, params * 4.0, optimizer, activations, logits, workspaces,
                       dispatcher)


def plan(shape: ModelShape, layout: ParallelLayout, workload: Workload = Workload(), settings: Settings = Settings(), *,
         model_name: str = "") -> Plan:
    check_plan(shape, layout, workload, settings)
    gpu = settings.gpu_memory_gib * GIB
    overhead = settings.framework_overhead_gib * GIB

    def stages(distributed_optimizer: bool, recompute: bool) -> list[StageMemory]:
        return [_stage_memory(shape, layout, workload, settings, r, distributed_optimizer=distributed_optimizer,
                              recompute=recompute) for r in range(layout.pipeline)]

    def training_peak(stage: StageMemory) -> float:
        transient = stage.transient * (1 + settings.allocator_slack_fraction)
        return stage.persistent + transient + overhead + vllm_asleep

    # vLLM: its share of every GPU, its weights (bf16: every engine holds the whole model, split over vLLM's TP),
    # the KV cache that is left.
    colocated = settings.vllm_memory_fraction is not None
    vllm_tp = vllm_tensor_parallel(shape, layout, settings)
    engines = rollout_engines(layout, vllm_tp) if colocated else 0
    vllm_budget = settings.vllm_memory_fraction * gpu if colocated else 0.0
    vllm_weights = vllm_weight_bytes(shape, vllm_tp) if colocated else 0.0
    vllm_overhead = settings.vllm_overhead_gib * GIB if colocated else 0.0
    vllm_asleep = vllm_overhead  # level-1 sleep frees the KV cache and offloads the weights; the rest stays
    kv_bytes = vllm_budget - vllm_weights - vllm_overhead
    kv_bytes_per_token = vllm_kv_bytes_per_token(shape, vllm_tp)
    kv_tokens = max(0, int(kv_bytes // kv_bytes_per_token)) if colocated else 0
    full_sequences = kv_tokens // workload.max_sequence_tokens
    sequences_per_engine = math.ceil(workload.sequences_per_step / engines) if colocated else 0

    # Without vLLM the built-in engine generates on the training model, with a static KV cache of its replica's rows
    # (or of builtin_max_batch_tokens token slots per batch) on each stage's layers, its KV heads split over TP.
    builtin_tokens = 0 if colocated else workload.sequences_per_step // layout.data * workload.max_sequence_tokens
    if settings.builtin_max_batch_tokens is not None:
        builtin_tokens = min(builtin_tokens, settings.builtin_max_batch_tokens)
    builtin_kv = builtin_tokens * max(stage_layer_counts(shape, layout)) * 2 \
        * max(1, shape.num_query_groups // layout.tensor) * shape.head_dim * BYTES_PER_ELEMENT[settings.params_dtype]

    chosen = stages(settings.distributed_optimizer, settings.recompute_activations)
    worst = max(chosen, key=lambda st: (training_peak(st), st.persistent))
    generation_peak = max(st.persistent for st in chosen) + overhead + vllm_budget + builtin_kv
    memory = {
        "parameters": worst.parameters / GIB, "gradients": worst.gradients / GIB, "optimizer": worst.optimizer / GIB,
        "activations": worst.activations / GIB, "logits": worst.logits / GIB,
        "logprob_workspaces": worst.logprob_workspaces / GIB, "dispatcher_buffers": worst.dispatcher / GIB,
        "allocator_slack": worst.transient * settings.allocator_slack_fraction / GIB,
        "framework_overhead": overhead / GIB,
        "vllm_asleep": vllm_asleep / GIB, "training_peak": training_peak(worst) / GIB,
        "vllm_budget": vllm_budget / GIB, "vllm_weights": vllm_weights / GIB, "vllm_kv_cache": max(kv_bytes, 0) / GIB,
        "builtin_kv_cache": builtin_kv / GIB, "generation_peak": generation_peak / GIB, "gpu": settings.gpu_memory_gib,
    }
    variants = {}
    for dist_opt in (True, False):
        for recompute in (False, True):
            peak = max(training_peak(st) for st in stages(dist_opt, recompute))
            variants[f"{'distopt' if dist_opt else 'no_distopt'}_{'recompute' if recompute else 'no_recompute'}"] \
                = peak / GIB

    vocab = padded_vocab_size(shape.vocab_size, layout.tensor)
    train = training_flops(shape, workload, response_tokens=workload.max_response_tokens, padded_vocab=vocab)
    generate = generation_flops(shape, num_sequences=workload.sequences_per_step,
                                prompt_tokens=workload.max_prompt_tokens,
                                response_tokens=workload.max_response_tokens, padded_vocab=vocab)
    flops = {"generate": generate, **train, "total": generate + train["old_logprob"] + train["update"],
             "note": "at the maximum prompt and response lengths (an upper bound); update = 3 x forward x epochs"}

    reasons = []
    if training_peak(worst) > gpu:
        reasons.append(f"training needs {training_peak(worst) / GIB:.1f} GiB on pipeline stage {worst.pp_rank}, "
                       f"more than the {settings.gpu_memory_gib:g} GiB GPU")
    if colocated:
        if generation_peak > gpu:
            reasons.append(f"generation needs {generation_peak / GIB:.1f} GiB (trainer state "
                           f"{max(st.persistent for st in chosen) / GIB:.1f} + vLLM's "
                           f"{settings.vllm_memory_fraction:g} x {settings.gpu_memory_gib:g} GiB + overhead), more "
                           f"than the GPU; lower vllm_memory_fraction or shard more")
        if full_sequences < 1:
            reasons.append(f"vLLM's KV cache ({max(kv_bytes, 0) / GIB:.2f} GiB) cannot hold one sequence of "
                           f"{workload.max_sequence_tokens} tokens; raise vllm_memory_fraction or vLLM's TP")
    elif generation_peak > gpu:
        reasons.append(f"generation on the built-in engine needs {generation_peak / GIB:.1f} GiB (trainer state "
                       f"{max(st.persistent for st in chosen) / GIB:.1f} + a KV cache of {builtin_tokens:,} token "
                       f"slots + overhead), more than the GPU; lower rollout.builtin_max_batch_tokens")
    kv_cache = {"bytes_per_token": kv_bytes_per_token, "tokens": kv_tokens, "full_length_sequences": full_sequences,
                "vllm_tensor_parallel": vllm_tp if colocated else None, "engines": engines,
                "engines_per_replica": engines // layout.data, "gpus_generating": engines * vllm_tp,
                "kv_cache_gib_per_gpu": max(kv_bytes, 0) / GIB, "sequences_per_engine": sequences_per_engine,
                "waves_at_full_length": math.ceil(sequences_per_engine / full_sequences) if full_sequences else None,
                "engine": "vllm" if colocated else "builtin", "builtin_batch_tokens": builtin_tokens}
    return Plan(model=model_name, layout=layout, workload=workload, settings=settings,
                params_total=total_parameter_count(shape), params_active=active_parameter_count(shape),
                params_per_stage=[parameter_count(shape, layout, r) for r in range(layout.pipeline)],
                stages=chosen, worst_stage=worst.pp_rank, memory_gib=memory, variants_gib=variants,
                kv_cache=kv_cache, flops_per_step=flops, fits=not reasons, reasons=reasons)


def suggest_layouts(shape: ModelShape, gpus: int, workload: Workload, settings: Settings) -> list[Plan]:
    """The plans of every layout of `gpus` GPUs the rules allow that fit, best first: TP within a node, dividing
    the heads; PP dividing the layers; a mixture-of-experts model's EP dividing its experts and TP x DP, ETP 1 or TP,
    and sequence parallelism at TP > 1 (which training it needs); each without and with activation recompute
    (`settings` otherwise). Best: a tenth of the GPU left at the training and the generation peak (the planner's
    activation and allocator terms are estimates), then no recompute, the fewest GPUs per model replica (the most
    data-parallel replicas), then the lowest training peak."""
    plans = []
    for tp in (t for t in _divisors(gpus) if t <= settings.gpus_per_node):
        for pp in (p for p in _divisors(gpus // tp) if shape.num_layers % p == 0):
            dp = gpus // (tp * pp)
            experts = [(1, None)] if shape.moe is None else [
                (ep, etp) for ep in _divisors(shape.moe.num_experts) if (tp * dp) % ep == 0
                for etp in sorted({1, tp}) if (tp * dp) % (ep * etp) == 0]
            for ep, etp in experts:
                layout = ParallelLayout(tensor=tp, pipeline=pp, data=dp, expert=ep, expert_tensor=etp,
                                        sequence_parallel=shape.moe is not None and tp > 1)
                for recompute in (False, True):
                    try:
                        candidate = plan(shape, layout, workload, replace(settings, recompute_activations=recompute))
                    except ValueError:  # the layout's rules (layout.check_layout) or the workload's
                        continue
                    if candidate.fits:
                        plans.append(candidate)
    def tight(p: Plan) -> bool:
        return max(p.memory_gib["training_peak"], p.memory_gib["generation_peak"]) > 0.9 * settings.gpu_memory_gib

    return sorted(plans, key=lambda p: (tight(p), p.settings.recompute_activations,
                                        p.layout.tensor * p.layout.pipeline, p.memory_gib["training_peak"]))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---------------------------------------------------------------------------------------------- phase times
# Seconds of one RL step's phases: its FLOPs and HBM bytes at the peak rates of Settings times the efficiencies
# Settings assumes. Responses have the workload's expected (mean) length, prompts their maximum (an upper bound).


def training_phase_s(shape: ModelShape, workload: Workload, settings: Settings, *, gpus: int,
                     tensor_parallel: int) -> dict[str, float]:
    """old_logprob and update seconds of one step on `gpus` training GPUs: their model FLOPs at the mean response
    length / (gpus x peak_flops_per_s x training_mfu). Full activation recompute runs the forward once more in the
    update (4 passes where the model FLOPs count 3)."""
    flops = training_flops(shape, workload, response_tokens=workload.expected_response_tokens,
                           padded_vocab=padded_vocab_size(shape.vocab_size, tensor_parallel))
    flops_per_s = gpus * settings.peak_flops_per_s * settings.training_mfu
    old_logprob_s = flops["old_logprob"] / flops_per_s
    update_s = flops["update"] * (4 / 3 if settings.recompute_activations else 1) / flops_per_s
    return {"old_logprob_s": old_logprob_s, "update_s": update_s, "train_s": old_logprob_s + update_s}


def decode_step_s(shape: ModelShape, settings: Settings, *, running: int, context_tokens: int, vllm_tp: int) -> float:
    """One decode step of a vLLM engine on `vllm_tp` GPUs with `running` sequences of `context_tokens` cached tokens
    each: every GPU reads its share of the matmul weights and of those sequences' KV cache from HBM (bytes /
    (hbm_bytes_per_s x decode_bandwidth_efficiency)) and computes one token per sequence (FLOPs / (peak_flops_per_s
    x generation_mfu)); the slower of the two. The reads win at RL batch sizes: decode is bandwidth bound."""
    weights = matmul_parameters(shape, padded_vocab_size(shape.vocab_size, vllm_tp))
    read_bytes = 2.0 * weights / vllm_tp + running * context_tokens * vllm_kv_bytes_per_token(shape, vllm_tp)
    read_s = read_bytes / (settings.hbm_bytes_per_s * settings.decode_bandwidth_efficiency)
    token_flops = 2.0 * weights + 4.0 * shape.num_attention_heads * shape.head_dim * shape.num_layers * context_tokens
    compute_s = running * token_flops / vllm_tp / (settings.peak_flops_per_s * settings.generation_mfu)
    return max(read_s, compute_s)


def generation_phase_s(shape: ModelShape, workload: Workload, settings: Settings, *, engines: int, vllm_tp: int,
                       kv_tokens_per_engine: int) -> dict:
    """Seconds one step's generation takes on `engines` vLLM engines of `vllm_tp` GPUs each (they run at once, the
    step's prompts split evenly over them), each with a KV cache of `kv_tokens_per_engine` tokens:
    - prefill: every prompt's forward once (vLLM's prefix cache shares it between the prompt's G samples), compute
      bound: FLOPs / (vllm_tp x peak_flops_per_s x generation_mfu);
    - decode: waves of as many sequences as the KV cache holds (each its mean response plus its 1/G share of the
      prompt's cache), each wave decoding the mean response length, then one straggler decoding on alone to the
      maximum length (an engine is done when its longest response is); decode_step_s per step. The waves stand for
      continuous batching, which refills a slot when a sequence ends.
    ValueError when the KV cache cannot hold one sequence."""
    prompt, mean, longest = (workload.max_prompt_tokens, workload.expected_response_tokens,
                             workload.max_response_tokens)
    group = workload.num_responses_per_prompt
    prompts_per_engine = math.ceil(workload.prompts_per_step / engines)
    sequences = prompts_per_engine * group
    running = min(sequences, int(kv_tokens_per_engine // (mean + prompt / group)))
    if running < 1:
        raise ValueError(f"a KV cache of {kv_tokens_per_engine:,} tokens cannot hold one sequence")
    prefill_flops = prompts_per_engine * forward_flops(shape, num_tokens=prompt, sum_squared_lengths=prompt**2,
                                                       padded_vocab=padded_vocab_size(shape.vocab_size, vllm_tp))
    prefill_s = prefill_flops / (vllm_tp * settings.peak_flops_per_s * settings.generation_mfu)
    waves = [running] * (sequences // running) + ([sequences % running] if sequences % running else [])
    step = partial(decode_step_s, shape, settings, vllm_tp=vllm_tp)
    decode_s = sum(step(running=batch, context_tokens=prompt + t) for batch in waves for t in range(mean)) \
        + sum(step(running=1, context_tokens=prompt + t) for t in range(mean, longest))
    return {"prefill_s": prefill_s, "decode_s": decode_s, "generate_s": prefill_s + decode_s,
            "sequences_per_engine": sequences, "running_per_engine": running, "waves": len(waves)}


def weight_sync_s(shape: ModelShape, settings: Settings) -> float:
    """One weight update of a rollout server: the whole model in bf16 from its replica's destination rank at
    weight_sync_bytes_per_s (every replica updates its own server at the same time)."""
    return total_parameter_count(shape) * 2.0 / settings.weight_sync_bytes_per_s


def step_s(generate_s: float, train_s: float, sync_s: float, max_staleness: int) -> float:
    """The steady-state seconds of an RL step whose generation and training run on GPUs of their own.

    N = 0 asks for a batch and waits for it: generation, then training, then the weight sync. At N >= 1 batch k is
    asked for when step k - N begins (training/rollout_queue.py), so the engine generates while the trainer trains;
    but a rollout server answers requests in order and every step ends with a weight sync, which waits for the
    generation before it (the update drains the engine, never interrupts it). So one generation overlaps one
    training step whatever N: the step is max(generation, training) + sync at every N >= 1, and staleness 1 is
    all it takes to keep both sides busy. The ceil(generation / training) of pipelines whose engines keep generating
    through weight updates does not apply: here a generation longer than a training step is the split's to fix (more
    rollout GPUs), not the staleness's."""
    if max_staleness == 0:
        return generate_s + train_s + sync_s
    return max(generate_s, train_s) + sync_s


def _step_phases(generation: dict, training: dict[str, float], sync_s: float | None,
                 max_staleness: int) -> dict[str, float]:
    """A step's phase seconds (of generation_phase_s and training_phase_s), its weight sync (None: not counted,
    left out) and its step_s."""
    phases = {**{k: generation[k] for k in ("prefill_s", "decode_s", "generate_s")}, **training}
    if sync_s is not None:
        phases["weight_sync_s"] = sync_s
    phases["step_s"] = step_s(phases["generate_s"], phases["train_s"], sync_s or 0.0, max_staleness)
    return phases


# ---------------------------------------------------------------------------------------------- the split


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
    phases = _step_phases(generation, training_phase_s(shape, workload, settings, gpus=training.world_size,
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
    return {**result, "phases_s": _step_phases(generation, training, None, max_staleness=0)}


NOT_MODELLED = (
    "dynamic sampling's further rounds (generated on the spot by the current policy, on the step's critical path)",
    "reward scoring, advantages, logging and checkpoints",
    "colocated engines' sleep, wake and device-local weight reload",
    "variance between steps, and stragglers beyond one per engine",
)


def phase_assumptions(workload: Workload, settings: Settings) -> dict:
    """What the phase-time model assumes, for the report: the rates, efficiencies and lengths it uses."""
    names = ("peak_flops_per_s", "hbm_bytes_per_s", "training_mfu", "generation_mfu", "decode_bandwidth_efficiency",
             "weight_sync_bytes_per_s", "server_memory_fraction", "vllm_memory_fraction", "vllm_overhead_gib")
    return {**{name: getattr(settings, name) for name in names},
            "prompt_tokens": workload.max_prompt_tokens,
            "mean_response_tokens": workload.expected_response_tokens,
            "mean_response_source": "given" if workload.mean_response_tokens is not None
            else "assumed: half of max_response_tokens",
            "max_response_tokens": workload.max_response_tokens,
            "not_modelled": list(NOT_MODELLED)}


def plan_disaggregated(shape: ModelShape, layout: ParallelLayout, workload: Workload, settings: Settings, *,
                       nodes: int, max_staleness: int = 1, server_tp: int | None = None,
                       model_name: str = "") -> dict:
    """The split of `nodes` nodes between training and rollout (rollout.engine vllm_remote) with the shortest step at
    rollout.max_staleness `max_staleness` (step_s), against `layout` on all of them with colocated engines.

    Training runs DP replicas of `layout` (its TP, PP and the rest; DP is the split's) on nodes of their own, and
    must fit in memory (plan()'s training peak); rollout runs one vLLM server of `server_tp` GPUs per replica (the
    vllm_remote rule; every size of server_tensor_parallel_sizes when None) on nodes of their own, each holding the
    model and a KV cache of at least one full-length sequence in server_memory_fraction of its GPUs. Ties go to
    fewer nodes, then fewer GPUs. ValueError when no split runs, with the reasons."""
    gpus_per_node, replica_gpus = settings.gpus_per_node, layout.tensor * layout.pipeline
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    check_plan(shape, replace(layout, data=None), workload, replace(settings, vllm_memory_fraction=None))
    check_layout(replace(layout, data=1), shape=shape, rollout=RolloutLayout("vllm_remote", 1, 1))  # the engine's rules
    allowed = server_tensor_parallel_sizes(shape, gpus_per_node)
    if server_tp is not None and server_tp not in allowed:
        raise ValueError(f"a rollout server's TP must divide the model's {shape.num_attention_heads} attention heads, "
                         f"divide or be divided by its {shape.num_query_groups} KV heads, and fit a node of "
                         f"{gpus_per_node} GPUs ({', '.join(map(str, allowed))}); got {server_tp}")
    splits, reasons = [], []
    for tp in [server_tp] if server_tp is not None else allowed:
        for dp in range(1, nodes * gpus_per_node // replica_gpus + 1):
            rollout_nodes = math.ceil(dp * tp / gpus_per_node)
            if math.ceil(dp * replica_gpus / gpus_per_node) + rollout_nodes > nodes or dp % rollout_nodes:
                continue  # more nodes than the job's, or servers that do not spread evenly over their nodes
            try:
                splits.append(_split(shape, layout, workload, settings, data_parallel=dp, server_tp=tp,
                                     max_staleness=max_staleness))
            except ValueError as e:
                reasons.append(str(e))
    if not splits:
        why = "; ".join(dict.fromkeys(reasons)) or (
            f"one training replica (TP x PP = {replica_gpus} GPUs) and one rollout server, on nodes of their own, "
            f"need more than {nodes} node(s)")
        raise ValueError(f"no split of {nodes} node(s) x {gpus_per_node} GPUs into training and rollout runs: {why}")
    splits.sort(key=lambda s: (s["phases_s"]["step_s"], s["training"]["nodes"] + s["rollout"]["nodes"],
                               s["training"]["gpus"] + s["rollout"]["gpus"]))
    colocated = _colocated(shape, replace(layout, data=nodes * gpus_per_node // replica_gpus), workload, settings)
    return {"model": model_name, "nodes": nodes, "gpus_per_node": gpus_per_node,
            "max_staleness": max_staleness, "staleness_needed": 1,
            **splits[0], "colocated": colocated, "alternatives": splits[1:],
            "assumptions": phase_assumptions(workload, settings)}


def settings_from_config(cfg, **overrides) -> Settings:
    """The planner's settings of a megatron_gtpo TrainConfig (dtype, recompute, colocated vLLM), plus overrides."""
    vllm = cfg.rollout.engine == "vllm"
    return Settings(**{"params_dtype": cfg.model.dtype, "recompute_activations": cfg.model.recompute_activations,
                       "logprob_workspace_mib": cfg.model.logprob_workspace_mib,
                       "builtin_max_batch_tokens": cfg.rollout.builtin_max_batch_tokens,
                       "vllm_memory_fraction": cfg.rollout.vllm_gpu_memory_utilization if vllm else None,
                       "vllm_tensor_parallel": cfg.rollout.vllm_tensor_parallel if vllm else None, **overrides})


def workload_from_config(cfg) -> Workload:
    """The planner's workload of a megatron_gtpo TrainConfig."""
    return Workload(prompts_per_step=cfg.data.prompts_per_step,
                    num_responses_per_prompt=cfg.rollout.num_responses_per_prompt,
                    max_prompt_tokens=cfg.data.max_prompt_tokens, max_response_tokens=cfg.rollout.max_new_tokens,
                    micro_batch_size=cfg.data.micro_batch_size, mini_batches_per_step=cfg.data.mini_batches_per_step,
                    epochs_per_step=cfg.data.epochs_per_step)
