"""The family of a config.json (its model_type), what a Qwen3 config becomes in megatron, the Qwen3 presets
(models/presets.py) against the published parameter counts, on the meta device and in the planner, and the
planner's activation bytes of a Qwen3 layer (its q/k norms) against the tensors autograd saves."""
import pytest

from distributed_harness import run_distributed
from megatron_gtpo.models.qwen import ModelShape, padded_vocab_size, transformer_config_from_hf
from megatron_gtpo.models.presets import FAMILY_PRESETS, hf_config
from megatron_gtpo.layout import ParallelLayout
from megatron_gtpo.planning import layer_activation_bytes, parameter_count
from plan_measurements import (GPU_FUSIONS, LAYER_PROBE, PROBE_BATCH, PROBE_SEQ, cpu_only_norm_bytes,
                               saved_activation_bytes)

# The model cards' "Number of Parameters" and "(Non-Embedding)", as printed (billions; the embedding and, untied,
# the output layer are the embedding parameters).
PUBLISHED = {"qwen3-0.6b": ("0.6", "0.44"), "qwen3-1.7b": ("1.7", "1.4"), "qwen3-4b": ("4.0", "3.6"),
             "qwen3-8b": ("8.2", "6.95"), "qwen3-14b": ("14.8", "13.2"), "qwen3-32b": ("32.8", "31.2")}
# (model, TP, PP): tied with PP > 1 (the last stage's copy of the embedding) and untied, split both ways.
LAYOUTS = [("qwen3-1.7b", 2, 1), ("qwen3-1.7b", 1, 2), ("qwen3-8b", 2, 1), ("qwen3-8b", 1, 2)]
# The planner tests' probe layer (plan_measurements.py) as Qwen3: 4 heads in 2 query groups (at TP=1 megatron copies
# q for the norm, at TP=2 not).
QWEN3_PROBE = dict(LAYER_PROBE, architectures=["Qwen3ForCausalLM"], model_type="qwen3")


def test_family_is_chosen_by_model_type():
    qwen3 = ModelShape.from_hf(hf_config("qwen3-0.6b"))
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_dim, qwen3.hidden_size // qwen3.num_attention_heads) == \
        (True, False, 128, 64)
    qwen25 = ModelShape.from_hf(hf_config("qwen2.5-0.5b"))
    assert (qwen25.qk_norm, qwen25.qkv_bias) == (False, True)
    # Files without a model_type are recognised by their architectures.
    no_type = {k: v for k, v in hf_config("qwen3-8b").items() if k != "model_type"}
    assert ModelShape.from_hf(no_type) == ModelShape.from_hf(hf_config("qwen3-8b"))

    moe = dict(hf_config("qwen3-8b"), model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"])
    with pytest.raises(ValueError, match=r"unsupported architecture \['Qwen2MoeForCausalLM'\] \(model_type "
                                         r"'qwen2_moe'\): supported are model_type 'qwen2' .* 'qwen3'"):
        ModelShape.from_hf(moe)
    without_head_dim = {k: v for k, v in hf_config("qwen3-8b").items() if k != "head_dim"}
    with pytest.raises(ValueError, match=r"lacks required keys \['head_dim'\]"):
        ModelShape.from_hf(without_head_dim)
    with pytest.raises(ValueError, match="attention_bias=true is not supported for Qwen3ForCausalLM"):
        ModelShape.from_hf(dict(hf_config("qwen3-8b"), attention_bias=True))


def test_transformer_config_of_qwen3():
    config = transformer_config_from_hf(hf_config("qwen3-32b"), tensor_parallel=8)
    assert (config.qk_layernorm, config.add_qkv_bias, config.kv_channels, config.num_attention_heads,
            config.num_query_groups, config.hidden_size, config.layernorm_epsilon) == \
        (True, False, 128, 64, 8, 5120, 1e-6)


def _measure(rank, world_size):
    """Parameters of every preset at TP=1, and on this rank of each of LAYOUTS, built on the meta device; the bytes
    autograd saves for one QWEN3_PROBE layer (a 2-layer model minus a 1-layer one) at TP=1 and TP=2."""
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.qwen import build_model

    def count(name, tp, pp, pp_rank):
        chunks = build_model(hf_config(name), tensor_parallel=tp, pipeline_parallel=pp, pp_rank=pp_rank,
                             meta_device=True)
        return sum(p.numel() for c in chunks for p in c.parameters())

    out = {"layouts": []}
    for name, tp, pp in LAYOUTS:
        groups = initialize_parallel(tp, pp)
        out["layouts"].append((groups.pp_rank, count(name, tp, pp, groups.pp_rank)))
    initialize_parallel(1, 1)
    out["totals"] = {name: count(name, 1, 1, 0) for name in FAMILY_PRESETS["qwen3"]}
    for tp in (1, 2):
        initialize_parallel(tp, 1)
        saved = [saved_activation_bytes(build_model(dict(QWEN3_PROBE, num_hidden_layers=layers), tensor_parallel=tp,
                                                     pipeline_parallel=1, pp_rank=0, accelerator=GPU_FUSIONS)[0],
                                         seq_len=PROBE_SEQ, batch=PROBE_BATCH) for layers in (1, 2)]
        out[tp] = saved[1] - saved[0]
    return out


@pytest.fixture(scope="module")
def measurements():
    return run_distributed(_measure, 2, timeout_s=300)


def test_presets_have_the_published_parameter_counts(measurements):
    totals = measurements[0]["totals"]
    assert sorted(totals) == sorted(PUBLISHED)
    for name, (total, non_embedding) in PUBLISHED.items():
        shape = ModelShape.from_hf(hf_config(name))
        tables = 1 if shape.tie_word_embeddings else 2
        padded_table = padded_vocab_size(shape.vocab_size, 1) * shape.hidden_size
        unpadded = totals[name] - tables * (padded_table - shape.vocab_size * shape.hidden_size)
        decimals = len(total.split(".")[1])
        assert f"{unpadded / 1e9:.{decimals}f}" == total, (name, unpadded)
        decimals = len(non_embedding.split(".")[1])
        assert f"{(totals[name] - tables * padded_table) / 1e9:.{decimals}f}" == non_embedding, name
        assert parameter_count(shape, ParallelLayout(), 0) == totals[name], name


def test_planner_counts_equal_meta_device_models(measurements):
    for i, (name, tp, pp) in enumerate(LAYOUTS):
        shape = ModelShape.from_hf(hf_config(name))
        layout = ParallelLayout(tensor=tp, pipeline=pp, data=2 // (tp * pp))
        for rank_counts in measurements:
            pp_rank, count = rank_counts["layouts"][i]
            assert count == parameter_count(shape, layout, pp_rank), (name, tp, pp, pp_rank)


@pytest.mark.parametrize("tp", [1, 2])
def test_local_profile_layer_activations_equal_saved_tensors(measurements, tp):
    shape = ModelShape.from_hf(dict(QWEN3_PROBE, num_hidden_layers=1))
    expected = layer_activation_bytes(shape, seq_len=PROBE_SEQ, micro_batch_size=PROBE_BATCH, tensor_parallel=tp,
                                      sequence_parallel=False, kernels="local", bytes_per_element=4)
    cpu_only = cpu_only_norm_bytes(shape, seq_len=PROBE_SEQ, batch=PROBE_BATCH, tensor_parallel=tp,
                                   bytes_per_element=4)
    assert [rank[tp] for rank in measurements] == [expected + cpu_only] * len(measurements)
