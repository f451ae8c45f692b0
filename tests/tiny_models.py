"""Tiny random Qwen2 / Qwen3 / Qwen3-MoE checkpoints built in code (nothing can be downloaded), saved as HF safetensors
directories."""
from __future__ import annotations

import torch

# model_type: (transformers config class, model class)
FAMILY_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                  "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}
# Qwen3-MoE's tiny experts: 4 of width 32, 2 per token, top-k probabilities renormalised (the published models' choice)
TINY_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
# The Qwen3 (dense and MoE) tests' shape: head_dim 32, not hidden_size / heads = 16 (Qwen3 sets it apart); the
# vocabulary of 1000 is padded to 1024 by megatron.
TINY_QWEN3 = dict(vocab_size=1000, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)


def tiny_config(family="qwen2", *, vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                num_kv_heads=2, tie=False, max_positions=256, rope_theta=1e6, head_dim=None, **experts):
    """A transformers config of `family` ("qwen2", "qwen3" or "qwen3_moe"). `head_dim`: None leaves the config
    class's default (Qwen2: hidden_size / num_heads; Qwen3: 128). `experts`: Qwen3-MoE's keys over TINY_EXPERTS."""
    import transformers

    config_class, model_class = FAMILY_CLASSES[family]
    explicit = {} if head_dim is None else {"head_dim": head_dim}
    if family == "qwen3_moe":
        explicit.update({**TINY_EXPERTS, **experts})
    elif experts:
        raise ValueError(f"{sorted(experts)} are Qwen3-MoE keys, not {family}'s")
    return getattr(transformers, config_class)(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        tie_word_embeddings=tie, max_position_embeddings=max_positions, rope_theta=rope_theta, rms_norm_eps=1e-6,
        architectures=[model_class], bos_token_id=1, eos_token_id=2, pad_token_id=0, **explicit)


def make_tiny_model(path, family="qwen2", *, seed=0, dtype=torch.float32, **config_kwargs):
    """Save a random model of `family` to `path`; returns it (eval mode). Weights get a larger spread than the
    default init so that logits are far from uniform and layout bugs cannot hide (every norm, the per-head q/k norms
    included, gets weights away from 1)."""
    import transformers

    torch.manual_seed(seed)
    model_class = getattr(transformers, FAMILY_CLASSES[family][1])
    model = model_class(tiny_config(family, **config_kwargs)).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def make_tiny_qwen2(path, **kwargs):
    """`make_tiny_model` of the Qwen2 family."""
    return make_tiny_model(path, "qwen2", **kwargs)
