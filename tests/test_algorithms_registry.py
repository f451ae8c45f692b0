"""The algorithm registry (names -> one entry, resolved once against the config) and the import rules of
algorithms/."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import megatron_gtpo.algorithms as algorithms
from megatron_gtpo.algorithms import (
    ALGORITHM_NAMES,
    ALGORITHMS,
    Algorithm,
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
    assert grpo.loss_defaults == dict(eps_low=0.2, eps_high=0.2, loss_agg_mode="seq-mean-token-mean")
    assert dapo.loss_defaults == dict(eps_low=0.2, eps_high=0.28, loss_agg_mode="token-mean")
    assert dapo.dynamic_sampling and dapo.length_penalty == "overlong" and not grpo.dynamic_sampling
    assert gtpo.loss_defaults == dict(eps_low=0.2, eps_high=0.28, loss_agg_mode="token-mean")
    assert gtpo.advantages is gtpo_advantages and gtpo.uses_entropy and not gtpo.sequence_level_loss
    assert grpo_s.sequence_level_loss and grpo_s.advantages is grpo_s_advantages
    assert grpo.advantages is dapo.advantages is grpo_advantages and not grpo.uses_entropy


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

    assert _CHOICES["algorithm.name"] == ALGORITHM_NAMES == ("gtpo", "grpo_s", "grpo", "dapo")


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
        _configured("gtpo", "algorithm.norm_scope=group", "algorithm.alpha2=0.3").advantages(rewards, entropy, mask),
        gtpo_advantages(rewards, entropy, mask, norm_scope="group", alpha2=0.3))
    torch.testing.assert_close(
        _configured("grpo_s", "algorithm.beta2=0.3", "algorithm.entropy_clip=[0.1, 1.5]").advantages(
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
    loss, _ = _configured("grpo_s", "algorithm.eps_high=0.4", "algorithm.sequence_ratio=geometric").policy_loss(
        logprobs, old, adv_B, mask_BT, loss_normalizer=B)
    expected, _ = sequence_policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=B, sequence_ratio="geometric",
                                       eps_low=0.2, eps_high=0.4)
    torch.testing.assert_close(loss, expected)
    assert _configured("grpo").dynamic_sampling is False and _configured("dapo").length_penalty is not None
    assert _configured("grpo", "algorithm.dynamic_sampling=true").dynamic_sampling is True


def test_each_loss_gets_its_algorithm_defaults_and_the_config_settings():
    rewards, entropy, mask, mask_BT, old, logprobs, adv_B = _loss_inputs(1, 2)
    B, T = mask_BT.shape
    adv_BT = gtpo_advantages(rewards, entropy, mask).reshape(B, T)

    loss, _ = _configured("dapo").policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=7.0)
    expected, _ = token_policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=7.0, loss_agg_mode="token-mean",
                                    eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(loss, expected)
    loss, _ = _configured("grpo").policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=B)
    expected, _ = token_policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=B,
                                    loss_agg_mode="seq-mean-token-mean", eps_low=0.2, eps_high=0.2)
    torch.testing.assert_close(loss, expected)
    assert _configured("grpo").loss_agg_mode == "seq-mean-token-mean"
    gtpo = _configured("gtpo", "algorithm.eps_high=0.4", "algorithm.dual_clip=3.0", "algorithm.entropy_coef=0.01")
    loss, _ = gtpo.policy_loss(logprobs, old, adv_BT, mask_BT, loss_normalizer=9.0, entropy_BT=-old)
    expected, _ = token_policy_loss(logprobs, old, adv_BT, mask_BT, loss_normalizer=9.0, eps_low=0.2, eps_high=0.4,
                                    dual_clip=3.0, entropy_BT=-old, entropy_coef=0.01)
    torch.testing.assert_close(loss, expected)
    loss, _ = _configured("grpo_s").policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=B)
    expected, _ = sequence_policy_loss(logprobs, old, adv_B, mask_BT, loss_normalizer=B, eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(loss, expected)


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
