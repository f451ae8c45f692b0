"""Megatron model shards -> full Hugging Face tensors, streamed in bounded-size buckets to the destination ranks.

The destinations are the hosts of a replica's rollout engines (rollout/placement.engine_hosts), given as
(pp_rank, tp_rank) pairs; by default only TP rank 0 of the first pipeline stage. Every destination receives EVERY
tensor: an engine on stage 1's GPUs needs stage 0's layers too. `hf_weight_buckets` is collective over the
model-parallel group (every TP and PP rank of one model replica iterates it). Tensor by tensor, in Hugging Face file
order, through the ONE mapping of models/hf_mapping.py:

1. the pipeline stage holding the megatron tensor collects its TP shards on the TP ranks that hold a destination on
   some stage (`dist.gather` onto TP rank 0 when that is the only one, else `dist.all_gather`; replicated tensors
   need neither);
2. those ranks turn the shards into the HF tensors (`megatron_shards_to_hf`: q/k/v split, gate/up split, vocab
   padding dropped, ...);
3. if destinations on other stages share that TP rank, the owning stage broadcasts the HF tensors along its
   pipeline group (stages there without a destination receive and drop them);
4. each destination collects whole units in a bucket and yields the bucket (a list of (hf_name, tensor)) when the
   next unit would take it past `bucket_bytes`. A unit is everything of one decoder layer (or one non-layer tensor):
   engines that post-process weights per layer (vLLM's in-place reload) must see a layer's tensors together.

Memory: each destination holds at most one bucket: max(bucket_bytes, the largest unit) bytes (the caller must drop a
bucket before asking for the next; the generator keeps no reference to it), plus, transiently, one more copy of the
megatron tensor being converted (its gathered TP shards, while its HF form joins the bucket). Never the whole model
(tests/test_rollout_weight_sync.py measures the resident set). A tied output layer is not sent (it IS the embedding).

Other ranks' iterations yield nothing; they only take part in the gathers and sends.

Experts (a mixture-of-experts model): an expert lives on one EP rank of its layer's stage, split over that rank's
expert-TP group. Step 1 gathers its shards there (over the expert-TP group instead of TP), and the holder then
broadcasts the HF tensors over its expert-parallel group, so that the converting ranks of every replica in the group
get them (with ETP = TP the EP group spans data-parallel replicas, which therefore sync together: the iteration is
then collective over the EP group too).

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
from megatron_gtpo.models.hf_mapping import (REPLICATED, ShardCoordinates, canonical_name, hf_tensor_shape,
                                             megatron_shards_to_hf, tensor_mappings)

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
    """HF tensors whose checksums identify a policy version after a sync: every RMSNorm weight of the one mapping
    (models/hf_mapping.py): each layer's input and post-attention norms, Qwen3's per-head q/k norms
    (self_attn.q_norm / k_norm), the final norm. They are trained, and every engine stores them unsharded and
    unrepacked, so the engine side can checksum them at any TP."""
    return [name for mapping in tensor_mappings(shape) for name in mapping.hf_names if name.endswith("norm.weight")]


def tensor_checksum(tensor: torch.Tensor) -> tuple[float, float]:
    """(sum, sum of squares) in float64: cheap, and different for any real weight update."""
    t = tensor.detach().double()
    return float(t.sum()), float((t * t).sum())


SINGLE_DESTINATION = ((0, 0),)  # (pp_rank, tp_rank): TP rank 0 of the first pipeline stage


def is_sync_destination(parallel, destinations=SINGLE_DESTINATION) -> bool:
    """Whether this rank receives the full HF tensors: its (pp_rank, tp_rank) is one of `destinations` (the hosts of
    its replica's engines, rollout/placement.engine_hosts; by default TP rank 0 of the first stage only), on CP rank 0
    (the other CP ranks hold the same weights: one of them sends)."""
    return parallel.cp_rank == 0 and (parallel.pp_rank, parallel.tp_rank) in set(destinations)


def _local_parameters(model_chunks: list, expert_offset: int) -> dict[str, torch.Tensor]:
    params = {}
    for chunk in model_chunks:
        offset = layer_offset(chunk)
        for name, param in chunk.named_parameters():
            params[canonical_name(name, offset, expert_offset)] = param
    return params


def _owner_stages(local_names: list[str], parallel) -> dict[str, int]:
    """Pipeline rank holding each canonical megatron tensor (an object all-gather over the pipeline group)."""
    if parallel.pp_size == 1:
        return {name: 0 for name in local_names}
    per_stage: list = [None] * parallel.pp_size
    dist.all_gather_object(per_stage, local_names, group=parallel.pp_group)
    owners: dict[str, int] = {}
    for stage, names in enumerate(per_stage):
        for name in names:
            owners.setdefault(name, stage)  # a tied output layer lives on two stages; it is never sent
    return owners


def hf_weight_buckets(model_chunks: list, parallel, shape, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      destinations=SINGLE_DESTINATION) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets of (hf_name, full HF tensor) on every destination rank (`is_sync_destination`), the same
    buckets on each; yield nothing elsewhere. Collective over the model-parallel group: every rank must exhaust the
    iterator. See the module doc for the protocol and the memory bound.

    Not decorated with torch.no_grad(): its generator wrapper holds the last yielded bucket while it produces the
    next one, i.e. two buckets at once (measured); the tensors are detached where they are read instead."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
    destinations = set(destinations)
    if not destinations or any(not (0 <= p < parallel.pp_size and 0 <= t < parallel.tp_size) for p, t in destinations):
        raise ValueError(f"sync destinations {sorted(destinations)} must be (pp_rank, tp_rank) pairs of this "
                         f"{parallel.pp_size} x {parallel.tp_size} replica")
    shard = ShardCoordinates.of(parallel)
    local = _local_parameters(model_chunks, shard.expert_offset(shape))
    owners = _owner_stages(list(local), parallel)
    dtype = next(iter(local.values())).dtype
    destination = is_sync_destination(parallel, destinations)
    # TP ranks that convert the HF tensors on the owning stage: those of a destination on any stage.
    converters = {t for _, t in destinations}
    column_stages = {p for p, t in destinations if t == parallel.tp_rank}  # destinations along my pipeline group

    bucket: list[tuple[str, torch.Tensor]] = []
    bucket_size = 0
    for unit in sync_units(shape):
        unit_bytes = sum(torch.Size(hf_tensor_shape(n, shape)).numel() for m in unit for n in m.hf_names) \
            * dtype.itemsize
        if destination and bucket and bucket_size + unit_bytes > bucket_bytes:
            yield bucket
            bucket, bucket_size = [], 0
        for mapping in unit:
            # An expert's stage is its layer's, which every EP rank there knows by the layer's router.
            holder_name = mapping.megatron_name if mapping.expert is None else \
                mapping.megatron_name.split(".mlp.experts.")[0] + ".mlp.router.weight"
            owner = owners.get(holder_name)
            if owner is None:
                raise KeyError(f"no pipeline stage holds {mapping.megatron_name!r}: the model chunks do not match "
                               f"the checkpoint shape")
            hf_tensors = None
            if owner == parallel.pp_rank and mapping.expert is not None:
                hf_tensors = _gather_expert_to_hf(mapping, local.get(mapping.megatron_name), parallel, shape,
                                                  converters, dtype)
            elif owner == parallel.pp_rank:
                hf_tensors = _gather_to_hf(mapping, local[mapping.megatron_name], parallel, shape, converters)
            if column_stages - {owner}:  # stage `owner` -> the other stages' destinations, along the pipeline group
                hf_tensors = _broadcast_all(hf_tensors, mapping, shape, dtype, owner, parallel)
            if destination:
                bucket += list(zip(mapping.hf_names, hf_tensors))
            del hf_tensors  # the generator frame must not keep a yielded bucket's tensors alive
        if destination:
            bucket_size += unit_bytes
    if destination and bucket:
        yield bucket


def _broadcast_all(tensors: list[torch.Tensor] | None, mapping, shape, dtype, owner: int,
                   parallel) -> list[torch.Tensor]:
    """The owning stage's HF tensors on every stage of this pipeline group (a destination's column). Stages with
    no destination in the column receive them too (one broadcast serves all) and drop them."""
    if parallel.pp_rank == owner:
        tensors = [t.contiguous() for t in tensors]
    else:
        tensors = [torch.empty(hf_tensor_shape(name, shape), dtype=dtype, device=parallel.device)
                   for name in mapping.hf_names]
    src = dist.get_global_rank(parallel.pp_group, owner)
    for tensor in tensors:
        dist.broadcast(tensor, src=src, group=parallel.pp_group)
    return tensors


@torch.no_grad()
def _gather_to_hf(mapping, param: torch.Tensor, parallel, shape, converters: set[int]) -> list[torch.Tensor] | None:
    """On the owning stage: the HF tensors on the TP ranks in `converters` (None on the others). The shards are
    gathered onto TP rank 0 when it is the only converter, else all-gathered."""
    converts = parallel.tp_rank in converters
    if mapping.layout == REPLICATED or parallel.tp_size == 1:
        return megatron_shards_to_hf(mapping, [param.detach()], shape) if converts else None
    shard = param.detach().contiguous()
    if converters == {0}:
        shards = [torch.empty_like(shard) for _ in range(parallel.tp_size)] if converts else None
        dist.gather(shard, gather_list=shards, dst=dist.get_global_rank(parallel.tp_group, 0), group=parallel.tp_group)
    else:
        shards = [torch.empty_like(shard) for _ in range(parallel.tp_size)]
        dist.all_gather(shards, shard, group=parallel.tp_group)
    return megatron_shards_to_hf(mapping, shards, shape) if converts else None


@torch.no_grad()
def _gather_expert_to_hf(mapping, param: torch.Tensor | None, parallel, shape, converters: set[int],
                         dtype: torch.dtype) -> list[torch.Tensor] | None:
    """On the owning stage: an expert's HF tensors on the TP ranks in `converters` (None on the others). `param` is
    this rank's shard of it, None where another EP rank holds the expert. Its holder gathers the expert-TP shards
    (onto expert-TP rank 0 when only that one converts, else onto all), then broadcasts the HF tensors over the
    expert-parallel group (ranks of one EP group share their expert-TP rank, so they all take part or none does)."""
    wanted = {t % parallel.etp_size for t in converters}  # expert-TP ranks of the converting TP ranks
    holder = mapping.expert // (shape.moe.num_experts // parallel.ep_size)
    if parallel.etp_rank not in wanted:
        if parallel.ep_rank == holder and parallel.etp_size > 1:  # its shard still goes to the converting ranks
            _gather_expert_shards(param.detach().contiguous(), parallel, wanted)
        return None
    hf_tensors = None
    if parallel.ep_rank == holder:
        shards = _gather_expert_shards(param.detach().contiguous(), parallel, wanted)
        hf_tensors = [t.contiguous() for t in megatron_shards_to_hf(mapping, shards, shape)]
    if parallel.ep_size > 1:
        if hf_tensors is None:
            hf_tensors = [torch.empty(hf_tensor_shape(name, shape), dtype=dtype, device=parallel.device)
                          for name in mapping.hf_names]
        src = dist.get_global_rank(parallel.ep_group, holder)
        for tensor in hf_tensors:
            dist.broadcast(tensor, src=src, group=parallel.ep_group)
    return hf_tensors if parallel.tp_rank in converters else None


def _gather_expert_shards(shard: torch.Tensor, parallel, wanted: set[int]) -> list[torch.Tensor] | None:
    """The expert-TP shards of one expert tensor, on the expert-TP ranks in `wanted` (None elsewhere)."""
    if parallel.etp_size == 1:
        return [shard]
    if wanted == {0}:
        shards = [torch.empty_like(shard) for _ in range(parallel.etp_size)] if parallel.etp_rank == 0 else None
        dist.gather(shard, gather_list=shards, dst=dist.get_global_rank(parallel.etp_group, 0),
                    group=parallel.etp_group)
        return shards
    shards = [torch.empty_like(shard) for _ in range(parallel.etp_size)]
    dist.all_gather(shards, shard, group=parallel.etp_group)
    return shards


def pack_bucket(bucket: list) -> tuple[list[str], list[str], list[list[int]], memoryview]:
    """A bucket of (name, tensor) as plain msgpack-able values: vLLM's RPC decodes tensors inside argument lists only
    for msgspec-typed parameters, so the tensors travel as one byte string (names, dtypes and shapes beside it).
    One host copy of the bucket is made, tensor by tensor straight from the device into its slice (no per-tensor
    host copies, no device-side concatenation); the byte string is a view of it."""
    names, dtype_names, shapes, flat = _pack(bucket, torch.device("cpu"))
    return names, dtype_names, shapes, memoryview(flat.numpy())


def pack_on_device(bucket: list) -> tuple[list[str], list[str], list[list[int]], torch.Tensor]:
    """A bucket as one flat uint8 tensor on its own device (one device-to-device copy), laid out as `pack_bucket`:
    the buffer one CUDA IPC handle exports (rollout/cuda_ipc.py)."""
    return _pack(bucket, bucket[0][1].device)


def _pack(bucket: list, device: torch.device):
    sizes = [t.numel() * t.element_size() for _, t in bucket]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    offset = 0
    for (_, t), size in zip(bucket, sizes):
        flat[offset:offset + size].copy_(t.detach().reshape(-1).view(torch.uint8))
        offset += size
    return ([n for n, _ in bucket], [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            [list(t.shape) for _, t in bucket], flat)


def unpack_bucket(names: list[str], dtype_names: list[str], shapes: list[list[int]],
                  payload: bytes) -> list[tuple[str, torch.Tensor]]:
    return unpack_flat(torch.frombuffer(bytearray(payload), dtype=torch.uint8), names, dtype_names, shapes)


def unpack_flat(flat: torch.Tensor, names: list[str], dtype_names: list[str],
                shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
    """Views of a packed bucket's tensors in a flat uint8 tensor (host or device). ValueError if the sizes differ."""
    dtypes = [getattr(torch, name) for name in dtype_names]
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes)]
    if sum(sizes) != flat.numel():
        raise ValueError(f"packed bucket holds {flat.numel()} bytes, its tensors need {sum(sizes)}")
    weights, offset = [], 0
    for name, dtype, shape, nbytes in zip(names, dtypes, shapes, sizes):
        weights.append((name, flat[offset:offset + nbytes].view(dtype).reshape(shape)))
        offset += nbytes
    return weights
