"""Qwen3-MoE's sparse MLP on megatron-core: the facts of a config.json's mixture-of-experts keys (`MoeShape`), the
router losses a run may add (`RouterLosses`) and the TransformerConfig settings they give (`moe_config_kwargs`).

Qwen3-MoE (transformers' Qwen3MoeSparseMoeBlock) replaces the MLP of every decoder layer by a router and E experts:
p = softmax(h W_gate^T) over the E experts; the k largest of p, renormalised to sum to 1 when `norm_topk_prob` (both
published models), weight the SwiGLU outputs of their k experts. No shared experts, no biases. On megatron-core that
is a TopKRouter with score function softmax: without pre-softmax (norm_topk_prob) it takes the top k of the logits
and a softmax over those k, which is the top-k probabilities renormalised (softmax is monotone and its normaliser
cancels); with pre-softmax (no norm_topk_prob) the top k of the full softmax as they are.

Experts: megatron's SequentialMLP (a loop over this rank's experts; runs on the CPU) on the local layer spec, the
grouped GEMM of Transformer Engine (TEGroupedMLP) on the TE spec. Both store their weights under the same sharded
keys. Tokens go to the experts' ranks through the all-to-all dispatcher (torch's all_to_all_single, which gloo runs).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeShape:
    """The mixture-of-experts facts of a Qwen3-MoE config.json."""

    num_experts: int
    topk: int  # num_experts_per_tok: experts per token
    ffn_hidden_size: int  # moe_intermediate_size: each expert's SwiGLU width
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1

    @classmethod
    def from_hf(cls, hf_config: dict) -> "MoeShape":
        """ValueError naming the key for what this model does not support: experts on only some layers
        (decoder_sparse_step > 1, mlp_only_layers) and shared experts (Qwen2-MoE's, which Qwen3-MoE has not)."""
        # transformers 5 writes the expert count as num_local_experts; the published config.json files say num_experts
        num_experts = hf_config.get("num_experts", hf_config.get("num_local_experts"))
        missing = [k for k, v in (("num_experts", num_experts), ("num_experts_per_tok",
                                                                  hf_config.get("num_experts_per_tok")),
                                  ("moe_intermediate_size", hf_config.get("moe_intermediate_size"))) if v is None]
        if missing:
            raise ValueError(f"config.json lacks the mixture-of-experts keys {missing}")
        topk = hf_config["num_experts_per_tok"]
        if not 1 <= topk <= num_experts:
            raise ValueError(f"num_experts_per_tok {topk} must be in [1, num_experts = {num_experts}]")
        step, dense_layers = hf_config.get("decoder_sparse_step", 1), hf_config.get("mlp_only_layers")
        if step != 1 or dense_layers:
            raise ValueError(f"experts on only some layers (decoder_sparse_step {step}, mlp_only_layers "
                             f"{dense_layers}) are not supported: every layer of the supported Qwen3-MoE models is "
                             f"sparse (decoder_sparse_step 1, mlp_only_layers [])")
        if hf_config.get("shared_expert_intermediate_size"):
            raise ValueError("shared experts (shared_expert_intermediate_size > 0) are not supported: Qwen3-MoE has "
                             "none")
        return cls(num_experts=int(num_experts), topk=int(topk),
                   ffn_hidden_size=int(hf_config["moe_intermediate_size"]),
                   norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)))


@dataclass(frozen=True)
class RouterLosses:
    """The router's auxiliary losses (model.moe.aux_loss_coef, model.moe.z_loss_coef): megatron's load-balancing loss
    (Switch Transformer's, per micro-batch) and the router z-loss (ST-MoE's), each with its coefficient; 0 is off, the
    RL default (docs/algorithms.md, "Mixture of experts")."""

    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0


def moe_config_kwargs(moe: MoeShape, *, expert_parallel: int, expert_tensor_parallel: int | None,
                      transformer_engine: bool, router_losses: RouterLosses = RouterLosses()) -> dict:
    """TransformerConfig keyword arguments for the experts of `moe` at the given expert layout.

    The router computes in fp32 whatever the model dtype (its top-k decides which weights a token sees at all: a
    bf16 near-tie would flip between generation and training); megatron's RouterReplay hooks are built into every
    router, inert until routing_replay.py gives them an action."""
    _define_missing_te_names()
    aux, z = router_losses.aux_loss_coef, router_losses.z_loss_coef
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_topk=moe.topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=z if z > 0 else None,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=transformer_engine,
        moe_enable_routing_replay=True,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,
    )


def _define_missing_te_names() -> None:
    """megatron-core 0.16.1's moe_utils imports te_general_gemm only when Transformer Engine imports, yet its router
    gating asks `te_general_gemm is not None` unconditionally (NameError without TE). Without TE the name is None,
    which selects its plain torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def mark_expert_parameters(model) -> None:
    """Every expert's parameters are expert-parallel parameters (megatron's `allreduce = False`: DDP gives them buffers
    of their own, reduced over the expert-data-parallel group, and the optimizer a chained optimizer of their own),
    also at EP = 1, where megatron would treat them as dense. The gradients are the same either way (at EP = 1 the
    expert-data-parallel group is the data-parallel group); what changes is that the optimizer, and so a trainer
    checkpoint's optimizer state, has the same structure at every EP, so that it resumes at another one.

    Marked by structure, every parameter under a MoE layer's `experts`, whatever the layer spec: megatron's local
    linear layers store an `is_expert` flag, Transformer Engine's grouped ones (TEGroupedLinear) do not."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer):
            for param in module.experts.parameters():
                param.allreduce = False
