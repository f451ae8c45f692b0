"""Context-parallel core attention for megatron-core's local layer spec: all-gather attention (Llama 3's CP).

megatron-core's local `DotProductAttention` refuses context parallelism (only Transformer Engine's attention
exchanges keys and values between the ranks of a sequence). This one gathers the whole row's keys and values from
the context-parallel group (their gradients are reduce-scattered back), puts them in position order, and lets this
rank's queries (its load-balanced chunks, distributed/context_parallel.py) attend to them under the causal mask on
row positions, or under a packed row's block-causal mask (training/forward.py), of which it takes its queries' rows.
Each query then sees exactly the keys it sees at CP = 1, through the local spec's core attention (SDPA, or
megatron's unfused attention: models/sdpa_attention.py). It holds the whole row's K/V on every rank (ring attention
avoids that): the CPU's attention, which TE's on a GPU must agree with.
"""
from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_gtpo.distributed.context_parallel import gather_sequence, load_balanced_positions

from .sdpa_attention import SdpaAttention


class _AllGatherKeys:
    """A core attention (the next class in the MRO) over the keys and values of the whole row, for queries of this
    context-parallel rank."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        # The parent's arithmetic on one rank's queries against all keys: its CP check does not apply. Its softmax is
        # built for an explicit mask (forward always passes one): a causal softmax kernel would assume sq == sk.
        super().__init__(dataclasses.replace(config, context_parallel_size=1), layer_number, AttnMaskType.padding,
                         attention_type, attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         pg_collection=pg_collection)
        self.config = config
        self.cp_group = pg_collection.cp

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [sq, b, np, hn], key / value [sq, b, ng, hn] of this rank's positions; `attention_mask`: None
        (causal) or the whole row's bool mask [1, 1, L, L], True where masked."""
        cp_rank, cp_size = self.cp_group.rank(), self.cp_group.size()
        length = key.shape[0] * cp_size
        rows_Q = load_balanced_positions(length, cp_rank, cp_size, device=query.device)
        if attention_mask is None:
            mask_QL = torch.arange(length, device=query.device)[None, :] > rows_Q[:, None]
        else:
            mask_QL = attention_mask[0, 0].index_select(0, rows_Q)
        return super().forward(query, gather_sequence(key, self.cp_group), gather_sequence(value, self.cp_group),
                               mask_QL[None, None], attention_bias=attention_bias, packed_seq_params=packed_seq_params)


class AllGatherContextAttention(_AllGatherKeys, SdpaAttention):
    """The context-parallel attention of model.core_attention=sdpa."""


class AllGatherUnfusedContextAttention(_AllGatherKeys, DotProductAttention):
    """The context-parallel attention of model.core_attention=unfused."""
