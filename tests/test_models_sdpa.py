"""The SDPA core attention (models/sdpa_attention.py) against a float64 softmax written out here, on every mask the
project gives the local spec's attention: none (padded rows, causal), a packed row's block-causal mask, a
left-padded prefill (pad queries that see no key), a decode step against a KV cache with and without padding, and
several new queries at the end of a cache without a mask (bottom-right causal); each mask also in SDPA's additive
form (sdpa_attention.additive_mask, which the built-in engine gives every layer). GQA: 4 heads over 2 query groups.
Forward outputs and gradients, in float64, in-process on host tensors (megatron's unfused attention needs CUDA, or
the CPU platform layer, which a test process must not install: it is compared with it, and with transformers, in
float64 at TP 2 x PP 2 and CP 2 in test_models_parity and test_context_parallel; the built-in engine's greedy tokens
in test_rollout_builtin)."""
import types

import pytest
import torch

HEADS, GROUPS, HEAD_DIM = 4, 2, 16


@pytest.fixture(scope="module")
def sdpa():
    """SdpaAttention, float64, one TP rank."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_gtpo.models.sdpa_attention import SdpaAttention

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=HEAD_DIM, attention_dropout=0.0,
                               hidden_dropout=0.0, params_dtype=torch.float64, use_cpu_initialization=True)
    one_rank = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1, rank=lambda: 0))
    return SdpaAttention(config, 1, AttnMaskType.causal, "self", pg_collection=one_rank)


def _qkv(sq, sk, batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, batch, HEADS, HEAD_DIM, dtype=torch.float64, generator=g)
    k, v = (torch.randn(sk, batch, GROUPS, HEAD_DIM, dtype=torch.float64, generator=g) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def _reference(q, k, v, masked_BHQK):
    """Written-out attention: every head's group's keys, scores / sqrt(d), masked scores at -1e30 (exp gives 0),
    softmax."""
    rep = HEADS // GROUPS
    k_BNKD, v_BNKD = (t.repeat_interleave(rep, dim=2).permute(1, 2, 0, 3) for t in (k, v))
    scores_BNQK = q.permute(1, 2, 0, 3) @ k_BNKD.transpose(-1, -2) / HEAD_DIM ** 0.5
    probs_BNQK = torch.softmax(scores_BNQK.masked_fill(masked_BHQK, -1e30), dim=-1)
    return (probs_BNQK @ v_BNKD).permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def _causal(sq, sk):
    """bool [1, 1, sq, sk], True = masked: the last sq of sk positions, each seeing itself and what precedes it."""
    return (torch.arange(sk)[None, :] > torch.arange(sk - sq, sk)[:, None])[None, None]


def _left_pad_mask(pads, sq, sk):
    """The built-in engine's mask of left-padded rows (rollout/builtin._attention_mask): pad keys and causal."""
    pad_BK = torch.arange(sk)[None, :] < torch.tensor(pads)[:, None]
    return pad_BK[:, None, None, :] | _causal(sq, sk)


def _packed_mask(lengths, total):
    from megatron_gtpo.training.forward import block_causal_mask

    return block_causal_mask(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]), total)


def _seeing_all_keys_if_none(masked_BHQK):
    """The mask SdpaAttention's contract applies: a query that would see no key sees them all."""
    return masked_BHQK & masked_BHQK.logical_not().any(dim=-1, keepdim=True)


# name: (sq, sk, batch, the mask given to the attention (None: causal), the mask it means)
LEFT_PADDED = _left_pad_mask([0, 3, 6], 7, 7)
CASES = {
    "padded-causal": (9, 9, 3, None, _causal(9, 9)),
    "packed": (12, 12, 1, _packed_mask([5, 4, 3], 12), _packed_mask([5, 4, 3], 12)),
    "left-padded-prefill": (7, 7, 3, LEFT_PADDED, _seeing_all_keys_if_none(LEFT_PADDED)),
    "decode-left-padded": (1, 9, 3, _left_pad_mask([0, 3, 6], 1, 9), _left_pad_mask([0, 3, 6], 1, 9)),
    "decode": (1, 9, 2, None, _causal(1, 9)),
    "queries-after-cache": (3, 9, 2, None, _causal(3, 9)),
}


@pytest.mark.parametrize("case,form", [(case, form) for case, (*_, given, _) in CASES.items()
                                       for form in ("bool", "additive") if form == "bool" or given is not None])
def test_sdpa_equals_written_out_attention(sdpa, case, form):
    """Each mask as megatron gives it (bool, True = masked), and converted once to SDPA's additive form (what the
    built-in engine gives every layer)."""
    from megatron_gtpo.models.sdpa_attention import additive_mask

    sq, sk, batch, given, meant = CASES[case]
    if form == "additive":
        given = additive_mask(given, torch.float64)
    q, k, v = _qkv(sq, sk, batch)
    out = sdpa(q, k, v, given)
    assert out.shape == (sq, batch, HEADS * HEAD_DIM) and torch.isfinite(out).all()
    ref = _reference(q, k, v, meant)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12), case
    weights = torch.randn(out.shape, dtype=torch.float64)
    for ours, theirs in zip(torch.autograd.grad((out * weights).sum(), (q, k, v)),
                            torch.autograd.grad((ref * weights).sum(), (q, k, v))):
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-12), case


def test_sdpa_refuses_what_it_does_not_compute(sdpa):
    import dataclasses

    from megatron.core.transformer.enums import AttnMaskType

    from megatron_gtpo.models.qwen import layer_spec
    from megatron_gtpo.models.sdpa_attention import SdpaAttention

    with pytest.raises(ValueError, match="attention_dropout"):
        SdpaAttention(dataclasses.replace(sdpa.config, attention_dropout=0.1), 1, AttnMaskType.causal, "self",
                      pg_collection=sdpa.pg_collection)
    with pytest.raises(ValueError, match="model.core_attention: 'flash' is not one of"):
        layer_spec(False, qk_norm=False, core_attention="flash")
    assert layer_spec(False, qk_norm=False).submodules.self_attention.submodules.core_attention is SdpaAttention


@pytest.mark.parametrize("case,form", [(case, form) for case, (*_, given, _) in CASES.items() if given is not None
                                       for form in ("bool", "additive")])
def test_keys_and_values_expanded_for_a_mask_give_the_same_attention(sdpa, case, form, monkeypatch):
    """SdpaAttention.expand_kv_with_mask_on (a masked GQA call with its keys and values expanded to every head, for
    CUDA's memory-efficient kernel) on this device type: outputs and gradients those of SDPA's own GQA, and the
    call SDPA got was the expanded one (every head's keys, no enable_gqa)."""
    import torch.nn.functional as F

    from megatron_gtpo.models import sdpa_attention
    from megatron_gtpo.models.sdpa_attention import additive_mask

    sq, sk, batch, given, _ = CASES[case]
    if form == "additive":
        given = additive_mask(given, torch.float64)
    q, k, v = _qkv(sq, sk, batch)
    weights = torch.randn(sq, batch, HEADS * HEAD_DIM, dtype=torch.float64)
    native = sdpa(q, k, v, given)
    native_grads = torch.autograd.grad((native * weights).sum(), (q, k, v))
    calls = []

    def spy(query, key, value, **kwargs):
        calls.append((key.shape[1], kwargs["enable_gqa"]))
        return F.scaled_dot_product_attention(query, key, value, **kwargs)

    monkeypatch.setattr(sdpa, "expand_kv_with_mask_on", frozenset({q.device.type}))
    monkeypatch.setattr(sdpa_attention, "F", types.SimpleNamespace(scaled_dot_product_attention=spy))
    expanded = sdpa(q, k, v, given)
    assert calls == [(HEADS, False)]
    assert torch.allclose(expanded, native, rtol=0, atol=1e-12), case
    for ours, theirs in zip(torch.autograd.grad((expanded * weights).sum(), (q, k, v)), native_grads):
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-12), case
