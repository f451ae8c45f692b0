"""The typed config: YAML + --set overrides, errors that name the key, example configs load."""
import glob
import os
import sys

import pytest

from megatron_gtpo.config import (
    ALGORITHM_SECTIONS,
    LENGTH_PENALTY_SECTIONS,
    MOVED_KEYS,
    AlgorithmConfig,
    ConfigError,
    TrainConfig,
    load_config,
    save_config,
    validate_layout,
)

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


BASE = "model: {tiny_synthetic: true}\ndata: {source: synthetic}\n"
PARTIAL = ["rollout.schedule.partial_rollouts=true", "rollout.max_new_tokens=8",
           "rollout.schedule.partial_segment_tokens=2"]


def test_overrides_are_typed_and_nested(tmp_path):
    cfg = load_config(_write(tmp_path, BASE), ["optim.lr=3e-4", "parallel.tensor=2",
                                               "algorithm.grpo_s.entropy_clip=[0.2, 2]", "algorithm.name=grpo_s",
                                               "logging.wandb_project=null"])
    assert isinstance(cfg, TrainConfig)
    assert cfg.optim.lr == 3e-4 and cfg.parallel.tensor == 2 and cfg.algorithm.grpo_s.entropy_clip == (0.2, 2.0)
    assert cfg.algorithm.name == "grpo_s" and cfg.logging.wandb_project is None


@pytest.mark.parametrize("text,overrides,message", [
    (BASE + "optim: {lrr: 1}\n", [], "unknown config key optim.lrr"),
    (BASE, ["rollout.bogus=1"], "unknown config key rollout.bogus"),
    (BASE, ["optim.lr=fast"], "optim.lr: expected a number, got 'fast'"),
    (BASE, ["parallel.tensor=1.5"], "parallel.tensor: expected an integer"),
    (BASE, ["algorithm.name=ppo"], "algorithm.name: 'ppo' is not one of gtpo, grpo_s, grpo, dapo, clip_cov, kl_cov"),
    (BASE, ["model.core_attention=flash"], "model.core_attention: must be one of ['sdpa', 'unfused'], got 'flash'"),
    (BASE, ["rollout.num_responses_per_prompt=1"], "group size must be >= 2"),
    (BASE, ["data.prompts_per_step=6", "data.mini_batches_per_step=4"], "must be divisible by"),
    ("data: {source: synthetic}\n", [], "set exactly one of model.hf_dir"),
    (BASE, ["algorithm.gtpo.entropy_clip=[3, 1]"], "algorithm.gtpo.entropy_clip: low must be <= high"),
    (BASE, ["algorithm.name=grpo_s", "algorithm.grpo_s.entropy_clip=[3, 1]"],
     "algorithm.grpo_s.entropy_clip: low must be <= high"),
    (BASE, ["algorithm.gtpo.norm_scope=token"], "algorithm.gtpo.norm_scope: 'token' is not one of batch, group"),
    (BASE, ["data.task=subtraction"],
     "data.task: 'subtraction' is not one of addition, scratchpad_addition, arithmetic_target"),
    (BASE, ["parallel.sequence_parallel=true"], "needs parallel.tensor > 1"),
    (BASE, ["optim.lr"], "expected key=value"),
    (BASE, ["algorithm.kl_coef=-0.1"], "algorithm.kl_coef: must be >= 0"),
    (BASE, ["algorithm.name=clip_cov", "algorithm.clip_cov.ratio=0"], "algorithm.clip_cov.ratio: must be in"),
    (BASE, ["algorithm.entropy_token_fraction=1.5"], "algorithm.entropy_token_fraction: must be in"),
    (BASE, ["algorithm.name=clip_cov", "algorithm.clip_cov.lb=5"],
     "algorithm.clip_cov.lb: must be < algorithm.clip_cov.ub"),
    (BASE, ["algorithm.name=kl_cov", "algorithm.kl_cov.coef=-1"], "algorithm.kl_cov.coef: must be >= 0, got -1"),
    (BASE, ["algorithm.name=kl_cov", "algorithm.kl_cov.ratio=2"], "algorithm.kl_cov.ratio: must be in"),
    (BASE, ["algorithm.name=dapo", "algorithm.overlong.cache_len=0"], "algorithm.overlong.cache_len: must be >= 1"),
    (BASE, ["algorithm.name=grpo", "algorithm.length_penalty=group_relative", "algorithm.group_relative.gamma=-1"],
     "algorithm.group_relative.gamma: must be >= 0"),
    (BASE, ["rollout.engine=vllm_remote"], "rollout.remote.addresses: the vllm_remote engine needs"),
    (BASE, ["rollout.remote.addresses=host:1"], "rollout.remote.addresses: expected a list"),
    (BASE, ["rollout.engine=builtin_remote"], "rollout.remote.addresses: the builtin_remote engine needs"),
    (BASE, ["rollout.schedule.max_staleness=1"], "rollout.schedule.max_staleness: 1 needs engines on processes of "
                                                 "their own that generate while the trainer trains"),
    (BASE, ["rollout.schedule.max_staleness=-1"], "rollout.schedule.max_staleness: must be >= 0"),
    (BASE, ["rollout.schedule.oversample_batches=-1"], "rollout.schedule.oversample_batches: must be >= 0"),
    (BASE, ["rollout.top_k=-1"], "rollout.top_k: must be >= 0 .0 = off., got -1"),
    (BASE, ["rollout.schedule.partial_rollouts=true"],
     "rollout.schedule.partial_segment_tokens: partial rollouts need a segment"),
    (BASE, ["rollout.schedule.partial_rollouts=true", "rollout.max_new_tokens=6",
            "rollout.schedule.partial_segment_tokens=4"], "rollout.max_new_tokens = 6.? that divides it, got 4"),
    (BASE, ["rollout.schedule.partial_segment_tokens=2"], "rollout.schedule.partial_segment_tokens: set only with "
                                                          "rollout.schedule.partial_rollouts: true"),
    (BASE, [*PARTIAL, "algorithm.name=grpo"], "rollout.schedule.partial_rollouts: needs dynamic sampling"),
    (BASE, PARTIAL, "rollout.schedule.partial_rollouts: needs the rollout correction"),
    (BASE, ["rollout.schedule.rounds_ahead=-1"], "rollout.schedule.rounds_ahead: must be >= 0, got -1"),
    (BASE, ["rollout.schedule.rounds_ahead=2"], "rollout.schedule.rounds_ahead: 2 needs rollout.schedule.max_staleness "
                                                ">= 1"),
    (BASE, ["rollout.schedule.ahead_schedule=when_idle"], "rollout.schedule.ahead_schedule: when_idle needs "
                                                          "rollout.schedule.rounds_ahead >= 1"),
    (BASE, ["rollout.schedule.max_staleness=1", "rollout.engine=builtin_remote", "rollout.remote.addresses=[h:1]"],
     "rollout.schedule.max_staleness: 1 needs the rollout correction .algorithm.rollout_correction.rollout_is: "
     "token, or geometric for grpo_s"),
    (BASE, ["rollout.engine=vllm", "rollout.vllm.kv_cache_memory_bytes=0"],
     "rollout.vllm.kv_cache_memory_bytes: must be > 0"),
    (BASE, ["rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=1.5"],
     "rollout.vllm.gpu_memory_utilization: must be in (0, 1], got 1.5"),
    (BASE, ["rollout.builtin.max_batch_tokens=64"], "rollout.builtin.max_batch_tokens: must exceed "
                                                    "rollout.max_new_tokens = 64"),
    (BASE, ["rollout.engine=builtin_remote", "rollout.remote.addresses=[h:1]", "rollout.remote.reconnect_timeout_s=-1"],
     "rollout.remote.reconnect_timeout_s: must be >= 0"),
    (BASE, ["optim.min_lr=1", "optim.lr=0.1"], "optim.min_lr: must be in [0, optim.lr = 0.1]"),
    (BASE, ["optim.warmup_steps=-1"], "optim.warmup_steps: must be >= 0"),
    (BASE, ["checkpoint.save_every=-2"], "checkpoint.save_every: must be >= -1"),
    (BASE, ["warm_start.lr=0.01", "warm_start.final_lr=0.02"], "warm_start.final_lr: must be in [0, warm_start.lr"),
    (BASE, ["parallel.tensor=0"], "parallel.tensor / parallel.pipeline: must be >= 1"),
    (BASE, ["parallel.virtual_pipeline=2"], "parallel.virtual_pipeline: needs parallel.pipeline >= 2"),
    (BASE, ["model.reference=/nonexistent/ref"], "model.reference: '/nonexistent/ref' is not a directory"),
    (BASE, ["data.source=jsonl", "data.path=p.jsonl"], "model.tiny_synthetic: the tiny model is built for the"),
    ("model: {hf_dir: /hf}\ndata: {source: jsonl, path: p.jsonl}\n", ["warm_start.steps=5"],
     "warm_start.steps: the supervised warm start trains on the synthetic task's answers; with data.source jsonl"),
    (BASE, ["algorithm.length_penalty=group_relative"], "algorithm.length_penalty: group_relative is not available "
                                                        "with gtpo"),
    (BASE, ["algorithm.name=grpo_s", "algorithm.length_penalty=overlong"], "algorithm.length_penalty: overlong is "
                                                                           "not available with grpo_s"),
    (BASE, ["algorithm.rollout_correction.rollout_is=tokens"],
     "algorithm.rollout_correction.rollout_is: 'tokens' is not one of none, token, sequence"),
    (BASE, ["rollout.schedule.ahead_schedule=idle"],
     "rollout.schedule.ahead_schedule: 'idle' is not one of fixed, when_idle"),
    (BASE, ["algorithm.rollout_correction.rollout_rs=token", "algorithm.rollout_correction.rollout_rs_bounds=[2, 1]"],
     "algorithm.rollout_correction.rollout_rs_bounds: need [low, high]"),
    (BASE, ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_cap=0"],
     "algorithm.rollout_correction.rollout_is_cap: must be > 0"),
    (BASE, ["data.pack_sequences=true"], "data.pack_sequences: needs data.max_tokens_per_micro_batch"),
    (BASE, ["algorithm.name=grpo_s", "algorithm.rollout_correction.rollout_is=token"],
     "algorithm.rollout_correction.rollout_is: token weights need a token-level loss"),
])
def test_errors_name_the_key(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(_write(tmp_path, text), overrides)


def test_an_old_key_gets_one_line_naming_its_new_place(tmp_path):
    text = BASE + "rollout: {engine: vllm, vllm_gpu_memory_utilization: 0.4}\n"
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, text))
    assert str(error.value) == "rollout.vllm_gpu_memory_utilization moved to rollout.vllm.gpu_memory_utilization"
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, BASE), ["rollout.engine=builtin_remote", "rollout.remote_addresses=[h:1]"])
    assert str(error.value) == "rollout.remote_addresses moved to rollout.remote.addresses"


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_each_moved_key_names_a_key_that_exists_and_is_refused_itself(old):
    for new in MOVED_KEYS[old]:
        node = TrainConfig()
        for name in new.split("."):
            node = getattr(node, name)  # the new place is a key of the config
    with pytest.raises(ConfigError) as error:
        load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", f"{old}=null"])
    assert str(error.value) == f"{old} moved to {' or '.join(MOVED_KEYS[old])}"


def test_an_algorithm_option_moved_into_its_section_is_answered_with_its_new_place(tmp_path):
    text = BASE + "algorithm: {name: dapo, overlong_max_len: 20480, kl_cov_coef: 3}\n"
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, text))
    assert str(error.value) == ("algorithm.kl_cov_coef moved to algorithm.kl_cov.coef; algorithm.overlong_max_len "
                                "moved to algorithm.overlong.max_len")
    with pytest.raises(ConfigError, match=r"^unknown config key algorithm.alpah2 \(did you mean "
                                          r"algorithm.gtpo.alpha2\?\)"):
        load_config(_write(tmp_path, BASE), ["algorithm.alpah2=0.2"])


# A valid value off the default for every option of a section read by one algorithm or one length penalty.
OFF_DEFAULT = {"alpha1": 2.0, "alpha2": 0.3, "norm_scope": "group", "entropy_clip": [0.1, 2.0], "beta1": 2.0,
               "beta2": 0.3, "sequence_ratio": "geometric", "ratio": 0.5, "lb": 0.5, "ub": 6.0, "coef": 2.0,
               "max_len": 8, "cache_len": 2, "gamma": 0.5}
OWNED = [(section, key) for section in (*ALGORITHM_SECTIONS, *LENGTH_PENALTY_SECTIONS)
         for key in getattr(AlgorithmConfig(), section).__dataclass_fields__]


@pytest.mark.parametrize("section,key", OWNED)
def test_an_option_is_read_by_its_owner_and_refused_naming_it_elsewhere(tmp_path, section, key):
    """A DAPO run given GTPO's alpha1 or KL-Cov's coef does not load: every option of an algorithm's (a length
    penalty's) section is refused, naming its reader, unless that algorithm (penalty) is the run's."""
    value = OFF_DEFAULT[key]
    setting = f"algorithm.{section}.{key}={value}"
    if section in ALGORITHM_SECTIONS:
        owner, other = [f"algorithm.name={section}"], ["algorithm.name=dapo"]
        reader = f"{section} (algorithm.name: {section}), and this run's algorithm is dapo"
    else:
        owner = ["algorithm.name=grpo", f"algorithm.length_penalty={section}"]
        other = ["algorithm.name=grpo"]
        reader = f"the {section} length penalty (algorithm.length_penalty: {section}), and this run's is none " \
                 f"(grpo's default)"
    cfg = load_config(_write(tmp_path, BASE), [*owner, setting])
    assert getattr(getattr(cfg.algorithm, section), key) == (tuple(value) if isinstance(value, list) else value)
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, BASE), [*other, setting])
    assert str(error.value) == f"algorithm.{section}.{key}: {value} is read only by {reader}: remove it"


@pytest.mark.parametrize("sets,message", [
    (["algorithm.rollout_correction.rollout_is_cap=3"], "algorithm.rollout_correction.rollout_is_cap: 3.0 is read only "
     "by the importance weights (algorithm.rollout_correction.rollout_is: token, sequence or geometric), and this run "
     "has none: remove it"),
    (["algorithm.rollout_correction.rollout_rs_bounds=[0.1, 3]"], "algorithm.rollout_correction.rollout_rs_bounds: "
     "[0.1, 3.0] is read only by the rejection (algorithm.rollout_correction.rollout_rs: token, sequence or "
     "geometric), and this run has none: remove it"),
    (["algorithm.name=grpo", "algorithm.max_resample_rounds=5"], "algorithm.max_resample_rounds: 5 is read only by "
     "dynamic sampling (algorithm.dynamic_sampling: true), and this run has it off (grpo's default): remove it"),
    (["algorithm.dynamic_sampling=false", "algorithm.max_resample_rounds=5"], "algorithm.max_resample_rounds: 5 is "
     "read only by dynamic sampling (algorithm.dynamic_sampling: true), and this run has it off: remove it"),
])
def test_a_bound_of_a_feature_that_is_off_is_refused_naming_the_feature(tmp_path, sets, message):
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, BASE), sets)
    assert str(error.value) == message
    load_config(_write(tmp_path, BASE), [*sets, "algorithm.rollout_correction.rollout_is=token",
                                         "algorithm.rollout_correction.rollout_rs=token",
                                         "algorithm.dynamic_sampling=true"])  # each read where its feature is on


def test_the_warm_start_learning_rate_falls_linearly_to_final_lr():
    from megatron_gtpo.config import WarmStartConfig
    decayed = WarmStartConfig(steps=5, lr=0.004, final_lr=0.0)
    assert [decayed.lr_at(i) for i in range(5)] == pytest.approx([0.004, 0.003, 0.002, 0.001, 0.0], abs=1e-15)
    assert {WarmStartConfig(steps=5, lr=0.004).lr_at(i) for i in range(5)} == {0.004}  # unset: constant


def test_remote_vllm_needs_one_server_per_data_parallel_replica():
    cfg = load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", "rollout.engine=vllm_remote",
                             "rollout.remote.addresses=[node1:5000, node2:5000]", "data.prompts_per_step=8"])
    assert cfg.rollout.remote.addresses == ["node1:5000", "node2:5000"]
    validate_layout(cfg, world_size=2)  # TP 1 x PP 1: one server per replica
    with pytest.raises(ConfigError, match="2 given, but there are 4 data-parallel replicas"):
        validate_layout(cfg, world_size=4)


def test_layout_dependent_checks():
    cfg = load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", "parallel.tensor=2",
                             "data.prompts_per_step=6"])
    validate_layout(cfg, world_size=4)  # DP = 2 divides 6
    with pytest.raises(ConfigError, match="world size 5 is not divisible by tensor x pipeline x context = 2 x 1 x 1"):
        validate_layout(cfg, world_size=5)
    with pytest.raises(ConfigError, match="data-parallel size x mini_batches_per_step = 4 x 1"):
        validate_layout(cfg, world_size=8)


def test_context_parallelism_fills_the_world_and_its_comm_kind_is_checked():
    base = ["model.tiny_synthetic=true", "data.source=synthetic"]
    assert load_config(None, base + ["parallel.context_comm=a2a"]).parallel.context_comm == "a2a"
    cfg = load_config(None, base + ["parallel.context=2", "rollout.engine=builtin_remote",
                                    "rollout.remote.addresses=[h:1]"])
    validate_layout(cfg, world_size=2)
    with pytest.raises(ConfigError, match="not divisible by tensor x pipeline x context = 1 x 1 x 2"):
        validate_layout(cfg, world_size=3)
    with pytest.raises(ConfigError, match="parallel.context_comm"):
        load_config(None, base + ["parallel.context_comm=ring"])


def test_the_model_must_split_at_the_layout():
    from megatron_gtpo.data.synthetic import tiny_model_hf_config
    from megatron_gtpo.models.qwen import ModelShape

    shape = ModelShape.from_hf(tiny_model_hf_config())
    cfg = load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", "parallel.tensor=2"])
    validate_layout(cfg, world_size=2, shape=shape)
    cfg.parallel.tensor = shape.num_query_groups * 2
    with pytest.raises(ConfigError, match="parallel.tensor / parallel.pipeline: the model cannot be split so"):
        validate_layout(cfg, shape=shape)


def test_colocated_vllm_engines_must_tile_their_replica():
    def config(vllm_tp):
        return load_config(None, ["model.hf_dir=/hf", "data.source=jsonl", "data.path=p.jsonl", "rollout.engine=vllm",
                                  "parallel.tensor=2", "parallel.pipeline=2", f"rollout.vllm.tensor_parallel={vllm_tp}",
                                  "data.prompts_per_step=8"])
    validate_layout(config(4), world_size=4)  # one replica: one engine over its TP x PP = 4 consecutive GPUs
    validate_layout(config(2), world_size=8)  # an engine per stage
    validate_layout(config(1), world_size=8)  # two engines per stage
    with pytest.raises(ConfigError, match=r"rollout.vllm.tensor_parallel: an engine at tensor parallel size 4 spans "
                                          r"pipeline stages, .* \(got 2 replicas, context 1\); use a divisor of "
                                          r"parallel.tensor = 2"):
        validate_layout(config(4), world_size=8)
    with pytest.raises(ConfigError, match=r"rollout.vllm.tensor_parallel: a rollout engine at tensor parallel size 3 "
                                          r"must divide the training tensor parallel size 2"):
        validate_layout(config(3), world_size=4)
    with pytest.raises(ConfigError, match="rollout.vllm.tensor_parallel: must be >= 1"):
        load_config(None, ["model.hf_dir=/hf", "data.source=synthetic", "rollout.engine=vllm",
                           "rollout.vllm.tensor_parallel=0"])


def test_missing_file_is_named():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent.yaml")


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(_write(tmp_path, BASE), ["algorithm.gtpo.entropy_clip=[0.1, 3.0]", "optim.lr=0.5"])
    save_config(cfg, str(tmp_path / "saved.yaml"))
    assert load_config(str(tmp_path / "saved.yaml")) == cfg


def test_example_configs_load():
    paths = sorted(glob.glob(os.path.join(EXAMPLES, "*.yaml")))
    assert paths
    for path in paths:
        load_config(path)


def test_length_penalties_stay_available_to_the_baselines(tmp_path):
    for name in ("grpo", "dapo"):
        for penalty in ("overlong", "group_relative"):
            cfg = load_config(_write(tmp_path, BASE), [f"algorithm.name={name}", f"algorithm.length_penalty={penalty}"])
            assert cfg.algorithm.length_penalty == penalty


@pytest.mark.parametrize("size", ["7b", "32b"])
@pytest.mark.parametrize("algorithm", ["gtpo", "grpo_s", "dapo"])
def test_paper_recipes_hold_the_paper_settings(size, algorithm):
    """docs/algorithms.md, "Paper settings": 128 prompts x 16 responses, lr 1e-6, temperature 1.0,
    top-p 1.0, prompts up to 2048 and responses up to 4096 tokens, alpha1 = beta1 = 1, alpha2 = beta2 = 0.1."""
    cfg = load_config(os.path.join(EXAMPLES, f"qwen2.5-{size}-{algorithm}.yaml"))
    assert cfg.algorithm.name == algorithm
    assert (cfg.data.prompts_per_step, cfg.rollout.num_responses_per_prompt) == (128, 16)
    assert cfg.optim.lr == 1e-6 and cfg.rollout.temperature == 1.0 and cfg.rollout.top_p == 1.0
    assert (cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens) == (2048, 4096)
    a = cfg.algorithm
    assert (a.gtpo.alpha1, a.gtpo.alpha2, a.grpo_s.beta1, a.grpo_s.beta2) == (1.0, 0.1, 1.0, 0.1)


def test_every_study_variant_of_compare_algorithms_loads():
    """tools/compare_algorithms.py's variants and ablations are overrides on their study's recipe: each loads (an
    option in another algorithm's section, or a key that moved, would be refused here rather than after the warm
    start)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "compare_algorithms", os.path.join(EXAMPLES, "..", "tools", "compare_algorithms.py"))
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool  # its dataclasses look their module up
    spec.loader.exec_module(tool)
    for study in tool.STUDIES.values():
        for variant in (*study.variants, *study.ablations):
            cfg = load_config(study.config, [f"algorithm.name={variant.algorithm}", *variant.overrides])
            assert cfg.algorithm.name == variant.algorithm
