"""Sequence packing through Transformer Engine (THD with cu_seqlens, training/forward.py) on CUDA: the log-probs of
sequences packed into one row against each sequence scored alone, same bf16 model."""
import torch

from cuda_only import pytestmark, skip_without, skip_without_cuda  # noqa: F401  (pytestmark marks the module `gpu`)

skip_without_cuda()

from distributed_harness import run_distributed  # noqa: E402
from tiny_models import make_tiny_qwen2  # noqa: E402

VOCAB = 4096
LENGTHS = (37, 128, 5, 64)  # whole sequences, back to back in the packed row


def _alone_and_packed(rank, world_size, model_dir, sequences):
    """Per sequence: (log-probs scored alone, log-probs read out of the packed row), fp32 on the host."""
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.training.forward import (forward_logprobs_and_entropy, make_micro_batches, pack_sequences,
                                                uses_local_attention)

    groups = initialize_parallel(1, 1)
    with HFCheckpoint(model_dir) as ckpt:
        chunks = build_model(ckpt.config, tensor_parallel=1, pipeline_parallel=1, pp_rank=0,
                             params_dtype=torch.bfloat16, use_transformer_engine=True)
        load_hf_weights(chunks, ckpt, tp_rank=0, tp_size=1)
    assert not uses_local_attention(chunks[0])  # the packed row goes to the model as THD
    alone = forward_logprobs_and_entropy(chunks, make_micro_batches(sequences, 1, device=groups.device), groups,
                                            vocab_size=VOCAB)
    ((packed_BL, _),) = forward_logprobs_and_entropy(
        chunks, [pack_sequences(sequences, device=groups.device, pad_to_multiple=16)], groups, vocab_size=VOCAB)
    out, offset = [], 0
    for sequence, (logprobs_BL, _) in zip(sequences, alone):
        n = len(sequence)
        out.append((logprobs_BL[0, :n - 1].cpu(), packed_BL[0, offset:offset + n - 1].cpu()))
        offset += n
    return out


def test_thd_packed_logprobs_match_each_sequence_alone(tmp_path):
    """Bound: both runs are bf16 through different attention kernels (THD varlen vs. a causal batch of one), so
    they agree to bf16 rounding, not bit for bit: mean |difference| < 0.02 nats, worst < 0.15. A leak across
    sequences or positions that did not restart would move the later sequences' log-probs by far more (random
    weights: whole nats)."""
    skip_without("transformer_engine", "THD packing needs Transformer Engine's attention")
    make_tiny_qwen2(tmp_path, dtype=torch.bfloat16, vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                    num_layers=2, num_heads=4, num_kv_heads=2, max_positions=512)
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    (pairs,) = run_distributed(_alone_and_packed, 1, args=(str(tmp_path), sequences), init_process_group=False,
                               timeout_s=600)
    for alone, packed in pairs:
        difference = (alone - packed).abs()
        assert difference.mean() < 0.02 and difference.max() < 0.15, (difference.mean(), difference.max())
