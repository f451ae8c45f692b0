"""The rules between features (config_rules.CROSS_FEATURE_RULES), row by row, and the rollout options an engine
ignores (config_rules.ENGINE_OPTIONS), option by option: a configuration that breaks exactly one rule gets exactly its
message, and the nearest configuration that does not break it loads."""
import pytest

from megatron_gtpo.config import ConfigError, features, load_config, parse_config
from megatron_gtpo.config_rules import CROSS_FEATURE_RULES, ENGINE_OPTIONS, REMOTE_ENGINES, refused_by

TINY = ["model.tiny_synthetic=true", "data.source=synthetic"]
JSONL = ["model.hf_dir=/hf", "data.source=jsonl", "data.path=p.jsonl"]
REMOTE = ["rollout.engine=builtin_remote", "rollout.remote_addresses=[h:1]"]
PARTIAL = ["rollout.partial_rollouts=true", "rollout.max_new_tokens=8", "rollout.partial_segment_tokens=2"]

# Per row (by name): the overrides that break it, and the change that makes them load.
EXAMPLES = {
    "vllm needs a Hugging Face directory": (["model.load=/ckpt", "data.source=synthetic", "rollout.engine=vllm"],
                                            ["rollout.vllm_hf_dir=/hf"]),
    "staleness needs engines of their own": (TINY + ["rollout.max_staleness=1", "algorithm.rollout_is=token"],
                                             ["rollout.engine=builtin_remote", "rollout.remote_addresses=[h:1]"]),
    "staleness needs the rollout correction": (TINY + ["rollout.max_staleness=1", "rollout.engine=builtin_remote",
                                                       "rollout.remote_addresses=[h:1]"],
                                               ["algorithm.rollout_is=token"]),
    "partial rollouts without routing replay": (TINY + PARTIAL + ["algorithm.rollout_is=token",
                                                                  "algorithm.routing_replay=rollout"],
                                                ["algorithm.routing_replay=none"]),
    "partial rollouts need dynamic sampling": (TINY + PARTIAL + ["algorithm.rollout_is=token", "algorithm.name=grpo"],
                                               ["algorithm.dynamic_sampling=true"]),
    "partial rollouts need the rollout correction": (TINY + PARTIAL, ["algorithm.rollout_is=token"]),
    "updates during generation need rollout servers": (
        TINY + ["rollout.update_during_generation=true"],
        REMOTE + ["rollout.max_staleness=1", "algorithm.rollout_is=token"]),
    "updates during generation need staleness": (TINY + REMOTE + ["rollout.update_during_generation=true"],
                                                 ["rollout.max_staleness=1", "algorithm.rollout_is=token"]),
    "updates during generation without routing replay": (
        TINY + REMOTE + ["rollout.update_during_generation=true", "rollout.max_staleness=1",
                         "algorithm.rollout_is=token", "algorithm.routing_replay=rollout"],
        ["algorithm.routing_replay=none"]),
    "rounds ahead are a count": (TINY + ["rollout.rounds_ahead=-1"], ["rollout.rounds_ahead=0"]),
    "rounds ahead need staleness": (TINY + REMOTE + ["rollout.rounds_ahead=1"],
                                    ["rollout.max_staleness=1", "algorithm.rollout_is=token"]),
    "rounds ahead need dynamic sampling": (
        TINY + REMOTE + ["rollout.rounds_ahead=1", "rollout.max_staleness=1", "algorithm.rollout_is=token",
                         "algorithm.name=grpo"], ["algorithm.dynamic_sampling=true"]),
    "rounds ahead within the rounds a step may take": (
        TINY + REMOTE + ["rollout.rounds_ahead=3", "rollout.max_staleness=1", "algorithm.rollout_is=token",
                         "algorithm.max_resample_rounds=2"], ["algorithm.max_resample_rounds=3"]),
    "routing replay needs CP = 1": (TINY + ["parallel.context=2", "algorithm.routing_replay=rollout",
                                            "rollout.engine=vllm_remote", "rollout.remote_addresses=[h:1]"],
                                    ["algorithm.routing_replay=none"]),
    "no built-in engine in the trainer at CP > 1": (TINY + ["parallel.context=2"],
                                 ["rollout.engine=builtin_remote", "rollout.remote_addresses=[h:1]"]),
    "the tiny model needs the synthetic task": (TINY + ["data.source=jsonl", "data.path=p.jsonl"],
                                                ["model.tiny_synthetic=false", "model.hf_dir=/hf"]),
    "the warm start needs the synthetic task": (JSONL + ["warm_start.steps=5"], ["warm_start.steps=0"]),
    "the high-entropy fraction needs a token-level loss": (
        TINY + ["algorithm.name=grpo_s", "algorithm.entropy_token_fraction=0.2"], ["algorithm.name=gtpo"]),
    "KL-Cov has no PPO clip": (TINY + ["algorithm.name=kl_cov", "algorithm.eps_high=0.28"],
                               ["algorithm.name=clip_cov"]),
}


def test_every_rule_has_its_examples():
    names = [rule.name for rule in CROSS_FEATURE_RULES]
    assert len(set(names)) == len(names)
    assert sorted(EXAMPLES) == sorted(names)


@pytest.mark.parametrize("rule", CROSS_FEATURE_RULES, ids=lambda rule: rule.name)
def test_each_rule_refuses_with_its_message_and_only_where_it_applies(rule):
    broken, fix = EXAMPLES[rule.name]
    assert refused_by(features(parse_config(None, broken))) == [rule]
    with pytest.raises(ConfigError) as error:
        load_config(None, broken)
    assert str(error.value) == rule.render(features(parse_config(None, broken)))
    assert refused_by(features(load_config(None, broken + fix))) == []


def test_a_rule_message_fills_in_the_configuration():
    with pytest.raises(ConfigError) as error:
        load_config(None, TINY + ["rollout.max_staleness=2", "algorithm.rollout_is=token"])
    assert str(error.value) == ("rollout.max_staleness: 2 needs engines on processes of their own that generate while "
                                "the trainer trains (vllm_remote or builtin_remote); the builtin engine shares the "
                                "trainer's")


ENGINES = {"builtin": TINY, "vllm": ["model.hf_dir=/hf", "data.source=synthetic"],
           **{engine: TINY + ["rollout.remote_addresses=[h:1]"] for engine in REMOTE_ENGINES}}
# A value other than the default, for each option of ENGINE_OPTIONS.
OTHER_VALUES = {"builtin_max_batch_tokens": "4096", "vllm_gpu_memory_utilization": "0.8",
                "vllm_kv_cache_memory_bytes": "1000000", "vllm_hf_dir": "/hf", "vllm_tensor_parallel": "2",
                "remote_addresses": "[h:1, h:2]", "remote_connect_timeout_s": "5", "remote_request_timeout_s": "5",
                "remote_reconnect_timeout_s": "5"}


def test_every_engine_option_has_a_value_to_try():
    assert sorted(OTHER_VALUES) == sorted(option.name for option in ENGINE_OPTIONS)


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("option", ENGINE_OPTIONS, ids=lambda option: option.name)
def test_an_engine_option_acts_or_is_refused_by_name(option, engine):
    base = ENGINES[engine] + [f"rollout.engine={engine}"]
    load_config(None, base)  # the defaults work with every engine
    overrides = base + [f"rollout.{option.name}={OTHER_VALUES[option.name]}"]
    if engine in option.engines:
        assert getattr(load_config(None, overrides).rollout, option.name) is not None
        return
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    message = str(error.value)
    assert message.startswith(f"rollout.{option.name}: acts with rollout.engine ") and f"the {engine} engine" in message
    assert ("remote_server" in message) == (engine == option.server_engine), message
    if engine == option.server_engine:
        assert option.server_flag in message


def test_a_remote_server_owns_its_batch_size():
    with pytest.raises(ConfigError) as error:
        load_config(None, ENGINES["builtin_remote"] + ["rollout.engine=builtin_remote",
                                                       "rollout.builtin_max_batch_tokens=4096"])
    assert str(error.value) == (
        "rollout.builtin_max_batch_tokens: acts with rollout.engine builtin only, and the builtin_remote engine would "
        "ignore it; a builtin_remote server takes it from its own command line (python -m "
        "megatron_gtpo.rollout.remote_server --max-batch-tokens); leave it at its default None")
