"""bf16 on CUDA: Megatron Qwen2 and Qwen3 logits against transformers (local and Transformer Engine specs), the
vocab-parallel op against float64, and an HF -> Megatron -> HF round trip of a bf16 checkpoint."""
import copy

import pytest
import torch

from cuda_only import pytestmark, skip_without_cuda  # noqa: F401  (pytestmark marks this module's tests `gpu`)

skip_without_cuda()

from distributed_harness import run_distributed  # noqa: E402
from checkpoint_checks import assert_bit_exact, read_safetensors_dir  # noqa: E402
from vocab_references import float64_reference  # noqa: E402
from tiny_models import make_tiny_model, make_tiny_qwen2  # noqa: E402

# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B), random weights, tied embeddings.
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                  num_kv_heads=2, tie=True, max_positions=512)
# Qwen3-0.6B's (Qwen/Qwen3-0.6B): per-head q/k norms, head_dim 128 > hidden / heads = 64, tied embeddings.
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                 num_kv_heads=8, head_dim=128, tie=True, max_positions=512)
SEQ_LEN = 128


def _megatron_bf16_logits(rank, world_size, model_dir, sequences, use_transformer_engine):
    """Full-vocabulary logits (fp32 copies of the bf16 outputs) of a bf16 Megatron model at TP=1 on one GPU."""
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.training.forward import make_micro_batches, run_pipeline

    groups = initialize_parallel(1, 1)
    with HFCheckpoint(model_dir) as ckpt:
        chunks = build_model(ckpt.config, tensor_parallel=1, pipeline_parallel=1, pp_rank=0,
                             params_dtype=torch.bfloat16, use_transformer_engine=use_transformer_engine)
        load_hf_weights(chunks, ckpt, tp_rank=0, tp_size=1)
    for c in chunks:
        c.eval()
    micro_batches = make_micro_batches(sequences, len(sequences), device=groups.device)
    with torch.no_grad():
        out = run_pipeline(chunks, micro_batches, lambda mb, logits: logits.float().cpu(), forward_only=True)
    return [row for mb in out for row in mb]


@pytest.fixture(scope="module")
def qwen25_05b(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen25_05b_bf16")
    model = make_tiny_qwen2(path, dtype=torch.bfloat16, **QWEN25_05B)
    return path, model


@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_06b_bf16")
    return path, make_tiny_model(path, "qwen3", dtype=torch.bfloat16, **QWEN3_06B)


def _log_softmax(logits, vocab_size):
    return torch.log_softmax(logits[..., :vocab_size].double(), dim=-1)


@pytest.mark.parametrize("model", ["qwen25_05b", "qwen3_06b"])
@pytest.mark.parametrize("spec", ["local", "transformer_engine"])
def test_bf16_logits_match_transformers(request, model, spec):
    """Tolerance: bf16 keeps 8 significant bits (relative rounding 2^-9 per operation), and two bf16
    implementations of 24 (28) layers round at different places, so they cannot agree to a fixed atol. The independent
    reference is transformers run in fp32 on the same (bf16-representable) weights; Megatron's bf16 log-softmax may
    deviate from it by at most 1.5x what transformers' own bf16 run deviates in the mean over tokens and vocabulary,
    and 3x in the worst entry (an extreme over 25M entries, noisier), +0.01 nats for a near-zero baseline."""
    if spec == "transformer_engine":
        from megatron_gtpo.models.accelerator import Accelerator

        if not Accelerator.probe().transformer_engine:
            pytest.skip("transformer_engine.pytorch does not import: the TE layer spec cannot be built")
    path, hf_bf16 = request.getfixturevalue(model)
    vocab = 151936  # both shapes
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (SEQ_LEN, SEQ_LEN // 2 + 3)]
    ours = run_distributed(_megatron_bf16_logits, 1, args=(str(path), sequences, spec == "transformer_engine"),
                           init_process_group=False, timeout_s=600)[0]
    hf_bf16 = hf_bf16.cuda()
    hf_fp32 = copy.deepcopy(hf_bf16).float()
    for seq, logits in zip(sequences, ours):
        ids = torch.tensor([seq], device="cuda")
        with torch.no_grad():
            ref = _log_softmax(hf_fp32(ids).logits[0].cpu(), vocab)
            theirs = _log_softmax(hf_bf16(ids).logits[0].float().cpu(), vocab)
        mine = _log_softmax(logits[:len(seq)], vocab)
        assert logits.shape[-1] == 152576  # padded to a multiple of lcm(128 x TP, 1024) = 1024: 149 x 1024
        err, hf_err = (mine - ref).abs(), (theirs - ref).abs()
        assert err.mean() <= 1.5 * hf_err.mean() + 0.01, (model, spec, err.mean().item(), hf_err.mean().item())
        assert err.max() <= 3.0 * hf_err.max() + 0.01, (model, spec, err.max().item(), hf_err.max().item())


@pytest.mark.parametrize("truncation", [None, (20, 0.9), (0, 0.95)])
def test_vocab_parallel_bf16_matches_float64(truncation):
    """The fused log-prob + entropy op on CUDA, bf16 logits at Qwen2.5's padded vocabulary, against float64
    autograd on the same bf16 values. Outputs are accumulated in fp32 over 152k entries (relative error ~1e-6
    after the sum), bf16 gradients are rounded once from fp32 (relative 2^-9). With top-k / top-p too: bf16 logits
    tie often, at the kept sets' boundaries too; top-p 0.95 alone on these flat rows takes the radix-select fallback
    for every token (CUDA's topk, scatter_add and integer shifts)."""
    from megatron_gtpo.distributed.truncation import Truncation
    from megatron_gtpo.distributed.vocab_parallel import vocab_parallel_logprobs_and_entropy

    g = torch.Generator().manual_seed(0)
    tokens, vocab, padded = 512, 151936, 152064
    logits = (torch.randn(tokens, padded, generator=g, dtype=torch.float64) * 3.0).to(torch.bfloat16)
    logits[:, vocab:] = 50.0  # padding must never reach the softmax
    case = dict(logits=logits.double(), targets=torch.randint(0, vocab, (tokens,), generator=g), vocab_size=vocab,
                temperature=0.9, weight_lp=torch.randn(tokens, generator=g, dtype=torch.float64),
                weight_ent=torch.randn(tokens, generator=g, dtype=torch.float64), truncation=truncation)
    ref = float64_reference(case)
    for chunk_size in (None, 100):
        x = logits.cuda().requires_grad_()
        logprobs, entropy = vocab_parallel_logprobs_and_entropy(
            x, case["targets"].cuda(), tp_group=None, vocab_size=vocab, temperature=0.9, chunk_size=chunk_size,
            truncation=None if truncation is None else Truncation(*truncation))
        grad, = torch.autograd.grad((0.3 * logprobs * case["weight_lp"].float().cuda()
                                     - 1.7 * entropy * case["weight_ent"].float().cuda()).sum(), x)
        torch.testing.assert_close(logprobs.double().cpu(), ref["logprobs"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy.double().cpu(), ref["entropy"], rtol=1e-5, atol=1e-5)
        assert grad.dtype == torch.bfloat16
        if truncation != (0, 0.95):
            torch.testing.assert_close(grad.double().cpu(), ref["grad_mix"], rtol=4e-3, atol=1e-6)
        else:  # nuclei of ~10^4 ids: float32 sums may put a row's boundary one token off float64's (its q ~ 1e-5)
            error = (grad.double().cpu() - ref["grad_mix"]).abs()
            off = error > 4e-3 * ref["grad_mix"].abs() + 1e-6
            assert off.sum(-1).max() <= 1 and off.sum() <= tokens // 20 and torch.all(error[off] < 1e-4), off.sum()


def test_bf16_hf_megatron_hf_round_trip_is_bit_exact(qwen25_05b, tmp_path):
    from megatron_gtpo.checkpoint import convert_hf_to_megatron, convert_megatron_to_hf

    path, _ = qwen25_05b
    meta = convert_hf_to_megatron(str(path), str(tmp_path / "mg"), progress=False)
    assert meta.dtype == "bfloat16"
    convert_megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "hf"), progress=False)
    original, back = read_safetensors_dir(path), read_safetensors_dir(tmp_path / "hf")
    assert all(t.dtype == torch.bfloat16 for t in back.values())
    assert_bit_exact(original, back)
