"""Tiny random Qwen2 checkpoints built in code (nothing can be downloaded), saved as HF safetensors directories."""
from __future__ import annotations

import torch


def tiny_qwen2_config(*, vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                      num_kv_heads=2, tie=False, max_positions=256, rope_theta=1e6):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                       tie_word_embeddings=tie, max_position_embeddings=max_positions, rope_theta=rope_theta,
                       rms_norm_eps=1e-6, architectures=["Qwen2ForCausalLM"], bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)


def make_tiny_qwen2(path, *, seed=0, dtype=torch.float32, **config_kwargs):
    """Save a random Qwen2ForCausalLM to `path`; returns the model (eval mode). Weights get a larger spread than
    the default init so that logits are far from uniform and layout bugs cannot hide."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(**config_kwargs)).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    return model
