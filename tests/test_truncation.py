"""The kept sets of top-k / top-p (distributed/truncation.py) on one process, against their definition written out
in float64 (vocab_references.truncated_kept_mask) and vLLM's formulation; the op's gradient under a truncation by
finite differences. The same at TP = 2 and 4: test_vocab_parallel.py."""
import math

import pytest
import torch

from megatron_gtpo.distributed import truncation as truncation_module
from megatron_gtpo.distributed.truncation import Truncation, kept_sets
from megatron_gtpo.distributed.vocab_parallel import vocab_parallel_logprobs_and_entropy
from vocab_references import truncated_kept_mask, vllm_style_kept_mask

VOCAB = 200  # > NUCLEUS_CANDIDATES: a flat row's nucleus is found by the fallback, a peaked one's from candidates
SETTINGS = [(5, 1.0), (0, 0.9), (0, 0.5), (7, 0.6), (40, 0.95), (1, 1.0)]


def _rows(seed, dtype, *, num_rows=10, step=None):
    """Rows from flat to peaked (scales 0.1 .. 8); with `step`, values on a grid (many exact ties)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-1, math.log10(8.0), num_rows, dtype=torch.float64)[:, None]
    logits = torch.randn(num_rows, VOCAB + 20, generator=g, dtype=torch.float64) * scales
    if step is not None:
        logits = torch.round(logits / step) * step  # -0.0 among them: equal to +0.0, other bits
    logits[:, VOCAB:] = 100.0  # padding columns: never kept, never counted
    return logits.to(dtype)


def _kept(logits, truncation, temperature, chunk=5):
    """(mask [T, V] over the real ids, log-mass [T]) by `kept_sets` on the whole vocabulary (no TP group)."""
    z = logits[:, :VOCAB].to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / temperature
    max_T = z.amax(-1)
    kept = kept_sets(logits, truncation, vocab_size=VOCAB, num_valid=VOCAB, temperature=temperature, max_T=max_T,
                     sum_exp_T=torch.exp(z - max_T[:, None]).sum(-1), tp_group=None, chunk=chunk)
    return kept.mask(z), kept.log_mass_T, z


@pytest.mark.parametrize("top_k,top_p", SETTINGS)
@pytest.mark.parametrize("step", [None, 0.25])
def test_kept_sets_are_the_definition(top_k, top_p, step):
    """Exactly the definition's tokens, ties included (by id), from candidates or the fallback; the mass of them."""
    logits = _rows(1, torch.float64, step=step)
    mask, log_mass, z = _kept(logits, Truncation(top_k, top_p), 0.7)
    expected = truncated_kept_mask(z, top_k, top_p)
    assert torch.equal(mask, expected), (mask.sum(-1), expected.sum(-1))
    torch.testing.assert_close(log_mass, torch.logsumexp(z.masked_fill(~expected, -math.inf), -1), rtol=1e-12,
                               atol=1e-12)


def test_the_fallback_and_the_candidates_agree(monkeypatch):
    """A nucleus found by the fallback's radix select equals the one the candidates give, row by row (float32)."""
    logits = _rows(2, torch.float32, step=0.125)
    for top_p in (0.3, 0.9):
        by_candidates = _kept(logits, Truncation(0, top_p), 1.0)[0]
        monkeypatch.setattr(truncation_module, "NUCLEUS_CANDIDATES", 1)
        by_radix_select = _kept(logits, Truncation(0, top_p), 1.0)[0]
        monkeypatch.undo()
        assert torch.equal(by_candidates, by_radix_select), top_p


@pytest.mark.parametrize("top_k,top_p", SETTINGS)
def test_matches_vllm_formulation_on_tie_free_rows(top_k, top_p):
    logits = _rows(3, torch.float32)
    mask, _, z = _kept(logits, Truncation(top_k, top_p), 1.3)
    assert torch.equal(mask, vllm_style_kept_mask(z, top_k, top_p))


def test_hand_computed_ties_go_to_the_lowest_ids():
    """Four equal logits: top-k 2 keeps ids 0, 1; top-p 0.5 keeps the tokens with less than half the mass before
    them (ids 0, 1), top-p 0.51 one more."""
    logits = torch.zeros(1, 4, dtype=torch.float64)
    for truncation, kept in ((Truncation(2, 1.0), [0, 1]), (Truncation(0, 0.5), [0, 1]),
                             (Truncation(0, 0.51), [0, 1, 2]), (Truncation(3, 0.4), [0, 1])):
        for target in range(4):
            logprob, entropy = vocab_parallel_logprobs_and_entropy(logits, torch.tensor([target]), tp_group=None,
                                                                   truncation=truncation)
            # A kept target has 1 / |K|; one outside K is added to it: 1 / (|K| + 1).
            expected = -math.log(len(kept) + (target not in kept))
            assert logprob.item() == pytest.approx(expected, abs=1e-12), (truncation, target)
            assert entropy.item() == pytest.approx(math.log(4), abs=1e-12)  # the full distribution's


@pytest.mark.parametrize("truncation", [Truncation(0, 0.8), Truncation(4, 0.6)])
def test_gradcheck_float64_with_the_kept_set_fixed(truncation):
    """Both outputs; targets inside and outside the kept set (the logits are far from any boundary at eps)."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 12, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 9, 3, 7])

    def both(x):
        return vocab_parallel_logprobs_and_entropy(x, targets, tp_group=None, vocab_size=10, temperature=0.8,
                                                   chunk_size=3, truncation=truncation)

    assert torch.autograd.gradcheck(both, (logits,), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_a_truncation_that_keeps_everything_is_the_plain_op():
    logits = torch.randn(4, 10)
    targets = torch.randint(0, 10, (4,))
    plain = vocab_parallel_logprobs_and_entropy(logits, targets, tp_group=None)
    for truncation in (Truncation(), Truncation(10, 1.0), Truncation(50, 1.0)):
        got = vocab_parallel_logprobs_and_entropy(logits, targets, tp_group=None, truncation=truncation)
        assert all(torch.equal(a, b) for a, b in zip(got, plain))


@pytest.mark.parametrize("kwargs,match", [(dict(top_k=-1), "top_k"), (dict(top_k=2.0), "top_k"),
                                          (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p")])
def test_bad_truncation_raises_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Truncation(**kwargs)


def test_saves_the_input_reference_and_per_token_numbers_only():
    """Backward recomputes the kept sets' masks from two numbers per token: no [T, V] mask is kept."""
    logits = torch.randn(5, 16, requires_grad=True)
    logprobs, _ = vocab_parallel_logprobs_and_entropy(logits, torch.randint(0, 16, (5,)), tp_group=None,
                                                      chunk_size=2, truncation=Truncation(4, 0.7))
    saved = logprobs.grad_fn.next_functions[0][0].saved_tensors
    assert len(saved) == 7 and all(t.numel() <= logits.shape[0] for t in saved if t.data_ptr() != logits.data_ptr())
