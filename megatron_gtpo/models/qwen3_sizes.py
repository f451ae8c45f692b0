"""The published Qwen3 dense architectures (the config.json files of Qwen/Qwen3-0.6B ... Qwen/Qwen3-32B), for recipes,
planning and meta-device shape checks without downloading anything. `qwen3_hf_config("qwen3-8b")` returns a
config.json dict. Every size has head_dim 128 (more than hidden_size / heads for 0.6B and 32B), vocabulary 151936,
40960 positions, rope_theta 1e6 and rms_norm_eps 1e-6."""
from __future__ import annotations

# name: (hidden, intermediate, layers, heads, kv_heads, tied)
_SIZES = {
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, True),
    "qwen3-4b": (2560, 9728, 36, 32, 8, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, False),
    "qwen3-14b": (5120, 17408, 40, 40, 8, False),
    "qwen3-32b": (5120, 25600, 64, 64, 8, False),
}
QWEN3_MODEL_NAMES = tuple(_SIZES)


def qwen3_hf_config(name: str) -> dict:
    key = name.lower()
    if key not in _SIZES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(QWEN3_MODEL_NAMES)}")
    hidden, inter, layers, heads, kv, tied = _SIZES[key]
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu", "attention_bias": False,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": tied, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "initializer_range": 0.02, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    }
