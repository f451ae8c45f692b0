"""What the checkpoint tests of every model family share: reading a HF directory with safetensors itself, bit-exact
comparison, the HF side files a converter must carry, and megatron models built and loaded at a rank's layout (in
spawned ranks) to compare parameters and declared shapes."""
from __future__ import annotations

import os

import torch
from safetensors import safe_open


SIDE_FILES = {"tokenizer.json": '{"model": "tiny"}', "tokenizer_config.json": '{"model_max_length": 256}',
              "vocab.json": '{"a": 0}', "merges.txt": "#version: 0.2\na b\n", "special_tokens_map.json": "{}"}


def read_safetensors_dir(path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF directory, read with safetensors itself (independent of our writer)."""
    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def assert_bit_exact(expected: dict, actual: dict):
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


def declared_global_shapes(chunks) -> dict:
    """{sharded key: global shape} of the tensors GPTModel.sharded_state_dict() declares (factories built)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from megatron_gtpo.checkpoint.megatron_checkpoint import model_sharded_state_dict

    shapes = {}
    for chunk_state in model_sharded_state_dict(chunks).values():
        for value in chunk_state.values():
            built = value.build() if isinstance(value, ShardedTensorFactory) else [value]
            for tensor in built if isinstance(built, list) else [built]:
                if isinstance(tensor, ShardedTensor):
                    shapes[tensor.key] = tuple(tensor.global_shape)
    return shapes


def model_at_layout(hf_config, groups):
    from megatron_gtpo.models.qwen import build_model

    chunks = build_model(hf_config, tensor_parallel=groups.tp_size, pipeline_parallel=groups.pp_size,
                         pp_rank=groups.pp_rank, expert_parallel=groups.ep_size,
                         expert_tensor_parallel=groups.etp_size)
    for chunk in chunks:
        chunk.eval()
    return chunks


def model_from_hf(hf_dir, groups):
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.hf_mapping import ShardCoordinates

    with HFCheckpoint(hf_dir) as ckpt:
        chunks = model_at_layout(ckpt.config, groups)
        load_hf_weights(chunks, ckpt, shard=ShardCoordinates.of(groups))
    return chunks


def unequal_parameters(expected_chunks, actual_chunks) -> list[str]:
    expected = dict(expected_chunks[0].named_parameters())
    actual = dict(actual_chunks[0].named_parameters())
    assert expected.keys() == actual.keys()
    return [name for name in expected if not torch.equal(expected[name], actual[name])]
