"""Megatron model shards -> full Hugging Face tensors, streamed in bounded-size buckets to one destination rank.

`hf_weight_buckets` is collective over the model-parallel group (every TP and PP rank of one model replica
iterates it). Tensor by tensor, in Hugging Face file order, through the ONE mapping of models/hf_mapping.py:

1. the pipeline stage holding the megatron tensor gathers its TP shards onto its TP rank 0 (`dist.gather` on the
   TP group; replicated tensors need no gather);
2. that rank turns the shards into the HF tensors (`megatron_shards_to_hf`: q/k/v split, gate/up split, vocab
   padding dropped, ...);
3. if that stage is not the first one, it sends them (send/recv on the pipeline group) to the destination: TP rank 0
   of the first pipeline stage, where the rollout engine lives;
4. the destination collects whole units in a bucket and yields the bucket (a list of (hf_name, tensor)) when the
   next unit would take it past `bucket_bytes`. A unit is everything of one decoder layer (or one non-layer tensor):
   engines that post-process weights per layer (vLLM's in-place reload) must see a layer's tensors together.

Memory: the destination holds at most one bucket: max(bucket_bytes, the largest unit) bytes (the caller must drop a
bucket before asking for the next; the generator keeps no reference to it), plus, transiently, one more copy of the
megatron tensor being converted (its gathered TP shards, while its HF form joins the bucket). Never the whole model
(tests/test_rollout_weight_sync.py measures the resident set). A tied output layer is not sent (it IS the embedding).

Other ranks' iterations yield nothing; they only take part in the gathers and sends.

`pack_bucket` / `unpack_bucket`: a bucket as one byte string plus names, dtypes and shapes, for engines reached
through an RPC that does not carry tensors (vLLM's collective_rpc, rollout/vllm_engine.py). Packing makes one host
copy, so a packed sync holds about two buckets at once (measured by the same test).
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_gtpo.models.hf_checkpoint import layer_offset
from megatron_gtpo.models.hf_mapping import (REPLICATED, canonical_name, hf_tensor_shape, megatron_shards_to_hf,
                                             tensor_mappings)

_LAYER_INDEX = re.compile(r"^decoder\.layers\.(\d+)\.")
DEFAULT_BUCKET_BYTES = 512 * 2**20


def sync_units(shape) -> list[list]:
    """The mappings to send, grouped into units that must share a bucket (one decoder layer, or one tensor)."""
    units: list[list] = []
    current_layer = None
    for mapping in tensor_mappings(shape):
        if shape.tie_word_embeddings and mapping.megatron_name == "output_layer.weight":
            continue
        match = _LAYER_INDEX.match(mapping.megatron_name)
        layer = int(match.group(1)) if match else None
        if layer is not None and layer == current_layer:
            units[-1].append(mapping)
        else:
            units.append([mapping])
        current_layer = layer
    return units


def policy_checksum_names(shape) -> list[str]:
    """HF tensors whose checksums identify a policy version after a sync: every RMSNorm weight. They are trained,
    and every engine stores them unsharded and unrepacked, so the engine side can checksum them at any TP."""
    names = [f"model.layers.{i}.{n}.weight" for i in range(shape.num_layers)
             for n in ("input_layernorm", "post_attention_layernorm")]
    return names + ["model.norm.weight"]


def tensor_checksum(tensor: torch.Tensor) -> tuple[float, float]:
    """(sum, sum of squares) in float64: cheap, and different for any real weight update."""
    t = tensor.detach().double()
    return float(t.sum()), float((t * t).sum())


def is_sync_destination(groups) -> bool:
    """The rank that receives the full HF tensors: TP rank 0 of the first pipeline stage."""
    return groups.tp_rank == 0 and groups.pp_rank == 0


def _local_parameters(model_chunks: list) -> dict[str, torch.Tensor]:
    params = {}
    for chunk in model_chunks:
        offset = layer_offset(chunk)
        for name, param in chunk.named_parameters():
            params[canonical_name(name, offset)] = param
    return params


def _owner_stages(local_names: list[str], groups) -> dict[str, int]:
    """Pipeline rank holding each canonical megatron tensor (an object all-gather over the pipeline group)."""
    if groups.pp_size == 1:
        return {name: 0 for name in local_names}
    per_stage: list = [None] * groups.pp_size
    dist.all_gather_object(per_stage, local_names, group=groups.pp_group)
    owners: dict[str, int] = {}
    for stage, names in enumerate(per_stage):
        for name in names:
            owners.setdefault(name, stage)  # a tied output layer lives on two stages; it is never sent
    return owners


def hf_weight_buckets(model_chunks: list, groups, shape, *,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets of (hf_name, full HF tensor) on the destination rank (`is_sync_destination`); yield nothing
    elsewhere. Collective over the model-parallel group: every rank must exhaust the iterator. See the module doc
    for the protocol and the memory bound.

    Not decorated with torch.no_grad(): its generator wrapper holds the last yielded bucket while it produces the
    next one, i.e. two buckets at once (measured); the tensors are detached where they are read instead."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
    local = _local_parameters(model_chunks)
    owners = _owner_stages(list(local), groups)
    dtype = next(iter(local.values())).dtype
    destination = is_sync_destination(groups)
    tp_root = dist.get_global_rank(groups.tp_group, 0) if groups.tp_size > 1 else None
    first_stage_peer = dist.get_global_rank(groups.pp_group, 0) if groups.pp_size > 1 else None

    bucket: list[tuple[str, torch.Tensor]] = []
    bucket_size = 0
    for unit in sync_units(shape):
        unit_bytes = sum(torch.Size(hf_tensor_shape(n, shape)).numel() for m in unit for n in m.hf_names) \
            * dtype.itemsize
        if destination and bucket and bucket_size + unit_bytes > bucket_bytes:
            yield bucket
            bucket, bucket_size = [], 0
        for mapping in unit:
            owner = owners.get(mapping.megatron_name)
            if owner is None:
                raise KeyError(f"no pipeline stage holds {mapping.megatron_name!r}: the model chunks do not match "
                               f"the checkpoint shape")
            hf_tensors = None
            if owner == groups.pp_rank:
                hf_tensors = _gather_to_hf(mapping, local[mapping.megatron_name], groups, shape, tp_root)
            if owner != 0 and groups.tp_rank == 0:  # stage `owner` -> first stage, along the pipeline group
                if groups.pp_rank == owner:
                    _send_all(hf_tensors, first_stage_peer, groups.pp_group)
                elif destination:
                    hf_tensors = _recv_all(mapping, shape, dtype, dist.get_global_rank(groups.pp_group, owner), groups)
            if destination:
                bucket += list(zip(mapping.hf_names, hf_tensors))
            del hf_tensors  # the generator frame must not keep a yielded bucket's tensors alive
        if destination:
            bucket_size += unit_bytes
    if destination and bucket:
        yield bucket


def _send_all(tensors: list[torch.Tensor], dst: int, group) -> None:
    for tensor in tensors:
        dist.send(tensor.contiguous(), dst=dst, group=group)


def _recv_all(mapping, shape, dtype, src: int, groups) -> list[torch.Tensor]:
    tensors = []
    for name in mapping.hf_names:
        tensor = torch.empty(hf_tensor_shape(name, shape), dtype=dtype, device=groups.device)
        dist.recv(tensor, src=src, group=groups.pp_group)
        tensors.append(tensor)
    return tensors


@torch.no_grad()
def _gather_to_hf(mapping, param: torch.Tensor, groups, shape, tp_root) -> list[torch.Tensor] | None:
    """On the owning stage: the HF tensors on its TP rank 0 (None on the other TP ranks)."""
    if mapping.layout == REPLICATED or groups.tp_size == 1:
        return megatron_shards_to_hf(mapping, [param.detach()], shape) if groups.tp_rank == 0 else None
    shard = param.detach().contiguous()
    shards = [torch.empty_like(shard) for _ in range(groups.tp_size)] if groups.tp_rank == 0 else None
    dist.gather(shard, gather_list=shards, dst=tp_root, group=groups.tp_group)
    return megatron_shards_to_hf(mapping, shards, shape) if groups.tp_rank == 0 else None


def pack_bucket(bucket: list) -> tuple[list[str], list[str], list[list[int]], memoryview]:
    """A bucket of (name, tensor) as plain msgpack-able values: vLLM's RPC decodes tensors inside argument lists only
    for msgspec-typed parameters, so the tensors travel as one byte string (names, dtypes and shapes beside it).
    One host copy of the bucket is made, tensor by tensor straight from the device into its slice (no per-tensor
    host copies, no device-side concatenation); the byte string is a view of it."""
    sizes = [t.numel() * t.element_size() for _, t in bucket]
    flat = torch.empty(sum(sizes), dtype=torch.uint8)
    offset = 0
    for (_, t), size in zip(bucket, sizes):
        flat[offset:offset + size].copy_(t.detach().reshape(-1).view(torch.uint8))
        offset += size
    return ([n for n, _ in bucket], [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            [list(t.shape) for _, t in bucket], memoryview(flat.numpy()))


def unpack_bucket(names: list[str], dtype_names: list[str], shapes: list[list[int]],
                  payload: bytes) -> list[tuple[str, torch.Tensor]]:
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    weights, offset = [], 0
    for name, dtype_name, shape in zip(names, dtype_names, shapes):
        dtype = getattr(torch, dtype_name)
        nbytes = math.prod(shape) * dtype.itemsize
        weights.append((name, flat[offset:offset + nbytes].view(dtype).reshape(shape)))
        offset += nbytes
    if offset != len(payload):
        raise ValueError(f"packed bucket holds {len(payload)} bytes, its tensors need {offset}")
    return weights
