"""Reading Hugging Face safetensors checkpoints one tensor at a time, and loading them into megatron model chunks
through the single mapping in hf_mapping.py."""
from __future__ import annotations

import json
import os

import torch

from .hf_mapping import ShardCoordinates, canonical_name, hf_tensor_shape, hf_to_megatron_shard, tensor_mappings
from .qwen import ModelShape, load_hf_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class HFCheckpoint:
    """A HF model directory's safetensors, read lazily: `get(name)` reads one tensor from disk (memory-mapped).

    Each `get` opens its file anew: pages read through a memory map stay resident for as long as the map is open,
    so a handle kept open for the whole checkpoint would end up holding all of it in memory. A returned tensor keeps
    only its own pages mapped, until it is freed."""

    def __init__(self, model_dir: str):
        from safetensors import safe_open

        self.model_dir = model_dir
        self.config = load_hf_config(model_dir)
        self.shape = ModelShape.from_hf(self.config)
        index_path = os.path.join(model_dir, INDEX_FILE)
        if os.path.isfile(index_path):
            with open(index_path, encoding="utf-8") as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(model_dir, SINGLE_FILE)):
            weight_map = None
        else:
            raise FileNotFoundError(f"{model_dir!r} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors "
                                    f"checkpoints are supported)")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        self._paths = {}
        for fname in files:
            path = os.path.join(model_dir, fname)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"shard {fname!r} listed in {INDEX_FILE} is missing from {model_dir!r}")
            self._paths[fname] = path
        if weight_map is None:
            with safe_open(self._paths[SINGLE_FILE], framework="pt") as f:
                weight_map = {k: SINGLE_FILE for k in f.keys()}
        self.weight_map = weight_map

    def close(self) -> None:
        """Nothing stays open between reads; kept so that `with HFCheckpoint(...)` reads naturally."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir!r}")
        from safetensors import safe_open

        with safe_open(self._paths[self.weight_map[name]], framework="pt") as f:
            tensor = f.get_tensor(name)
        expected = hf_tensor_shape(name, self.shape)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} in the checkpoint does not match {expected} "
                             f"implied by config.json in {self.model_dir!r}")
        return tensor


def layer_offset(model_chunk) -> int:
    """Global index of the first transformer layer held by a model chunk."""
    module = getattr(model_chunk, "module", model_chunk)
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    layers = module.decoder.layers if getattr(module, "decoder", None) is not None else []
    return layers[0].layer_number - 1 if len(layers) else 0


@torch.no_grad()
def load_hf_weights(model_chunks: list, checkpoint: HFCheckpoint, *, tp_rank: int = 0, tp_size: int = 1,
                    shard: ShardCoordinates | None = None) -> None:
    """Copy the HF tensors into this rank's parameters (any TP/PP/VPP; a mixture-of-experts model at any EP/ETP with
    `shard`, ShardCoordinates.of(groups), which replaces tp_rank / tp_size). Every parameter must be covered; only
    this rank's experts are read."""
    shard = shard or ShardCoordinates(tp_rank, tp_size)
    shape = checkpoint.shape
    by_name = {m.megatron_name: m for m in tensor_mappings(shape)}
    for chunk in model_chunks:
        offset = layer_offset(chunk)
        for param_name, param in chunk.named_parameters():
            name = canonical_name(param_name, offset, shard.expert_offset(shape))
            mapping = by_name.get(name)
            if mapping is None:
                raise KeyError(f"megatron parameter {param_name!r} ({name}) has no Hugging Face counterpart")
            rank, size = shard.split(mapping)
            tensor = hf_to_megatron_shard(mapping, [checkpoint.get(n) for n in mapping.hf_names], shape, rank, size)
            if tensor.shape != param.shape:
                raise ValueError(f"{param_name}: HF shard shape {tuple(tensor.shape)} != parameter shape "
                                 f"{tuple(param.shape)} (TP={shard.tp_size}, EP={shard.ep_size}, "
                                 f"ETP={shard.etp_size})")
            param.copy_(tensor)
