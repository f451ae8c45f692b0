"""Qwen3 and Qwen3-MoE checkpoints through the converters and the one HF <-> megatron mapping (Qwen2's, with the
converters' other checks, are in test_converters.py and test_converters_megatron.py):
- HF -> megatron_gtpo checkpoint -> HF is bit-exact, fp32 and bf16, tied and untied (Qwen3: the q/k norms included, no
  biases invented; Qwen3-MoE: the router and every expert);
- the converted checkpoint holds exactly the keys and global shapes megatron declares (Qwen3-MoE: experts on a layer
  and an expert axis) and loads at other layouts (Qwen3-MoE: EP 2 over replicas or inside TP, and PP 2) to what
  load_hf_weights gives; a Qwen3-MoE checkpoint saved at EP 2 exports bit-exactly and loads at EP 1."""
import json

import pytest
import torch

from checkpoint_checks import (assert_bit_exact, declared_global_shapes, model_at_layout, model_from_hf,
                               read_safetensors_dir, unequal_parameters)
from distributed_harness import run_distributed
from megatron_gtpo.checkpoint import convert_hf_to_megatron, convert_megatron_to_hf, read_checkpoint_metadata
from megatron_gtpo.checkpoint.hf_export import TorchDistReader
from tiny_models import TINY_QWEN3, make_tiny_model

LAYERS, EXPERTS, HIDDEN, EXPERT_WIDTH = TINY_QWEN3["num_layers"], 4, 64, 32
# family: {model: make_tiny_model's keyword arguments}
MODELS = {"qwen3": {"untied": dict(tie=False, seed=21), "tied": dict(tie=True, dtype=torch.bfloat16, seed=22)},
          "qwen3_moe": {"fp32": dict(seed=31),
                        "bf16": dict(tie=True, dtype=torch.bfloat16, seed=32, norm_topk_prob=False)}}
# (family, model, TP, PP) converted and exported back
ROUND_TRIPS = [("qwen3", m, tp, pp) for m in ("untied", "tied") for tp, pp in ((1, 1), (2, 2))] + \
              [("qwen3_moe", "fp32", 1, 1), ("qwen3_moe", "bf16", 2, 1)]
# family: (model, TP it is converted at) loaded at each (TP, PP, EP, ETP) on 2 ranks
LOADED = {"qwen3": ([("untied", 1), ("tied", 2)], [(2, 1, 1, None), (1, 2, 1, None)]),
          # 2 experts per replica, 2 whole experts per TP rank, all experts on each of 2 stages
          "qwen3_moe": ([("fp32", 2)], [(1, 1, 2, None), (2, 1, 2, 1), (1, 2, 1, None)])}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """(family, model) -> the directory of a tiny model of MODELS (built when first asked for)."""
    built = {}

    def model_dir(family, model):
        if (family, model) not in built:
            path = tmp_path_factory.mktemp(f"{family}_{model}")
            make_tiny_model(path, family, **MODELS[family][model], **TINY_QWEN3)
            built[family, model] = path
        return built[family, model]
    return model_dir


def _family_structure(family, exported: dict, config: dict, model: str) -> None:
    """What each family's export must hold beyond the bit-exact tensors."""
    if family == "qwen3":
        assert {n for n in exported if "_norm." in n and ".self_attn." in n} == \
            {f"model.layers.{i}.self_attn.{qk}_norm.weight" for i in range(LAYERS) for qk in "qk"}
        assert (config["model_type"], config["head_dim"], config["tie_word_embeddings"]) == \
            ("qwen3", 32, model == "tied")
    else:
        assert sum(".mlp.experts." in name for name in exported) == LAYERS * EXPERTS * 3  # 3 tensors each
        assert (config["model_type"], config["num_experts_per_tok"]) == ("qwen3_moe", 2)


@pytest.mark.parametrize("family,model,tp,pp", ROUND_TRIPS,
                         ids=[f"{f}-{m}-tp{tp}-pp{pp}" for f, m, tp, pp in ROUND_TRIPS])
def test_round_trip_is_bit_exact(model_dirs, tmp_path, family, model, tp, pp):
    src = model_dirs(family, model)
    convert_hf_to_megatron(str(src), str(tmp_path / "mg"), tensor_parallel=tp, pipeline_parallel=pp, progress=False)
    convert_megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "hf"), progress=False)
    original, exported = read_safetensors_dir(src), read_safetensors_dir(tmp_path / "hf")
    assert_bit_exact(original, exported)
    _family_structure(family, exported, json.loads((tmp_path / "hf" / "config.json").read_text()), model)


def _load_at_layouts(rank, world_size, cases, layouts, saved_dir):
    """For each of `layouts`: parameters that differ between loading each converted checkpoint and loading its HF
    directory, and the keys megatron declares; then, with `saved_dir`, a checkpoint saved at EP 2 from the first
    case's HF weights."""
    from megatron_gtpo.checkpoint import load_model_only, save_checkpoint
    from megatron_gtpo.distributed import initialize_parallel

    report = {}
    for tp, pp, ep, etp in layouts:
        groups = initialize_parallel(tp, pp, expert_parallel=ep, expert_tensor_parallel=etp)
        for hf_dir, mg_dir in cases:
            loaded = model_at_layout(read_checkpoint_metadata(mg_dir).hf_config, groups)
            load_model_only(mg_dir, loaded)
            report[hf_dir, tp, pp, ep] = (unequal_parameters(model_from_hf(hf_dir, groups), loaded),
                                          declared_global_shapes(loaded))
    if saved_dir is not None:
        hf_dir, mg_dir = cases[0]
        model = model_from_hf(hf_dir, initialize_parallel(1, 1, expert_parallel=2))
        save_checkpoint(saved_dir, model, hf_config=read_checkpoint_metadata(mg_dir).hf_config)
    return report


def _load_saved_at_ep1(rank, world_size, hf_dir, saved_dir):
    """The parameters that differ from the HF directory's, and the warnings the load gave (none: megatron-core's
    reader warns of torch deprecations a user does not act on)."""
    import warnings

    from megatron_gtpo.checkpoint import load_model_only
    from megatron_gtpo.distributed import initialize_parallel

    groups = initialize_parallel(1, 1)
    loaded = model_at_layout(read_checkpoint_metadata(saved_dir).hf_config, groups)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_model_only(saved_dir, loaded)
    return unequal_parameters(model_from_hf(hf_dir, groups), loaded), [str(w.message) for w in caught]


def _family_keys(family, stored: dict) -> None:
    """The keys and global shapes each family's converted checkpoint must store."""
    if family == "qwen3":
        assert "decoder.layers.self_attention.q_layernorm.weight" in stored
        assert not any(k.endswith("linear_qkv.bias") for k in stored)
    else:
        assert stored["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == \
            (LAYERS, EXPERTS, 2 * EXPERT_WIDTH, HIDDEN)
        assert stored["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == (LAYERS, EXPERTS, HIDDEN, EXPERT_WIDTH)
        assert stored["decoder.layers.mlp.router.weight"] == (LAYERS, EXPERTS, HIDDEN)
        assert "decoder.layers.pre_mlp_layernorm.weight" in stored  # its own key in a MoE layer, on either layer spec


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_converted_checkpoint_is_megatrons_layout_and_loads_at_other_layouts(model_dirs, tmp_path, family):
    models, layouts = LOADED[family]
    cases = []
    for model, tp in models:
        convert_hf_to_megatron(str(model_dirs(family, model)), str(tmp_path / model), tensor_parallel=tp,
                               progress=False)
        cases.append((str(model_dirs(family, model)), str(tmp_path / model)))
    saved_dir = str(tmp_path / "saved") if family == "qwen3_moe" else None
    per_rank = run_distributed(_load_at_layouts, 2, args=(cases, layouts, saved_dir), timeout_s=400)
    for hf_dir, mg_dir in cases:
        stored = {k: tuple(md.size) for k, md in TorchDistReader(mg_dir).metadata.state_dict_metadata.items()}
        _family_keys(family, stored)
        declared = {}
        for report in per_rank:
            for (case_dir, tp, pp, ep), (unequal, shapes) in report.items():
                if case_dir == hf_dir:
                    assert unequal == [], f"{hf_dir} at TP={tp} PP={pp} EP={ep}: {unequal}"
                    declared.update(shapes)
        assert declared == stored
    if saved_dir is not None:
        hf_dir = cases[0][0]
        assert read_checkpoint_metadata(saved_dir).expert_parallel == 2
        assert run_distributed(_load_saved_at_ep1, 1, args=(hf_dir, saved_dir), timeout_s=300) == [([], [])]
        convert_megatron_to_hf(saved_dir, str(tmp_path / "hf2"), progress=False)
        assert_bit_exact(read_safetensors_dir(hf_dir), read_safetensors_dir(tmp_path / "hf2"))
