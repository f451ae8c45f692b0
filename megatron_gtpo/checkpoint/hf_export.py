"""megatron_gtpo checkpoint -> Hugging Face Qwen2 / Qwen3 / Qwen3-MoE directory (sharded safetensors + index,
config.json, generation config, tokenizer files), streaming, in one process.

Works on converter output and on trainer checkpoints (written at any TP/PP/EP, with or without optimizer state): only
the model's keys are read. For each entry of the single HF<->Megatron mapping, the global megatron tensor of one
layer (or of one expert of a layer) is read from the torch_dist data (whatever chunks it was stored in), split into
HF tensors by `megatron_shards_to_hf` (which also drops the padded vocabulary rows), and appended to a safetensors
file whose header was written up front. Memory: one layer's global tensor, its HF pieces and one stored chunk being
deserialised, about 3x the largest tensor above the interpreter's baseline.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_gtpo.models.hf_checkpoint import INDEX_FILE, SINGLE_FILE
from megatron_gtpo.models.hf_mapping import hf_tensor_shape, megatron_shards_to_hf, tensor_mappings
from megatron_gtpo.progress import progress_bar

from .atomic_dir import atomic_output_dir
from .manifest import check_intact, reading
from .megatron_checkpoint import (HF_FILES_DIR, copy_hf_side_files, dist_checkpoint_key, dtype_name,
                                  read_checkpoint_metadata)

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size ("5GB")
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524_288_000, '1000' -> 1000 (bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if m is None or m.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"max shard size {text!r} is not a size such as 5GB, 500MB, 2GiB or a number of bytes")
    size = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    if size < 1:
        raise ValueError(f"max shard size {text!r} must be positive")
    return size


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors packed into files of at most `max_shard_bytes` (a larger tensor gets a file of its own),
    as Hugging Face's save_pretrained does."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


class SafetensorsShardWriter:
    """Writes safetensors files whose contents (names, shapes, dtypes, order) are known up front, one tensor at a
    time: each file's header is written when the file is opened and each tensor's bytes are appended as it arrives,
    so only the tensor being written is in memory. `write` must be called in the planned order; `close` checks that
    everything was written and writes the index (model.safetensors.index.json) when there is more than one file."""

    def __init__(self, directory: str, shards: list[list[TensorSpec]]):
        for spec in (s for shard in shards for s in shard):
            if spec.dtype not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{spec.name}: dtype {spec.dtype} cannot be written to safetensors here")
        self.directory = directory
        self.shards = shards
        n = len(shards)
        self.file_names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._queue = [(i, spec) for i, shard in enumerate(shards) for spec in shard]
        self._next = 0
        self._file = None
        self._file_index = -1

    def _open(self, index: int) -> None:
        if self._file is not None:
            self._file.close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for spec in self.shards[index]:
            header[spec.name] = {"dtype": _SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self._file = open(os.path.join(self.directory, self.file_names[index]), "wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        self._file_index = index

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._queue):
            raise ValueError(f"{name}: every planned tensor has already been written")
        index, spec = self._queue[self._next]
        if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(f"expected {spec.name} {spec.shape} {spec.dtype} next, got {name} "
                             f"{tuple(tensor.shape)} {tensor.dtype}")
        if index != self._file_index:
            self._open(index)
        self._file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._next += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._next != len(self._queue):
            raise ValueError(f"{len(self._queue) - self._next} planned tensors were not written, starting with "
                             f"{self._queue[self._next][1].name}")
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": sum(s.nbytes for shard in self.shards for s in shard)},
                     "weight_map": {s.name: self.file_names[i] for i, shard in enumerate(self.shards) for s in shard}}
            with open(os.path.join(self.directory, INDEX_FILE), "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2)
                f.write("\n")


class _IntoTensorPlanner(DefaultLoadPlanner):
    """Directs every read of a plan into one destination tensor (the default planner narrows it to each read's
    box, relative to the box the plan was made for)."""

    def __init__(self, destination: torch.Tensor):
        super().__init__()
        self.destination = destination

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.destination


class TorchDistReader:
    """Reads boxes of tensors out of torch_dist (torch.distributed.checkpoint) data, whatever chunks they were
    stored in, without starting torch.distributed."""

    def __init__(self, directory: str):
        self.directory = directory
        self._reader = FileSystemReader(directory)
        self.metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, True)

    def tensor_metadata(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"checkpoint {self.directory!r} has no tensor {key!r}"
                             + ("" if md is None else f" (it holds a {type(md).__name__} under that key)"))
        return md

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box [offsets, offsets + sizes) of stored tensor `key`, in its stored dtype."""
        md = self.tensor_metadata(key)
        destination = torch.empty(sizes, dtype=md.properties.dtype)
        box = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        items = create_read_items_for_chunk_list(key, md, [box])
        if sum(math.prod(item.lengths) for item in items) != destination.numel():
            raise ValueError(f"checkpoint {self.directory!r}: the stored chunks of {key!r} do not cover "
                             f"{tuple(offsets)} + {tuple(sizes)} (incomplete checkpoint)")
        self._reader.read_data(LoadPlan(items), _IntoTensorPlanner(destination)).wait()
        return destination


def _generation_config(hf_config: dict) -> dict:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {"_from_model_config": True, **{k: hf_config[k] for k in keys if hf_config.get(k) is not None}}


def convert_megatron_to_hf(megatron_dir: str, output_dir: str, *, dtype: torch.dtype | None = None,
                           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, force: bool = False,
                           progress: bool = True) -> list[str]:
    """Write the HF Qwen2 / Qwen3 model of the megatron_gtpo checkpoint in `megatron_dir` to `output_dir` (created
    atomically; replaced only with `force`). Each tensor keeps its stored dtype unless `dtype` is given. Returns the
    names of the safetensors files."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    check_intact(megatron_dir)
    meta = read_checkpoint_metadata(megatron_dir)
    shape = meta.shape
    reader = TorchDistReader(megatron_dir)
    mappings = tensor_mappings(shape)
    if shape.tie_word_embeddings:  # lm_head is the embedding: HF stores it once, megatron too
        mappings = [m for m in mappings if m.megatron_name != "output_layer.weight"]

    # Plan from the stored metadata alone: every key and global shape is checked before anything is written.
    reads, specs = [], []
    for mapping in mappings:
        at = dist_checkpoint_key(mapping.megatron_name, shape)
        key, axes = at.key, len(at.index)
        md = reader.tensor_metadata(key)
        stored = tuple(md.size)
        per_layer = stored[axes:]
        if stored[:axes] != at.stacked or not per_layer:
            axes_named = ", ".join(f"{n} {what}" for n, what in zip(at.stacked, ("layers", "experts")))
            raise ValueError(f"{key}: stored shape {stored} is not [{axes_named}, ...] as config.json says")
        metas = [torch.empty(per_layer, dtype=md.properties.dtype, device="meta")]
        try:
            hf_metas = megatron_shards_to_hf(mapping, metas, shape)
        except RuntimeError as e:
            raise ValueError(f"{key}: stored shape {stored} does not fit the model in config.json ({e})") from e
        for name, hf_meta in zip(mapping.hf_names, hf_metas):
            if tuple(hf_meta.shape) != hf_tensor_shape(name, shape):
                raise ValueError(f"{key}: stored shape {stored} gives {name} {tuple(hf_meta.shape)}, but config.json "
                                 f"implies {hf_tensor_shape(name, shape)}")
            specs.append(TensorSpec(name, tuple(hf_meta.shape), dtype or hf_meta.dtype))
        reads.append((mapping, key, (*at.index, *(0 for _ in per_layer)), (*(1 for _ in at.index), *per_layer), axes))

    out_dtypes = {spec.dtype for spec in specs}
    hf_config = dict(meta.hf_config)
    if len(out_dtypes) == 1:  # config.json names the weights' dtype ("torch_dtype"; transformers 5 says "dtype")
        for dtype_key in [k for k in ("torch_dtype", "dtype") if k in hf_config] or ["torch_dtype"]:
            hf_config[dtype_key] = dtype_name(next(iter(out_dtypes)))

    with atomic_output_dir(output_dir, force=force, inputs=(megatron_dir,)) as tmp:
        writer = SafetensorsShardWriter(tmp, plan_shards(specs, max_shard_bytes))
        for mapping, key, offsets, sizes, axes in progress_bar(reads, desc="HF tensors", unit="tensor",
                                                               disable=not progress):
            with reading(megatron_dir):
                stored = reader.read(key, offsets, sizes)
            global_tensor = stored.reshape(stored.shape[axes:])  # without the stacked axes (each of size 1 here)
            for name, tensor in zip(mapping.hf_names, megatron_shards_to_hf(mapping, [global_tensor], shape)):
                writer.write(name, tensor if dtype is None else tensor.to(dtype))
            del stored, global_tensor
        writer.close()
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(hf_config, f, indent=2)
            f.write("\n")
        copy_hf_side_files(os.path.join(megatron_dir, HF_FILES_DIR), tmp)
        if not os.path.isfile(os.path.join(tmp, "generation_config.json")):
            with open(os.path.join(tmp, "generation_config.json"), "w", encoding="utf-8") as f:
                json.dump(_generation_config(hf_config), f, indent=2)
                f.write("\n")
    return writer.file_names
