"""Activation bytes autograd keeps per decoder layer (the "te" and "local" kernel profiles) and the micro-batches whose
activations a pipeline stage holds at its peak."""
from __future__ import annotations

from megatron_gtpo.layout import ParallelLayout
from megatron_gtpo.models.qwen import ModelShape

# Elements kept by autograd per token and per decoder layer, as (coefficient, dimension name, split):
# split "tp": divided by TP; "sp": divided by TP under sequence parallelism only; "position": replicated and kept
# once per sequence position, shared by the sequences of a micro-batch; "tp_row": divided by TP and kept for every
# token of the whole row on each context-parallel rank (the keys and values the all-gather attention gathers).
# Context parallelism (CP = C) gives a rank L / C of a row's L tokens: every term but "tp_row" is per token of those.
# Dimension names: h hidden, f ffn hidden, q = heads x head_dim, kv = query groups x head_dim, d head_dim,
# heads = attention heads, 1 = a scalar per token; a "_fp32" name is kept in fp32 whatever the model dtype.
_LAYER_ACTIVATION_TERMS = {
    # Transformer Engine: LayerNormLinear keeps its input and normalised output (2 norms); flash attention keeps
    # q, k, v (native GQA) and its output (the output projection's input); fused SwiGLU keeps fc1's output (2f)
    # and fc2 its input (f).
    "te": ((4, "h", "sp"), (2, "q", "tp"), (2, "kv", "tp"), (3, "f", "tp")),
    # megatron's local spec with the SDPA core attention (models/sdpa_attention.py) and a GPU's fusions (measured on
    # CPU in fp32 and bf16 with them on, less _CPU_ONLY_TERMS): each RMSNorm its input and output (torch's fused
    # CUDA kernel) and an fp32 rstd per token; RoPE's cos/sin for q and k ([s, 1, 1, d] each); SDPA's q (after RoPE),
    # output (the output projection's input), fp32 log-sum-exp per head, and k and v of the whole row (native GQA;
    # under CP the gathered ones: models/context_attention.py); the fused SwiGLU fc1's output (2f) and fc2 its input.
    "local": ((4, "h", "sp"), (2, "1_fp32", "sp"), (4, "d", "position"), (2, "q", "tp"), (1, "heads_fp32", "tp"),
              (2, "kv", "tp_row"), (3, "f", "tp")),
}
# The local profile's linear_qkv output: at CP = 1 its q and k parts (SDPA's v, a view of it, keeps it whole; v is
# counted above); at CP > 1 (where SDPA gets a gathered copy of v) whole, with q/k norms, whose inputs are views of it.
_LOCAL_QKV_OUTPUT = {"cp1": ((1, "q", "tp"), (1, "kv", "tp")), "cp_qk_norm": ((1, "q", "tp"), (2, "kv", "tp"))}
# Not counted, the CPU's only (tests/plan_measurements.cpu_only_norm_bytes adds it to compare with CPU measurements):
# torch's RMSNorm on the CPU is composite and keeps an fp32 copy of its input and the fp32 normalised product, where
# CUDA's fused kernel keeps its input only, in the model dtype.


# What the per-head q/k norms (Qwen3) add. Both specs: the norms keep their inputs (k is a view of linear_qkv's
# output, which therefore stays alive whole: q, k and v; q is a copy where megatron's reshape of a rank's query heads
# cannot be a view, "q_copy": more than one query group per rank and more than one head per group) and an fp32 rstd
# per head. The local profile counts linear_qkv's output already (_LOCAL_QKV_OUTPUT, kept at any CP with q/k norms).
_QK_NORM_ACTIVATION_TERMS = {
    "te": ((1, "q", "tp"), (2, "kv", "tp"), (1, "q_copy", "tp"), (1, "heads_groups_fp32", "tp")),
    "local": ((1, "q_copy", "tp"), (1, "heads_groups_fp32", "tp")),
}


# What a mixture-of-experts layer keeps besides its experts' MLP activations (those are the dense MLP's terms, for k
# experts per token of width moe_intermediate_size / ETP): each token's k copies as the experts' input and the
# experts' outputs before the probability-weighted sum ("topk_h"), and the router's fp32 logits and probabilities
# over E experts ("experts_fp32", in 4-byte units of the model dtype's size). An estimate, not measured (SequentialMLP
# on the CPU keeps per-expert pieces of the same tensors).
_MOE_ACTIVATION_TERMS = ((2, "topk_h", "sp"), (2, "experts_fp32", "sp"))


def layer_activation_bytes(shape: ModelShape, *, seq_len: int, micro_batch_size: int, tensor_parallel: int,
                           sequence_parallel: bool, kernels: str, bytes_per_element: int,
                           recompute: bool = False, expert_tensor_parallel: int | None = None,
                           context_parallel: int = 1) -> int:
    """Bytes autograd keeps for one decoder layer and one micro-batch of `micro_batch_size` sequences of
    `seq_len` tokens, on one rank of `context_parallel` (CP) ranks that split each sequence: L / CP tokens of it,
    and (the "local" profile) the whole row's gathered keys and values. With full recompute only the layer's input
    (the checkpoint) is kept. A mixture-of-experts layer: its MLP terms for the k experts each token goes to (their
    width split over `expert_tensor_parallel`, default TP), plus _MOE_ACTIVATION_TERMS."""
    if kernels not in _LAYER_ACTIVATION_TERMS:
        raise ValueError(f"kernels {kernels!r} is not one of {', '.join(_LAYER_ACTIVATION_TERMS)}")
    t, c = tensor_parallel, context_parallel
    tokens = seq_len * micro_batch_size / c
    if recompute:
        return round(tokens * shape.hidden_size * bytes_per_element / (t if sequence_parallel else 1))
    q = shape.num_attention_heads * shape.head_dim
    copies_q = shape.num_query_groups // t > 1 and shape.num_attention_heads > shape.num_query_groups
    fp32 = 4 / bytes_per_element  # an fp32 element in model-dtype elements
    dims = {"h": shape.hidden_size, "f": shape.ffn_hidden_size, "q": q, "kv": shape.num_query_groups * shape.head_dim,
            "d": shape.head_dim, "1_fp32": fp32, "heads_fp32": shape.num_attention_heads * fp32,
            "q_copy": q if copies_q else 0, "heads_groups_fp32": (shape.num_attention_heads + shape.num_query_groups)
            * fp32}
    moe_terms = ()
    if shape.moe is not None:  # "f" terms divide by TP: k experts of width F_moe / ETP per token
        etp = expert_tensor_parallel or t
        dims.update(f=shape.moe.topk * shape.moe.ffn_hidden_size * t / etp, topk_h=shape.moe.topk * shape.hidden_size,
                    experts_fp32=shape.moe.num_experts * 4 / bytes_per_element)
        moe_terms = _MOE_ACTIVATION_TERMS
    divisor = {"tp": t, "sp": t if sequence_parallel else 1, "position": micro_batch_size, "tp_row": t / c}
    terms = _LAYER_ACTIVATION_TERMS[kernels] + (_QK_NORM_ACTIVATION_TERMS[kernels] if shape.qk_norm else ()) \
        + moe_terms
    if kernels == "local" and (c == 1 or shape.qk_norm):
        terms += _LOCAL_QKV_OUTPUT["cp1" if c == 1 else "cp_qk_norm"]
    per_token = sum(coef * dims[name] / divisor[split] for coef, name, split in terms)
    index_and_mask = 0
    if kernels == "local" and c > 1:  # the all-gather attention's own per layer: the int64 position order of the
        # gathered K and of V (index_select keeps its index), and the mask of this rank's queries against the row,
        # which SDPA keeps as an additive mask in the model dtype
        index_and_mask = 2 * 8 * seq_len + seq_len // c * seq_len * bytes_per_element
    return round(per_token * tokens * bytes_per_element) + index_and_mask


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



def context_kv_bytes(shape: ModelShape, *, seq_len: int, micro_batch_size: int, tensor_parallel: int,
                     context_parallel: int, kernels: str, bytes_per_element: int) -> int:
    """The keys and values in flight between context-parallel ranks while one layer's attention runs (transient; 0 at
    CP = 1), for one micro-batch of sequences of `seq_len` tokens. "te" (Transformer Engine's p2p ring): a rank's K/V
    block it computes on and the one it receives, and in backward their gradients as well: 4 blocks of
    2 x kv / TP per local token (an estimate). "local" (the all-gather attention): the whole row's K and V as
    gathered and in position order (gather_sequence's two [L, kv / TP] tensors each)."""
    if context_parallel == 1:
        return 0
    kv = shape.num_query_groups * shape.head_dim / tensor_parallel
    row_tokens = seq_len * micro_batch_size
    if kernels == "te":
        return round(4 * 2 * kv * row_tokens / context_parallel * bytes_per_element)
    return round(2 * 2 * kv * row_tokens * bytes_per_element)
