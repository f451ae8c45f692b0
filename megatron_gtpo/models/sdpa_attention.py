"""Core attention for megatron-core's local layer spec through torch's scaled_dot_product_attention (SDPA).

megatron-core 0.16.1's local `DotProductAttention` expands the keys and values of every query group to each of its
heads, materialises the [b, heads, sq, sk] scores and their softmax (in fp32 under bf16), and builds a causal mask
per layer. `SdpaAttention` computes the same function with one SDPA call: GQA natively (`enable_gqa`), causal
attention without a mask where the queries and keys are the same positions (`is_causal`, which a fused kernel
applies by itself), and an explicit mask only where one is given. It is the local spec's default; config
`model.core_attention: unfused` restores megatron's (accelerator.CORE_ATTENTIONS). Transformer Engine's attention
is not touched.

The masks it is given follow megatron's convention (bool, True = masked; broadcastable to [b, 1, sq, sk]): padded
rows get none (causal), packed rows a block-causal mask (training/forward.py), the static KV-cache path of
generation a left-padding mask (rollout/builtin.py), the context-parallel attention its queries' rows of the
whole row's mask (models/context_attention.py). Three things differ from SDPA's conventions, handled here:
- SDPA's boolean mask is keep = True: the mask is inverted. A caller may give the mask in SDPA's additive form
  instead (`additive_mask`), converted once for all layers; a floating mask is passed to SDPA as it is.
- What a query that sees no key (a left pad of a prefill) gets is up to the SDPA backend: zeros from torch 2.13's
  CPU kernels, NaN from older releases, and a NaN would reach the real positions through the pads' keys and values
  in the next layer (0 x NaN); megatron's -10000 fill gives such a row a finite mean. Such a row is let see every
  key instead: the same on every backend, finite, and never read (its position is padding).
- Without a mask and with fewer queries than keys (sq < sk: new tokens against a KV cache), the queries are the
  last sq positions: causal alignment is bottom-right, where SDPA's `is_causal` is top-left. One query (a decode
  step) sees every key and needs no mask.

A mask with GQA: CUDA's memory-efficient kernel takes a mask but not `enable_gqa`, and the flash kernel neither, so
SDPA falls back to its math kernel there (scores of every head materialised). `SdpaAttention.expand_kv_with_mask_on`
names the device types on which such a call gets its keys and values expanded to every head instead (a copy per
layer, kept for the backward), which the memory-efficient kernel takes. None yet: benchmarks/gpu_probe.py (item
`sdpa_backends`) times both on a GPU and reports which to choose; turning it on for "cuda" also needs the planner's
local profile (planning/activations.py) to count the expanded keys and values of packed rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SdpaAttention(DotProductAttention):
    """DotProductAttention's contract (query [sq, b, np, hn], key / value [sk, b, ng, hn] -> context [sq, b, np * hn]
    of this TP rank's heads) through one scaled_dot_product_attention call. A subclass, so that whatever asks for
    megatron's local attention (training/forward.uses_local_attention, the built-in engine's mask check) finds it."""

    # The device types on which a masked GQA call expands the keys and values to every head (module doc).
    expand_kv_with_mask_on: frozenset[str] = frozenset()

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        unsupported = {"attention_dropout": self.attention_dropout.p != 0,  # megatron's dropout forks the TP RNG
                       "softmax_type": config.softmax_type != "vanilla",
                       "window_size": config.window_size is not None,
                       "apply_query_key_layer_scaling": config.apply_query_key_layer_scaling}
        if any(unsupported.values()):
            raise ValueError(f"model.core_attention=sdpa does not support {[k for k, v in unsupported.items() if v]}"
                             f" (set model.core_attention=unfused)")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """`attention_mask`: None (causal), bool (True where masked), or additive (`additive_mask`), broadcastable to
        [b, 1, sq, sk]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SdpaAttention takes packed rows as a block-causal mask, and no attention bias")
        sq, batch, heads, _ = query.shape
        sk = key.shape[0]
        sdpa_mask_BHQK, causal = None, False  # SDPA's attn_mask: bool (True = seen) or additive
        if attention_mask is not None:
            sdpa_mask_BHQK = attention_mask.to(query.dtype) if attention_mask.is_floating_point() else \
                _seeing_all_if_none(attention_mask)
        elif sq == sk:
            causal = True
        elif sq > 1:  # the last sq positions against all sk keys: bottom-right causal
            sdpa_mask_BHQK = (torch.arange(sk, device=query.device)[None, :]
                              <= torch.arange(sk - sq, sk, device=query.device)[:, None])
        key_BGKD, value_BGKD, groups = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), key.shape[2]
        if groups != heads and sdpa_mask_BHQK is not None and query.device.type in self.expand_kv_with_mask_on:
            key_BGKD, value_BGKD, groups = (key_BGKD.repeat_interleave(heads // groups, dim=1),
                                            value_BGKD.repeat_interleave(heads // groups, dim=1), heads)
        context_BNQD = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3), key_BGKD, value_BGKD, attn_mask=sdpa_mask_BHQK, is_causal=causal,
            scale=self.softmax_scale, enable_gqa=groups != heads)
        return context_BNQD.permute(2, 0, 1, 3).reshape(sq, batch, self.hidden_size_per_partition)


def additive_mask(masked_BHQK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """megatron's boolean mask (True = masked) in the form SDPA applies: added to the scores, 0 where a query sees a
    key and -inf where masked; a query that would see no key sees all (module doc). SdpaAttention takes either form;
    a caller that gives one mask to every layer converts it once (rollout/builtin.py: once per forward step, where
    each layer converting a boolean mask, and SDPA converting it again, took 7 ops per layer and decode step)."""
    return torch.zeros(masked_BHQK.shape, dtype=dtype, device=masked_BHQK.device).masked_fill_(
        ~_seeing_all_if_none(masked_BHQK), float("-inf"))


def _seeing_all_if_none(masked_BHQK: torch.Tensor) -> torch.Tensor:
    """SDPA's keep-mask (True = seen) of a boolean mask (True = masked), a query seeing no key let see all."""
    keep_BHQK = ~masked_BHQK
    return keep_BHQK | ~keep_BHQK.any(dim=-1, keepdim=True)
