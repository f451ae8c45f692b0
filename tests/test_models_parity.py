"""Megatron's logits equal transformers' on the same weights, for every model family: Qwen2 and Qwen3 at TP/PP
layouts, Qwen3-MoE at EP 1 and 2 with TP and PP, the experts over data-parallel replicas (ETP = TP) or inside a TP
group (ETP 1).

Each family has an untied and a tied model with a vocabulary of 1000 (padded to 1024) and 2 query groups (GQA).
Qwen3's have head_dim 32 (not hidden_size / heads = 16) and q/k norm weights away from 1. The Qwen3-MoE ones have 4
experts of which 2 serve each token and router weights of the same spread as the rest, so a wrong top-k, a missing or
extra renormalisation of the top-k probabilities, an expert mapped to the wrong index or rank, or a swapped gate / up
projection changes the logits; one renormalises its top-k probabilities (norm_topk_prob, the published models'
choice), the other does not (and ties its embeddings).

The local spec's two core attentions (models/sdpa_attention.py): the SDPA one, the default, in every case; at TP 2 x
PP 2 also in float64, next to megatron's unfused one, over padded rows and over the sequences packed into one row
(block-causal mask): the three agree to float64 rounding."""
import copy

import pytest
import torch

from distributed_harness import results_by_world_size
from tiny_models import TINY_QWEN3, make_tiny_model

SEQUENCES = [[5, 17, 250, 999, 3, 42, 7], [1, 2, 3], [900, 800, 700, 600, 500, 400, 300, 200, 100, 0]]
# family: the keyword arguments of its untied and its tied model (make_tiny_model)
MODELS = {
    "qwen2": [dict(tie=tie, vocab_size=1000, num_layers=4, num_heads=4, num_kv_heads=2, seed=int(tie))
              for tie in (False, True)],
    "qwen3": [dict(tie=tie, seed=11 + tie, **TINY_QWEN3) for tie in (False, True)],
    "qwen3_moe": [dict(tie=tie, seed=21 + tie, norm_topk_prob=not tie, **TINY_QWEN3) for tie in (False, True)],
}
DENSE_LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
# (family, TP, PP, EP, ETP, DP, float64: also in float64 with both core attentions, padded and packed)
CASES = [(family, tp, pp, 1, None, 1) for family in ("qwen2", "qwen3") for tp, pp in DENSE_LAYOUTS] + [
    ("qwen3_moe", 1, 1, 1, None, 1),
    ("qwen3_moe", 1, 1, 2, None, 2),  # two replicas, each holding 2 of the 4 experts; tokens cross replicas
    ("qwen3_moe", 2, 1, 2, 1, 1),  # one replica: its two TP ranks hold 2 whole experts each
    ("qwen3_moe", 1, 2, 2, None, 2),  # experts over replicas on both stages
    ("qwen3_moe", 2, 2, 2, 1, 1),
    ("qwen3_moe", 2, 1, 2, None, 2),  # each expert split over TP = ETP = 2, EP over replicas
]
CASES = [(*case, case[:3] == ("qwen2", 2, 2)) for case in CASES]
FLOAT64_RUNS = [(attention, packed) for attention in ("sdpa", "unfused") for packed in (False, True)]


def _megatron_logits(rank, world_size, model_dirs, tp, pp, ep, etp, float64):
    """Each model's logits of SEQUENCES (2 per micro-batch) at the layout, on TP rank 0 of the last stage of each
    replica (None elsewhere): {"float32": [per model]}, and with `float64` {(attention, packed): [per model]} of
    FLOAT64_RUNS (packed: one micro-batch of all SEQUENCES in one row)."""
    import torch.distributed as dist

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.hf_mapping import ShardCoordinates
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.training.forward import make_micro_batches, pack_sequences, run_pipeline

    groups = initialize_parallel(tp, pp, expert_parallel=ep, expert_tensor_parallel=etp)

    def gather_vocab(mb, logits_local):
        parts = [torch.empty_like(logits_local) for _ in range(tp)]
        dist.all_gather(parts, logits_local.contiguous(), group=groups.tp_group)
        return torch.cat(parts, dim=-1)

    def logits_of(dtype, attention, packed):
        per_model = []
        for model_dir in model_dirs:
            with HFCheckpoint(model_dir) as ckpt:
                chunks = build_model(ckpt.config, tensor_parallel=tp, pipeline_parallel=pp, pp_rank=groups.pp_rank,
                                     expert_parallel=ep, expert_tensor_parallel=etp, params_dtype=dtype,
                                     core_attention=attention)
                load_hf_weights(chunks, ckpt, shard=ShardCoordinates.of(groups))
            for c in chunks:
                c.eval()
            micro_batches = [pack_sequences(SEQUENCES, device=groups.device)] if packed else \
                make_micro_batches(SEQUENCES, 2, device=groups.device)
            per_model.append(run_pipeline(chunks, micro_batches, gather_vocab, forward_only=True))
        return per_model

    runs = {"float32": logits_of(torch.float32, "sdpa", False)}
    for attention, packed in FLOAT64_RUNS if float64 else ():
        runs[attention, packed] = logits_of(torch.float64, attention, packed)
    return runs if groups.is_last_stage and groups.tp_rank == 0 else None


@pytest.fixture(scope="module")
def logits(family_models):
    """case of CASES -> each rank's `_megatron_logits`; the cases of one world size in one set of ranks."""
    return results_by_world_size(_megatron_logits, CASES, world_size=lambda c: c[1] * c[2] * c[5],
                                 args=lambda c: (tuple(str(path) for path, _ in family_models(c[0])), *c[1:5], c[6]),
                                 timeout_s=600)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    """family -> [(path, transformers model)] of MODELS, each family built when first asked for."""
    built = {}

    def models(family):
        if family not in built:
            built[family] = []
            for kwargs in MODELS[family]:
                path = tmp_path_factory.mktemp(f"{family}_tied" if kwargs["tie"] else f"{family}_untied")
                built[family].append((path, make_tiny_model(path, family, **kwargs)))
        return built[family]
    return models


@pytest.mark.parametrize("family,tp,pp,ep,etp,dp,float64", CASES,
                         ids=[f"{f}-tp{tp}-pp{pp}-ep{ep}-etp{etp or tp}-dp{dp}" for f, tp, pp, ep, etp, dp, _ in CASES])
def test_logits_match_transformers(family_models, logits, family, tp, pp, ep, etp, dp, float64):
    """Megatron's logits of SEQUENCES on TP x PP x DP ranks against each transformers model of the family; every
    data-parallel replica scores the same sequences, and each one's logits are checked."""
    models = family_models(family)
    replicas = [r for r in logits((family, tp, pp, ep, etp, dp, float64)) if r is not None]
    assert len(replicas) == dp
    for per_model in (r["float32"] for r in replicas):
        for (path, hf), micro_batch_logits in zip(models, per_model):
            rows = [row for mb in micro_batch_logits for row in mb]
            assert len(rows) == len(SEQUENCES)
            for seq, logits in zip(SEQUENCES, rows):
                with torch.no_grad():
                    ref = hf(torch.tensor([seq])).logits[0]
                ours = logits[:len(seq), :1000]
                rel = (ours - ref).abs().max() / ref.abs().max()
                assert rel < 1e-4, f"{path.name} TP={tp} PP={pp} EP={ep} ETP={etp or tp}: relative error {rel:.2e}"
                assert logits.shape[-1] == 1024  # vocabulary padded to the TP-independent multiple


@pytest.mark.parametrize("case", [c for c in CASES if c[-1]], ids=lambda c: f"{c[0]}-tp{c[1]}-pp{c[2]}")
def test_core_attentions_match_transformers_in_float64(family_models, logits, case):
    """float64: the SDPA and the unfused core attention, padded and packed, against each other (to float64 rounding)
    and against transformers' logits (both compute RoPE's angles in float32, differently: 1e-7 apart); a masking
    error moves logits by far more."""
    (runs,) = [r for r in logits(case) if r is not None]
    for i, (path, hf) in enumerate(family_models(case[0])):
        hf64 = copy.deepcopy(hf).double()
        for packed in (False, True):
            per_attention = {}
            for attention in ("sdpa", "unfused"):
                micro_batch_logits = runs[attention, packed][i]
                rows = micro_batch_logits[0][0].split([len(s) for s in SEQUENCES]) if packed else \
                    [row[:len(seq)] for row, seq in zip((r for mb in micro_batch_logits for r in mb), SEQUENCES)]
                per_attention[attention] = [row[:, :1000] for row in rows]  # packed: one row, back to back
            for seq, ours, unfused in zip(SEQUENCES, per_attention["sdpa"], per_attention["unfused"]):
                with torch.no_grad():
                    ref = hf64(torch.tensor([seq])).logits[0]
                assert ours.dtype == torch.float64
                what = f"{path.name} packed={packed}"
                assert (ours - unfused).abs().max() < 1e-12 * ref.abs().max(), f"{what}: SDPA vs unfused"
                for attention, logits_ in (("sdpa", ours), ("unfused", unfused)):
                    error = (logits_ - ref).abs().max() / ref.abs().max()
                    assert error < 1e-6, f"{what} {attention}: relative error {error:.2e} against transformers"
