"""Self-attention that rotates each key once, before it enters megatron's static KV cache.

megatron-core 0.16.1's static inference path (`Attention._adjust_key_value_for_inference`, without flash decode)
caches the keys unrotated and applies RoPE to every cached key at every forward step: a decode step at position p
rotates p keys per layer where one is new, and rotates the query in a second RoPE call of its own.
`RopeOnceSelfAttention` rotates the new queries and keys of a static-cache forward step together, in one RoPE call
on their concatenation, caches the rotated keys, and hands megatron's attention no rotary embedding for the step, so
nothing is rotated again. RoPE is elementwise, with each position's angles: a rotated key is the same, bit for bit,
whether it is rotated at its own step or at every later one, and so are the attention's inputs.

Everything else (training and scoring, which have no inference context; flash decode; the dynamic inference
context; layers without RoPE; queries and keys with rotary embeddings of their own) takes megatron's own path
unchanged. The local layer spec uses it (models/qwen.layer_spec); Transformer Engine's spec keeps megatron's
SelfAttention.
"""
from __future__ import annotations

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
        query_key = apply_rotary_pos_emb(torch.cat([query, key], dim=2), rotary_pos_emb[0][start:start + new],
                                         config=self.config,
                                         mscale=_yarn_get_concentration_factor_from_config(self.config),
                                         cp_group=self.pg_collection.cp)
        query, key = query_key.split([heads, key.shape[2]], dim=2)
        return super()._adjust_key_value_for_inference(inference_context, query, key, value, None, *args, **kwargs)
