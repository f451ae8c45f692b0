"""Micro-batching of token sequences and the forward-only pass that yields per-token log-probs and entropies.

The pass runs megatron-core's pipeline schedule (any TP/PP/VPP); the last pipeline stage applies the vocab-parallel
log-prob/entropy op to its logits shard, so full-vocabulary logits never exist on any rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from megatron_gtpo.distributed import ParallelGroups, vocab_parallel_logprobs_and_entropy


@dataclass
class MicroBatch:
    """Right-padded sequences. Causal attention makes right padding invisible to the real positions."""

    tokens_BL: torch.Tensor  # int64 [B, L]
    lengths_B: torch.Tensor  # int64 [B], true lengths
    position_ids_BL: torch.Tensor  # int64 [B, L]

    @property
    def token_mask_BL(self) -> torch.Tensor:
        """True on real tokens."""
        return torch.arange(self.tokens_BL.shape[1], device=self.lengths_B.device) < self.lengths_B[:, None]


def next_token_targets(tokens_BL: torch.Tensor) -> torch.Tensor:
    """The token each column is scored against: column k predicts token k + 1; the last column's target is a
    dummy id 0 (it scores nothing). All L columns are scored and the caller ignores the last: slicing the logits
    instead would hand the vocab-parallel op a non-contiguous [B, L-1, V/TP] view."""
    return torch.nn.functional.pad(tokens_BL[:, 1:], (0, 1))


def make_micro_batches(sequences: list[list[int]], micro_batch_size: int, *, device: torch.device, pad_id: int = 0,
                       pad_to_multiple: int = 1) -> list[MicroBatch]:
    """Consecutive groups of `micro_batch_size` sequences (the last may be smaller), each padded to its own longest
    sequence rounded up to `pad_to_multiple` (the TP size under sequence parallelism), on `device` (the training
    device: one host-to-device copy per micro-batch, from the token lists)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if any(len(s) == 0 for s in sequences):
        raise ValueError("empty token sequence")
    batches = []
    for start in range(0, len(sequences), micro_batch_size):
        chunk = sequences[start:start + micro_batch_size]
        length = max(len(s) for s in chunk)
        length = -(-length // pad_to_multiple) * pad_to_multiple
        tokens = torch.tensor([seq + [pad_id] * (length - len(seq)) for seq in chunk], dtype=torch.long, device=device)
        positions = torch.arange(length, dtype=torch.long, device=device).expand(len(chunk), length).contiguous()
        batches.append(MicroBatch(tokens, torch.tensor([len(s) for s in chunk], device=device), positions))
    return batches


def run_forward(model_chunks: list, micro_batches: list[MicroBatch], groups: ParallelGroups, on_last_stage,
                *, forward_only: bool = True):
    """Run megatron's schedule over `micro_batches`; `on_last_stage(micro_batch, logits_BLV_local)` is called on the
    last pipeline stage and what it returns is collected (a list, in micro-batch order; [] on other stages)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        logits = model(mb.tokens_BL, mb.position_ids_BL, attention_mask=None)
        return logits, partial(_collect, mb)

    def _collect(mb, logits, non_loss_data=False):
        return on_last_stage(mb, logits)

    iterators = [iter(micro_batches) for _ in model_chunks] if len(model_chunks) > 1 else iter(micro_batches)
    max_len = max(mb.tokens_BL.shape[1] for mb in micro_batches)
    with torch.no_grad():
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators, model=model_chunks,
            num_microbatches=len(micro_batches), seq_length=max_len,
            micro_batch_size=max(mb.tokens_BL.shape[0] for mb in micro_batches),
            forward_only=forward_only, collect_non_loss_data=True)


def next_token_logprobs_and_entropy(model_chunks: list, micro_batches: list[MicroBatch], groups: ParallelGroups,
                                    *, vocab_size: int, temperature: float = 1.0, chunk_size: int | None = None):
    """Per micro-batch (logprobs_BL1, entropy_BL1), float32 on the logits' device, on the last pipeline stage ([]
    elsewhere): logprobs[b, k] = log p(tokens[b, k+1] | tokens[b, :k+1]) under logits / temperature, entropy[b, k]
    the entropy of that next-token distribution over the true vocabulary. Positions k >= length-1 hold padding
    garbage."""

    def on_last_stage(mb: MicroBatch, logits_BLV):
        logprobs, entropy = vocab_parallel_logprobs_and_entropy(
            logits_BLV, next_token_targets(mb.tokens_BL), tp_group=groups.tp_group, vocab_size=vocab_size,
            temperature=temperature, chunk_size=chunk_size)
        return logprobs[:, :-1].float(), entropy[:, :-1].float()

    for model in model_chunks:
        model.eval()
    return run_forward(model_chunks, micro_batches, groups, on_last_stage)
