"""TE's DotProductAttention, computed with torch's scaled_dot_product_attention in fp32, and _SplitAlongDim."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..base import BaseModule


class _SplitAlongDim:
    """TE's autograd split (megatron-core splits the fused q/k/v output with it): torch.split's views."""

    @staticmethod
    def apply(tensor: torch.Tensor, dim: int, split_sizes) -> tuple:
        return torch.split(tensor, list(split_sizes), dim=dim)


def _attend(q, k, v, *, causal: bool, scale: float):
    """q [b, s, hq, d], k / v [b, s, g, d] -> [b, s, hq, d]; query head j uses key/value head j // (hq / g)."""
    repeat = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return out.transpose(1, 2)


class DotProductAttention(BaseModule):
    """Core attention over q [s, b, h, d] / k, v [s, b, g, d] (sbhd) or [t, h, d] / [t, g, d] with cu_seqlens (thd),
    h query heads and g key/value heads on this rank; returns [s, b, h * d] or [t, h * d]. Masks: "causal" and
    "no_mask" without an attention_mask (the trainer's passes) and, in thd, "padding_causal" / "padding" per packed
    sequence; rows beyond the last sequence give zeros. Explicit masks are refused: what TE's backends do with
    them is not modelled."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", window_size=None, sequence_parallel=False, tp_size=1,
                 get_rng_state_tracker=None, tp_group=None, layer_number=None, attention_type="self",
                 softmax_scale=None, softmax_type="vanilla", return_max_logit=False, **kwargs):
        super().__init__()
        unsupported = {k: v for k, v in dict(attention_dropout=attention_dropout, window_size=window_size,
                                             return_max_logit=return_max_logit, **kwargs).items() if v} | (
            {"softmax_type": softmax_type} if softmax_type != "vanilla" else {})
        if unsupported or attention_type != "self":
            raise NotImplementedError(f"the Transformer Engine stand-in does not model {unsupported or attention_type}")
        head_dim = kv_channels if isinstance(kv_channels, int) else kv_channels[0]
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(head_dim)
        self.qkv_format, self.attn_mask_type = qkv_format, attn_mask_type

    def set_context_parallel_group(self, cp_group, *args, **kwargs) -> None:
        if cp_group is not None and torch.distributed.get_world_size(cp_group) > 1:
            raise NotImplementedError("context parallelism is not part of the Transformer Engine stand-in")

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None, cu_seqlens_q=None,
                cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None,
                max_seqlen_kv=None, attn_mask_type=None, core_attention_bias_type="no_bias", **unused):
        qkv_format = qkv_format or self.qkv_format
        mask_type = attn_mask_type or self.attn_mask_type
        if core_attention_bias_type != "no_bias":
            raise NotImplementedError("attention biases are not part of the Transformer Engine stand-in")
        if qkv_format == "thd":
            return self._thd(query_layer, key_layer, value_layer, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                             cu_seqlens_kv_padded, mask_type)
        if qkv_format != "sbhd":
            raise NotImplementedError(f"qkv_format {qkv_format!r}")
        if mask_type not in ("causal", "no_mask") or attention_mask is not None:
            raise NotImplementedError(f"attn_mask_type {mask_type!r} with attention_mask "
                                      f"{'None' if attention_mask is None else 'given'} in sbhd")
        q, k, v = (t.transpose(0, 1) for t in (query_layer, key_layer, value_layer))
        out = _attend(q, k, v, causal=mask_type == "causal", scale=self.softmax_scale)
        s, b = query_layer.shape[:2]
        return out.transpose(0, 1).reshape(s, b, -1).to(query_layer.dtype)

    def _thd(self, q, k, v, cu_q, cu_kv, cu_q_padded, cu_kv_padded, mask_type):
        if mask_type not in ("padding_causal", "padding"):
            raise NotImplementedError(f"attn_mask_type {mask_type!r} in thd")
        if (cu_q_padded is not None and not torch.equal(cu_q_padded, cu_q)) or \
                (cu_kv_padded is not None and not torch.equal(cu_kv_padded, cu_kv)) or not torch.equal(cu_q, cu_kv):
            raise NotImplementedError("padded or cross-attention cu_seqlens are not part of the stand-in")
        out = q.new_zeros(q.shape[0], q.shape[1], q.shape[2], dtype=torch.float32)
        bounds = cu_q.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                out[start:end] = _attend(q[None, start:end], k[None, start:end], v[None, start:end],
                                         causal=mask_type == "padding_causal", scale=self.softmax_scale)[0]
        return out.reshape(q.shape[0], -1).to(q.dtype)
