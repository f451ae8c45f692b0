"""RopeOnceSelfAttention (models/rope_once_attention.py) against megatron's SelfAttention with the same weights:
a left-padded prefill and decode steps through megatron's static KV cache (each key rotated once, when cached,
against every cached key rotated at every step), and a forward without a cache (training: megatron's path). Float64,
in-process on host tensors, one TP rank; the local spec's attention submodules (SDPA core attention); GQA: 4 heads
over 2 query groups. The built-in engine's greedy tokens against transformers' are in test_rollout_builtin."""
import dataclasses
import types

import pytest
import torch

HEADS, GROUPS, HEAD_DIM, BATCH, PROMPT, DECODE_STEPS = 4, 2, 16, 3, 6, 3
PADS = torch.tensor([0, 2, 5])  # left pads of each row


@pytest.fixture(scope="module")
def attentions():
    """(RopeOnceSelfAttention, megatron's SelfAttention with the same weights, rotary embedding [S, 1, 1, D])."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.spec_utils import build_module

    from megatron_gtpo.models.qwen import layer_spec
    from megatron_gtpo.models.rope_once_attention import RopeOnceSelfAttention

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=HEAD_DIM, attention_dropout=0.0,
                               hidden_dropout=0.0, add_qkv_bias=True, params_dtype=torch.float64,
                               use_cpu_initialization=True)
    one_rank = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    groups = types.SimpleNamespace(tp=one_rank, cp=one_rank, pp=one_rank)
    spec = layer_spec(False, False).submodules.self_attention
    assert spec.module is RopeOnceSelfAttention
    torch.manual_seed(0)
    rope_once = build_module(spec, config=config, layer_number=1, pg_collection=groups)
    megatron = build_module(dataclasses.replace(spec, module=SelfAttention), config=config, layer_number=1,
                            pg_collection=groups)
    megatron.load_state_dict(rope_once.state_dict())
    # Without torch.distributed, megatron resolves every TP group to None: the linears get the one-rank group.
    for attention in (rope_once, megatron):
        attention.linear_qkv.tp_group = attention.linear_proj.tp_group = one_rank
    # megatron's RotaryEmbedding (which places it on CUDA): angle position * base^(-2i / D), halves repeated.
    angles_SD = torch.arange(PROMPT + DECODE_STEPS, dtype=torch.float64)[:, None] * \
        10000.0 ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mappings, "get_tensor_model_parallel_group_if_none", lambda group, **_: group)
        yield rope_once.eval(), megatron.eval(), torch.cat([angles_SD, angles_SD], dim=-1)[:, None, None, :]


def _left_pad_mask(sq, sk):
    """bool [B, 1, sq, sk], True = masked: pad keys, and causal for the last sq of sk positions."""
    pad_BK = torch.arange(sk)[None, :] < PADS[:, None]
    causal_QK = torch.arange(sk)[None, :] > torch.arange(sk - sq, sk)[:, None]
    return pad_BK[:, None, None, :] | causal_QK


def test_kv_cache_steps_equal_megatrons(attentions):
    """Prefill and decode steps: outputs and cached values bit for bit megatron's; the cached keys rotated."""
    from megatron.core.inference.contexts import StaticInferenceContext

    rope_once, megatron, rotary_S11D = attentions
    g = torch.Generator().manual_seed(1)
    hidden_SBH = torch.randn(PROMPT + DECODE_STEPS, BATCH, HEADS * HEAD_DIM, dtype=torch.float64, generator=g)
    contexts = [StaticInferenceContext(max_batch_size=BATCH, max_sequence_length=PROMPT + DECODE_STEPS)
                for _ in range(2)]
    for context in contexts:  # the cache on the host (megatron allocates it on the current CUDA device)
        context.key_value_memory_dict[1] = tuple(torch.zeros(PROMPT + DECODE_STEPS, BATCH, GROUPS, HEAD_DIM,
                                                             dtype=torch.float64) for _ in range(2))
    start = 0
    with torch.no_grad():
        for step in range(1 + DECODE_STEPS):
            new = PROMPT if step == 0 else 1
            mask = _left_pad_mask(new, start + new)
            outputs = [attention(hidden_SBH[start:start + new], mask, inference_context=context,
                                 rotary_pos_emb=rotary_S11D)[0]
                       for attention, context in zip((rope_once, megatron), contexts)]
            assert torch.equal(*outputs), f"step {step}: max difference {(outputs[0] - outputs[1]).abs().max()}"
            for context in contexts:
                context.increment_sequence_len_offset(new)
                context.enable_decode_mode()
            start += new
    (keys_SBGD, values_SBGD), (raw_keys_SBGD, raw_values_SBGD) = (c.key_value_memory_dict[1] for c in contexts)
    assert torch.equal(values_SBGD, raw_values_SBGD)
    first_half, second_half = raw_keys_SBGD.chunk(2, dim=-1)  # RoPE written out: x cos + rotate_half(x) sin
    rotated_SBGD = raw_keys_SBGD * rotary_S11D.cos() + torch.cat([-second_half, first_half], dim=-1) * rotary_S11D.sin()
    torch.testing.assert_close(keys_SBGD, rotated_SBGD, rtol=1e-12, atol=1e-12)


def test_forward_without_cache_is_megatrons(attentions):
    """Training and scoring (no inference context): megatron's own path, gradients included."""
    rope_once, megatron, rotary_S11D = attentions
    hidden_SBH = torch.randn(PROMPT, BATCH, HEADS * HEAD_DIM, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(2), requires_grad=True)
    grads = []
    for attention in (rope_once, megatron):
        output_SBH = attention(hidden_SBH, None, rotary_pos_emb=rotary_S11D[:PROMPT])[0]
        grads.append((output_SBH, *torch.autograd.grad(output_SBH.square().sum(), [hidden_SBH])))
    for ours, theirs in zip(*grads):
        assert torch.equal(ours, theirs)
