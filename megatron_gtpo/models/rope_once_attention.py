"""Self-attention that rotates each key once, before it enters megatron's static KV cache.

megatron-core 0.16.1's static inference path (`Attention._adjust_key_value_for_inference`, without flash decode)
caches the keys unrotated and applies RoPE to every cached key at every forward step: a decode step at position p
rotates p keys per layer where one is new, and rotates the query in a second RoPE call of its own.
`RopeOnceSelfAttention` rotates the new queries and keys of a static-cache forward step together, in one RoPE call
on their concatenation, caches the rotated keys, and hands megatron's attention no rotary embedding for the step, so
nothing is rotated again. RoPE is elementwise, with each position's angles: a rotated key is the same, bit for bit,
whether it is rotated at its own step or at every later one, and so are the attention's inputs.

The rotation is megatron's unfused RoPE written with what does not change between layers and steps taken out:
megatron's `_apply_rotary_pos_emb_bshd` computes cos and sin of the angles at every call (in every layer), and
rotate_half as a chunk, a negation and a concatenation. Here cos and sin (scaled by mscale and cast as megatron
does) are computed once per rotary table, the table every layer of a model is given (megatron caches it per
sequence length), with rotate_half's sign folded into the sine: x cos + rotate_half(x) sin = x cos + roll(x, D/2)
[-sin, sin], the same numbers bit for bit (negation is exact). Interleaved or partial rotary embeddings, multi-latent
attention and fused RoPE kernels take megatron's `apply_rotary_pos_emb`.

Everything else (training and scoring, which have no inference context; flash decode; the dynamic inference
context; layers without RoPE; queries and keys with rotary embeddings of their own) takes megatron's own path
unchanged. The local layer spec uses it (models/qwen.layer_spec); Transformer Engine's spec keeps megatron's
SelfAttention.
"""
from __future__ import annotations

import functools

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config)
from megatron.core.transformer.attention import SelfAttention


class RopeOnceSelfAttention(SelfAttention):
    """megatron's SelfAttention; with a static KV cache, each key is rotated once (module doc)."""

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb, *args,
                                        **kwargs):
        """megatron's contract (query [sq, b, np, hn], key / value [sq, b, ng, hn] of the new positions in; the
        query and all cached keys and values out); here the query and the keys come out rotated, and the rotary
        embedding returned is None."""
        if inference_context is None or not inference_context.is_static_batching() or rotary_pos_emb is None \
                or rotary_pos_emb[0] is not rotary_pos_emb[1] or self.config.flash_decode:
            return super()._adjust_key_value_for_inference(inference_context, query, key, value, rotary_pos_emb,
                                                           *args, **kwargs)
        start, new, heads = inference_context.sequence_len_offset, query.shape[0], query.shape[2]
        query_key = torch.cat([query, key], dim=2)
        mscale = _yarn_get_concentration_factor_from_config(self.config)
        table_S11D = rotary_pos_emb[0]
        if self.config.rotary_interleaved or self.config.multi_latent_attention or self.config.apply_rope_fusion \
                or table_S11D.shape[-1] != query.shape[-1]:
            query_key = apply_rotary_pos_emb(query_key, table_S11D[start:start + new], config=self.config,
                                             mscale=mscale, cp_group=self.pg_collection.cp)
        else:
            cos_S11D, signed_sin_S11D = _cos_and_signed_sin(table_S11D, mscale, query.dtype)
            rolled = query_key.roll(query.shape[-1] // 2, dims=-1).mul_(signed_sin_S11D[start:start + new])
            query_key = query_key.mul(cos_S11D[start:start + new]).add_(rolled)
        query, key = query_key.split([heads, key.shape[2]], dim=2)
        return super()._adjust_key_value_for_inference(inference_context, query, key, value, None, *args, **kwargs)


@functools.lru_cache(maxsize=4)
def _cos_and_signed_sin(table_S11D: torch.Tensor, mscale: float, dtype: torch.dtype):
    """(cos, [-sin, sin]) of a rotary table [S, 1, 1, D] (angles, halves repeated), as megatron's unfused RoPE
    computes them (times mscale, cast to the inputs' dtype), the sine's first half negated: rotate_half's sign.
    Kept per table: megatron caches the table, one object for all layers and steps of a sequence length."""
    cos_S11D = (torch.cos(table_S11D) * mscale).to(dtype)
    sin_S11D = (torch.sin(table_S11D) * mscale).to(dtype)
    first, second = sin_S11D.chunk(2, dim=-1)
    return cos_S11D, torch.cat([-first, second], dim=-1)
