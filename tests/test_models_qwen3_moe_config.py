"""Qwen3-MoE's config.json in megatron: the mixture-of-experts keys and the layouts refused with one error each, the
router settings it becomes, the expert-parallel layout rules, the presets (models/presets.py) against the
published total and active parameter counts, and the planner's per-rank counts against models built on the meta
device at expert-parallel layouts."""
from dataclasses import replace

import pytest
import torch

from distributed_harness import run_distributed
from megatron_gtpo.layout import LayoutError, ParallelLayout, RolloutLayout, check_layout
from megatron_gtpo.models.moe import RouterLosses
from megatron_gtpo.models.qwen import ModelShape, padded_vocab_size, transformer_config_from_hf
from megatron_gtpo.models.presets import FAMILY_PRESETS, hf_config
from megatron_gtpo.planning import active_parameter_count, parameter_count, total_parameter_count

# The model cards: "Number of Parameters: 30.5B in total and 3.3B activated" (Qwen3-30B-A3B) and "235B in total and
# 22B activated" (Qwen3-235B-A22B); billions, as printed: cut after the printed digits (3.35B activated is "3.3B").
PUBLISHED = {"qwen3-30b-a3b": ("30.5", "3.3"), "qwen3-235b-a22b": ("235", "22")}
SHAPE_30B = ModelShape.from_hf(hf_config("qwen3-30b-a3b"))  # 128 experts of width 768, 48 layers
# The 30B-A3B with 4 layers (the same layers, fewer of them): cheap to build on the meta device at EP layouts.
SMALL_30B = dict(hf_config("qwen3-30b-a3b"), num_hidden_layers=4)
# (TP, PP, EP, ETP) on 2 ranks: experts over DP (EP = DP = 2), over TP (ETP 1 inside TP 2), and over stages.
META_LAYOUTS = [(1, 1, 2, None), (2, 1, 2, 1), (1, 2, 1, None)]


def test_moe_keys_become_the_shape():
    moe = SHAPE_30B.moe
    assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.norm_topk_prob) == (128, 8, 768, True)
    assert (SHAPE_30B.qk_norm, SHAPE_30B.qkv_bias, SHAPE_30B.head_dim) == (True, False, 128)  # Qwen3's attention
    assert ModelShape.from_hf(hf_config("qwen3-8b")).moe is None
    # transformers 5 saves the expert count as num_local_experts
    renamed = {("num_local_experts" if k == "num_experts" else k): v for k, v in hf_config(
        "qwen3-30b-a3b").items()}
    assert ModelShape.from_hf(renamed) == SHAPE_30B


@pytest.mark.parametrize("change, message", [
    ({"decoder_sparse_step": 2}, r"experts on only some layers \(decoder_sparse_step 2"),
    ({"mlp_only_layers": [0, 5]}, r"experts on only some layers .*mlp_only_layers \[0, 5\]"),
    ({"shared_expert_intermediate_size": 512}, "shared experts .* are not supported: Qwen3-MoE has none"),
    ({"num_experts_per_tok": 200}, r"num_experts_per_tok 200 must be in \[1, num_experts = 128\]"),
    ({"moe_intermediate_size": None}, r"lacks the mixture-of-experts keys \['moe_intermediate_size'\]"),
])
def test_unsupported_expert_layouts_are_refused_with_one_error(change, message):
    config = {k: v for k, v in dict(hf_config("qwen3-30b-a3b"), **change).items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelShape.from_hf(config)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_settings(norm_topk_prob):
    config_json = dict(hf_config("qwen3-30b-a3b"), norm_topk_prob=norm_topk_prob)
    config = transformer_config_from_hf(config_json, tensor_parallel=2, expert_parallel=8, expert_tensor_parallel=1)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size, config.qk_layernorm) == \
        (128, 8, 768, True)
    # The top k of the logits then a softmax over them is the renormalised top-k probabilities.
    assert config.moe_router_pre_softmax is not norm_topk_prob
    assert (config.moe_router_score_function, config.moe_token_dispatcher_type, config.moe_router_dtype) == \
        ("softmax", "alltoall", "fp32")
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (8, 1)
    assert config.moe_shared_expert_intermediate_size is None and not config.add_bias_linear
    # The router losses are off unless asked for (docs/algorithms.md, "Mixture of experts").
    assert (config.moe_router_load_balancing_type, config.moe_aux_loss_coeff, config.moe_z_loss_coeff) == \
        ("none", 0.0, None)
    losses = transformer_config_from_hf(config_json, router_losses=RouterLosses(aux_loss_coef=1e-3, z_loss_coef=1e-4))
    assert (losses.moe_router_load_balancing_type, losses.moe_aux_loss_coeff, losses.moe_z_loss_coeff) == \
        ("aux_loss", 1e-3, 1e-4)


@pytest.mark.parametrize("layout, kwargs, message", [
    (ParallelLayout(data=2, expert=2), {"shape": ModelShape.from_hf(hf_config("qwen3-8b"))},
     "parallel.expert / parallel.expert_tensor: the model has no experts"),
    (ParallelLayout(data=3, expert=3), {"shape": SHAPE_30B}, "the model's 128 experts are not divisible by EP=3"),
    (ParallelLayout(tensor=4), {"shape": ModelShape.from_hf(
        dict(hf_config("qwen3-30b-a3b"), moe_intermediate_size=766))},
     "moe_intermediate_size 766 is not divisible by ETP=4"),
    (ParallelLayout(tensor=2, expert_tensor=4), {}, "parallel.expert_tensor: 4 must divide parallel.tensor = 2"),
    (ParallelLayout(tensor=2, data=2, expert=4), {},
     r"expert_tensor x expert = 2 x 4 must divide tensor x context x data-parallel size = 2 x 1 x 2"),
    # vLLM serves a mixture-of-experts model (colocated or remote); a built-in rollout server does not.
    (ParallelLayout(data=2, expert=2),
     {"shape": SHAPE_30B, "rollout": RolloutLayout("builtin_remote", remote_servers=2)},
     "rollout.engine: builtin_remote is not supported for a mixture-of-experts model"),
    (ParallelLayout(data=2, expert=2), {"shape": SHAPE_30B, "rollout": RolloutLayout("vllm")}, None),
    (ParallelLayout(data=2, expert=2), {"shape": SHAPE_30B, "rollout": RolloutLayout("vllm_remote", remote_servers=2)},
     None),
    # megatron-core's MoE layer refuses to train at TP > 1 without sequence parallelism.
    (ParallelLayout(tensor=2, data=2, expert=2), {"shape": SHAPE_30B, "training": True},
     "a mixture-of-experts model trains at TP > 1 only with parallel.sequence_parallel"),
    (ParallelLayout(tensor=2, data=2, expert=2, sequence_parallel=True),
     {"shape": SHAPE_30B, "training": True}, None),
    # Fits: EP over the DP replicas (ETP = TP), EP inside TP (ETP 1), or both.
    (ParallelLayout(tensor=2, data=4, expert=4), {"shape": SHAPE_30B}, None),
    (ParallelLayout(tensor=4, data=2, expert=8, expert_tensor=1), {"shape": SHAPE_30B}, None),
    # The context-parallel ranks of a stage take part in the experts' layout: EP 4 over TP 2 x CP 2.
    (ParallelLayout(tensor=2, context=2, data=1, expert=4, expert_tensor=1), {"shape": SHAPE_30B}, None),
])
def test_expert_layout_rules(layout, kwargs, message):
    if message is None:
        check_layout(layout, **kwargs)
        return
    with pytest.raises(LayoutError, match=message):
        check_layout(layout, **kwargs)


def test_presets_have_the_published_total_and_active_counts():
    assert sorted(FAMILY_PRESETS["qwen3_moe"]) == sorted(PUBLISHED)
    for name, (total, active) in PUBLISHED.items():
        shape = ModelShape.from_hf(hf_config(name))
        padding = 2 * (padded_vocab_size(shape.vocab_size, 1) - shape.vocab_size) * shape.hidden_size  # untied
        for count, published in ((total_parameter_count(shape), total), (active_parameter_count(shape), active)):
            last_digit = 10.0 ** -len(published.split(".")[1]) if "." in published else 1.0
            assert float(published) <= (count - padding) / 1e9 < float(published) + last_digit, (name, count)


def _meta_counts(rank, world_size):
    """Parameters on this rank of SMALL_30B built on the meta device at each of META_LAYOUTS: (pp_rank, count)."""
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.qwen import build_model

    counts = []
    for tp, pp, ep, etp in META_LAYOUTS:
        groups = initialize_parallel(tp, pp, expert_parallel=ep, expert_tensor_parallel=etp)
        chunks = build_model(SMALL_30B, tensor_parallel=tp, pipeline_parallel=pp, pp_rank=groups.pp_rank,
                             expert_parallel=ep, expert_tensor_parallel=etp, meta_device=True)
        counts.append((groups.pp_rank, sum(p.numel() for c in chunks for p in c.parameters())))
    return counts


def test_planner_counts_equal_meta_device_models_at_expert_layouts():
    shape = ModelShape.from_hf(SMALL_30B)
    per_rank = run_distributed(_meta_counts, 2, timeout_s=300)
    for i, (tp, pp, ep, etp) in enumerate(META_LAYOUTS):
        layout = ParallelLayout(tensor=tp, pipeline=pp, data=2 // (tp * pp), expert=ep, expert_tensor=etp)
        for counts in per_rank:
            pp_rank, count = counts[i]
            assert count == parameter_count(shape, layout, pp_rank), (tp, pp, ep, etp, pp_rank)


@pytest.mark.parametrize("overrides, message", [
    # Routing replay needs the routing recorded or returned at generation: layout.check_layout's one rule (whether
    # vLLM can return it is vllm_engine.routed_experts_unavailable's, when the engine starts).
    (["rollout.engine=builtin_remote", "rollout.remote.addresses=[h:1]"],
     "rollout.engine: builtin_remote does not record routing for model.moe.routing_replay: rollout"),
])
def test_routing_replay_is_refused_where_it_cannot_run(overrides, message):
    from megatron_gtpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", "model.moe.routing_replay=rollout",
                           *overrides])


@pytest.mark.parametrize("key", ["model.moe.routing_replay=rollout", "model.moe.aux_loss_coef=0.001",
                                 "model.moe.z_loss_coef=0.001"])
def test_expert_settings_need_a_mixture_of_experts_model(key):
    from megatron_gtpo.config import ConfigError, load_config, validate_for_model

    cfg = load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", key])
    with pytest.raises(ConfigError) as error:
        validate_for_model(cfg, ModelShape.from_hf(hf_config("qwen3-8b")))
    assert str(error.value) == (f"{key.replace('=', ': ')} is read only by a mixture-of-experts model (Qwen3-MoE); "
                                f"this one is dense: remove it")
    validate_for_model(cfg, SHAPE_30B)


SMALL_MOE = dict(hf_config("qwen3-30b-a3b"), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=64, max_position_embeddings=512)


def _measured_training_state(rank, world_size):
    """SMALL_MOE in bf16 at EP=2 over DP=2 through the trainer's set-up (DDP, a chained DistributedOptimizer: dense
    parameters sharded over DP, experts over the expert-DP group), one Adam step; the bytes of the parameters,
    gradients and optimizer state (moments and fp32 masters) that exist afterwards."""
    from megatron_gtpo.config import TrainConfig
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.training.model_setup import wrap_for_training
    from plan_measurements import state_bytes_after_one_step

    initialize_parallel(1, 1, expert_parallel=2)
    chunks = build_model(SMALL_MOE, tensor_parallel=1, pipeline_parallel=1, pp_rank=0, expert_parallel=2,
                         params_dtype=torch.bfloat16)
    cfg = TrainConfig(steps=1)
    cfg.model.dtype = "bfloat16"
    policy = wrap_for_training(cfg, chunks)
    return state_bytes_after_one_step(chunks, policy.ddp_chunks[0], policy.optimizer, SMALL_MOE["vocab_size"])


def test_planner_training_state_bytes_at_ep2_equal_measured_tensors():
    from megatron_gtpo.planning import Settings, Workload, plan

    measured = run_distributed(_measured_training_state, 2, timeout_s=300)
    stage = plan(ModelShape.from_hf(SMALL_MOE), ParallelLayout(data=2, expert=2),
                 Workload(prompts_per_step=2, num_responses_per_prompt=2, max_prompt_tokens=16, max_response_tokens=16),
                 Settings(params_dtype="bfloat16", vllm_memory_fraction=None, kernels="local")).stages[0]
    for rank in measured:
        assert rank["optimizers"] == 2  # dense parameters and experts
        for key in ("parameters", "gradients", "optimizer"):
            # Up to the padding of megatron's second (expert) buffer, which the planner does not count: < 0.1 %.
            assert rank[key] == pytest.approx(getattr(stage, key), rel=1e-3, abs=0), key


def test_the_moe_recipe_fits_16_and_8_h100s_and_the_planner_suggests_layouts():
    from megatron_gtpo.config import load_config
    from megatron_gtpo.planning import plan, settings_from_config, suggest_layouts, workload_from_config

    cfg = load_config("examples/qwen3-30b-a3b-gtpo.yaml")
    workload, settings = workload_from_config(cfg), settings_from_config(cfg)
    p = cfg.parallel
    recipe = ParallelLayout(tensor=p.tensor, pipeline=p.pipeline, data=16 // (p.tensor * p.pipeline), expert=p.expert,
                            expert_tensor=p.expert_tensor, sequence_parallel=p.sequence_parallel)
    assert settings.vllm_memory_fraction is not None  # 16 GPUs: colocated vLLM engines
    recipe_plan = plan(SHAPE_30B, recipe, workload, settings)
    assert recipe_plan.fits
    # vLLM's share of a GPU holds the whole model, every layer's 128 experts included, in bf16 over vLLM TP 2. By hand:
    # 48 x (attention 2048 x (4096 + 2 x 512) + 4096 x 2048 + q/k norms 256, experts 128 x 3 x 2048 x 768, router
    # 2048 x 128, 2 norms 2048) + embedding and output 2 x 151,936 x 2048 + final norm 2048 (the planner pads the
    # vocabulary to 152,576: 0.01 % more). Its KV cache: K and V of 48 layers x 2 of the 4 KV heads x 128 x 2 bytes.
    by_hand = 48 * (2048 * 5120 + 4096 * 2048 + 256 + 128 * 3 * 2048 * 768 + 2048 * 128 + 2 * 2048) \
        + 2 * 151_936 * 2048 + 2048
    assert recipe_plan.memory_gib["vllm_weights"] * 2**30 == pytest.approx(by_hand * 2 / 2, rel=2e-4)
    assert recipe_plan.kv_cache["bytes_per_token"] == 2 * 48 * 2 * 128 * 2
    # 1 node: the built-in engine (the recipe's note), with recompute.
    builtin = replace(settings, vllm_memory_fraction=None, builtin_max_batch_tokens=131072)
    one_node = ParallelLayout(tensor=2, data=4, expert=4, expert_tensor=2, sequence_parallel=True)
    assert not plan(SHAPE_30B, one_node, workload, replace(settings, recompute_activations=True)).fits  # with vLLM
    assert plan(SHAPE_30B, one_node, workload, replace(builtin, recompute_activations=True)).fits
    for gpus, engine_settings, most_gib in ((8, builtin, 80), (16, settings, 80), (16, builtin, 72)):
        best = suggest_layouts(SHAPE_30B, gpus, workload, engine_settings)[0]
        assert best.fits and best.layout.world_size == gpus
        # 16 GPUs with the built-in engine leave a tenth; on 8 (DP = 2) routing replay's record takes 4.5 GiB per GPU
        # and none leaves a tenth; vLLM takes half of every GPU while it generates.
        assert max(best.memory_gib["training_peak"], best.memory_gib["generation_peak"]) <= most_gib
    assert suggest_layouts(SHAPE_30B, 16, workload, settings)[0].layout == recipe
