"""Sampling (temperature, top-k, top-p, greedy) and the engine's parameter checks, against float64 references
written here independently (per-row Python loops over sorted probabilities; ties go to the lowest id, as Python's
stable sort leaves them)."""
import math

import pytest
import torch

from megatron_gtpo.distributed import Truncation
from megatron_gtpo.rollout import SamplingParams, sample_next_tokens, sampling_log_probs
from megatron_gtpo.rollout.engine import check_prompts
from megatron_gtpo.rollout.sampling import counter_uniform, stream_keys


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
@pytest.mark.parametrize("ties", [False, True])
def test_sampling_log_probs_match_reference(top_k, top_p, ties):
    torch.manual_seed(0)
    logits_BV = torch.randn(6, 42, dtype=torch.float64) * 2
    if ties:
        logits_BV = torch.round(logits_BV * 2) / 2
    log_probs_BV = sampling_log_probs(logits_BV, vocab_size=40, temperature=1.2, truncation=Truncation(top_k, top_p))
    for row, lp_row in zip(logits_BV, log_probs_BV):
        kept, probs = _kept_reference(row[:40].tolist(), temperature=1.2, top_k=top_k, top_p=top_p)
        assert set(torch.nonzero(torch.isfinite(lp_row)).flatten().tolist()) == kept
        assert torch.allclose(lp_row[list(kept)], torch.tensor([math.log(probs[i]) for i in kept],
                                                               dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 3, 1.0), (1.5, 0, 0.6), (1.2, 4, 0.7)])
def test_sampling_frequencies_match_filtered_distribution(temperature, top_k, top_p):
    vocab_size, padded, draws = 8, 10, 40000
    logits_V = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.7, -1.0, 1.4, 0.0, 50.0, 50.0])  # 2 padding columns, huge
    kept, expected = _kept_reference(logits_V[:vocab_size].tolist(), temperature=temperature, top_k=top_k,
                                     top_p=top_p)
    # Half the rows: one seed each (the rows' first draws); half: one seed, one draw index each.
    seeds_B = torch.cat([torch.arange(draws // 2) + 7, torch.full((draws // 2,), 7)])
    draws_B = torch.cat([torch.zeros(draws // 2, dtype=torch.long), torch.arange(draws // 2) + 1])
    tokens_B, logprobs_B = sample_next_tokens(logits_V.expand(draws, padded), vocab_size=vocab_size,
                                              temperature=temperature, top_k=top_k, top_p=top_p,
                                              stream_keys_B=stream_keys(seeds_B), draws_B=draws_B)
    counts = torch.bincount(tokens_B, minlength=padded).double() / draws
    for token in range(padded):
        want = expected.get(token, 0.0)
        if want == 0.0:
            assert counts[token] == 0, f"token {token} is outside the kept set {kept} but was drawn"
        else:  # 40000 draws: the standard error is <= 0.0025
            assert abs(counts[token] - want) < 0.012, (token, counts[token].item(), want)
    # Log-probs: those of the distribution drawn from (renormalised over the kept set).
    ref_logp_B = torch.tensor([math.log(expected[t]) for t in tokens_B.tolist()], dtype=torch.float64)
    assert torch.allclose(logprobs_B.double(), ref_logp_B, atol=1e-6, rtol=0)
    assert logprobs_B.dtype == torch.float32


def test_greedy_is_argmax_with_untempered_logprobs():
    logits_BV = torch.tensor([[0.1, 3.0, 3.0, -1.0, 9.0], [2.0, -2.0, 0.5, 1.0, 9.0], [-1.0, -1.0, -1.0, -1.0, 9.0]])
    tokens_B, logprobs_B = sample_next_tokens(logits_BV, vocab_size=4, temperature=0.0)
    assert tokens_B.tolist() == [1, 0, 0]  # the padding column (id 4) never wins; ties go to the lowest id
    ref = torch.log_softmax(logits_BV[:, :4].double(), dim=-1)[torch.arange(3), tokens_B]
    assert torch.allclose(logprobs_B.double(), ref, atol=1e-7)
    assert math.isclose(logprobs_B[2].item(), math.log(0.25), rel_tol=1e-6)


def test_sampling_is_deterministic_for_a_seed_and_bf16_is_computed_in_fp32():
    torch.manual_seed(1)
    logits_BV = torch.randn(16, 300).to(torch.bfloat16)

    def draw(seed, logits_BV=logits_BV, draws_B=torch.arange(16)):
        return sample_next_tokens(logits_BV, vocab_size=290, temperature=0.9, top_p=0.95,
                                  stream_keys_B=stream_keys(torch.full((len(logits_BV),), seed)), draws_B=draws_B)

    (a, lp_a), (b, lp_b), (c, _) = draw(3), draw(3), draw(4)
    assert torch.equal(a, b) and torch.equal(lp_a, lp_b)
    assert not torch.equal(a, c)
    # A row's token depends on its logits, seed and draw index only: not on the rows beside it or their order.
    order = torch.randperm(16)
    assert torch.equal(draw(3, logits_BV[order], torch.arange(16)[order])[0], a[order])
    assert all(draw(3, logits_BV[i:i + 1], torch.tensor([i]))[0].item() == a[i] for i in range(16))
    assert lp_a.dtype == torch.float32
    for row, token, logprob in zip(logits_BV[:, :290].double(), a.tolist(), lp_a.tolist()):
        kept, probs = _kept_reference(row.tolist(), temperature=0.9, top_k=0, top_p=0.95)
        assert token in kept and logprob == pytest.approx(math.log(probs[token]), abs=1e-6)


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


def _counter_uniform_reference(seed: int, draw: int, column: int) -> float:
    """counter_uniform's definition in plain Python integers: 32-bit hashes of seed, draw and column."""
    def mix(x):
        x ^= x >> 16
        x = (x * 0x21F0AAAD) % 2**32
        x ^= x >> 15
        x = (x * 0x735A2D97) % 2**32
        return x ^ (x >> 15)

    seed %= 2**64
    row_key = mix(mix(mix(seed % 2**32) ^ (seed >> 32)) ^ draw)
    return ((mix(row_key ^ mix(column)) >> 8) + 0.5) / 2**24


def test_counter_uniform_is_its_definition_and_uniform():
    seeds_B = torch.tensor([0, 1, 2**40 + 5, -3, 123456789])
    draws_B = torch.tensor([0, 7, 1, 2, 2**31])
    u_BV = counter_uniform(stream_keys(seeds_B), draws_B, 50, dtype=torch.float64)
    for b in range(5):
        for v in (0, 1, 31, 49):
            assert u_BV[b, v].item() == _counter_uniform_reference(seeds_B[b].item(), draws_B[b].item(), v)
    # 1024 streams x 2 draws x 512 columns: every 1/32 bin holds 1/32 of the values (chi-square, 31 degrees of
    # freedom: 99.99% quantile ~ 70), and neighbours in seed, draw and column are uncorrelated.
    seeds = torch.arange(1024).repeat_interleave(2)
    u_BV = counter_uniform(stream_keys(seeds), torch.arange(2).repeat(1024), 512)
    assert u_BV.dtype == torch.float32 and 0 < u_BV.min() and u_BV.max() < 1
    counts = torch.bincount((u_BV * 32).long().flatten(), minlength=32).double()
    expected = u_BV.numel() / 32
    assert ((counts - expected) ** 2 / expected).sum() < 70
    centred = u_BV.double() - 0.5
    for a, b in ((centred[0::2], centred[1::2]), (centred[:-2:2], centred[2::2]), (centred[:, :-1], centred[:, 1:])):
        correlation = (a * b).mean() / (centred ** 2).mean()
        assert abs(correlation) < 0.01, correlation  # 500k pairs: the standard error is ~0.0015


def test_sample_next_tokens_rejects_bad_input():
    with pytest.raises(ValueError, match="logits_BV"):
        sample_next_tokens(torch.zeros(3), vocab_size=3, temperature=1.0)
    with pytest.raises(ValueError, match="vocab_size"):
        sample_next_tokens(torch.zeros(2, 3), vocab_size=4, temperature=1.0)
    with pytest.raises(ValueError, match="stream_keys_B and draws_B"):
        sample_next_tokens(torch.zeros(2, 3), vocab_size=3, temperature=1.0,
                           stream_keys_B=torch.zeros(2, dtype=torch.long))
