"""The published Qwen3-MoE architectures (the config.json files of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B), for
recipes, planning and meta-device shape checks without downloading anything. `qwen3_moe_hf_config("qwen3-30b-a3b")`
returns a config.json dict. Both have 128 experts of which 8 serve each token with renormalised top-k probabilities,
every layer sparse (decoder_sparse_step 1, no mlp_only_layers), no shared experts, head_dim 128, 4 KV heads, untied
embeddings, vocabulary 151936, 40960 positions, rope_theta 1e6 and rms_norm_eps 1e-6. Published totals: 30.5B
parameters of which 3.3B active, and 235B of which 22B active (tests/test_models_qwen3_moe_config.py checks them)."""
from __future__ import annotations

# name: (hidden, intermediate (unused: no dense layer), moe_intermediate, layers, heads)
_SIZES = {
    "qwen3-30b-a3b": (2048, 6144, 768, 48, 32),
    "qwen3-235b-a22b": (4096, 12288, 1536, 94, 64),
}
QWEN3_MOE_MODEL_NAMES = tuple(_SIZES)


def qwen3_moe_hf_config(name: str) -> dict:
    key = name.lower()
    if key not in _SIZES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(QWEN3_MOE_MODEL_NAMES)}")
    hidden, inter, moe_inter, layers, heads = _SIZES[key]
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
        "attention_bias": False, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": moe_inter, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
        "output_router_logits": False, "tie_word_embeddings": False, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "initializer_range": 0.02, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    }
