"""vocab_parallel_logprobs_and_entropy against a float64 single-process reference on the full vocabulary.

The distributed tests start one set of gloo ranks per world size (1, 2, 4) and run every case inside it, the
truncated ones (top-k / top-p, distributed/truncation.py) too; the parent process computes the reference
(torch.log_softmax / softmax on the un-padded vocabulary, float64, autograd for the gradients, the kept sets from
their definition: vocab_references.py) and compares each rank's outputs and its shard of the gradients.
"""
import math

import pytest
import torch
import torch.distributed as dist

from distributed_harness import run_distributed
from megatron_gtpo.distributed import truncation as truncation_module
from megatron_gtpo.distributed.truncation import Truncation
from megatron_gtpo.distributed.vocab_parallel import vocab_parallel_logprobs_and_entropy
from vocab_references import float64_reference

PADDED_VOCAB = 48  # divisible by TP = 1, 2, 4
CHUNK_SIZES = (None, 2, 5)  # unchunked, dividing the token count, and not dividing it


def _make_case(seed, *, lead_shape, vocab_size, temperature, dtype, offset_first_quarter=0.0, truncation=None,
               step=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*lead_shape, PADDED_VOCAB, generator=g, dtype=torch.float64) * 3.0
    if step is not None:  # values on a grid: many exact ties, at the top-k and nucleus boundaries too
        logits = torch.round(logits / (3.0 * step)) * step
    # A large offset on the first quarter of the vocab makes the per-rank maxima differ by far more than the
    # exp range at TP=4: the cross-rank rescaling must be right, not merely harmless.
    logits[..., : PADDED_VOCAB // 4] += offset_first_quarter
    # Padding columns get garbage that would dominate the softmax if it leaked in.
    logits[..., vocab_size:] = 50.0
    targets = torch.randint(0, vocab_size, lead_shape, generator=g)
    # Put some targets on the largest real id and in the first shard, to hit shard edges.
    targets.view(-1)[0] = vocab_size - 1
    targets.view(-1)[1] = 0
    if dtype == torch.bfloat16:
        logits = logits.to(torch.bfloat16).to(torch.float64)  # the reference sees exactly what the op sees
    return dict(logits=logits, targets=targets, vocab_size=vocab_size, temperature=temperature, dtype=dtype,
                weight_lp=torch.randn(lead_shape, generator=g, dtype=torch.float64),
                weight_ent=torch.randn(lead_shape, generator=g, dtype=torch.float64), truncation=truncation)


def _uniform_rows(case, rows):
    """`case` with its first `rows` token rows all equal over the real ids: every kept set is ids 0.. (ties by id),
    and splits across the TP ranks."""
    case["logits"].view(-1, PADDED_VOCAB)[:rows, :case["vocab_size"]] = 0.5
    return case


CASES = {
    "fp32_flat_no_padding": _make_case(0, lead_shape=(10,), vocab_size=48, temperature=1.0, dtype=torch.float32),
    # vocab 35 of 48: at TP=2 the last shard is part padding; at TP=4 shard 2 is part padding, shard 3 all padding.
    "fp32_sb_layout_padding": _make_case(1, lead_shape=(4, 3), vocab_size=35, temperature=1.0,
                                         dtype=torch.float32),
    "fp32_temperature_padding": _make_case(2, lead_shape=(4, 3), vocab_size=35, temperature=0.7,
                                           dtype=torch.float32),
    "fp32_hot_temperature_offset": _make_case(3, lead_shape=(3, 4), vocab_size=47, temperature=1.6,
                                              dtype=torch.float32, offset_first_quarter=40.0),
    "fp32_tp4_last_shard_holds_one_real_id": _make_case(4, lead_shape=(6,), vocab_size=37, temperature=1.0,
                                                      dtype=torch.float32),
    "bf16_sb_layout_padding": _make_case(5, lead_shape=(4, 3), vocab_size=35, temperature=0.9,
                                         dtype=torch.bfloat16),
}


# Top-k / top-p (truncation.Truncation(top_k, top_p)). Each runs at NUCLEUS_CANDIDATES 64 (every top-p-alone
# nucleus found from the candidates, the vocabulary being 48) and 2 (most of them by the fallback's radix select).
TRUNCATED_CASES = {
    "top_k_padding": _make_case(10, lead_shape=(4, 3), vocab_size=35, temperature=0.7, dtype=torch.float32,
                                truncation=(5, 1.0)),
    "top_p_padding_float64": _make_case(11, lead_shape=(12,), vocab_size=35, temperature=1.3, dtype=torch.float64,
                                        truncation=(0, 0.9)),
    "top_k_top_p_offset": _make_case(12, lead_shape=(3, 4), vocab_size=47, temperature=1.0, dtype=torch.float32,
                                     offset_first_quarter=8.0, truncation=(7, 0.6)),
    "top_k_ties_split_float64": _uniform_rows(_make_case(13, lead_shape=(10,), vocab_size=45, temperature=0.8,
                                                         dtype=torch.float64, step=0.25, truncation=(30, 1.0)), 2),
    "top_p_ties_split_float64": _uniform_rows(_make_case(14, lead_shape=(10,), vocab_size=45, temperature=1.0,
                                                         dtype=torch.float64, step=0.25, truncation=(0, 0.5)), 2),
    "top_k_top_p_ties_float64": _uniform_rows(_make_case(15, lead_shape=(10,), vocab_size=48, temperature=1.0,
                                                         dtype=torch.float64, step=0.5, truncation=(20, 0.7)), 2),
    "bf16_top_p": _make_case(16, lead_shape=(4, 3), vocab_size=35, temperature=0.9, dtype=torch.bfloat16,
                             truncation=(0, 0.95)),
}
TRUNCATED_CHUNK_SIZES = (None, 5)
CANDIDATES = (64, 2)


class _CollectiveCounter:
    """Wraps torch.distributed's collectives to count calls (the untruncated op must do exactly two, all in forward)
    and record the largest tensor any of them moves."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter",
             "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier")

    def __init__(self):
        self.count = 0
        self.largest = 0
        self._originals = {name: getattr(dist, name) for name in self.NAMES}

    def __enter__(self):
        for name, original in self._originals.items():
            def counted(*args, _original=original, **kwargs):
                self.count += 1
                tensors = [a for arg in args for a in (arg if isinstance(arg, list) else [arg])
                           if isinstance(a, torch.Tensor)]
                self.largest = max([self.largest] + [t.numel() for t in tensors])
                return _original(*args, **kwargs)
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _run_op_with_grads(shard, case, tp_group, chunk_size):
    x = shard.clone().requires_grad_()
    weight_lp = case["weight_lp"].to(x.dtype if x.dtype == torch.float64 else torch.float32)
    weight_ent = case["weight_ent"].to(weight_lp.dtype)
    truncation = None if case["truncation"] is None else Truncation(*case["truncation"])
    with _CollectiveCounter() as forward_calls:
        logprobs, entropy = vocab_parallel_logprobs_and_entropy(
            x, case["targets"], tp_group=tp_group, vocab_size=case["vocab_size"],
            temperature=case["temperature"], chunk_size=chunk_size, truncation=truncation)
    with _CollectiveCounter() as backward_calls:
        # (a) log-prob alone and (b) entropy alone: the other output gets no gradient (None) in backward.
        grad_lp, = torch.autograd.grad((logprobs * weight_lp).sum(), x, retain_graph=True)
        grad_ent, = torch.autograd.grad((entropy * weight_ent).sum(), x, retain_graph=True)
        grad_mix, = torch.autograd.grad((0.3 * logprobs * weight_lp - 1.7 * entropy * weight_ent).sum(), x)
    return dict(logprobs=logprobs.detach(), entropy=entropy.detach(), grad_lp=grad_lp, grad_ent=grad_ent,
                grad_mix=grad_mix, forward_collectives=forward_calls.count,
                backward_collectives=backward_calls.count, largest_collective=forward_calls.largest)


def _tp_groups(world_size, tp_size):
    """Consecutive ranks form a TP group (every rank must create every group)."""
    groups = [dist.new_group(list(range(start, start + tp_size))) for start in range(0, world_size, tp_size)]
    return groups[dist.get_rank() // tp_size]


def _worker(rank, world_size, cases, truncated_cases, tp_sizes):
    torch.set_num_threads(1)
    results, tp_ranks = {}, {}
    for tp_size in tp_sizes:
        tp_group = _tp_groups(world_size, tp_size)
        tp_rank = tp_ranks[tp_size] = dist.get_rank(tp_group)
        vocab_local = PADDED_VOCAB // tp_size
        for name, case in cases.items():
            shard = case["logits"][..., tp_rank * vocab_local:(tp_rank + 1) * vocab_local]
            shard = shard.to(case["dtype"]).contiguous()
            for chunk_size in CHUNK_SIZES:
                results[(tp_size, name, chunk_size)] = _run_op_with_grads(shard, case, tp_group, chunk_size)
        for name, case in truncated_cases.items():
            shard = case["logits"][..., tp_rank * vocab_local:(tp_rank + 1) * vocab_local]
            shard = shard.to(case["dtype"]).contiguous()
            for candidates in CANDIDATES:
                truncation_module.NUCLEUS_CANDIDATES = candidates
                for chunk_size in TRUNCATED_CHUNK_SIZES:
                    results[(tp_size, name, chunk_size, candidates)] = _run_op_with_grads(shard, case, tp_group,
                                                                                          chunk_size)
        # vocab_size larger than V_local * TP: every rank raises before any collective.
        try:
            vocab_parallel_logprobs_and_entropy(torch.zeros(2, vocab_local), torch.zeros(2, dtype=torch.long),
                                                tp_group=tp_group, vocab_size=PADDED_VOCAB + 1)
            results[(tp_size, "too_large_vocab_error")] = None
        except ValueError as err:
            results[(tp_size, "too_large_vocab_error")] = str(err)
    # tp_group=None means no tensor parallelism even inside a multi-rank world: the full vocab, no collective.
    case = cases["fp32_sb_layout_padding"]
    with _CollectiveCounter() as calls:
        results["no_tp_group"] = vocab_parallel_logprobs_and_entropy(
            case["logits"].float(), case["targets"], tp_group=None, vocab_size=case["vocab_size"])
    results["no_tp_group_collectives"] = calls.count
    return tp_ranks, results


def _check_rank_results(tp_size, tp_rank, results, references):
    vocab_local = PADDED_VOCAB // tp_size
    shard = slice(tp_rank * vocab_local, (tp_rank + 1) * vocab_local)
    for name, case in CASES.items():
        ref = references[name]
        bf16 = case["dtype"] == torch.bfloat16
        unchunked = results[(tp_size, name, None)]
        for chunk_size in CHUNK_SIZES:
            got = results[(tp_size, name, chunk_size)]
            where = f"TP={tp_size} rank {tp_rank} case {name} chunk_size={chunk_size}"
            assert got["forward_collectives"] == (2 if tp_size > 1 else 0), where
            assert got["backward_collectives"] == 0, where
            assert got["logprobs"].dtype == torch.float32 and got["logprobs"].shape == case["targets"].shape
            # Outputs are accumulated in fp32 from the exact (bf16-representable) inputs: tight in both dtypes.
            torch.testing.assert_close(got["logprobs"].double(), ref["logprobs"], rtol=1e-6, atol=1e-6, msg=where)
            torch.testing.assert_close(got["entropy"].double(), ref["entropy"], rtol=1e-6, atol=1e-6, msg=where)
            for grad in ("grad_lp", "grad_ent", "grad_mix"):
                assert got[grad].dtype == case["dtype"], where
                # bf16 gradients are rounded once from fp32 (relative 2^-9); fp32 ones carry fp32 rounding only.
                rtol, atol = (4e-3, 1e-6) if bf16 else (1e-5, 1e-6)
                torch.testing.assert_close(got[grad].double(), ref[grad][..., shard], rtol=rtol, atol=atol,
                                           msg=f"{where} {grad}")
            for key in ("logprobs", "entropy", "grad_lp", "grad_ent", "grad_mix"):
                # Chunking changes only how many rows go through each kernel call.
                torch.testing.assert_close(got[key], unchunked[key], rtol=1e-7, atol=1e-7, msg=f"{where} {key}")
    message = results[(tp_size, "too_large_vocab_error")]
    assert message is not None and "vocab_size" in message and str(PADDED_VOCAB + 1) in message


def _check_truncated_results(tp_size, tp_rank, results, references):
    vocab_local = PADDED_VOCAB // tp_size
    shard = slice(tp_rank * vocab_local, (tp_rank + 1) * vocab_local)
    for name, case in TRUNCATED_CASES.items():
        ref = references[name]
        top_k = case["truncation"][0]
        num_tokens = case["targets"].numel()
        float64, bf16 = case["dtype"] == torch.float64, case["dtype"] == torch.bfloat16
        tol = dict(rtol=1e-12, atol=1e-12) if float64 else dict(rtol=1e-6, atol=1e-6)
        grad_tol = dict(rtol=4e-3, atol=1e-6) if bf16 else dict(rtol=1e-5, atol=1e-6) if not float64 else tol
        for candidates in CANDIDATES:
            width = top_k or min(candidates, case["vocab_size"])
            for chunk_size in TRUNCATED_CHUNK_SIZES:
                got = results[(tp_size, name, chunk_size, candidates)]
                where = f"TP={tp_size} rank {tp_rank} case {name} chunk_size={chunk_size} candidates={candidates}"
                assert got["backward_collectives"] == 0, where
                # Never the vocabulary: no collective moves more than the candidates of the tokens, or the
                # fallback's 256 bins per token, whatever V.
                assert got["largest_collective"] <= num_tokens * max(width, 256), (where, got["largest_collective"])
                torch.testing.assert_close(got["logprobs"].double(), ref["logprobs"], **tol, msg=where)
                torch.testing.assert_close(got["entropy"].double(), ref["entropy"], **tol, msg=where)
                for grad in ("grad_lp", "grad_ent", "grad_mix"):
                    assert got[grad].dtype == case["dtype"], where
                    torch.testing.assert_close(got[grad].double(), ref[grad][..., shard], **grad_tol,
                                               msg=f"{where} {grad}")


@pytest.fixture(scope="module")
def references():
    return {name: float64_reference(case) for name, case in {**CASES, **TRUNCATED_CASES}.items()}


@pytest.mark.slow
@pytest.mark.parametrize("world_size,tp_sizes", [(1, (1,)), (2, (2,)), (4, (4, 2))])
def test_matches_float64_reference_across_tp_ranks(world_size, tp_sizes, references):
    """Outputs and the three gradients on every rank and chunking, with padding, temperature, bf16, [s, b, V];
    at world 4 also TP=2 groups inside a DP=2 world (the rank within the group, not the global rank, counts)."""
    per_rank = run_distributed(_worker, world_size, args=(CASES, TRUNCATED_CASES, tp_sizes), timeout_s=240)
    for tp_ranks, results in per_rank:
        for tp_size in tp_sizes:
            _check_rank_results(tp_size, tp_ranks[tp_size], results, references)
            _check_truncated_results(tp_size, tp_ranks[tp_size], results, references)
        assert results["no_tp_group_collectives"] == 0
        logprobs, entropy = results["no_tp_group"]
        ref = references["fp32_sb_layout_padding"]
        torch.testing.assert_close(logprobs.double(), ref["logprobs"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(entropy.double(), ref["entropy"], rtol=1e-6, atol=1e-6)


def test_padding_gets_zero_gradient_and_no_probability():
    case = CASES["fp32_sb_layout_padding"]
    x = case["logits"].float().requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs_and_entropy(x, case["targets"], tp_group=None, vocab_size=35)
    (logprobs.sum() + entropy.sum()).backward()
    assert torch.equal(x.grad[..., 35:], torch.zeros_like(x.grad[..., 35:]))
    # Padding logits are 50: had they leaked in, every log-prob would be far below the real-vocab values.
    torch.testing.assert_close(logprobs.double(), float64_reference(case)["logprobs"], rtol=1e-6, atol=1e-6)


def test_gradcheck_float64_both_outputs():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 2, 7, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 6, (3, 2), generator=g)

    def both(x):
        return vocab_parallel_logprobs_and_entropy(x, targets, tp_group=None, vocab_size=6, temperature=0.8,
                                                   chunk_size=4)

    assert torch.autograd.gradcheck(both, (logits,), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_float64_matches_hand_computed_uniform_case():
    # All-equal logits over 4 real ids: log-prob = -log 4, entropy = log 4, whatever the temperature.
    logits = torch.zeros(2, 6, dtype=torch.float64)
    logprobs, entropy = vocab_parallel_logprobs_and_entropy(logits, torch.tensor([0, 3]), tp_group=None,
                                                            vocab_size=4, temperature=2.5)
    torch.testing.assert_close(logprobs, torch.full((2,), -math.log(4.0), dtype=torch.float64))
    torch.testing.assert_close(entropy, torch.full((2,), math.log(4.0), dtype=torch.float64))


def test_saves_input_reference_and_per_token_scalars_only():
    logits = torch.randn(5, 16, requires_grad=True)
    logprobs, _ = vocab_parallel_logprobs_and_entropy(logits, torch.randint(0, 16, (5,)), tp_group=None,
                                                      chunk_size=2)
    op_node = logprobs.grad_fn.next_functions[0][0]  # under the reshape back to the targets' shape
    saved = op_node.saved_tensors
    big = [t for t in saved if t.numel() > logits.shape[0]]
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr(), [tuple(t.shape) for t in saved]


def test_outputs_modified_in_place_still_backpropagate():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 6, (4,), generator=g)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    logprobs, entropy = vocab_parallel_logprobs_and_entropy(logits, targets, tp_group=None)
    entropy.mul_(mask)  # e.g. masking padding positions in place
    logprobs.mul_(mask)
    grad, = torch.autograd.grad((logprobs + entropy).sum(), logits)
    log_p = torch.log_softmax(logits, -1)
    ref_loss = ((log_p.gather(-1, targets[:, None]).squeeze(-1) - (log_p.exp() * log_p).sum(-1)) * mask).sum()
    ref_grad, = torch.autograd.grad(ref_loss, logits)
    torch.testing.assert_close(grad, ref_grad)


def test_unchecked_out_of_range_target_gives_nan_logprob():
    logits = torch.randn(3, 8)
    logprobs, entropy = vocab_parallel_logprobs_and_entropy(logits, torch.tensor([1, 8, -1]), tp_group=None,
                                                            check_targets=False)
    assert not torch.isnan(logprobs[0]) and torch.isnan(logprobs[1:]).all()
    assert not torch.isnan(entropy).any()


@pytest.mark.parametrize("kwargs,targets,match", [
    (dict(), torch.zeros(4, dtype=torch.long), "targets shape"),
    (dict(), torch.zeros(3, 4, dtype=torch.float32), "integer"),
    (dict(), torch.tensor([[0, 1, 2, 8]] * 3), r"targets must be token ids in \[0, vocab_size=8\)"),
    (dict(), torch.tensor([[0, 1, -1, 2]] * 3), r"got values in \[-1, 2\]"),
    (dict(vocab_size=6), torch.tensor([[0, 1, 6, 2]] * 3), r"vocab_size=6"),
    (dict(vocab_size=9), torch.zeros(3, 4, dtype=torch.long), "vocab_size must be an int in"),
    (dict(vocab_size=0), torch.zeros(3, 4, dtype=torch.long), "vocab_size must be an int in"),
    (dict(temperature=0.0), torch.zeros(3, 4, dtype=torch.long), "temperature"),
    (dict(temperature=-1.0), torch.zeros(3, 4, dtype=torch.long), "temperature"),
    (dict(chunk_size=0), torch.zeros(3, 4, dtype=torch.long), "chunk_size"),
    (dict(chunk_size=-2), torch.zeros(3, 4, dtype=torch.long), "chunk_size"),
])
def test_bad_input_raises_value_error(kwargs, targets, match):
    with pytest.raises(ValueError, match=match):
        vocab_parallel_logprobs_and_entropy(torch.randn(3, 4, 8), targets, tp_group=None, **kwargs)


def test_non_contiguous_shard_raises_value_error():
    logits_bsv = torch.randn(3, 4, 8)
    with pytest.raises(ValueError, match="contiguous"):
        vocab_parallel_logprobs_and_entropy(logits_bsv.transpose(0, 1), torch.zeros(4, 3, dtype=torch.long),
                                            tp_group=None)
