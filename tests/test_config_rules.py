"""The rules between features (config_rules.CROSS_FEATURE_RULES), row by row: a configuration that breaks exactly one
rule gets exactly its message, and the nearest configuration that does not break it loads. And the engines' own
sections: rollout.engine alone switches engines, and only the selected engine's section is read."""
import pytest

from megatron_gtpo.config import ConfigError, features, load_config, parse_config
from megatron_gtpo.config_rules import CROSS_FEATURE_RULES, refused_by
from megatron_gtpo.engine_table import ENGINE_NAMES

TINY = ["model.tiny_synthetic=true", "data.source=synthetic"]
JSONL = ["model.hf_dir=/hf", "data.source=jsonl", "data.path=p.jsonl"]
REMOTE = ["rollout.engine=builtin_remote", "rollout.remote.addresses=[h:1]"]
CORRECTION = "algorithm.rollout_correction.rollout_is=token"
PARTIAL = ["rollout.schedule.partial_rollouts=true", "rollout.max_new_tokens=8",
           "rollout.schedule.partial_segment_tokens=2"]

# Per row (by name): the overrides that break it, and the change that makes them load.
EXAMPLES = {
    "vllm needs a Hugging Face directory": (["model.load=/ckpt", "data.source=synthetic", "rollout.engine=vllm"],
                                            ["rollout.vllm.hf_dir=/hf"]),
    "staleness needs engines of their own": (TINY + ["rollout.schedule.max_staleness=1", CORRECTION],
                                             ["rollout.engine=builtin_remote", "rollout.remote.addresses=[h:1]"]),
    "staleness needs the rollout correction": (TINY + ["rollout.schedule.max_staleness=1",
                                                       "rollout.engine=builtin_remote",
                                                       "rollout.remote.addresses=[h:1]"],
                                               [CORRECTION]),
    "partial rollouts without routing replay": (TINY + PARTIAL + [CORRECTION,
                                                                  "model.moe.routing_replay=rollout"],
                                                ["model.moe.routing_replay=none"]),
    "partial rollouts need dynamic sampling": (TINY + PARTIAL + [CORRECTION, "algorithm.name=grpo"],
                                               ["algorithm.dynamic_sampling=true"]),
    "partial rollouts need the rollout correction": (TINY + PARTIAL, [CORRECTION]),
    "updates during generation need rollout servers": (
        TINY + ["rollout.schedule.update_during_generation=true"],
        REMOTE + ["rollout.schedule.max_staleness=1", CORRECTION]),
    "updates during generation need staleness": (TINY + REMOTE + ["rollout.schedule.update_during_generation=true"],
                                                 ["rollout.schedule.max_staleness=1", CORRECTION]),
    "updates during generation without routing replay": (
        TINY + REMOTE + ["rollout.schedule.update_during_generation=true", "rollout.schedule.max_staleness=1",
                         CORRECTION, "model.moe.routing_replay=rollout"],
        ["model.moe.routing_replay=none"]),
    "rounds ahead need dynamic sampling": (
        TINY + REMOTE + ["rollout.schedule.rounds_ahead=1", "rollout.schedule.max_staleness=1", CORRECTION,
                         "algorithm.name=grpo"], ["algorithm.dynamic_sampling=true"]),
    "rounds ahead within the rounds a step may take": (
        TINY + REMOTE + ["rollout.schedule.rounds_ahead=3", "rollout.schedule.max_staleness=1", CORRECTION,
                         "algorithm.max_resample_rounds=2"], ["algorithm.max_resample_rounds=3"]),
    "routing replay needs CP = 1": (TINY + ["parallel.context=2", "model.moe.routing_replay=rollout",
                                            "rollout.engine=vllm_remote", "rollout.remote.addresses=[h:1]"],
                                    ["model.moe.routing_replay=none"]),
    "no built-in engine in the trainer at CP > 1": (TINY + ["parallel.context=2"],
                                 ["rollout.engine=builtin_remote", "rollout.remote.addresses=[h:1]"]),
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
        load_config(None, TINY + ["rollout.schedule.max_staleness=2", CORRECTION])
    assert str(error.value) == ("rollout.schedule.max_staleness: 2 needs engines on processes of their own that "
                                "generate while the trainer trains (vllm_remote or builtin_remote); the builtin engine "
                                "shares the trainer's")


# One configuration with every engine's section set: rollout.engine alone picks which one is read.
EVERY_SECTION = ["model.hf_dir=/hf", "data.source=jsonl", "data.path=p.jsonl", "rollout.builtin.max_batch_tokens=4096",
                 "rollout.vllm.gpu_memory_utilization=0.8", "rollout.vllm.kv_cache_memory_bytes=1000000",
                 "rollout.vllm.tensor_parallel=2", "rollout.remote.addresses=[h:1]",
                 "rollout.remote.connect_timeout_s=5", "rollout.remote.request_timeout_s=5",
                 "rollout.remote.reconnect_timeout_s=5"]


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_switching_the_engine_needs_no_other_change(engine):
    cfg = load_config(None, [*EVERY_SECTION, f"rollout.engine={engine}"])
    assert (cfg.rollout.engine, cfg.rollout.vllm.tensor_parallel, cfg.rollout.remote.addresses) == (engine, 2, ["h:1"])


@pytest.mark.parametrize("engine, section", [("builtin", "vllm"), ("vllm", "remote"), ("vllm_remote", "builtin")])
def test_the_section_of_an_engine_not_selected_is_not_read(engine, section):
    """A value the section's own check refuses loads where another engine is selected, and is refused, naming it,
    where its engine is."""
    bad = {"vllm": "rollout.vllm.gpu_memory_utilization=1.5", "remote": "rollout.remote.reconnect_timeout_s=-1",
           "builtin": "rollout.builtin.max_batch_tokens=8"}[section]
    load_config(None, [*EVERY_SECTION, f"rollout.engine={engine}", bad])
    own = {"builtin": "builtin", "vllm": "vllm", "remote": "vllm_remote"}[section]
    with pytest.raises(ConfigError, match=f"^{bad.split('=')[0]}: "):
        load_config(None, [*EVERY_SECTION, f"rollout.engine={own}", bad])
