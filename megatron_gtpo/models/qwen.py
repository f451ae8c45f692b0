"""Qwen2 / Qwen2.5, Qwen3 dense and Qwen3-MoE on megatron-core: TransformerConfig from a Hugging Face config.json,
layer specs, model builder.

All families are the same GPTModel (GQA, RMSNorm, SwiGLU, RoPE); what differs is in `QwenFamily`, chosen by the
config's `model_type` (`ModelShape.from_hf`): Qwen2 has a bias on q/k/v; Qwen3 has none, but an RMSNorm over
head_dim on every query and key head before RoPE (megatron's qk_layernorm) and an explicit head_dim (megatron's
kv_channels), which need not be hidden_size / heads. Qwen3-MoE is Qwen3 with a router and experts in place of every
layer's MLP (models/moe.py). `transformer_config_from_hf` is the ONE function that turns a config.json into a
megatron TransformerConfig. Everything about tensor names and layouts lives in `hf_mapping.py`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_gtpo.layout import ParallelLayout, check_layout

from .accelerator import CORE_ATTENTIONS, Accelerator, fusion_settings
from .local_norm import LocalRMSNorm
from .moe import MoeShape, RouterLosses, mark_expert_parameters, moe_config_kwargs


@dataclass(frozen=True)
class QwenFamily:
    """What a config.json's `model_type` decides about the architecture."""

    architecture: str  # the HF class (`architectures` in config.json)
    models: str  # for error messages
    qkv_bias: bool  # bias on the q/k/v projections
    qk_norm: bool  # RMSNorm over head_dim on each query and key head, before RoPE
    required_keys: tuple[str, ...]  # beyond _REQUIRED_KEYS
    moe: bool = False  # a router and experts in every layer's place of the MLP (models/moe.py)


# Qwen3 wants head_dim spelled out: transformers' Qwen3Config defaults it to 128, not hidden_size / heads.
FAMILIES = {
    "qwen2": QwenFamily("Qwen2ForCausalLM", "Qwen2, Qwen2.5", qkv_bias=True, qk_norm=False, required_keys=()),
    "qwen3": QwenFamily("Qwen3ForCausalLM", "Qwen3 dense", qkv_bias=False, qk_norm=True, required_keys=("head_dim",)),
    "qwen3_moe": QwenFamily("Qwen3MoeForCausalLM", "Qwen3-MoE", qkv_bias=False, qk_norm=True,
                            required_keys=("head_dim",), moe=True),
}

# Megatron pads the vocabulary so that every TP rank holds an equal, 128-aligned slice. We pad to a multiple of
# lcm(128 * TP, 1024): that is a multiple of 128 * TP, and for every TP <= 8 it does not depend on TP at all, so a
# distributed checkpoint written at one TP reloads at another without touching the embedding shapes.
VOCAB_DIVISIBLE_BY = 128
VOCAB_TP_INDEPENDENT_MULTIPLE = 1024


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    multiple = math.lcm(VOCAB_DIVISIBLE_BY * tensor_parallel, VOCAB_TP_INDEPENDENT_MULTIPLE)
    return -(-vocab_size // multiple) * multiple


def load_hf_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {model_dir!r}: not a Hugging Face model directory")
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e


_REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")


def family_of(hf_config: dict) -> QwenFamily:
    """The family named by config.json's `model_type` (by its `architectures` in files without one)."""
    archs = hf_config.get("architectures") or []
    model_type = hf_config.get("model_type")
    family = FAMILIES.get(model_type) if model_type is not None else \
        next((f for f in FAMILIES.values() if f.architecture in archs), None)
    if family is None:
        supported = ", ".join(f"model_type {name!r} ({f.architecture}: {f.models})" for name, f in FAMILIES.items())
        raise ValueError(f"unsupported architecture {archs or model_type!r} (model_type {model_type!r}): supported "
                         f"are {supported}")
    return family


@dataclass(frozen=True)
class ModelShape:
    """The architecture facts of a Qwen2, Qwen3 or Qwen3-MoE config.json that the model, the mapping and the planner
    use; `qkv_bias` and `qk_norm` come from its family (`QwenFamily`), `moe` (None for dense models) from the
    mixture-of-experts keys (models/moe.py)."""

    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int  # true vocabulary, before padding
    tie_word_embeddings: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    init_std: float
    qkv_bias: bool
    qk_norm: bool
    moe: MoeShape | None = None

    @classmethod
    def from_hf(cls, hf_config: dict) -> "ModelShape":
        family = family_of(hf_config)
        missing = [k for k in _REQUIRED_KEYS + family.required_keys if k not in hf_config]
        if missing:
            raise ValueError(f"config.json lacks required keys {missing}")
        if hf_config.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=true is not supported (Qwen2.5 and Qwen3 checkpoints do not use it)")
        if hf_config.get("attention_bias") and not family.qkv_bias:  # Qwen2's modelling ignores the key
            raise ValueError(f"attention_bias=true is not supported for {family.architecture}: it adds biases to "
                             f"q/k/v and o_proj, which no published checkpoint has")
        if hf_config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf_config['hidden_act']!r} is not supported (Qwen2 and Qwen3 use 'silu')")
        # transformers >= 5 writes rope settings under `rope_parameters`; older config.json files use the top level.
        rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"RoPE scaling {rope!r} is not supported (Qwen2.5 and Qwen3 checkpoints use plain RoPE)")
        rope_theta = hf_config.get("rope_theta", rope.get("rope_theta", 10000.0))
        heads = hf_config["num_attention_heads"]
        hidden = hf_config["hidden_size"]
        return cls(
            hidden_size=hidden,
            ffn_hidden_size=hf_config["intermediate_size"],
            num_layers=hf_config["num_hidden_layers"],
            num_attention_heads=heads,
            num_query_groups=hf_config.get("num_key_value_heads", heads),
            head_dim=hf_config.get("head_dim") or hidden // heads,
            vocab_size=hf_config["vocab_size"],
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(hf_config.get("max_position_embeddings", 32768)),
            init_std=float(hf_config.get("initializer_range", 0.02)),
            qkv_bias=family.qkv_bias,
            qk_norm=family.qk_norm,
            moe=MoeShape.from_hf(hf_config) if family.moe else None,
        )


def transformer_config_from_hf(hf_config: dict, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                               virtual_pipeline_parallel: int | None = None, sequence_parallel: bool = False,
                               expert_parallel: int = 1, expert_tensor_parallel: int | None = None,
                               context_parallel: int = 1, context_comm: str = "p2p",
                               params_dtype: torch.dtype = torch.float32, recompute_activations: bool = False,
                               accelerator: Accelerator | None = None, transformer_engine: bool = False,
                               packed_sequences: bool = False, router_losses: RouterLosses = RouterLosses(),
                               core_attention: str = "sdpa"):
    """The megatron-core TransformerConfig of a Qwen2 / Qwen3 / Qwen3-MoE config.json, for the given parallel layout,
    layer spec (`transformer_engine`) and machine (`accelerator`, default this process's: models/accelerator.py
    decides the fusions). `packed_sequences`: the model will see packed rows (data.pack_sequences). Qwen3-MoE: its
    experts at `expert_parallel` (EP) and `expert_tensor_parallel` (None: TP, megatron's default), with
    `router_losses` (models/moe.py). `context_parallel` (CP) splits every sequence over that many ranks; TE's
    attention exchanges keys and values by `context_comm` (layout.CP_COMM_TYPES), the local spec's gathers them
    (models/context_attention.py). `core_attention`: the local spec's (accelerator.CORE_ATTENTIONS).

    All families: GQA (num_query_groups = num_key_value_heads), head_dim as kv_channels, no biases except Qwen2's on
    q/k/v, RMSNorm, SwiGLU, RoPE (rope_theta is passed to GPTModel, which owns the rotary embedding); Qwen3's per-head
    q/k RMSNorm is megatron's qk_layernorm (built over kv_channels with layernorm_epsilon; finalize_model_grads sums
    its gradients over TP, each rank seeing only its own heads). Dropout is 0 (RL fine-tuning, and exact parity with
    HF).
    """
    from megatron.core.transformer import TransformerConfig

    shape = ModelShape.from_hf(hf_config)
    check_layout(ParallelLayout(tensor_parallel, pipeline_parallel, None, virtual_pipeline_parallel, sequence_parallel,
                                expert=expert_parallel, expert_tensor=expert_tensor_parallel, context=context_parallel),
                 shape=shape)  # LayoutError (a ValueError) naming the rule
    accelerator = accelerator or Accelerator.probe()
    if transformer_engine and not accelerator.transformer_engine:
        raise ValueError("the Transformer Engine layer spec needs CUDA and a working transformer_engine.pytorch")
    experts = {} if shape.moe is None else moe_config_kwargs(
        shape.moe, expert_parallel=expert_parallel, expert_tensor_parallel=expert_tensor_parallel,
        transformer_engine=transformer_engine, router_losses=router_losses)
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=shape.init_std,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline_parallel,
        sequence_parallel=sequence_parallel,
        context_parallel_size=context_parallel,
        cp_comm_type=context_comm if context_parallel > 1 else None,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        attention_softmax_in_fp32=True,
        variable_seq_lengths=True,  # RL micro-batches have different lengths
        # MoE: the all-to-all dispatcher (models/moe.py). Dense: the default "allgather" vetoes variable_seq_lengths.
        **(experts or {"moe_token_dispatcher_type": "alltoall"}),
        **fusion_settings(accelerator, transformer_engine=transformer_engine, packed_sequences=packed_sequences,
                          core_attention=core_attention),
        recompute_granularity="full" if recompute_activations else None,
        recompute_method="uniform" if recompute_activations else None,
        recompute_num_layers=1 if recompute_activations else None,
    )


def layer_spec(transformer_engine: bool, qk_norm: bool, num_experts: int | None = None, *,
               context_parallel: bool = False, core_attention: str = "sdpa"):
    """Transformer Engine's or megatron's local layer spec; `qk_norm`: with per-head q/k norms (Qwen3); `num_experts`:
    a router and that many experts in place of the MLP (Qwen3-MoE; TE's grouped GEMM or the local SequentialMLP);
    `context_parallel`: the local spec's attention gathers the keys and values of the context-parallel ranks
    (models/context_attention.py; TE's attention does that by itself); `core_attention`: the local spec's core
    attention, "sdpa" (models/sdpa_attention.py) or megatron's "unfused" DotProductAttention (TE's spec ignores it).

    The local spec stores a dense layer's pre-MLP norm under TE's name (mlp.linear_fc1.layer_norm_weight), since TE
    fuses it into fc1; TE's MoE layer keeps it a module of its own (pre_mlp_layernorm), and so does the local MoE
    layer here, so that MoE checkpoints load with either spec. The local spec's norms are LocalRMSNorm (megatron's
    WrappedTorchNorm refuses sequence parallelism); `decoder_block_spec` adds the final one."""
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)

    if transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=bool(num_experts),
                                                          qk_layernorm=qk_norm)
    spec = get_gpt_layer_local_spec(num_experts=num_experts, normalization="RMSNorm", qk_layernorm=qk_norm)
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = LocalRMSNorm
    from .rope_once_attention import RopeOnceSelfAttention

    layer.self_attention.module = RopeOnceSelfAttention  # keys rotated once, as they enter a KV cache
    from .lean_linears import LeanColumnParallelLinear, LeanRowParallelLinear

    # Without gradients (generation, scoring), the linears skip megatron's autograd machinery (lean_linears.py).
    mlp = layer.mlp.submodules.experts.submodules if num_experts else layer.mlp.submodules
    attention.linear_qkv, attention.linear_proj = LeanColumnParallelLinear, LeanRowParallelLinear
    mlp.linear_fc1, mlp.linear_fc2 = LeanColumnParallelLinear, LeanRowParallelLinear
    if core_attention not in CORE_ATTENTIONS:
        raise ValueError(f"model.core_attention: {core_attention!r} is not one of {list(CORE_ATTENTIONS)}")
    if context_parallel:
        from .context_attention import AllGatherContextAttention, AllGatherUnfusedContextAttention

        attention.core_attention = AllGatherContextAttention if core_attention == "sdpa" else \
            AllGatherUnfusedContextAttention
    elif core_attention == "sdpa":
        from .sdpa_attention import SdpaAttention

        attention.core_attention = SdpaAttention
    if qk_norm:
        attention.q_layernorm = attention.k_layernorm = LocalRMSNorm
    if num_experts:
        layer.sharded_state_dict_keys_map.pop("pre_mlp_layernorm.")
    return spec


def decoder_block_spec(layer, config, *, transformer_engine: bool, vp_stage: int | None, pp_rank: int):
    """What GPTModel builds one model chunk's decoder block from: TE's `layer` spec as it is (megatron adds TE's final
    norm); the local spec's `layer` for each of the chunk's layers, with a LocalRMSNorm as the final norm (given a
    layer spec, megatron would add WrappedTorchNorm)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if transformer_engine:
        return layer
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage, pp_rank),
                                      layer_norm=LocalRMSNorm)


def build_model(hf_config: dict, *, tensor_parallel: int, pipeline_parallel: int, pp_rank: int,
                virtual_pipeline_parallel: int | None = None, sequence_parallel: bool = False,
                expert_parallel: int = 1, expert_tensor_parallel: int | None = None,
                context_parallel: int = 1, context_comm: str = "p2p",
                router_losses: RouterLosses = RouterLosses(), params_dtype: torch.dtype = torch.float32,
                recompute_activations: bool = False,
                use_transformer_engine: bool | None = None,
                parallel_output: bool = True, meta_device: bool = False, accelerator: Accelerator | None = None,
                packed_sequences: bool = False, core_attention: str = "sdpa") -> list:
    """This rank's model chunks (one per virtual pipeline stage; a list of one without VPP), on the current CUDA
    device (on the CPU platform, the logical device the audit tracks).

    Needs megatron's parallel state initialised (distributed.initialize_parallel). The vocabulary is padded with
    `padded_vocab_size`; the padded logits are masked by every consumer (vocab-parallel op, scoring, generation).
    The layer spec is Transformer Engine's where `accelerator` (default: this process's) runs it, unless
    `use_transformer_engine` says otherwise. `meta_device=True` builds shapes only (no memory, no initialisation;
    the local spec unless asked otherwise, which has the same parameters): for parameter counts, planning, and
    building a GPU run's model on a CPU (`accelerator=Accelerator(cuda=True, ...)`). Qwen3-MoE: its experts at
    `expert_parallel` / `expert_tensor_parallel` (initialize_parallel's), with `router_losses`. `context_parallel` /
    `context_comm` / `core_attention`: as transformer_config_from_hf.
    """
    import contextlib

    from megatron.core.models.gpt import GPTModel

    from .lean_linears import LeanColumnParallelLinear

    shape = ModelShape.from_hf(hf_config)
    accelerator = accelerator or Accelerator.probe()
    if use_transformer_engine is None:
        use_transformer_engine = accelerator.transformer_engine and not meta_device
    config = transformer_config_from_hf(
        hf_config, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
        virtual_pipeline_parallel=virtual_pipeline_parallel, sequence_parallel=sequence_parallel,
        expert_parallel=expert_parallel, expert_tensor_parallel=expert_tensor_parallel,
        context_parallel=context_parallel, context_comm=context_comm,
        params_dtype=params_dtype, recompute_activations=recompute_activations,
        accelerator=accelerator, transformer_engine=use_transformer_engine, packed_sequences=packed_sequences,
        router_losses=router_losses, core_attention=core_attention)
    if meta_device:
        config.use_cpu_initialization, config.perform_initialization = True, False
    spec = layer_spec(use_transformer_engine, shape.qk_norm, shape.moe.num_experts if shape.moe else None,
                      context_parallel=context_parallel > 1, core_attention=core_attention)
    num_chunks = virtual_pipeline_parallel or 1
    chunks = []
    for vp_stage in range(num_chunks):
        first = pp_rank == 0 and vp_stage == 0
        last = pp_rank == pipeline_parallel - 1 and vp_stage == num_chunks - 1
        with torch.device("meta") if meta_device else contextlib.nullcontext():
            model = GPTModel(
                config=config, transformer_layer_spec=decoder_block_spec(
                    spec, config, transformer_engine=use_transformer_engine,
                    vp_stage=vp_stage if virtual_pipeline_parallel else None, pp_rank=pp_rank),
                vocab_size=padded_vocab_size(shape.vocab_size, tensor_parallel),
                max_sequence_length=shape.max_position_embeddings,
                pre_process=first, post_process=last, parallel_output=parallel_output,
                share_embeddings_and_output_weights=shape.tie_word_embeddings,
                position_embedding_type="rope", rotary_percent=1.0, rotary_base=int(shape.rope_theta),
                vp_stage=vp_stage if virtual_pipeline_parallel else None,
            )
        if model.post_process:  # megatron builds it as a ColumnParallelLinear whatever the layer spec
            model.output_layer.__class__ = LeanColumnParallelLinear  # the same module, with the lean forward
        if shape.moe is not None:
            mark_expert_parameters(model)
        if not meta_device:
            # As Megatron-LM's get_model: the local spec's norms (and everything under use_cpu_initialization) are
            # built on the host. DDP moves the parameters it wraps into its device buffers; every other model (the
            # reference policy, scoring, evaluation) would keep them there. And as its Float16Module: the local
            # spec's norms are built in fp32 whatever params_dtype says; one dtype for all parameters (two would
            # split the distributed optimizer's buffers, whose checkpoint then fails to save).
            model.to(device=torch.cuda.current_device(), dtype=params_dtype)
        chunks.append(model)
    return chunks
