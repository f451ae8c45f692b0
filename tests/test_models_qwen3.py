"""Qwen3 dense on megatron against transformers' Qwen3ForCausalLM on the same weights: logits at TP/PP layouts, tied
and untied; a weight sync of a changed policy (every parameter perturbed) whose HF tensors, loaded into
Qwen3ForCausalLM, give the log-probs the built-in engine served; and a policy update at TP=2 equal to one on a single
process (the q/k norms' gradients, partial on each TP rank, are summed). The tiny models have head_dim 32, not
hidden_size / heads = 16, and q/k norm weights away from 1, so a wrong head_dim, a missing or swapped q/k norm or a
stray q/k/v bias changes the logits."""
import zlib

import pytest
import torch

from distributed_harness import run_distributed
from test_parallel_invariance import BY_COUNT, LOSS_LEVELS, _assert_same, _merge, _one_step
from test_qwen2_parity import assert_logits_match_transformers
from tiny_models import make_tiny_model

VOCAB = 1000  # padded to 1024 by megatron (test_qwen2_parity's vocabulary)
TINY = dict(vocab_size=VOCAB, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)
PROMPTS = [[5, 17, 250, 999, 3, 42, 7], [1, 2, 3], [900, 800, 700, 600, 500]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def qwen3_models(tmp_path_factory):
    """(path, transformers model) of an untied and a tied tiny Qwen3."""
    models = []
    for tie in (False, True):
        path = tmp_path_factory.mktemp("qwen3_tied" if tie else "qwen3_untied")
        models.append((path, make_tiny_model(path, "qwen3", tie=tie, seed=11 + tie, **TINY)))
    return models


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_logits_match_transformers(qwen3_models, tp, pp):
    assert_logits_match_transformers(qwen3_models, tp, pp)


def _perturb(chunks, groups) -> None:
    """Noise on every parameter, seeded by its name: replicated ones (the q/k norms too) stay equal on all TP ranks,
    and the last stage's copy of tied embeddings equal to the embedding, as training keeps them; TP-split ones
    differ between ranks."""
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                split = getattr(p, "tensor_model_parallel", False)
                key = name.replace("output_layer", "embedding.word_embeddings")
                g = torch.Generator().manual_seed(zlib.crc32(key.encode()) + (groups.tp_rank if split else 0))
                p.add_(0.02 * torch.randn(p.shape, generator=g).to(p.device))


def _sync_and_serve(rank, world_size, model_dir, tp, pp):
    """The built-in engine's greedy responses after the perturbation, and the HF tensors the sync delivers to its
    destination (TP rank 0 of the first stage); None elsewhere."""
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.rollout import BuiltinEngine, SamplingParams
    from megatron_gtpo.rollout.weight_sync import hf_weight_buckets, is_sync_destination

    groups = initialize_parallel(tp, pp)
    with HFCheckpoint(model_dir) as ckpt:
        chunks = build_model(ckpt.config, tensor_parallel=tp, pipeline_parallel=pp, pp_rank=groups.pp_rank)
        load_hf_weights(chunks, ckpt, tp_rank=groups.tp_rank, tp_size=tp)
        shape = ckpt.shape
    _perturb(chunks, groups)
    responses = BuiltinEngine(chunks, groups, VOCAB).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)).to_lists()
    received = {name: t.clone() for bucket in hf_weight_buckets(chunks, groups, shape) for name, t in bucket}
    return (received, responses) if is_sync_destination(groups) else None


@pytest.mark.parametrize("tp,pp,tied", [(2, 1, False), (1, 2, True)])
def test_weight_sync_serves_the_built_in_engines_logprobs(qwen3_models, tp, pp, tied):
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    path, hf = qwen3_models[tied]
    results = run_distributed(_sync_and_serve, tp * pp, args=(str(path), tp, pp), timeout_s=300)
    received, responses = next(r for r in results if r is not None)
    checkpoint = load_file(str(path / "model.safetensors"))
    assert sorted(received) == sorted(checkpoint)  # q_norm / k_norm included, no biases, lm_head only if untied
    assert all(not torch.equal(received[name], tensor) for name, tensor in checkpoint.items())  # all perturbed

    served = Qwen3ForCausalLM(hf.config).eval()
    missing, unexpected = served.load_state_dict(received, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"] if tied else [], [])  # tied: lm_head IS the embedding
    assert_serves_the_responses(served, PROMPTS, responses, f"TP={tp} PP={pp}")


def assert_serves_the_responses(served, prompts, responses, where: str) -> None:
    """The transformers model `served` gives each greedy response (one per prompt) and its log-probs (1e-4)."""
    for prompt, (response,) in zip(prompts, responses):
        with torch.no_grad():
            logits_LV = served(torch.tensor([prompt + response.token_ids])).logits[0, len(prompt) - 1:-1]
        assert response.token_ids == logits_LV.argmax(-1).tolist()  # greedy
        tokens_L = torch.tensor(response.token_ids)
        logprobs_L = torch.log_softmax(logits_LV.double(), -1)[torch.arange(len(tokens_L)), tokens_L]
        err = (torch.tensor(response.logprobs, dtype=torch.float64) - logprobs_L).abs().max().item()
        assert err < 1e-4, f"{where}: served log-probs differ from the synced weights' by {err:.2e}"


def test_policy_update_at_tp2_matches_one_process(qwen3_models):
    path, hf = qwen3_models[0]
    single = run_distributed(_one_step, 1, args=(str(path), 1, 1, [BY_COUNT]), timeout_s=300)
    tp2 = run_distributed(_one_step, 2, args=(str(path), 2, 1, [BY_COUNT]), timeout_s=300)
    for level in LOSS_LEVELS:
        reference, ours = _merge(single, (level, BY_COUNT)), _merge(tp2, (level, BY_COUNT))
        assert not torch.equal(reference[2]["model.layers.0.self_attn.q_norm.weight"],
                               hf.model.layers[0].self_attn.q_norm.weight.detach())  # the update reached it
        _assert_same(reference, ours, f"{level} loss, TP=2 vs one process")
