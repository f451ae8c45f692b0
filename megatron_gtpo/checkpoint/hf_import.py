"""Hugging Face Qwen2 / Qwen3 / Qwen3-MoE safetensors -> megatron_gtpo checkpoint, streaming, in one process.

No model is built and torch.distributed is not started. For each entry of the single HF<->Megatron mapping, the HF
tensors are read (memory-mapped), `hf_to_megatron_shard(..., tp_size=1)` gives the global megatron tensor (the
TP-independent view dist_checkpointing stores), and it is written as the chunks a run at `tensor_parallel` would
write (equal parts along its TP split dimension; 2*TP parts for linear_fc1, whose global layout is
[gate of all ranks; up of all ranks]) straight into the torch_dist format, under megatron's sharded keys
(megatron_checkpoint.dist_checkpoint_key; an expert's at its layer and expert index). megatron.core.dist_checkpointing
then loads it at any TP/PP/EP.

Memory: every write item is planned from shapes alone (config.json, checked against each HF tensor's header), then
data is produced one mapping at a time when the writer asks for it: at most the HF tensors of one mapping, their
global megatron tensor and one chunk copy are alive, about 3x the largest tensor (the embedding) above the
interpreter's baseline. benchmarks/convert_bench.py measures it.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
# _StorageInfo is private, but it is what FileSystemReader expects in .metadata for each item (file, offset, length).
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from megatron_gtpo.models.hf_checkpoint import HFCheckpoint
from megatron_gtpo.models.hf_mapping import FC1, TensorMapping, hf_to_megatron_shard, tensor_mappings
from megatron_gtpo.layout import ParallelLayout, check_layout
from megatron_gtpo.progress import progress_bar

from .atomic_dir import atomic_output_dir
from .manifest import write_manifest
from .megatron_checkpoint import (HF_FILES_DIR, CheckpointMetadata, StoredAt, copy_hf_side_files,
                                  dist_checkpoint_key, dtype_name, write_checkpoint_metadata,
                                  write_megatron_format_files)


@dataclass(frozen=True)
class _Chunk:
    """One stored piece of a megatron tensor: rows/columns `start:start+length` of its TP split dimension."""

    mapping: TensorMapping
    stored: StoredAt  # its key and index on the stacked leading axes (layer; layer and expert)
    split_dim: int | None  # in the per-layer tensor; None: stored whole
    start: int
    length: int

    def offsets(self, ndim: int) -> tuple[int, ...]:
        per_layer = [self.start if d == self.split_dim else 0 for d in range(ndim)]
        return (*self.stored.index, *per_layer)

    def sizes(self, global_shape: tuple[int, ...]) -> tuple[int, ...]:
        per_layer = [self.length if d == self.split_dim else n for d, n in enumerate(global_shape)]
        return (*(1 for _ in self.stored.index), *per_layer)


def _chunks(mapping: TensorMapping, global_shape: tuple[int, ...], tensor_parallel: int, shape) -> list[_Chunk]:
    stored = dist_checkpoint_key(mapping.megatron_name, shape)
    split_dim = mapping.tp_split_dim
    if split_dim is None:
        return [_Chunk(mapping, stored, None, 0, 0)]
    parts = 2 * tensor_parallel if mapping.layout == FC1 else tensor_parallel
    length = global_shape[split_dim] // parts
    return [_Chunk(mapping, stored, split_dim, i * length, length) for i in range(parts)]


class _ChunkSavePlanner(DefaultSavePlanner):
    """Plans every chunk's write item up front from shapes and dtypes alone, and produces a chunk's data only when
    the storage writer asks for it (`lookup_object`, the planner's documented extension point)."""

    def __init__(self, items: list[tuple[WriteItem, _Chunk]], produce):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items = [item for item, _ in items]
        self._chunks = {(item.index.fqn, tuple(item.index.offset)): chunk for item, chunk in items}
        self._produce = produce

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self._produce(self._chunks[(index.fqn, tuple(index.offset))])


class _SequentialWriter(FileSystemWriter):
    """torch's FileSystemWriter, except that it writes the items one after another into one file and lets go of each
    tensor once written (torch's own loop keeps every tensor of a file alive until the file is complete). The
    encoding is torch's: each item is torch.save'd at an offset recorded in the checkpoint's .metadata."""

    def __init__(self, path: str, *, progress: bool):
        super().__init__(path, single_file_per_rank=True, thread_count=1)
        self._progress = progress

    def write_data(self, plan: SavePlan, planner) -> Future:

        file_name = f"{plan.storage_data.prefix}0.distcp"
        results = []
        with open(os.path.join(self.path, file_name), "wb") as stream:
            for item in progress_bar(plan.items, desc="megatron chunks", unit="chunk", disable=not self._progress):
                if item.type != WriteItemType.SHARD:
                    raise TypeError(f"{item.index.fqn}: only tensor chunks are written here, not {item.type}")
                tensor = planner.resolve_data(item).detach().contiguous()
                if tensor.untyped_storage().nbytes() != tensor.nbytes:
                    tensor = tensor.clone()  # torch.save would write the whole storage of a view
                offset = stream.tell()
                torch.save(tensor, stream)
                results.append(WriteResult(index=item.index, size_in_bytes=stream.tell() - offset,
                                           storage_data=_StorageInfo(file_name, offset, stream.tell() - offset)))
                del tensor
            stream.flush()
            if self.sync_files:
                os.fsync(stream.fileno())
        future: Future = Future()
        future.set_result(results)
        return future


class _Importer:
    """Reads a HF checkpoint through the mapping and produces chunks on demand, one mapping's tensors at a time."""

    def __init__(self, ckpt: HFCheckpoint, *, tensor_parallel: int, dtype: torch.dtype | None):
        self.ckpt, self.shape, self.dtype = ckpt, ckpt.shape, dtype
        self.plan: list[tuple[WriteItem, _Chunk]] = []
        self.dtypes: set[torch.dtype] = set()
        for mapping in tensor_mappings(self.shape):
            if self.shape.tie_word_embeddings and mapping.megatron_name == "output_layer.weight":
                continue  # a tied output layer is stored as the embedding (megatron marks it as a replica)
            self._plan_mapping(mapping, tensor_parallel)
        self._current: tuple[TensorMapping | None, torch.Tensor | None] = (None, None)

    def _plan_mapping(self, mapping: TensorMapping, tensor_parallel: int) -> None:
        # Every HF tensor is opened (its header only: the memory map is not touched) so that missing tensors and
        # shapes that disagree with config.json are reported before anything is written.
        headers = [self.ckpt.get(name) for name in mapping.hf_names]
        dtypes = {t.dtype for t in headers}
        if len(dtypes) != 1:
            raise ValueError(f"{mapping.hf_names} have different dtypes {sorted(map(str, dtypes))}")
        dtype = self.dtype or dtypes.pop()
        self.dtypes.add(dtype)
        metas = [torch.empty(t.shape, dtype=dtype, device="meta") for t in headers]
        global_shape = tuple(hf_to_megatron_shard(mapping, metas, self.shape, 0, 1).shape)
        for chunk in _chunks(mapping, global_shape, tensor_parallel, self.shape):
            stored_shape = (*chunk.stored.stacked, *global_shape)
            item = WriteItem(
                index=MetadataIndex(chunk.stored.key, torch.Size(chunk.offsets(len(global_shape)))),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets(len(global_shape))),
                                               sizes=torch.Size(chunk.sizes(global_shape))),
                    properties=TensorProperties(dtype=dtype), size=torch.Size(stored_shape)))
            self.plan.append((item, chunk))

    def _global_tensor(self, mapping: TensorMapping) -> torch.Tensor:
        if self._current[0] is not mapping:
            self._current = (None, None)  # free the previous mapping's tensors before reading the next
            hf_tensors = [self.ckpt.get(name) for name in mapping.hf_names]
            if self.dtype is not None:
                hf_tensors = [t.to(self.dtype) for t in hf_tensors]
            self._current = (mapping, hf_to_megatron_shard(mapping, hf_tensors, self.shape, 0, 1))
        return self._current[1]

    def chunk_data(self, chunk: _Chunk) -> torch.Tensor:
        tensor = self._global_tensor(chunk.mapping)
        if chunk.split_dim is not None:
            tensor = tensor.narrow(chunk.split_dim, chunk.start, chunk.length)
        return tensor.reshape(chunk.sizes(tuple(tensor.shape)))  # a leading 1 per stacked axis


def convert_hf_to_megatron(hf_dir: str, output_dir: str, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                           dtype: torch.dtype | None = None, force: bool = False,
                           progress: bool = True) -> CheckpointMetadata:
    """Write the megatron_gtpo checkpoint of the HF Qwen2 / Qwen3 / Qwen3-MoE model in `hf_dir` to `output_dir`
    (created atomically; an existing one is replaced only with `force`). Each tensor keeps its dtype unless `dtype` is
    given. `tensor_parallel` / `pipeline_parallel` are checked against the model and set how the data is chunked on
    disk; the checkpoint loads at any TP/PP/EP."""
    from torch.distributed.checkpoint import save as dcp_save

    for name, value in (("tensor_parallel", tensor_parallel), ("pipeline_parallel", pipeline_parallel)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    ckpt = HFCheckpoint(hf_dir)
    check_layout(ParallelLayout(tensor_parallel, pipeline_parallel, None), shape=ckpt.shape)
    importer = _Importer(ckpt, tensor_parallel=tensor_parallel, dtype=dtype)
    dtypes = importer.dtypes
    metadata = CheckpointMetadata(
        hf_config=ckpt.config, dtype=dtype_name(next(iter(dtypes))) if len(dtypes) == 1 else "mixed",
        tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
        extra={"converted_from": os.path.abspath(hf_dir)})
    with atomic_output_dir(output_dir, force=force, inputs=(hf_dir,)) as tmp:
        with warnings.catch_warnings():  # torch warns that it saves in a single process, which is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp_save({}, storage_writer=_SequentialWriter(tmp, progress=progress),
                         planner=_ChunkSavePlanner(importer.plan, importer.chunk_data), no_dist=True)
            except CheckpointException as e:  # one process, one failure: raise it rather than DCP's wrapper
                (error, _), = e.failures.values()
                raise error from None
        write_megatron_format_files(tmp)
        copy_hf_side_files(hf_dir, os.path.join(tmp, HF_FILES_DIR))
        write_checkpoint_metadata(tmp, metadata)
        write_manifest(tmp)
    return metadata
