"""THE Hugging Face <-> Megatron name and layout mapping for Qwen2, Qwen3 (dense) and Qwen3-MoE. The converters, the
HF weight loader, checkpoint export and the weight sync all go through this module and nowhere else. The families
differ in entries decided by the shape: linear_qkv.bias (Qwen2's q/k/v biases), the per-head q/k norms (Qwen3's
self_attn.q_norm / k_norm, megatron's self_attention.q_layernorm / k_layernorm) and, for Qwen3-MoE, the router and
experts in place of the MLP:
  model.layers.N.mlp.gate.weight                            <-> decoder.layers.N.mlp.router.weight
  model.layers.N.mlp.experts.E.{gate_proj, up_proj}.weight  <-> decoder.layers.N.mlp.experts.local_experts.E.linear_fc1
  model.layers.N.mlp.experts.E.down_proj.weight             <-> decoder.layers.N.mlp.experts.local_experts.E.linear_fc2

Megatron names here are canonical: the local-spec names (`input_layernorm`, `pre_mlp_layernorm`,
`local_experts.E`) with GLOBAL layer and expert indices. `canonical_name` turns a parameter name of a model chunk
(Transformer Engine spec or local spec, stage-local layer index, EP-rank-local expert index) into that form.

Layouts (per TP rank r of T, H = hidden size, d = head_dim, G = query groups, Q = heads / G):
  linear_qkv  [G/T * (Q+2) * d, H]  for each of this rank's query groups g: [q heads of g; k_g; v_g]
  linear_fc1  [2 * F/T, H]          [gate rows of rank r; up rows of rank r]
  linear_proj, linear_fc2           split along dim 1 (row-parallel input)
  embedding, output_layer           vocab padded with zero rows to padded_vocab_size(V, T), split along dim 0
  layer norms, router               replicated (q/k norms: [d], one weight shared by every head; router: [E, H])
  an expert's linear_fc1 / fc2      as linear_fc1 / fc2, split over the expert-TP ranks (ETP) instead of TP; each
                                    EP rank holds E / EP whole experts (`ShardCoordinates`)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .qwen import ModelShape, padded_vocab_size

REPLICATED, COLUMN, ROW, QKV, FC1, VOCAB = "replicated", "column", "row", "qkv", "fc1", "vocab"


@dataclass(frozen=True)
class TensorMapping:
    megatron_name: str
    hf_names: tuple[str, ...]
    layout: str
    expert: int | None = None  # the global index of the expert this tensor belongs to (None: not an expert's)

    @property
    def tp_split_dim(self) -> int | None:
        return {REPLICATED: None, ROW: 1}.get(self.layout, 0)


@dataclass(frozen=True)
class ShardCoordinates:
    """Which part of every tensor a rank holds: its TP rank of TP, its EP rank of EP and its expert-TP rank of ETP
    (distributed.ParallelGroups.shard). A dense model's, or a single process's, is TP only."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    @classmethod
    def of(cls, groups) -> "ShardCoordinates":
        """The coordinates of a distributed.ParallelGroups."""
        return cls(groups.tp_rank, groups.tp_size, groups.ep_rank, groups.ep_size, groups.etp_rank, groups.etp_size)

    def split(self, mapping: TensorMapping) -> tuple[int, int]:
        """(rank, size) of the tensor-parallel split of `mapping`'s tensor: expert tensors split over ETP."""
        return (self.etp_rank, self.etp_size) if mapping.expert is not None else (self.tp_rank, self.tp_size)

    def expert_offset(self, shape: ModelShape) -> int:
        """The global index of this rank's first expert."""
        return self.ep_rank * (shape.moe.num_experts // self.ep_size) if shape.moe else 0

    def holds(self, mapping: TensorMapping, shape: ModelShape) -> bool:
        """Whether this rank's EP rank holds `mapping`'s expert (every rank holds non-expert tensors)."""
        return mapping.expert is None or mapping.expert // (shape.moe.num_experts // self.ep_size) == self.ep_rank


def tensor_mappings(shape: ModelShape) -> list[TensorMapping]:
    """Every tensor of the full model, in HF file order. A tied model has no lm_head: its output layer maps to the
    embedding (the last pipeline stage keeps its own copy of it in megatron)."""
    maps = [TensorMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB)]
    for i in range(shape.num_layers):
        mg, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = hf + "self_attn."
        maps += [
            TensorMapping(mg + "input_layernorm.weight", (hf + "input_layernorm.weight",), REPLICATED),
            TensorMapping(mg + "self_attention.linear_qkv.weight",
                          (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"), QKV),
        ]
        if shape.qkv_bias:
            maps.append(TensorMapping(mg + "self_attention.linear_qkv.bias",
                                      (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"), QKV))
        maps.append(TensorMapping(mg + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), ROW))
        if shape.qk_norm:
            maps += [TensorMapping(mg + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), REPLICATED),
                     TensorMapping(mg + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), REPLICATED)]
        maps.append(TensorMapping(mg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",),
                                  REPLICATED))
        maps += _mlp_mappings(mg + "mlp.", hf + "mlp.", shape)
    maps.append(TensorMapping("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED))
    lm_head = "model.embed_tokens.weight" if shape.tie_word_embeddings else "lm_head.weight"
    maps.append(TensorMapping("output_layer.weight", (lm_head,), VOCAB))
    return maps


def _mlp_mappings(mg: str, hf: str, shape: ModelShape) -> list[TensorMapping]:
    """One layer's dense MLP, or its router and experts (in HF's order of expert index)."""
    if shape.moe is None:
        return [TensorMapping(mg + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"), FC1),
                TensorMapping(mg + "linear_fc2.weight", (hf + "down_proj.weight",), ROW)]
    maps = [TensorMapping(mg + "router.weight", (hf + "gate.weight",), REPLICATED)]
    for e in range(shape.moe.num_experts):
        mg_e, hf_e = f"{mg}experts.local_experts.{e}.", f"{hf}experts.{e}."
        maps += [TensorMapping(mg_e + "linear_fc1.weight", (hf_e + "gate_proj.weight", hf_e + "up_proj.weight"), FC1,
                               expert=e),
                 TensorMapping(mg_e + "linear_fc2.weight", (hf_e + "down_proj.weight",), ROW, expert=e)]
    return maps


def hf_tensor_names(shape: ModelShape) -> list[str]:
    """The tensors a HF checkpoint of this shape holds (each once; tied models have no lm_head.weight)."""
    seen: dict[str, None] = {}
    for m in tensor_mappings(shape):
        for name in m.hf_names:
            seen.setdefault(name)
    return list(seen)


def hf_tensor_shape(name: str, shape: ModelShape) -> tuple[int, ...]:
    """The shape config.json implies for a HF tensor (to name mismatches before loading)."""
    h, d, heads, groups, f = (shape.hidden_size, shape.head_dim, shape.num_attention_heads, shape.num_query_groups,
                              shape.ffn_hidden_size)
    moe_rules = [] if shape.moe is None else [  # before the dense MLP's, whose patterns match an expert's names too
        (r".*mlp\.gate\.weight", (shape.moe.num_experts, h)),
        (r".*mlp\.experts\.\d+\.(gate|up)_proj\.weight", (shape.moe.ffn_hidden_size, h)),
        (r".*mlp\.experts\.\d+\.down_proj\.weight", (h, shape.moe.ffn_hidden_size)),
    ]
    rules = moe_rules + [
        (r"model\.embed_tokens\.weight|lm_head\.weight", (shape.vocab_size, h)),
        (r".*(input|post_attention)_layernorm\.weight|model\.norm\.weight", (h,)),
        (r".*self_attn\.[qk]_norm\.weight", (d,)),
        (r".*q_proj\.weight", (heads * d, h)), (r".*q_proj\.bias", (heads * d,)),
        (r".*[kv]_proj\.weight", (groups * d, h)), (r".*[kv]_proj\.bias", (groups * d,)),
        (r".*o_proj\.weight", (h, heads * d)),
        (r".*(gate|up)_proj\.weight", (f, h)), (r".*down_proj\.weight", (h, f)),
    ]
    for pattern, expected in rules:
        if re.fullmatch(pattern, name):
            return expected
    raise KeyError(f"{name!r} is not a Qwen2 / Qwen3 / Qwen3-MoE tensor")


_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
# megatron-core's distributed-checkpoint keys use the Transformer Engine names for both layer specs.
LOCAL_TO_TE = {local: te for te, local in _TE_TO_LOCAL.items()}
_LAYER = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")  # SequentialMLP (local spec)
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")  # TEGroupedMLP (TE spec)


def canonical_name(param_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """'decoder.layers.1.mlp.linear_fc1.layer_norm_weight' on a stage starting at layer 4 ->
    'decoder.layers.5.pre_mlp_layernorm.weight'; an expert's 'decoder.layers.0.mlp.experts.local_experts.1.
    linear_fc1.weight' (or TE's grouped 'decoder.layers.0.mlp.experts.linear_fc1.weight1') on an EP rank whose first
    expert is 8 -> 'decoder.layers.4.mlp.experts.local_experts.9.linear_fc1.weight'. DDP's `module.` prefixes are
    dropped."""
    name = re.sub(r"^(module\.)+", "", param_name)
    m = _LAYER.match(name)
    if m is None:
        return name
    rest = _TE_TO_LOCAL.get(m.group(2), m.group(2))
    if (expert := _LOCAL_EXPERT.match(rest)) is not None:
        rest = f"mlp.experts.local_experts.{int(expert.group(1)) + expert_offset}.{expert.group(2)}"
    elif (expert := _GROUPED_EXPERT.match(rest)) is not None:
        rest = f"mlp.experts.local_experts.{int(expert.group(2)) + expert_offset}.{expert.group(1)}.weight"
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{rest}"


def _qkv_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    groups, d = shape.num_query_groups, shape.head_dim
    per_group = shape.num_attention_heads // groups
    tail = q.shape[1:]
    q = q.reshape(groups, per_group * d, *tail)
    k = k.reshape(groups, d, *tail)
    v = v.reshape(groups, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(groups * (per_group + 2) * d, *tail)


def _qkv_split(full: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
    groups, d = shape.num_query_groups, shape.head_dim
    per_group = shape.num_attention_heads // groups
    tail = full.shape[1:]
    grouped = full.reshape(groups, (per_group + 2) * d, *tail)
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return [q.reshape(groups * per_group * d, *tail), k.reshape(groups * d, *tail), v.reshape(groups * d, *tail)]


def hf_to_megatron_shard(mapping: TensorMapping, hf_tensors: list[torch.Tensor], shape: ModelShape,
                         tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's shard of a megatron tensor, from the HF tensors named by `mapping.hf_names` (same order)."""
    layout = mapping.layout
    if layout == REPLICATED:
        return hf_tensors[0]
    if layout == ROW:
        return hf_tensors[0].chunk(tp_size, dim=1)[tp_rank]
    if layout == QKV:
        return _qkv_full(*hf_tensors, shape).chunk(tp_size, dim=0)[tp_rank]
    if layout == FC1:
        gate, up = hf_tensors
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    if layout == VOCAB:
        table = hf_tensors[0]
        padding = padded_vocab_size(shape.vocab_size, tp_size) - table.shape[0]
        rows_per_rank = (table.shape[0] + padding) // tp_size
        start = tp_rank * rows_per_rank
        shard = table[start:start + rows_per_rank]
        if shard.shape[0] < rows_per_rank:  # the padded tail: zero rows (never reach a softmax)
            pad = table.new_zeros(rows_per_rank - shard.shape[0], *table.shape[1:])
            shard = torch.cat([shard, pad], dim=0)
        return shard
    raise ValueError(f"unknown layout {layout!r}")


def _cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat, except that a single tensor is returned as it is (a weight sync at TP=1 copies nothing here)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def megatron_shards_to_hf(mapping: TensorMapping, shards: list[torch.Tensor],
                          shape: ModelShape) -> list[torch.Tensor]:
    """The HF tensors (in `mapping.hf_names` order) from all TP ranks' shards of one megatron tensor (rank order).
    For a replicated tensor one shard is enough. With a single shard (TP=1) the results are views of it where the
    layout allows (all but q/k/v): callers must not write into them."""
    layout = mapping.layout
    if layout == REPLICATED:
        return [shards[0]]
    if layout == ROW:
        return [_cat(shards, dim=1)]
    if layout == QKV:
        return _qkv_split(_cat(shards, dim=0), shape)
    if layout == FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [_cat([h[0] for h in halves], dim=0), _cat([h[1] for h in halves], dim=0)]
    if layout == VOCAB:
        return [_cat(shards, dim=0)[:shape.vocab_size]]
    raise ValueError(f"unknown layout {layout!r}")
