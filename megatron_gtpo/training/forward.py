"""Micro-batching of token sequences and the forward-only pass that yields per-token log-probs and entropies.

The pass runs megatron-core's pipeline schedule (any TP/PP/VPP); the last pipeline stage applies the vocab-parallel
log-prob/entropy op to its logits shard, so full-vocabulary logits never exist on any rank.

Two layouts of a micro-batch's rows (`MicroBatch`):
- padded: one sequence per row, right-padded to the longest; megatron's default causal mask.
- packed (`pack_sequences`): one row holding several sequences back to back, attention confined to each sequence.
  With Transformer Engine (GPU) the row goes to the model as THD with cu_seqlens (PackedSeqParams): its attention
  and RoPE restart at every sequence start. On megatron-core's local layer spec (CPU), which refuses
  PackedSeqParams, the row gets a block-diagonal causal attention mask [1, 1, L, L] instead, and RoPE is computed
  from the position in the row (GPTModel does not read position_ids for RoPE): q.k under RoPE depends only on the
  difference of two positions, and the mask only lets a token see tokens of its own sequence, so the logits equal
  those of positions restarting at 0, up to rounding.

Context parallelism (CP > 1): a micro-batch keeps its whole rows; `on_context_rank` marks the row positions this rank
feeds the model (megatron's load-balanced layout, distributed/context_parallel.py), which `model_forward` cuts out and
the attention completes from the other ranks (a packed row's mask stays the whole row's). The next-token targets are
made from the whole rows before the cut, and the per-token log-probs and entropies gathered back into row order
(`next_token_logprobs_and_entropy`), so everything after them sees the layout of CP = 1. Rows must be a multiple of
2 x CP long (ParallelGroups.sequence_multiple).

Scored columns: a step's padded micro-batch reads the outputs of its response tokens only, so `MicroBatch.scored_from`
(its shortest prompt's last column) makes the output layer and the log-prob/entropy op skip the columns before it
(docs/step_batch.md); packed rows, sequence and context parallelism keep every column.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from megatron_gtpo.distributed import ParallelGroups, Truncation, vocab_parallel_logprobs_and_entropy
from megatron_gtpo.distributed.context_parallel import gather_sequence, load_balanced_positions
from megatron_gtpo.models.moe_routing import RoutedExperts, prepare_routers


@dataclass
class MicroBatch:
    """Padded: one right-padded sequence per row (causal attention makes right padding invisible to the real
    positions). Packed: one row [1, L] of sequences back to back, then padding; `cu_seqlens` bounds them."""

    tokens_BL: torch.Tensor  # int64 [B, L]
    lengths_B: torch.Tensor  # int64 [B], true lengths (packed: the row's tokens before its padding)
    position_ids_BL: torch.Tensor  # int64 [B, L] (packed: restarting at 0 for every sequence)
    # Packed only: int32 [n + 1], the start of each of the row's n segments and L; the padding tail (if any) is the
    # last segment, so segments tile the row. max_segment: the longest segment's length (host int).
    cu_seqlens: torch.Tensor | None = None
    max_segment: int = 0
    # Routing replay (a mixture-of-experts model): the experts [B, L, M, k] every token goes to at each of this
    # rank's MoE layers (models/moe_routing.py); None: the routers choose.
    routed_experts: RoutedExperts | None = None
    # Context parallelism: long [L / CP], the row positions this rank feeds the model (`on_context_rank`); None: all.
    context_positions_L: torch.Tensor | None = None
    # The first column whose next-token outputs are read (host int): the output layer and the log-prob/entropy op
    # run on the columns from it on only, and the columns before it come out 0. A step's padded micro-batch sets it
    # to its shortest prompt's last column (step_batch.py), as TRL's logits_to_keep: the update and the old-policy
    # pass read response tokens only. 0 with packed rows, sequence or context parallelism.
    scored_from: int = 0

    @property
    def token_mask_LB(self) -> torch.Tensor:
        """bool [L, B]: the row positions the model sees that hold tokens (not padding), in the routers' order."""
        mask_LB = torch.arange(self.tokens_BL.shape[1], device=self.lengths_B.device)[:, None] < self.lengths_B[None, :]
        return mask_LB if self.context_positions_L is None else mask_LB[self.context_positions_L]


def on_context_rank(mb: MicroBatch, parallel: ParallelGroups) -> MicroBatch:
    """`mb` with the row positions this context-parallel rank feeds the model marked (itself at CP = 1)."""
    if parallel.cp_size == 1:
        return mb
    assert mb.routed_experts is None, "config_rules: routing replay needs CP = 1"
    return dataclasses.replace(mb, context_positions_L=load_balanced_positions(
        mb.tokens_BL.shape[1], parallel.cp_rank, parallel.cp_size, device=mb.tokens_BL.device))


def next_token_targets(tokens_BL: torch.Tensor) -> torch.Tensor:
    """The token each column is scored against: column k predicts token k + 1; the last column's target is a
    dummy id 0 (it scores nothing). All L columns are scored and the caller ignores the last: slicing the logits
    instead would hand the vocab-parallel op a non-contiguous [B, L-1, V/TP] view."""
    return torch.nn.functional.pad(tokens_BL[:, 1:], (0, 1))


def make_micro_batches(sequences: list[list[int]], micro_batch_size: int, *, device: torch.device,
                       pad_to_multiple: int = 1) -> list[MicroBatch]:
    """Consecutive groups of `micro_batch_size` sequences (the last may be smaller), each padded to its own longest
    sequence rounded up to `pad_to_multiple` (the TP size under sequence parallelism), on `device` (the training
    device: one host-to-device copy per micro-batch, from the token lists)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    chunks = [sequences[start:start + micro_batch_size] for start in range(0, len(sequences), micro_batch_size)]
    return [padded_micro_batch(sequence_rows(chunk, device), [len(s) for s in chunk], pad_to_multiple=pad_to_multiple)
            for chunk in chunks]


def pack_sequences(sequences: list[list[int]], *, device: torch.device, pad_to_multiple: int = 1) -> MicroBatch:
    """The sequences back to back in one row, padded at its end to a multiple of `pad_to_multiple`, on `device`."""
    return packed_micro_batch(sequence_rows(sequences, device), [len(s) for s in sequences],
                              pad_to_multiple=pad_to_multiple)


def sequence_rows(sequences: list[list[int]], device: torch.device) -> torch.Tensor:
    """int64 [S, L] on `device`: sequence s in row s from column 0, zeros after it (L: the longest)."""
    width = max((len(s) for s in sequences), default=0)
    return torch.tensor([list(s) + [0] * (width - len(s)) for s in sequences], dtype=torch.long,
                        device=device).view(len(sequences), width)


def padded_micro_batch(tokens_SL: torch.Tensor, lengths: list[int], *, pad_to_multiple: int = 1) -> MicroBatch:
    """One padded micro-batch of the sequences in the rows of `tokens_SL` (integer [S, L] on the training device, row
    s holding sequence s from column 0 and zeros after its `lengths[s]` tokens): the rows as int64, cut or
    zero-padded to the longest length rounded up to `pad_to_multiple`."""
    if not lengths or min(lengths) == 0:
        raise ValueError("empty token sequence" if lengths else "a micro-batch needs at least one sequence")
    length = -(-max(lengths) // pad_to_multiple) * pad_to_multiple
    device = tokens_SL.device
    tokens_BL = _padded_right(tokens_SL[:, :length].to(torch.long).contiguous(), length)
    positions = torch.arange(length, dtype=torch.long, device=device).expand(len(lengths), length).contiguous()
    return MicroBatch(tokens_BL, torch.tensor(lengths, device=device), positions)


def packed_micro_batch(tokens_SL: torch.Tensor, lengths: list[int], *, pad_to_multiple: int = 1) -> MicroBatch:
    """The sequences in the rows of `tokens_SL` (as for `padded_micro_batch`) back to back in one row, padded at its
    end to a multiple of `pad_to_multiple`."""
    if not lengths or min(lengths) == 0:
        raise ValueError("packing needs at least one sequence, none of them empty")
    device = tokens_SL.device
    total = sum(lengths)
    length = -(-total // pad_to_multiple) * pad_to_multiple
    segments = lengths + ([length - total] if length > total else [])
    valid_SL = torch.arange(tokens_SL.shape[1], device=device) < torch.tensor(lengths, device=device)[:, None]
    tokens_L = _padded_right(tokens_SL[valid_SL].to(torch.long), length)  # row-major: one sequence after another
    positions = [p for n in segments for p in range(n)]
    cu_seqlens = [0]
    for n in segments:
        cu_seqlens.append(cu_seqlens[-1] + n)
    return MicroBatch(tokens_L[None], torch.tensor([total], device=device),
                      torch.tensor([positions], dtype=torch.long, device=device),
                      torch.tensor(cu_seqlens, dtype=torch.int32, device=device), max(segments))


def _padded_right(tokens: torch.Tensor, length: int) -> torch.Tensor:
    """`tokens` with zero columns appended up to `length` along its last dimension (itself if it has them)."""
    missing = length - tokens.shape[-1]
    return torch.nn.functional.pad(tokens, (0, missing)) if missing else tokens


def block_causal_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """bool [1, 1, L, L], True where attention is masked out (megatron's convention): query i sees key j iff
    j <= i and both lie in the same segment of `cu_seqlens`."""
    positions_L = torch.arange(length, device=cu_seqlens.device)
    segment_L = torch.bucketize(positions_L, cu_seqlens[1:].long(), right=True)
    visible_LL = (segment_L[:, None] == segment_L[None, :]) & (positions_L[None, :] <= positions_L[:, None])
    return ~visible_LL[None, None]


def uses_local_attention(model_chunk) -> bool:
    """Whether the chunk's attention is the local spec's (megatron-core's DotProductAttention or a subclass: the SDPA
    and context-parallel ones of models/), else Transformer Engine's."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return any(isinstance(m, DotProductAttention) for m in model_chunk.modules())


def model_forward(model, mb: MicroBatch, *, local_attention: bool):
    """The model's logits for a micro-batch of either layout (module docstring); `local_attention` as
    `uses_local_attention` says of the model. A mixture-of-experts model's routers replay `mb.routed_experts` (or
    choose, without) and see which tokens are real (models/moe_routing.prepare_routers)."""
    packed_locally = mb.cu_seqlens is not None and local_attention
    if packed_locally and model.config.masked_softmax_fusion:
        raise ValueError("data.pack_sequences on megatron-core's local layer spec needs masked_softmax_fusion "
                         "off (its fused causal softmax ignores the block-diagonal mask): use Transformer "
                         "Engine on GPU (THD), or set data.pack_sequences=false")
    if mb.cu_seqlens is not None and not local_attention and mb.context_positions_L is not None:
        raise ValueError("data.pack_sequences with parallel.context > 1 on Transformer Engine (THD) needs every "
                         "sequence split over the context-parallel ranks on its own, which is not implemented: set "
                         "data.pack_sequences=false")
    prepare_routers(model, mb.routed_experts, mb.token_mask_LB)
    tokens_BL, position_ids_BL = mb.tokens_BL, mb.position_ids_BL
    if mb.context_positions_L is not None:
        tokens_BL, position_ids_BL = tokens_BL[:, mb.context_positions_L], position_ids_BL[:, mb.context_positions_L]
    if mb.scored_from:
        assert mb.cu_seqlens is None and mb.context_positions_L is None, "scored_from: padded rows at CP = 1 only"
        with logits_from(model, mb.scored_from):
            return model(tokens_BL, position_ids_BL, attention_mask=None)
    if mb.cu_seqlens is None:
        return model(tokens_BL, position_ids_BL, attention_mask=None)
    if packed_locally:
        return model(tokens_BL, position_ids_BL, attention_mask=block_causal_mask(mb.cu_seqlens, mb.tokens_BL.shape[1]))
    from megatron.core.packed_seq_params import PackedSeqParams

    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=mb.cu_seqlens, cu_seqlens_kv=mb.cu_seqlens,
                             max_seqlen_q=mb.max_segment, max_seqlen_kv=mb.max_segment)
    return model(tokens_BL, position_ids_BL, attention_mask=None, packed_seq_params=params)


@contextlib.contextmanager
def logits_from(model, position: int):
    """While it lasts, the output layer of `model` (a chunk, bare or in megatron's DDP wrapper) computes the logits
    of the sequence positions >= `position` only; a chunk without one (not the last pipeline stage) is left alone."""
    while not hasattr(model, "output_layer") and hasattr(model, "module"):
        model = model.module
    layer = getattr(model, "output_layer", None)
    if layer is None:
        yield
        return
    if not hasattr(layer, "first_position"):  # models/qwen.py's builder makes it a LeanColumnParallelLinear
        raise TypeError(f"the output layer is a {type(layer).__name__}, which computes every position's logits")
    layer.first_position = position
    try:
        yield
    finally:
        layer.first_position = 0


def run_pipeline(model_chunks: list, micro_batches: list, on_last_stage: Callable, *, forward_only: bool,
                 inputs: Callable[[object], MicroBatch] = lambda mb: mb) -> list:
    """Megatron-core's pipeline schedule over `micro_batches` (`inputs(mb)` gives each one's model inputs): the one
    place the project calls it. On the last pipeline stage `on_last_stage(mb, logits_BLV_local)` is called per
    micro-batch and what it returns is collected, in micro-batch order ([] on the other stages):
    - forward_only: anything (no autograd graph is built);
    - else (a training step): megatron's loss-function contract, `(loss, metrics dict)`; the losses are backpropagated
      and the list holds the metrics dicts."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    local_attention = uses_local_attention(model_chunks[0])

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return model_forward(model, inputs(mb), local_attention=local_attention), partial(_on_last_stage, mb)

    def _on_last_stage(mb, logits, non_loss_data=False):  # megatron passes non_loss_data when collecting outputs
        return on_last_stage(mb, logits)

    iterators = [iter(micro_batches) for _ in model_chunks] if len(model_chunks) > 1 else iter(micro_batches)
    rows = [inputs(mb).tokens_BL for mb in micro_batches]
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators, model=model_chunks,
            num_microbatches=len(micro_batches), seq_length=max(r.shape[1] for r in rows),
            micro_batch_size=max(r.shape[0] for r in rows), forward_only=forward_only,
            collect_non_loss_data=forward_only)


def next_token_logprobs_and_entropy(logits_BLV: torch.Tensor, tokens_BL: torch.Tensor, parallel: ParallelGroups, *,
                                    vocab_size: int, temperature: float = 1.0, truncation: Truncation | None = None,
                                    chunk_size: int | None = None, check_targets: bool = False,
                                    scored_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_BL, entropy_BL) of the vocab-parallel logits of a micro-batch's rows: column k scores tokens[b, k+1]
    under logits / temperature (with `truncation`, the sampling's top-k / top-p: under the truncated, renormalised
    distribution), and the entropy of that next-token distribution over the true vocabulary (the last
    column, and in a packed row each sequence's last, hold garbage: their next token is not their own). The one
    place logits become log-probs and entropies (the old-policy pass, the update, scoring). `check_targets` checks
    the ids' range, at the cost of a host sync. Under context parallelism the logits are this rank's positions of the
    whole rows `tokens_BL` (`on_context_rank`), and the values come back for the whole rows, gathered over the CP
    ranks: every CP rank then computes the same loss from them, and each keeps the gradient of its own positions
    (distributed/context_parallel.gather_sequence). With `scored_from` (MicroBatch.scored_from) the logits are of the
    columns from it on, and the columns before it come out 0."""
    targets_BL = next_token_targets(tokens_BL)
    if scored_from:
        assert parallel.cp_size == 1, "scored_from: CP = 1 only"
        values = vocab_parallel_logprobs_and_entropy(
            logits_BLV, targets_BL[:, scored_from:].contiguous(), tp_group=parallel.tp_group, vocab_size=vocab_size,
            temperature=temperature, truncation=truncation, chunk_size=chunk_size, check_targets=check_targets)
        return tuple(torch.nn.functional.pad(v_BL, (scored_from, 0)) for v_BL in values)
    if parallel.cp_size > 1:
        targets_BL = targets_BL[:, load_balanced_positions(tokens_BL.shape[1], parallel.cp_rank, parallel.cp_size,
                                                           device=tokens_BL.device)]
    values = vocab_parallel_logprobs_and_entropy(
        logits_BLV, targets_BL, tp_group=parallel.tp_group, vocab_size=vocab_size,
        temperature=temperature, truncation=truncation, chunk_size=chunk_size, check_targets=check_targets)
    if parallel.cp_size == 1:
        return values
    return tuple(gather_sequence(v_BL.t().contiguous(), parallel.cp_group, same_use_on_every_rank=True).t()
                 for v_BL in values)


def forward_logprobs_and_entropy(model_chunks: list, micro_batches: list[MicroBatch], parallel: ParallelGroups,
                                 *, vocab_size: int, temperature: float = 1.0, truncation: Truncation | None = None,
                                 chunk_size: int | None = None):
    """Per micro-batch (logprobs_BL1, entropy_BL1), float32 on the logits' device, on the last pipeline stage ([]
    elsewhere): logprobs[b, k] = log p(tokens[b, k+1] | tokens[b, :k+1]) under logits / temperature (and
    `truncation`: next_token_logprobs_and_entropy), entropy[b, k]
    the entropy of that next-token distribution over the true vocabulary. Positions k >= length-1 hold padding
    garbage; in a packed row, so does each sequence's last position (its "next token" is the next sequence's first),
    and the context tokens[b, :k+1] is the sequence's own."""

    def on_last_stage(mb: MicroBatch, logits_BLV):
        logprobs, entropy = next_token_logprobs_and_entropy(logits_BLV, mb.tokens_BL, parallel, vocab_size=vocab_size,
                                                            temperature=temperature, truncation=truncation,
                                                            chunk_size=chunk_size, check_targets=True)
        return logprobs[:, :-1].float(), entropy[:, :-1].float()

    for model in model_chunks:
        model.eval()
    return run_pipeline(model_chunks, micro_batches, on_last_stage, forward_only=True,
                        inputs=lambda mb: on_context_rank(mb, parallel))
