"""The [N, G, T] passes of GTPO / GRPO-S (algorithms/token_passes.py): the native CPU kernels and the torch ops
against each other and against float64 references, and whole advantages through each path against the float64
loop reference of test_algorithms_advantages.py.

Shapes are chosen so that T is not a multiple of any vector width (the kernels' tail loops run), with single-row
groups, empty rows, all-correct / all-failed groups, NaN / inf / huge values at padding, and non-contiguous inputs.
Tolerance for float32: 2e-5 relative to the scale of each output.
"""
from __future__ import annotations

import pytest
import torch

import megatron_gtpo.algorithms.token_passes as token_passes
from megatron_gtpo.algorithms import grpo_s_advantages, gtpo_advantages, gtpo_token_rewards
from test_algorithms_advantages import _dense_from_dict, _random_batch, reference_grpo_s, reference_gtpo

SHAPES = [(3, 5, 37), (2, 1, 9), (4, 8, 64), (1, 3, 1)]
CLIPS = [None, (0.3, 2.0)]
EPS, ALPHA2 = 1e-8, 0.1


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """Runs a test once through the native kernels and once through the torch ops (float32 inputs on CPU)."""
    if request.param == "torch":
        monkeypatch.setattr(token_passes, "_use_native", lambda entropy: False)
    return request.param


def test_native_kernels_are_built():
    """setup.py builds them wherever a C compiler exists (it is optional only so that an install never fails);
    on the machines this project tests on, a missing build is a bug, not a fallback."""
    assert token_passes.native_available(), token_passes._NATIVE_MISSING


def _inputs(seed, shape, *, garbage_padding=True):
    N, G, T = shape
    rewards, entropy, mask, _ = _random_batch(seed, N=N, G=G, T=T, dtype=torch.float32)
    if G > 1:
        rewards[0] = 1.0  # an all-correct group
    if garbage_padding:
        junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -3.0])
        entropy = torch.where(mask, entropy, junk[torch.arange(mask.numel()) % 5].view(mask.shape))
    return rewards, entropy, mask, rewards != 1


def _reference_weights_f64(entropy, mask, failed, clip):
    low, high = (0.0, float("inf")) if clip is None else clip
    h = entropy.double().clamp(low, high)
    return torch.where(mask, torch.where(failed.unsqueeze(-1), 1 / (h + EPS), h), 0.0)


def _assert_close_scaled(got, expected, rtol=2e-5):
    scale = expected.abs().max().clamp(min=1.0)
    torch.testing.assert_close(got.double(), expected, atol=rtol * float(scale), rtol=rtol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("clip", CLIPS)
def test_shaping_moments_against_float64(path, shape, clip):
    for seed in range(3):
        rewards, entropy, mask, failed = _inputs(seed, shape)
        coef, moments = token_passes.shaping_moments(entropy, mask, failed, alpha2=ALPHA2, entropy_clip=clip, eps=EPS,
                                                     dtype=torch.float32)
        assert coef.dtype == torch.float32 and moments.dtype == torch.float64
        w = _reference_weights_f64(entropy, mask, failed, clip)
        for k, rows in enumerate((~failed, failed)):
            sel = rows.unsqueeze(-1).double()
            count, total, total_sq = ((sel * mask).sum(1), (sel * w).sum(1), (sel * w * w).sum(1))
            expected_coef = ALPHA2 * count / (total + EPS)
            _assert_close_scaled(coef[:, k], expected_coef)
            bonus = w * expected_coef.unsqueeze(1) * sel  # the bonus of every type-k token
            _assert_close_scaled(moments[:, 0, k], count.sum(-1), rtol=0)
            _assert_close_scaled(moments[:, 1, k], bonus.sum((1, 2)))
            _assert_close_scaled(moments[:, 2, k], bonus.square().sum((1, 2)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("clip", CLIPS)
def test_apply_affine_against_float64(path, shape, clip):
    N, G, T = shape
    gen = torch.Generator().manual_seed(5)
    for seed in range(3):
        rewards, entropy, mask, failed = _inputs(10 + seed, shape)
        coef = torch.rand(N, 2, T, generator=gen)
        slope, intercept = torch.randn(N, 2, generator=gen), torch.randn(N, 2, generator=gen)
        got = token_passes.apply_affine(entropy, mask, failed, coef, slope, intercept, entropy_clip=clip, eps=EPS,
                                        dtype=torch.float32)
        k = failed.long()
        rows_coef = torch.gather(coef.double(), 1, k.unsqueeze(-1).expand(N, G, T))
        w = _reference_weights_f64(entropy, mask, failed, clip)
        expected = (w * rows_coef * slope.double().gather(1, k).unsqueeze(-1)
                    + intercept.double().gather(1, k).unsqueeze(-1))
        expected = torch.where(mask, expected, 0.0)
        assert got.dtype == torch.float32 and (got[~mask] == 0).all()
        _assert_close_scaled(got, expected)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("clip", CLIPS)
def test_row_sums_against_float64(path, shape, clip):
    rewards, entropy, mask, _ = _inputs(20, shape)
    length, total = token_passes.row_sums(entropy, mask, entropy_clip=clip, dtype=torch.float32)
    low, high = (0.0, float("inf")) if clip is None else clip
    torch.testing.assert_close(length.double(), mask.sum(-1).double(), atol=0, rtol=0)
    _assert_close_scaled(total, torch.where(mask, entropy.double().clamp(low, high), 0.0).sum(-1))


@pytest.mark.parametrize("norm_scope", ["batch", "group"])
@pytest.mark.parametrize("clip", CLIPS)
def test_advantages_through_each_path_match_the_loop_reference(path, norm_scope, clip):
    for seed in range(4):
        rewards, entropy, mask, lengths = _random_batch(300 + seed, N=4, G=6, T=29, dtype=torch.float32)
        got = gtpo_advantages(rewards, entropy, mask, norm_scope=norm_scope, entropy_clip=clip)
        ref = reference_gtpo(rewards.double().tolist(), entropy.double().tolist(), lengths.tolist(), alpha1=1.0,
                             alpha2=ALPHA2, norm_scope=norm_scope, entropy_clip=clip, eps=EPS)
        _assert_close_scaled(got, _dense_from_dict(ref, mask.shape))
        ref_s = reference_grpo_s(rewards.double().tolist(), entropy.double().tolist(), lengths.tolist(), beta1=1.0,
                                 beta2=0.1, entropy_clip=clip, eps=EPS)
        _assert_close_scaled(grpo_s_advantages(rewards, entropy, mask, entropy_clip=clip),
                             torch.tensor(ref_s, dtype=torch.float64))


def test_native_and_torch_paths_agree_and_keep_nan_semantics(monkeypatch):
    rewards, entropy, mask, _ = _inputs(40, (5, 7, 45))
    results = {}
    for name, use_native in (("native", True), ("torch", False)):
        monkeypatch.setattr(token_passes, "_use_native", lambda e, use_native=use_native: use_native)
        poisoned = entropy.clone()
        poisoned[1, 2, 0] = float("nan")  # a valid token
        assert mask[1, 2, 0]
        results[name] = [gtpo_advantages(rewards, entropy, mask), gtpo_token_rewards(rewards, entropy, mask),
                         grpo_s_advantages(rewards, entropy, mask),
                         gtpo_advantages(rewards, poisoned, mask), grpo_s_advantages(rewards, poisoned, mask)]
    for got, expected in zip(results["native"][:3], results["torch"][:3]):
        assert torch.isfinite(got).all()
        _assert_close_scaled(got, expected.double())
    for name, result in results.items():
        assert torch.isnan(result[3]).any() and torch.isnan(result[4]).any(), name


def test_non_contiguous_and_bfloat16_inputs():
    rewards, entropy, mask, _ = _inputs(50, (3, 4, 40), garbage_padding=False)
    wide = torch.zeros(3, 4, 80)
    wide[..., ::2] = entropy  # a strided view holding the same values
    strided = wide[..., ::2]
    assert not strided.is_contiguous()
    expected = gtpo_advantages(rewards, entropy.contiguous(), mask)
    torch.testing.assert_close(gtpo_advantages(rewards, strided, mask), expected, atol=0, rtol=0)
    bf16 = entropy.to(torch.bfloat16)
    got = gtpo_advantages(rewards, bf16, mask)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, gtpo_advantages(rewards, bf16.float(), mask), atol=0, rtol=0)


def test_native_path_refuses_what_its_raw_pointers_cannot_read():
    rewards, entropy, mask, failed = _inputs(60, (2, 3, 8))
    with pytest.raises(ValueError, match="same device"):
        token_passes.shaping_moments(entropy, mask.to("meta"), failed, alpha2=ALPHA2, entropy_clip=None, eps=EPS,
                                     dtype=torch.float32)
    with pytest.raises(ValueError, match="failed_NG must have shape"):
        token_passes.shaping_moments(entropy, mask, failed[:, :2], alpha2=ALPHA2, entropy_clip=None, eps=EPS,
                                     dtype=torch.float32)
    coef, _ = token_passes.shaping_moments(entropy, mask, failed, alpha2=ALPHA2, entropy_clip=None, eps=EPS,
                                           dtype=torch.float32)
    with pytest.raises(ValueError, match="coef_N2T must have shape"):
        token_passes.apply_affine(entropy, mask, failed, coef[:, :, :4], torch.ones(2, 2), torch.zeros(2, 2),
                                  entropy_clip=None, eps=EPS, dtype=torch.float32)
