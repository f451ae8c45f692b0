"""Sampling (temperature, top-k, top-p, greedy) and the engine's parameter checks, against float64 references
written here independently (per-row Python loops over sorted probabilities)."""
import math

import pytest
import torch

from megatron_gtpo.rollout import SamplingParams, filter_top_k_top_p, sample_next_tokens
from megatron_gtpo.rollout.engine import check_prompts


def _kept_reference(logits_row, *, temperature, top_k, top_p):
    """The set of token ids top-k then top-p keep, by plain Python over float64 probabilities."""
    z = [float(x) / temperature for x in logits_row]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if top_k > 0:
        order = order[:top_k]
    m = max(z[i] for i in order)
    weights = [math.exp(z[i] - m) for i in order]
    total = sum(weights)
    kept, mass = [], 0.0
    for i, w in zip(order, weights):
        if mass >= top_p:
            break
        kept.append(i)
        mass += w / total
    return set(kept), {i: w / sum(weights[:len(kept)]) for i, w in zip(kept, weights)}


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.5), (7, 0.8), (1, 0.3), (0, 0.999)])
def test_filter_matches_reference(top_k, top_p):
    torch.manual_seed(0)
    logits_BV = torch.randn(6, 40, dtype=torch.float64) * 2
    filtered_BV = filter_top_k_top_p(logits_BV, top_k=top_k, top_p=top_p)
    for row, frow in zip(logits_BV, filtered_BV):
        kept, _ = _kept_reference(row.tolist(), temperature=1.0, top_k=top_k, top_p=top_p)
        assert set(torch.nonzero(torch.isfinite(frow)).flatten().tolist()) == kept
        assert torch.equal(frow[list(kept)], row[list(kept)])  # survivors keep their logits


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 3, 1.0), (1.5, 0, 0.6), (1.2, 4, 0.7)])
def test_sampling_frequencies_match_filtered_distribution(temperature, top_k, top_p):
    vocab_size, padded, draws = 8, 10, 40000
    logits_V = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.7, -1.0, 1.4, 0.0, 50.0, 50.0])  # 2 padding columns, huge
    kept, expected = _kept_reference(logits_V[:vocab_size].tolist(), temperature=temperature, top_k=top_k,
                                     top_p=top_p)
    generator = torch.Generator().manual_seed(7)
    tokens_B, logprobs_B = sample_next_tokens(logits_V.expand(draws, padded), vocab_size=vocab_size,
                                              temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    counts = torch.bincount(tokens_B, minlength=padded).double() / draws
    for token in range(padded):
        want = expected.get(token, 0.0)
        if want == 0.0:
            assert counts[token] == 0, f"token {token} is outside the kept set {kept} but was drawn"
        else:  # 40000 draws: the standard error is <= 0.0025
            assert abs(counts[token] - want) < 0.012, (token, counts[token].item(), want)
    # Log-probs: the temperature-scaled FULL distribution over the true vocabulary (top-k/top-p do not enter).
    ref_logp_V = torch.log_softmax(logits_V[:vocab_size].double() / temperature, dim=-1)
    assert torch.allclose(logprobs_B.double(), ref_logp_V[tokens_B], atol=1e-6, rtol=0)
    assert logprobs_B.dtype == torch.float32


def test_greedy_is_argmax_with_untempered_logprobs():
    logits_BV = torch.tensor([[0.1, 3.0, 3.0, -1.0, 9.0], [2.0, -2.0, 0.5, 1.0, 9.0], [-1.0, -1.0, -1.0, -1.0, 9.0]])
    tokens_B, logprobs_B = sample_next_tokens(logits_BV, vocab_size=4, temperature=0.0)
    assert tokens_B.tolist() == [1, 0, 0]  # the padding column (id 4) never wins; ties go to the lowest id
    ref = torch.log_softmax(logits_BV[:, :4].double(), dim=-1)[torch.arange(3), tokens_B]
    assert torch.allclose(logprobs_B.double(), ref, atol=1e-7)
    assert math.isclose(logprobs_B[2].item(), math.log(0.25), rel_tol=1e-6)


def test_sampling_is_deterministic_for_a_generator_seed_and_bf16_is_computed_in_fp32():
    torch.manual_seed(1)
    logits_BV = torch.randn(16, 300).to(torch.bfloat16)

    def draw(seed):
        return sample_next_tokens(logits_BV, vocab_size=290, temperature=0.9, top_p=0.95,
                                  generator=torch.Generator().manual_seed(seed))

    (a, lp_a), (b, lp_b), (c, _) = draw(3), draw(3), draw(4)
    assert torch.equal(a, b) and torch.equal(lp_a, lp_b)
    assert not torch.equal(a, c)
    assert lp_a.dtype == torch.float32
    ref = torch.log_softmax(logits_BV[:, :290].double() / 0.9, dim=-1)[torch.arange(16), a]
    assert torch.allclose(lp_a.double(), ref, atol=1e-6)


@pytest.mark.parametrize("kwargs,name", [
    (dict(n=0), "n"), (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"), (dict(top_k=2.0), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop_token_ids=[2]), "stop_token_ids"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"), (dict(seed=None), "seed"),
])
def test_sampling_params_reject_bad_values(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompts,message", [
    ([], "non-empty list"), ([[]], r"prompts\[0\]"), ([[1, 2], [3, 1000]], r"prompts\[1\].*1000"),
    ([[1, -1]], "outside the vocabulary"), ([[1] * 60], "exceeds the model's 64 positions"),
])
def test_check_prompts_rejects_bad_prompts(prompts, message):
    with pytest.raises(ValueError, match=message):
        check_prompts(prompts, vocab_size=1000, max_positions=64, max_new_tokens=8)


def test_sample_next_tokens_rejects_bad_input():
    with pytest.raises(ValueError, match="logits_BV"):
        sample_next_tokens(torch.zeros(3), vocab_size=3, temperature=1.0)
    with pytest.raises(ValueError, match="vocab_size"):
        sample_next_tokens(torch.zeros(2, 3), vocab_size=4, temperature=1.0)
