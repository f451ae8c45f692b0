"""The published Qwen2.5 base-model architectures (their config.json files), for recipes, planning and meta-device
shape checks without downloading anything. `qwen25_hf_config("qwen2.5-7b")` returns a config.json dict."""
from __future__ import annotations

# name: (hidden, intermediate, layers, heads, kv_heads, vocab, tied, max_positions, rms_norm_eps)
_SIZES = {
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, True, 32768, 1e-6),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, True, 131072, 1e-6),
    "qwen2.5-3b": (2048, 11008, 36, 16, 2, 151936, True, 32768, 1e-6),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False, 131072, 1e-6),
    "qwen2.5-14b": (5120, 13824, 48, 40, 8, 152064, False, 131072, 1e-5),
    "qwen2.5-32b": (5120, 27648, 64, 40, 8, 152064, False, 131072, 1e-5),
    "qwen2.5-72b": (8192, 29568, 80, 64, 8, 152064, False, 131072, 1e-5),
}
QWEN25_MODEL_NAMES = tuple(_SIZES)


def qwen25_hf_config(name: str) -> dict:
    key = name.lower()
    if key not in _SIZES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(QWEN25_MODEL_NAMES)}")
    hidden, inter, layers, heads, kv, vocab, tied, max_pos, eps = _SIZES[key]
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "tie_word_embeddings": tied, "max_position_embeddings": max_pos, "rms_norm_eps": eps,
        "rope_theta": 1000000.0, "initializer_range": 0.02, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
    }
