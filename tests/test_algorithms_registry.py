"""The algorithm registry (names -> one entry, resolved once against the config) and the import rules of
algorithms/."""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest
import torch

import megatron_gtpo.algorithms as algorithms
from megatron_gtpo.algorithms import (
    ALGORITHM_NAMES,
    ALGORITHMS,
    Algorithm,
    PPOClip,
    configure_algorithm,
    grpo_advantages,
    grpo_s_advantages,
    gtpo_advantages,
    resolve_algorithm,
    sequence_policy_loss,
    token_policy_loss,
)


def _batch(seed=0, N=3, G=4, T=6):
    gen = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(N, G, generator=gen) < 0.5).double()
    entropy = 2 * torch.rand(N, G, T, generator=gen, dtype=torch.float64)
    mask = torch.arange(T) < torch.randint(1, T + 1, (N, G), generator=gen).unsqueeze(-1)
    return rewards, entropy, mask


def test_entries_follow_the_papers():
    grpo, dapo, gtpo, grpo_s = (ALGORITHMS[a] for a in (Algorithm.GRPO, Algorithm.DAPO, Algorithm.GTPO,
                                                         Algorithm.GRPO_S))
    assert grpo.loss_defaults == dict(clip=PPOClip(0.2, 0.2), loss_agg_mode="seq-mean-token-mean")
    assert dapo.loss_defaults == dict(clip=PPOClip(0.2, 0.28), loss_agg_mode="token-mean")
    assert dapo.dynamic_sampling and dapo.length_penalty == "overlong" and not grpo.dynamic_sampling
    assert gtpo.loss_defaults == dict(clip=PPOClip(0.2, 0.28), loss_agg_mode="token-mean")
    assert gtpo.advantages is gtpo_advantages and gtpo.uses_entropy and not gtpo.sequence_level_loss
    assert grpo_s.sequence_level_loss and grpo_s.advantages is grpo_s_advantages
    assert grpo.advantages is dapo.advantages is grpo_advantages and not grpo.uses_entropy
    clip_cov, kl_cov = ALGORITHMS[Algorithm.CLIP_COV], ALGORITHMS[Algorithm.KL_COV]
    assert clip_cov.advantages is kl_cov.advantages is grpo_advantages  # DAPO's, with dynamic sampling
    assert clip_cov.dynamic_sampling and kl_cov.dynamic_sampling
    assert clip_cov.loss_defaults == dapo.loss_defaults and clip_cov.covariance_selection == "clip"
    assert kl_cov.loss_defaults == dict(clip=None, loss_agg_mode="token-mean")
    assert kl_cov.covariance_selection == "kl" and kl_cov.loss_options == {"kl_cov_coef": "coef"}


def test_the_covariance_and_entropy_selections_are_bound_from_the_config():
    from megatron_gtpo.config import AlgorithmConfig

    defaults = AlgorithmConfig()  # the paper's recipes (verl recipe/entropy): 2e-4 in (1, 5); 2e-3 with coef 1
    assert (defaults.clip_cov.ratio, defaults.clip_cov.lb, defaults.clip_cov.ub) == (2e-4, 1.0, 5.0)
    assert (defaults.kl_cov.ratio, defaults.kl_cov.coef, defaults.entropy_token_fraction) == (2e-3, 1.0, None)
    assert _configured("dapo").select_tokens is None and _configured("gtpo").select_tokens is None
    K = 400
    gen = torch.Generator().manual_seed(0)
    a, lp, h, keys = torch.randn(K, generator=gen), -torch.rand(K, generator=gen), torch.rand(K, generator=gen), \
        torch.rand(K, generator=gen, dtype=torch.float64)
    from megatron_gtpo.algorithms.token_selection import select_tokens

    def same(got, expected):
        assert got.keep_K.tolist() == expected.keep_K.tolist() and got.metrics.keys() == expected.metrics.keys()
        assert (got.penalise_K is None) == (expected.penalise_K is None)
        if got.penalise_K is not None:
            assert got.penalise_K.tolist() == expected.penalise_K.tolist()

    same(_configured("clip_cov", "algorithm.clip_cov.lb=0.1").select_tokens(a, lp, h, keys),
         select_tokens(a, lp, h, keys, clip_cov=(2e-4, 0.1, 5.0)))
    same(_configured("kl_cov", "algorithm.kl_cov.ratio=0.1", "algorithm.entropy_token_fraction=0.2").select_tokens(
        a, lp, h, keys), select_tokens(a, lp, h, keys, kl_cov_ratio=0.1, entropy_token_fraction=0.2))
    same(_configured("gtpo", "algorithm.entropy_token_fraction=0.5").select_tokens(a, lp, h, keys),
         select_tokens(a, lp, h, keys, entropy_token_fraction=0.5))


@pytest.mark.parametrize("name", ["gtpo", "grpo_s"])
@pytest.mark.parametrize("scope", ["batch", "group"])
def test_a_group_without_both_outcomes_gets_no_entropy_noise(name, scope):
    """Dynamic sampling off: the paper's formulas shape an all-correct (all-failed) group into the z-score of its
    entropies alone, at full advantage scale. The project gives its tokens 0 (as GRPO's z-score does) and shapes the
    other groups as if it were not there (as if dynamic sampling had dropped it)."""
    rewards, entropy, mask = _batch(5, N=4)
    rewards[0], rewards[1, :2], rewards[1, 2:], rewards[2] = 1.0, 1.0, 0.0, 0.0  # 0 all correct, 2 all failed
    rewards[3, 0], rewards[3, 1:] = 1.0, 0.0
    configured = _configured(name, *([f"algorithm.gtpo.norm_scope={scope}"] if name == "gtpo" else []),
                             "algorithm.dynamic_sampling=false")
    assert configured.dynamic_sampling is False
    got = configured.advantages(rewards, entropy, mask)
    kept = torch.tensor([1, 3])
    fn = gtpo_advantages if name == "gtpo" else grpo_s_advantages
    paper = fn(rewards, entropy, mask, **({"norm_scope": scope} if name == "gtpo" else {}))
    assert paper[0].abs().max() > 0.5 and paper[2].abs().max() > 0.5  # the formula's entropy noise, at unit scale
    assert (got[0] == 0).all() and (got[2] == 0).all()
    torch.testing.assert_close(got[kept], fn(rewards[kept], entropy[kept], mask[kept],
                                             **({"norm_scope": scope} if name == "gtpo" else {})))
    none_informative = configured.advantages(rewards[[0, 2]], entropy[[0, 2]], mask[[0, 2]])
    assert none_informative.shape == paper[[0, 2]].shape and (none_informative == 0).all()


@pytest.mark.parametrize("name, expected", [("grpo", Algorithm.GRPO), ("DAPO", Algorithm.DAPO),
                                            ("gtpo", Algorithm.GTPO), ("grpo-s", Algorithm.GRPO_S),
                                            ("grpo_s", Algorithm.GRPO_S), (Algorithm.GTPO, Algorithm.GTPO)])
def test_resolve_algorithm_by_name(name, expected):
    assert resolve_algorithm(name) is expected


def test_resolve_unknown_algorithm_raises():
    with pytest.raises(ValueError, match="unknown algorithm 'ppo'"):
        resolve_algorithm("ppo")


def test_config_choices_are_the_registry_names():
    from megatron_gtpo.config import _CHOICES

    assert _CHOICES["algorithm.name"] == ALGORITHM_NAMES == ("gtpo", "grpo_s", "grpo", "dapo", "clip_cov", "kl_cov")


def _configured(name, *overrides):
    from megatron_gtpo.config import load_config

    cfg = load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", f"algorithm.name={name}",
                             *overrides])
    return configure_algorithm(cfg.algorithm, max_new_tokens=cfg.rollout.max_new_tokens)


def test_advantages_dispatch_to_the_right_function_with_the_config_scalars():
    rewards, entropy, mask = _batch()
    torch.testing.assert_close(_configured("grpo").advantages(rewards, entropy, mask), grpo_advantages(rewards))
    torch.testing.assert_close(_configured("dapo").advantages(rewards), grpo_advantages(rewards))
    torch.testing.assert_close(
        _configured("gtpo", "algorithm.gtpo.norm_scope=group", "algorithm.gtpo.alpha2=0.3").advantages(
            rewards, entropy, mask),
        gtpo_advantages(rewards, entropy, mask, norm_scope="group", alpha2=0.3))
    torch.testing.assert_close(
        _configured("grpo_s", "algorithm.grpo_s.beta2=0.3", "algorithm.grpo_s.entropy_clip=[0.1, 1.5]").advantages(
            rewards, entropy, mask), grpo_s_advantages(rewards, entropy, mask, beta2=0.3, entropy_clip=(0.1, 1.5)))
    with pytest.raises(ValueError, match="need entropy_NGT and mask_NGT"):
        _configured("gtpo").advantages(rewards)


def _loss_inputs(batch_seed: int, logprob_seed: int):
    """A batch flattened to [B, T] with old / new log-probs and GRPO's per-sequence advantages, float64."""
    rewards, entropy, mask = _batch(batch_seed)
    B, T = mask.shape[0] * mask.shape[1], mask.shape[2]
    gen = torch.Generator().manual_seed(logprob_seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64)
    logprobs = old + 0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    return rewards, entropy, mask, mask.reshape(B, T), old, logprobs, grpo_advantages(rewards).reshape(B)


def test_configured_loss_takes_the_config_settings_over_the_defaults():
    rewards, entropy, mask, mask_BT, old, logprobs, adv_B = _loss_inputs(3, 4)
    B = mask_BT.shape[0]
    loss, _ = _configured("grpo_s", "algorithm.eps_high=0.4", "algorithm.grpo_s.sequence_ratio=geometric").policy_loss(
        logprobs, old, adv_B, mask_BT, loss_normalizer=B)
    expected, _ = sequence_policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=B, sequence_ratio="geometric",
                                       clip=PPOClip(0.2, 0.4))
    torch.testing.assert_close(loss, expected)
    assert _configured("grpo").dynamic_sampling is False and _configured("dapo").length_penalty is not None
    assert _configured("grpo", "algorithm.dynamic_sampling=true").dynamic_sampling is True


def test_each_loss_gets_its_algorithm_defaults_and_the_config_settings():
    rewards, entropy, mask, mask_BT, old, logprobs, adv_B = _loss_inputs(1, 2)
    B, T = mask_BT.shape
    adv_BT = gtpo_advantages(rewards, entropy, mask).reshape(B, T)

    loss, _ = _configured("dapo").policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=7.0)
    expected, _ = token_policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=7.0, loss_agg_mode="token-mean",
                                    clip=PPOClip(0.2, 0.28))
    torch.testing.assert_close(loss, expected)
    loss, _ = _configured("grpo").policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=B)
    expected, _ = token_policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=B,
                                    loss_agg_mode="seq-mean-token-mean", clip=PPOClip(0.2, 0.2))
    torch.testing.assert_close(loss, expected)
    assert _configured("grpo").loss_agg_mode == "seq-mean-token-mean"
    gtpo = _configured("gtpo", "algorithm.eps_high=0.4", "algorithm.dual_clip=3.0", "algorithm.entropy_coef=0.01")
    loss, _ = gtpo.policy_loss(logprobs, old, adv_BT, mask_BT, loss_normalizer=9.0, entropy_BT=-old)
    expected, _ = token_policy_loss(logprobs, old, adv_BT, mask_BT, loss_normalizer=9.0, clip=PPOClip(0.2, 0.4, 3.0),
                                    entropy_BT=-old, entropy_coef=0.01)
    torch.testing.assert_close(loss, expected)
    loss, _ = _configured("grpo_s").policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=B)
    expected, _ = sequence_policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=B, clip=PPOClip(0.2, 0.28))
    torch.testing.assert_close(loss, expected)


# Values off the defaults for every option of an algorithm's own section (strong enough to change what it computes).
OFF_DEFAULT = {"alpha1": 2.0, "alpha2": 0.5, "norm_scope": "group", "entropy_clip": (0.5, 1.0), "beta1": 2.0,
               "beta2": 0.5, "sequence_ratio": "geometric", "ratio": 0.5, "lb": -5.0, "ub": 6.0, "coef": 3.0}


def _computed(configured, seed=0) -> list[torch.Tensor]:
    """What a configured algorithm computes on one batch: its advantages, its loss, its token selection if any."""
    rewards, entropy, mask, mask_BT, old, logprobs, adv_B = _loss_inputs(seed, seed + 1)
    penalise_BT = torch.rand(mask_BT.shape, generator=torch.Generator().manual_seed(seed)) < 0.3
    tensors = {"kl_penalty_BT": penalise_BT} if configured.algorithm is Algorithm.KL_COV else {}
    loss, _ = configured.policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=7.0, **tensors)
    computed = [configured.advantages(rewards, entropy, mask), loss]
    if configured.select_tokens is not None:
        keys_K = torch.rand(int(mask_BT.sum()), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        selected = configured.select_tokens(adv_B[:, None].expand_as(mask_BT)[mask_BT], old[mask_BT],
                                            entropy.reshape(mask_BT.shape)[mask_BT], keys_K)
        computed += [selected.keep_K, selected.penalise_K]
    return computed


@pytest.mark.parametrize("name", ALGORITHM_NAMES)
def test_an_algorithm_reads_its_own_section_and_no_other(name):
    """configure_algorithm binds an algorithm's options from algorithm.<name> alone: every other algorithm's section
    set off its defaults (a config validation refuses, built here directly) changes nothing it computes, and its own
    section's values reach its functions."""
    from megatron_gtpo.config import ALGORITHM_SECTIONS, AlgorithmConfig

    def off(section):
        return dataclasses.replace(section, **{key: OFF_DEFAULT[key] for key in section.__dataclass_fields__})

    plain = AlgorithmConfig(name=name)
    expected = _computed(configure_algorithm(plain, max_new_tokens=6))
    others = AlgorithmConfig(name=name, **{s: off(getattr(plain, s)) for s in ALGORITHM_SECTIONS if s != name})
    for got, want in zip(_computed(configure_algorithm(others, max_new_tokens=6)), expected, strict=True):
        torch.testing.assert_close(got, want)
    if name in ALGORITHM_SECTIONS:
        own = AlgorithmConfig(name=name, **{name: off(getattr(plain, name))})
        assert any(not torch.equal(got, want)
                   for got, want in zip(_computed(configure_algorithm(own, max_new_tokens=6)), expected))


def test_kl_cov_takes_its_coefficient_from_its_section():
    rewards, entropy, mask, mask_BT, old, logprobs, adv_B = _loss_inputs(5, 6)
    penalise_BT = torch.rand(mask_BT.shape, generator=torch.Generator().manual_seed(0)) < 0.3
    loss, _ = _configured("kl_cov", "algorithm.kl_cov.coef=3.0").policy_loss(
        logprobs, old, adv_B, mask_BT, loss_normalizer=7.0, kl_penalty_BT=penalise_BT)
    expected, _ = token_policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=7.0, clip=None,
                                    kl_penalty_BT=penalise_BT, kl_cov_coef=3.0)
    torch.testing.assert_close(loss, expected)


def test_the_sections_named_after_algorithms_hold_what_their_entries_take():
    from megatron_gtpo.config import ALGORITHM_SECTIONS, AlgorithmConfig

    takes_options = {a.value for a, e in ALGORITHMS.items()
                     if e.advantage_options or e.loss_options or e.covariance_selection}
    assert set(ALGORITHM_SECTIONS) == takes_options == {"gtpo", "grpo_s", "clip_cov", "kl_cov"}
    for name in ALGORITHM_SECTIONS:
        entry, fields = ALGORITHMS[Algorithm(name)], getattr(AlgorithmConfig(), name).__dataclass_fields__
        assert set(entry.advantage_options) | set(entry.loss_options.values()) <= set(fields)


FORBIDDEN_IMPORTS = ("torch.distributed", "megatron", "vllm", "transformer_engine", "megatron_gtpo.config")
ALLOWED_TOP_LEVEL = {"__future__", "torch", "typing", "dataclasses", "enum", "functools", "logging", "math",
                     "megatron_gtpo"}


def test_algorithms_import_only_torch_and_the_standard_library():
    package_dir = pathlib.Path(algorithms.__file__).parent
    sources = sorted(package_dir.glob("*.py"))
    assert len(sources) >= 6
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert not any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN_IMPORTS), \
                    f"{path.name} imports {name}"
                assert name.split(".")[0] in ALLOWED_TOP_LEVEL, f"{path.name} imports {name}"
                if name.startswith("megatron_gtpo"):
                    assert name.startswith("megatron_gtpo.algorithms"), f"{path.name} imports {name}"
