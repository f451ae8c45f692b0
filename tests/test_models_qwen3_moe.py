"""Qwen3-MoE on megatron-core's MoE layers against transformers' Qwen3MoeForCausalLM on the same weights: logits at
EP 1 and 2, with TP and PP, the experts over data-parallel replicas (ETP = TP) or inside a TP group (ETP 1).

The tiny models have 4 experts of which 2 serve each token, head_dim 32 (not hidden_size / heads = 16), q/k norm
weights away from 1 and router weights of the same spread as the rest, so a wrong top-k, a missing or extra
renormalisation of the top-k probabilities, an expert mapped to the wrong index or rank, or a swapped gate / up
projection changes the logits. One model renormalises its top-k probabilities (norm_topk_prob, the published
models' choice), the other does not (and ties its embeddings)."""
import pytest

from test_qwen2_parity import assert_logits_match_transformers
from tiny_models import make_tiny_model

TINY = dict(vocab_size=1000, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """(path, transformers model): top-k renormalised and untied; not renormalised and tied."""
    models = []
    for norm_topk_prob, tie in ((True, False), (False, True)):
        path = tmp_path_factory.mktemp(f"qwen3_moe_norm{int(norm_topk_prob)}")
        models.append((path, make_tiny_model(path, "qwen3_moe", tie=tie, seed=21 + tie, norm_topk_prob=norm_topk_prob,
                                             **TINY)))
    return models


@pytest.mark.parametrize("tp,pp,ep,etp,dp", [
    (1, 1, 1, None, 1),
    (1, 1, 2, None, 2),  # two replicas, each holding 2 of the 4 experts; tokens cross replicas
    (2, 1, 2, 1, 1),  # one replica: its two TP ranks hold 2 whole experts each
    pytest.param(1, 2, 2, None, 2, marks=pytest.mark.slow),  # experts over replicas on both stages
    pytest.param(2, 2, 2, 1, 1, marks=pytest.mark.slow),
    pytest.param(2, 1, 2, None, 2, marks=pytest.mark.slow),  # each expert split over TP=ETP=2, EP over replicas
])
def test_logits_match_transformers(moe_models, tp, pp, ep, etp, dp):
    assert_logits_match_transformers(moe_models, tp, pp, ep=ep, etp=etp, dp=dp)
