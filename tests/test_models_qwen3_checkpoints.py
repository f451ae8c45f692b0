"""Qwen3 checkpoints through the converters: HF -> megatron_gtpo checkpoint -> HF is bit-exact (q/k norms included,
no biases invented, tied and untied), and the converted checkpoint holds exactly the keys and global shapes a megatron
Qwen3 GPTModel declares and loads at other TP/PP layouts to the weights load_hf_weights gives."""
import json

import pytest
import torch

from distributed_harness import run_distributed
from megatron_gtpo.checkpoint import convert_hf_to_megatron, convert_megatron_to_hf, read_checkpoint_metadata
from megatron_gtpo.checkpoint.hf_export import TorchDistReader
from test_converters import assert_bit_exact, read_safetensors_dir
from test_converters_megatron import _build, _declared_global_shapes, _from_hf, _unequal_parameters
from test_models_qwen3 import TINY
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_hf")
    make_tiny_model(root / "untied", "qwen3", tie=False, seed=21, **TINY)
    make_tiny_model(root / "tied", "qwen3", tie=True, dtype=torch.bfloat16, seed=22, **TINY)
    return {"untied": root / "untied", "tied": root / "tied"}


ROUND_TRIPS = [(m, tp, pp) for m in ("untied", "tied") for tp, pp in ((1, 1), (2, 2))]


@pytest.mark.parametrize("model,tp,pp", ROUND_TRIPS, ids=[f"{m}-tp{tp}-pp{pp}" for m, tp, pp in ROUND_TRIPS])
def test_round_trip_is_bit_exact(qwen3_dirs, tmp_path, model, tp, pp):
    src = qwen3_dirs[model]
    convert_hf_to_megatron(str(src), str(tmp_path / "mg"), tensor_parallel=tp, pipeline_parallel=pp, progress=False)
    convert_megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "hf"), progress=False)
    original, exported = read_safetensors_dir(src), read_safetensors_dir(tmp_path / "hf")
    assert_bit_exact(original, exported)
    assert {n for n in exported if "_norm." in n and ".self_attn." in n} == \
        {f"model.layers.{i}.self_attn.{qk}_norm.weight" for i in range(TINY["num_layers"]) for qk in "qk"}
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["head_dim"], config["tie_word_embeddings"]) == ("qwen3", 32, model == "tied")


def _load_at_layouts(rank, world_size, cases):
    """For each layout on 2 ranks: parameters that differ between loading the converted checkpoint and loading the
    HF directory, and the sharded keys megatron declares."""
    from megatron_gtpo.checkpoint import load_model_only
    from megatron_gtpo.distributed import initialize_parallel

    report = {}
    for tp, pp in ((2, 1), (1, 2)):
        groups = initialize_parallel(tp, pp)
        for hf_dir, mg_dir in cases:
            loaded = _build(read_checkpoint_metadata(mg_dir).hf_config, groups)
            load_model_only(mg_dir, loaded)
            report[hf_dir, tp, pp] = (_unequal_parameters(_from_hf(hf_dir, groups), loaded),
                                      _declared_global_shapes(loaded))
    return report


def test_converted_checkpoint_is_megatrons_layout_and_loads_at_other_layouts(qwen3_dirs, tmp_path):
    cases = []
    for name, tp in (("untied", 1), ("tied", 2)):
        convert_hf_to_megatron(str(qwen3_dirs[name]), str(tmp_path / name), tensor_parallel=tp, progress=False)
        cases.append((str(qwen3_dirs[name]), str(tmp_path / name)))
    per_rank = run_distributed(_load_at_layouts, 2, args=(cases,), timeout_s=300)
    for hf_dir, mg_dir in cases:
        stored = {k: tuple(md.size) for k, md in TorchDistReader(mg_dir).metadata.state_dict_metadata.items()}
        assert "decoder.layers.self_attention.q_layernorm.weight" in stored
        assert not any(k.endswith("linear_qkv.bias") for k in stored)
        declared = {}
        for report in per_rank:
            for (case_dir, tp, pp), (unequal, shapes) in report.items():
                if case_dir == hf_dir:
                    assert unequal == [], f"{hf_dir} at TP={tp} PP={pp}: {unequal}"
                    declared.update(shapes)
        assert declared == stored
