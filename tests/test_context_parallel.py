"""Context parallelism on CPU: the local spec's all-gather attention (models/context_attention.py) at CP = 2 gives the
logits of CP = 1, and parameter gradients summed over the CP ranks equal CP = 1's, for padded rows (causal mask) and
packed rows (block-causal mask), on a tiny Qwen2 (q/k/v bias), Qwen3 (per-head q/k norms) and Qwen3-MoE (routers
told which positions are padding, models/moe_routing.py); so do the
per-token log-probs and entropies of the scoring pass (training/forward.py), split and gathered back over CP. In
float64; CP = 1 runs megatron's unfused core attention, CP = 2 the SDPA one (the default, models/sdpa_attention.py)
and, on the Qwen2, the unfused one too."""
import pytest
import torch

from distributed_harness import run_distributed
from tiny_models import make_tiny_model

TINY = dict(vocab_size=1000, num_layers=2, num_heads=4, num_kv_heads=2)
# Three sequences: padded rows of 12 tokens, or one packed row of 21 + 3 padding (multiples of 2 C for C = 2).
SEQUENCES = [[5, 17, 250, 999, 3, 42, 7], [1, 2, 3], [900, 800, 700, 600, 500, 400, 300, 200, 100, 0, 11]]
ROW_MULTIPLE = 4


def _micro_batch(pack: bool, device):
    """SEQUENCES as padded rows (megatron's causal mask) or one packed row (block-causal mask), as the training
    passes cut them (training/forward.py)."""
    from megatron_gtpo.training.forward import make_micro_batches, pack_sequences

    if pack:
        return pack_sequences(SEQUENCES, device=device, pad_to_multiple=ROW_MULTIPLE)
    return make_micro_batches(SEQUENCES, len(SEQUENCES), device=device, pad_to_multiple=ROW_MULTIPLE)[0]


def _logits_and_grads(rank, world_size, runs, cp):
    """Per (model directory, core attention) of `runs` and row layout: the whole rows' logits [B, L, V], every
    parameter's gradient of a fixed weighted sum of the logits, summed over the CP ranks (each rank's is the part its
    positions contribute), and the scoring pass's (logprobs_BL, entropy_BL)."""
    import torch.distributed as dist

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.distributed.context_parallel import load_balanced_positions
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.training.forward import forward_logprobs_and_entropy, model_forward, on_context_rank

    groups = initialize_parallel(1, 1, context_parallel=cp)
    out = []
    for model_dir, attention in runs:
        with HFCheckpoint(model_dir) as ckpt:
            model = build_model(ckpt.config, tensor_parallel=1, pipeline_parallel=1, pp_rank=0, context_parallel=cp,
                                params_dtype=torch.float64, core_attention=attention)[0]
            load_hf_weights([model], ckpt)
        model.eval()
        for pack in (False, True):
            mb = _micro_batch(pack, groups.device)
            tokens_BL = mb.tokens_BL
            positions = load_balanced_positions(tokens_BL.shape[1], groups.cp_rank, cp, device=groups.device)
            logits_BlV = model_forward(model, on_context_rank(mb, groups), local_attention=True)
            weights_BLV = torch.randn((*tokens_BL.shape, logits_BlV.shape[-1]),
                                      generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(groups.device)
            model.zero_grad()
            (logits_BlV * weights_BLV[:, positions]).sum().backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            for grad in grads.values():
                dist.all_reduce(grad, group=groups.cp_group)
            parts = [torch.empty_like(logits_BlV) for _ in range(cp)]
            dist.all_gather(parts, logits_BlV.detach().contiguous(), group=groups.cp_group)
            logits_BLV = torch.empty((*tokens_BL.shape, logits_BlV.shape[-1]), dtype=torch.float64,
                                     device=groups.device)
            for r, part in enumerate(parts):
                logits_BLV[:, load_balanced_positions(tokens_BL.shape[1], r, cp, device=groups.device)] = part
            (scores,) = forward_logprobs_and_entropy([model], [mb], groups, vocab_size=TINY["vocab_size"])
            out.append((logits_BLV.cpu(), {name: grad.cpu() for name, grad in grads.items()},
                        [v.cpu() for v in scores]))
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = []
    for family, extra in (("qwen2", {}), ("qwen3", {"head_dim": 32}), ("qwen3_moe", {"head_dim": 32})):
        path = tmp_path_factory.mktemp(family)
        make_tiny_model(path, family, seed=3, **TINY, **extra)
        dirs.append(str(path))
    return dirs


@pytest.mark.slow
def test_all_gather_attention_at_cp2_equals_cp1(model_dirs):
    unfused, sdpa = ([(d, attention) for d in model_dirs] for attention in ("unfused", "sdpa"))
    reference = run_distributed(_logits_and_grads, 1, args=(unfused, 1), timeout_s=300)[0]
    split = run_distributed(_logits_and_grads, 2, args=(sdpa + unfused[:1], 2), timeout_s=300)
    cases = [f"{family} {'packed' if pack else 'padded'}"
             for family in ("qwen2", "qwen3", "qwen3_moe", "qwen2-unfused") for pack in (False, True)]
    for rank_out in split:
        for case, (ref_logits, ref_grads, ref_scores), (logits, grads, scores) in zip(cases, reference + reference[:2],
                                                                                      rank_out):
            torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10, msg=lambda m: f"{case}: {m}")
            for values, ref in zip(scores, ref_scores):  # log-probs, entropies
                torch.testing.assert_close(values, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case} scores: {m}")
            for name, ref in ref_grads.items():
                scale = ref.abs().max().clamp_min(1e-6)
                tolerance = 1e-6 if "router" in name else 1e-10  # megatron's router softmax runs in float32
                assert (grads[name] - ref).abs().max() / scale < tolerance, f"{case}: gradient of {name}"


@pytest.mark.slow  # megatron's GPT layer specs' import: 2.5 s of CPU (make test runs it)
def test_context_parallel_reaches_megatron_config_and_the_local_spec():
    """TE's attention reads context_parallel_size and cp_comm_type from the TransformerConfig; the local spec gets the
    all-gather attention in DotProductAttention's place (which refuses CP > 1), on either core attention."""
    from megatron_gtpo.models.context_attention import AllGatherContextAttention, AllGatherUnfusedContextAttention
    from megatron_gtpo.models.presets import hf_config
    from megatron_gtpo.models.qwen import layer_spec, transformer_config_from_hf

    config = transformer_config_from_hf(hf_config("qwen2.5-0.5b"), context_parallel=2, context_comm="a2a")
    assert (config.context_parallel_size, config.cp_comm_type) == (2, "a2a")
    assert transformer_config_from_hf(hf_config("qwen2.5-0.5b")).cp_comm_type is None
    attention = layer_spec(False, qk_norm=False, context_parallel=True).submodules.self_attention.submodules
    assert attention.core_attention is AllGatherContextAttention
    attention = layer_spec(False, qk_norm=False, context_parallel=True,
                           core_attention="unfused").submodules.self_attention.submodules
    assert attention.core_attention is AllGatherUnfusedContextAttention
