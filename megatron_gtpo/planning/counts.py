"""Parameter and FLOP counts of a Qwen2 / Qwen3 / Qwen3-MoE model: per rank of a TP/PP/EP layout exactly as
megatron-core builds it (tests/test_plan.py compares them with models built on the meta device), and the model FLOPs of
a forward, of generation and of one step's training phases."""
from __future__ import annotations

from megatron_gtpo.layout import ParallelLayout
from megatron_gtpo.models.qwen import ModelShape, padded_vocab_size

from .inputs import Workload


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
    """megatron-core's expert-data-parallel size: a stage's TP x CP x DP ranks laid out again as ETP x EP x EDP."""
    return layout.tensor * layout.context * layout.data // (layout.expert_tensor_size * layout.expert)


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
    over every sequence per forward-only pass (`Workload.old_logprob_passes`: none where the update's own forward
    gives the old log-probs); update, forward and backward (3 x forward) per epoch."""
    n, length = workload.sequences_per_step, workload.max_prompt_tokens + response_tokens
    forward = n * forward_flops(shape, num_tokens=length, sum_squared_lengths=length**2, padded_vocab=padded_vocab)
    return {"old_logprob": forward * workload.old_logprob_passes, "update": 3.0 * forward * workload.epochs_per_step}

