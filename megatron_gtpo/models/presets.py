"""The published architectures of the supported families (their config.json files), for recipes, planning and
meta-device shape checks without downloading anything: one table, one function. `hf_config("qwen2.5-7b")` returns a
config.json dict; `PRESET_NAMES` lists every name, `FAMILY_PRESETS[model_type]` those of one family.

- Qwen2.5 (model_type qwen2): q/k/v bias, head_dim = hidden / heads.
- Qwen3 dense (qwen3): head_dim 128 for every size (more than hidden / heads for 0.6B and 32B), vocabulary 151936,
  40960 positions, rope_theta 1e6, rms_norm_eps 1e-6.
- Qwen3-MoE (qwen3_moe): 128 experts of which 8 serve each token with renormalised top-k probabilities, every layer
  sparse (decoder_sparse_step 1, no mlp_only_layers), no shared experts, head_dim 128, 4 KV heads, untied
  embeddings. Published totals: 30.5B parameters of which 3.3B active, and 235B of which 22B active
  (tests/test_models_qwen3_moe_config.py checks them).
"""
from __future__ import annotations

import copy


def _qwen25(hidden, inter, layers, heads, kv, vocab, tied, max_pos, eps) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "tie_word_embeddings": tied, "max_position_embeddings": max_pos, "rms_norm_eps": eps,
        "rope_theta": 1000000.0, "initializer_range": 0.02, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
    }


def _qwen3(hidden, inter, layers, heads, kv, tied) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu", "attention_bias": False,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": tied, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "initializer_range": 0.02, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    }


def _qwen3_moe(hidden, inter, moe_inter, layers, heads) -> dict:
    # `inter` is unused by the model (no dense layer) but published in config.json.
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


_PRESETS = {
    # Qwen2.5: (hidden, intermediate, layers, heads, kv_heads, vocab, tied, max_positions, rms_norm_eps)
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, 151936, True, 32768, 1e-6),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2, 151936, True, 131072, 1e-6),
    "qwen2.5-3b": _qwen25(2048, 11008, 36, 16, 2, 151936, True, 32768, 1e-6),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, 152064, False, 131072, 1e-6),
    "qwen2.5-14b": _qwen25(5120, 13824, 48, 40, 8, 152064, False, 131072, 1e-5),
    "qwen2.5-32b": _qwen25(5120, 27648, 64, 40, 8, 152064, False, 131072, 1e-5),
    "qwen2.5-72b": _qwen25(8192, 29568, 80, 64, 8, 152064, False, 131072, 1e-5),
    # Qwen3 dense: (hidden, intermediate, layers, heads, kv_heads, tied)
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, 8, False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8, False),
    # Qwen3-MoE: (hidden, intermediate, moe_intermediate, layers, heads)
    "qwen3-30b-a3b": _qwen3_moe(2048, 6144, 768, 48, 32),
    "qwen3-235b-a22b": _qwen3_moe(4096, 12288, 1536, 94, 64),
}
PRESET_NAMES = tuple(_PRESETS)
FAMILY_PRESETS = {family: tuple(n for n, c in _PRESETS.items() if c["model_type"] == family)
                  for family in ("qwen2", "qwen3", "qwen3_moe")}


def hf_config(name: str) -> dict:
    """A fresh config.json dict of the preset `name` (case-insensitive)."""
    key = name.lower()
    if key not in _PRESETS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(PRESET_NAMES)}")
    return copy.deepcopy(_PRESETS[key])
