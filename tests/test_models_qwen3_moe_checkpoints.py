"""Qwen3-MoE weights through the one HF <-> megatron mapping at expert-parallel layouts:
- the converters: HF -> megatron_gtpo checkpoint -> HF is bit-exact (router and every expert, fp32 and bf16); the
  converted checkpoint holds exactly the keys and global shapes megatron declares (experts on a layer and an expert
  axis) and loads at EP 2 (over replicas, or inside TP) and at PP 2 to what load_hf_weights gives; a checkpoint
  saved at EP 2 exports bit-exactly and loads at EP 1;
- the weight sync: after every parameter is perturbed, the HF tensors hf_weight_buckets delivers at EP 2 (gathered
  from the EP rank holding each expert, and from its expert-TP shards), written as a HF checkpoint and loaded by
  transformers' Qwen3MoeForCausalLM, give the tokens and log-probs the built-in engine served at that layout."""
import json
import zlib

import pytest
import torch

from distributed_harness import run_distributed
from megatron_gtpo.checkpoint import convert_hf_to_megatron, convert_megatron_to_hf, read_checkpoint_metadata
from megatron_gtpo.checkpoint.hf_export import TorchDistReader
from test_converters import assert_bit_exact, read_safetensors_dir
from test_converters_megatron import _build, _declared_global_shapes, _from_hf, _unequal_parameters
from test_models_qwen3 import assert_serves_the_responses
from test_models_qwen3_moe import TINY
from tiny_models import make_tiny_model

VOCAB = TINY["vocab_size"]
PROMPTS = [[5, 17, 250, 999, 3, 42, 7], [1, 2, 3], [900, 800, 700, 600, 500]]
NEW_TOKENS = 6
# (TP, PP, EP, ETP) on 2 ranks: 2 experts per replica, 2 whole experts per TP rank, all experts on each of 2 stages.
LAYOUTS = [(1, 1, 2, None), (2, 1, 2, 1), (1, 2, 1, None)]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe_hf")
    make_tiny_model(root / "fp32", "qwen3_moe", seed=31, **TINY)
    make_tiny_model(root / "bf16", "qwen3_moe", tie=True, dtype=torch.bfloat16, seed=32, norm_topk_prob=False,
                    **TINY)
    return {"fp32": root / "fp32", "bf16": root / "bf16"}


@pytest.mark.parametrize("model,tp", [("fp32", 1), ("bf16", 2)])
def test_round_trip_is_bit_exact(moe_dirs, tmp_path, model, tp):
    src = moe_dirs[model]
    convert_hf_to_megatron(str(src), str(tmp_path / "mg"), tensor_parallel=tp, progress=False)
    convert_megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "hf"), progress=False)
    original, exported = read_safetensors_dir(src), read_safetensors_dir(tmp_path / "hf")
    assert_bit_exact(original, exported)
    assert sum(".mlp.experts." in name for name in exported) == TINY["num_layers"] * 4 * 3  # 4 experts, 3 each
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["num_experts_per_tok"]) == ("qwen3_moe", 2)


def _load_at_layouts(rank, world_size, hf_dir, mg_dir, saved_dir):
    """For each of LAYOUTS: parameters that differ between loading the converted checkpoint and loading the HF
    directory, and the keys megatron declares; then a checkpoint saved at EP 2 (from the HF weights)."""
    from megatron_gtpo.checkpoint import load_model_only, save_checkpoint
    from megatron_gtpo.distributed import initialize_parallel

    report = {}
    for tp, pp, ep, etp in LAYOUTS:
        groups = initialize_parallel(tp, pp, expert_parallel=ep, expert_tensor_parallel=etp)
        loaded = _build(read_checkpoint_metadata(mg_dir).hf_config, groups)
        load_model_only(mg_dir, loaded)
        report[tp, pp, ep] = (_unequal_parameters(_from_hf(hf_dir, groups), loaded), _declared_global_shapes(loaded))
    groups = initialize_parallel(1, 1, expert_parallel=2)
    model = _from_hf(hf_dir, groups)
    save_checkpoint(saved_dir, model, hf_config=read_checkpoint_metadata(mg_dir).hf_config)
    return report


def _load_saved_at_ep1(rank, world_size, hf_dir, saved_dir):
    from megatron_gtpo.checkpoint import load_model_only
    from megatron_gtpo.distributed import initialize_parallel

    groups = initialize_parallel(1, 1)
    loaded = _build(read_checkpoint_metadata(saved_dir).hf_config, groups)
    load_model_only(saved_dir, loaded)
    return _unequal_parameters(_from_hf(hf_dir, groups), loaded)


def test_converted_checkpoint_is_megatrons_layout_and_loads_at_expert_layouts(moe_dirs, tmp_path):
    hf_dir, mg_dir, saved_dir = str(moe_dirs["fp32"]), str(tmp_path / "mg"), str(tmp_path / "saved")
    convert_hf_to_megatron(hf_dir, mg_dir, tensor_parallel=2, progress=False)
    per_rank = run_distributed(_load_at_layouts, 2, args=(hf_dir, mg_dir, saved_dir), timeout_s=400)
    stored = {k: tuple(md.size) for k, md in TorchDistReader(mg_dir).metadata.state_dict_metadata.items()}
    layers, experts, hidden, width = TINY["num_layers"], 4, 64, 32
    assert stored["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (layers, experts, 2 * width, hidden)
    assert stored["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == (layers, experts, hidden, width)
    assert stored["decoder.layers.mlp.router.weight"] == (layers, experts, hidden)
    assert "decoder.layers.pre_mlp_layernorm.weight" in stored  # its own key in a MoE layer, on either layer spec
    declared = {}
    for report in per_rank:
        for (tp, pp, ep), (unequal, shapes) in report.items():
            assert unequal == [], f"TP={tp} PP={pp} EP={ep}: {unequal}"
            declared.update(shapes)
    assert declared == stored
    assert read_checkpoint_metadata(saved_dir).expert_parallel == 2
    assert run_distributed(_load_saved_at_ep1, 1, args=(hf_dir, saved_dir), timeout_s=300) == [[]]
    convert_megatron_to_hf(saved_dir, str(tmp_path / "hf2"), progress=False)
    assert_bit_exact(read_safetensors_dir(hf_dir), read_safetensors_dir(tmp_path / "hf2"))


def _perturb(chunks, groups, shape) -> None:
    """Noise on every parameter, seeded by its canonical name (global layer and expert) and, for a split one, its
    (expert-)TP rank: replicas of a tensor stay equal, shards differ, as training keeps them."""
    from megatron_gtpo.models.hf_checkpoint import layer_offset
    from megatron_gtpo.models.hf_mapping import ShardCoordinates, canonical_name

    offset = ShardCoordinates.of(groups).expert_offset(shape)
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                key = canonical_name(name, layer_offset(chunk), offset).replace("output_layer",
                                                                                 "embedding.word_embeddings")
                split = getattr(p, "tensor_model_parallel", False)
                rank = (groups.etp_rank if ".experts." in key else groups.tp_rank) if split else 0
                g = torch.Generator().manual_seed(zlib.crc32(key.encode()) + rank)
                p.add_(0.02 * torch.randn(p.shape, generator=g).to(p.device))


def _sync_and_serve(rank, world_size, model_dir, tp, pp, ep, etp):
    """The built-in engine's greedy responses after the perturbation, and the HF tensors the sync delivers to its
    destination (TP rank 0 of the first stage of each replica); None elsewhere."""
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.hf_mapping import ShardCoordinates
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.rollout import BuiltinEngine, SamplingParams
    from megatron_gtpo.rollout.weight_sync import hf_weight_buckets, is_sync_destination

    groups = initialize_parallel(tp, pp, expert_parallel=ep, expert_tensor_parallel=etp)
    with HFCheckpoint(model_dir) as ckpt:
        chunks = build_model(ckpt.config, tensor_parallel=tp, pipeline_parallel=pp, pp_rank=groups.pp_rank,
                             expert_parallel=ep, expert_tensor_parallel=etp)
        load_hf_weights(chunks, ckpt, shard=ShardCoordinates.of(groups))
        shape = ckpt.shape
    _perturb(chunks, groups, shape)
    # Each replica its own prompts (different responses and lengths): the engine keeps the EP group in lockstep.
    prompts = PROMPTS[groups.dp_rank:] + PROMPTS[:groups.dp_rank]
    responses = BuiltinEngine(chunks, groups, VOCAB).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)).to_lists()
    received = {name: t.clone() for bucket in hf_weight_buckets(chunks, groups, shape) for name, t in bucket}
    return (received, prompts, responses) if is_sync_destination(groups) else None


@pytest.mark.parametrize("tp,pp,ep,etp,dp", [
    (1, 1, 2, None, 2),
    (2, 1, 2, 1, 1),
    pytest.param(2, 1, 2, None, 2, marks=pytest.mark.slow),  # each expert split over ETP = TP = 2
    pytest.param(1, 2, 2, None, 2, marks=pytest.mark.slow),
])
def test_weight_sync_serves_the_built_in_engines_logprobs(moe_dirs, tmp_path, tp, pp, ep, etp, dp):
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeForCausalLM

    path = moe_dirs["fp32"]
    results = run_distributed(_sync_and_serve, tp * pp * dp, args=(str(path), tp, pp, ep, etp), timeout_s=400)
    destinations = [r for r in results if r is not None]
    assert len(destinations) == dp
    checkpoint = load_file(str(path / "model.safetensors"))
    for received, prompts, responses in destinations:
        assert sorted(received) == sorted(checkpoint)  # every expert of every layer, the routers
        assert all(not torch.equal(received[name], tensor) for name, tensor in checkpoint.items())  # all perturbed
        served_dir = tmp_path / "served"
        served_dir.mkdir(exist_ok=True)
        save_file({k: v.contiguous() for k, v in received.items()}, str(served_dir / "model.safetensors"))
        (served_dir / "config.json").write_text((path / "config.json").read_text())
        served = Qwen3MoeForCausalLM.from_pretrained(str(served_dir)).eval()
        assert_serves_the_responses(served, prompts, responses, f"TP={tp} PP={pp} EP={ep}")
