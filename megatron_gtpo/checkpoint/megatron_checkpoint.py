"""The megatron_gtpo checkpoint: a megatron-core distributed checkpoint (torch_dist format) plus a metadata file.

A checkpoint directory holds

    megatron_gtpo_checkpoint.json  CheckpointMetadata: format version, the HF config.json, true and padded vocabulary
                                   size, weight dtype, the TP/PP it was written at, what it contains
    hf_files/                      tokenizer and generation-config files of the HF model it came from (if any)
    .metadata, *.distcp            torch.distributed.checkpoint data (what megatron.core.dist_checkpointing reads)
    metadata.json, common.pt       megatron's dist-checkpoint format config and common (non-sharded) state
    manifest.json                  every other file's size and SHA-256 (checkpoint/manifest.py), checked before a load

Model tensors are stored under megatron-core's own sharded keys (`GPTModel.sharded_state_dict()`, no prefix) in
their global, TP/PP/EP-independent shape: transformer-layer tensors are stacked on a leading layer axis under
`decoder.layers.<name>` (a dense layer's norms under their Transformer Engine names, `dist_checkpoint_key`), an
expert's on a layer axis and then an expert axis under `decoder.layers.mlp.experts.experts.<name>`, linear_fc1 is
[gate of all TP ranks; up of all TP ranks], linear_qkv is grouped per query group, and the embedding / output layer
hold the padded vocabulary. This is the layout Megatron-LM writes, so dist_checkpointing reshards it on load to any
TP/PP. The state dict nests each model chunk under "model" ("model0", "model1", ... with virtual pipeline stages), as
Megatron-LM does; the trainer adds its own state (optimizer, RNG, data position, step) under other top-level keys
through `extra_sharded_state`. Loading the model alone reads only the model's keys, so it works on checkpoints with
or without optimizer state.

`save_checkpoint` writes the checkpoints of a built model: the KL reference's and the trainer's (which adds its
optimizer state, RNG states and trainer_state.json). The HF import (hf_import.py) is the format's other writer: it
streams HF tensors into the same keys in one process, without a model (docs/checkpoints.md). `save_checkpoint` and
`load_checkpoint` are collective over the default torch.distributed process group (every rank
calls them; dist_checkpointing coordinates over that group). Tied embeddings: the output layer of the last stage is
stored under the embedding's key (megatron marks it as a replica), so a tied checkpoint has no `output_layer.weight`.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field

import torch

from megatron_gtpo.atomic_files import write_atomically
from megatron_gtpo.models.hf_mapping import LOCAL_TO_TE
from megatron_gtpo.models.qwen import ModelShape, padded_vocab_size

from .atomic_dir import begin_output_dir, commit_output_dir
from .manifest import check_intact, reading, write_manifest

METADATA_FILE = "megatron_gtpo_checkpoint.json"
FORMAT_NAME = "megatron_gtpo.checkpoint"
FORMAT_VERSION = 1
HF_FILES_DIR = "hf_files"
# Files of a HF model directory that travel with the weights (config.json is kept in the metadata instead).
HF_SIDE_FILE_PATTERNS = ("tokenizer*", "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                         "chat_template.json", "chat_template.jinja", "generation_config.json")
WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# What megatron.core.dist_checkpointing.save writes next to the torch_dist data: its format config and the common
# (non-sharded) part of the state dict, which is empty for model weights.
MEGATRON_FORMAT_FILE = "metadata.json"
MEGATRON_FORMAT = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}
MEGATRON_COMMON_FILE = "common.pt"

_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT_NAME = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CheckpointMetadata:
    """What a checkpoint holds besides its tensors. TP/PP are the layout it was written at: it loads at any."""

    hf_config: dict
    dtype: str  # weight dtype name ("bfloat16", "float32", ...), "mixed" if the weights differ
    tensor_parallel: int
    pipeline_parallel: int
    contents: tuple[str, ...] = ("model",)  # top-level state keys: "model" (or "model0", ...) plus the trainer's
    extra: dict = field(default_factory=dict)  # anything the writer wants to keep (the trainer's step, config, ...)
    format_version: int = FORMAT_VERSION
    expert_parallel: int = 1  # the EP it was written at (1 for dense models); it loads at any

    @property
    def shape(self) -> ModelShape:
        return ModelShape.from_hf(self.hf_config)

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.shape.vocab_size, self.tensor_parallel)

    def to_json(self) -> dict:
        record = {"format": FORMAT_NAME, **asdict(self), "contents": list(self.contents),
                  "vocab_size": self.vocab_size, "padded_vocab_size": self.padded_vocab_size}
        return record


def write_checkpoint_metadata(directory: str, metadata: CheckpointMetadata) -> None:
    with open(os.path.join(directory, METADATA_FILE), "w", encoding="utf-8") as f:
        json.dump(metadata.to_json(), f, indent=2)
        f.write("\n")


def read_checkpoint_metadata(directory: str) -> CheckpointMetadata:
    """The metadata of a megatron_gtpo checkpoint directory (errors name what is wrong with it)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"megatron checkpoint directory {directory!r} does not exist")
    path = os.path.join(directory, METADATA_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory!r} is not a megatron_gtpo checkpoint: it has no {METADATA_FILE} "
                                f"(written by tools/convert_hf_to_megatron.py and by the trainer)")
    with open(path, encoding="utf-8") as f:
        try:
            record = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
    if record.get("format") != FORMAT_NAME:
        raise ValueError(f"{path}: format {record.get('format')!r} is not {FORMAT_NAME!r}")
    version = record.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {version!r} is not supported (this code reads 1..{FORMAT_VERSION})")
    try:
        metadata = CheckpointMetadata(
            hf_config=record["hf_config"], dtype=record["dtype"], tensor_parallel=int(record["tensor_parallel"]),
            pipeline_parallel=int(record["pipeline_parallel"]), contents=tuple(record["contents"]),
            extra=record.get("extra", {}), format_version=version,
            expert_parallel=int(record.get("expert_parallel", 1)))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: missing or malformed field {e}") from e
    if record.get("vocab_size", metadata.vocab_size) != metadata.vocab_size:
        raise ValueError(f"{path}: vocab_size {record['vocab_size']} disagrees with its hf_config "
                         f"({metadata.vocab_size})")
    return metadata


@dataclass(frozen=True)
class StoredAt:
    """Where megatron-core's dist_checkpointing stores a canonical megatron tensor: under `key`, at `index` of the
    leading axes it is stacked on, whose sizes are `stacked` (() for tensors outside the layers; (layers,) for a
    layer's; (layers, experts) for an expert's)."""

    key: str
    index: tuple[int, ...] = ()
    stacked: tuple[int, ...] = ()


def dist_checkpoint_key(megatron_name: str, shape: ModelShape) -> StoredAt:
    """Where a canonical megatron tensor (hf_mapping names) of a model of `shape` is stored:
    'decoder.layers.3.input_layernorm.weight' -> 'decoder.layers.self_attention.linear_qkv.layer_norm_weight' at
    layer 3 (a dense layer's norms under their TE names); 'decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.
    weight' -> 'decoder.layers.mlp.experts.experts.linear_fc2.weight' at (3, 5). A mixture-of-experts layer keeps its
    pre-MLP norm's own name (models/qwen2.layer_spec)."""
    m = _LAYER_NAME.fullmatch(megatron_name)
    if m is None:
        return StoredAt(megatron_name)
    layer, rest = int(m.group(1)), m.group(2)
    if (expert := _EXPERT_NAME.fullmatch(rest)) is not None:
        return StoredAt(f"decoder.layers.mlp.experts.experts.{expert.group(2)}", (layer, int(expert.group(1))),
                        (shape.num_layers, shape.moe.num_experts))
    if shape.moe is None or rest != "pre_mlp_layernorm.weight":
        rest = LOCAL_TO_TE.get(rest, rest)
    return StoredAt(f"decoder.layers.{rest}", (layer,), (shape.num_layers,))


def stored_keys(directory: str) -> set[str]:
    """The keys of everything in a checkpoint's torch_dist data (tensors and objects)."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise FileNotFoundError(f"{directory!r} has no torch.distributed.checkpoint data (.metadata is missing)")
    return set(FileSystemReader(directory).read_metadata().state_dict_metadata)


def write_megatron_format_files(directory: str) -> None:
    """The two small files megatron's loader expects next to torch_dist data written without it."""
    with open(os.path.join(directory, MEGATRON_FORMAT_FILE), "w", encoding="utf-8") as f:
        json.dump(MEGATRON_FORMAT, f)
    torch.save({}, os.path.join(directory, MEGATRON_COMMON_FILE))


def copy_hf_side_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copy the tokenizer / generation-config files present in `src_dir` (HF_SIDE_FILE_PATTERNS) to `dst_dir`."""
    names = sorted({os.path.basename(p) for pattern in HF_SIDE_FILE_PATTERNS
                    for p in glob.glob(os.path.join(glob.escape(src_dir), pattern)) if os.path.isfile(p)})
    if names:
        os.makedirs(dst_dir, exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    return names


def model_state_keys(num_chunks: int) -> list[str]:
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def _unwrapped(model_chunks: list) -> list:
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(model_chunks))


def model_sharded_state_dict(model_chunks: list) -> dict:
    """{"model": sharded state of chunk 0} (or "model0", "model1", ... for virtual pipeline stages)."""
    chunks = _unwrapped(model_chunks)
    return {key: chunk.sharded_state_dict() for key, chunk in zip(model_state_keys(len(chunks)), chunks)}


def _weights_dtype(model_chunks: list) -> str:
    dtypes = {p.dtype for chunk in model_chunks for p in chunk.parameters()}
    return dtype_name(dtypes.pop()) if len(dtypes) == 1 else "mixed"


def save_checkpoint(directory: str, model_chunks: list, *, hf_config: dict, model_state: dict | None = None,
                    extra_sharded_state: dict | None = None, extra_metadata: dict | None = None,
                    hf_files_from: str | None = None, files: dict[str, str] | None = None,
                    rank_files: dict[str, object] | None = None, force: bool = False,
                    keep_last: int | None = None) -> None:
    """The checkpoint writer of a built model (the KL reference's model-only checkpoints, and the trainer's).

    Writes this rank's model chunks (`model_state`: their sharded state dict when the caller built it already, e.g.
    for the optimizer's state that refers to it) and `extra_sharded_state` (the trainer's optimizer state, as megatron
    sharded state dicts or plain objects) to `directory`, with the metadata file and a manifest. Collective: every
    rank of the default process group calls it. The directory appears only when complete (written to
    `<directory>.tmp-...`, then renamed by rank 0); an existing one is refused unless `force`.
    `hf_files_from`: a HF model directory whose tokenizer and generation-config files are copied in, so that the
    checkpoint exports to a complete HF model. `files`: {relative path: text} written by rank 0; `rank_files`:
    {relative path: object} that every rank torch.saves (paths differ per rank). `keep_last`: `directory` is the
    newest of a series of checkpoints beside it (`<prefix><number>`, e.g. the trainer's step_00000010): the parent's
    `latest` file is pointed at it and only the newest `keep_last` of the series are kept."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    state = model_state if model_state is not None else model_sharded_state_dict(model_chunks)
    extra = dict(extra_sharded_state or {})
    clashing = sorted(k for k in extra if re.fullmatch(r"model\d*", k))
    if clashing:
        raise ValueError(f"extra_sharded_state keys {clashing} clash with the model's keys (model, model<i>)")
    config = _unwrapped(model_chunks)[0].config
    metadata = CheckpointMetadata(
        hf_config=hf_config, dtype=_weights_dtype(model_chunks), tensor_parallel=config.tensor_model_parallel_size,
        pipeline_parallel=config.pipeline_model_parallel_size, contents=tuple(state) + tuple(extra),
        extra=dict(extra_metadata or {}), expert_parallel=config.expert_model_parallel_size)
    json.dumps(metadata.to_json())  # fail before writing anything if the metadata is not JSON-serialisable

    # Rank 0 decides and every rank learns the outcome, so that a refused overwrite fails on all ranks alike.
    outcome: list = [None]
    if dist.get_rank() == 0:
        try:
            if keep_last is not None:
                os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
                _remove_stale_temporaries(directory)
            outcome[0] = begin_output_dir(directory, force=force)
        except OSError as e:
            outcome[0] = e
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    tmp = outcome[0]
    dist_checkpointing.save({**state, **extra}, tmp)
    for name, value in (rank_files or {}).items():
        os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
        torch.save(value, os.path.join(tmp, name))
    dist.barrier()
    if dist.get_rank() == 0:
        write_checkpoint_metadata(tmp, metadata)
        for name, text in (files or {}).items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
        if hf_files_from is not None:
            copy_hf_side_files(hf_files_from, os.path.join(tmp, HF_FILES_DIR))
    dist.barrier()
    write_manifest(tmp, group=dist.group.WORLD)
    if dist.get_rank() == 0:
        commit_output_dir(tmp, directory, force=force)
        if keep_last is not None:
            _point_latest_and_prune(directory, keep_last)
    dist.barrier()


LATEST = "latest"  # in a series' parent directory: the name of its newest complete checkpoint


def series_members(root: str, prefix: str) -> list[str]:
    """The complete checkpoints `<prefix><number>` in `root`, oldest first (temporaries never match)."""
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if d.startswith(prefix) and d[len(prefix):].isdigit())


def _series_prefix(directory: str) -> str:
    return os.path.basename(os.path.abspath(directory)).rstrip("0123456789")


def _remove_stale_temporaries(directory: str) -> None:
    """What an interrupted save of the same checkpoint left behind."""
    directory = os.path.abspath(directory)
    for stale in glob.glob(glob.escape(directory) + ".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _point_latest_and_prune(directory: str, keep_last: int) -> None:
    root, name = os.path.split(os.path.abspath(directory))
    write_atomically(os.path.join(root, LATEST), name + "\n")
    for old in series_members(root, _series_prefix(directory))[:-keep_last]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def load_checkpoint(directory: str, model_chunks: list, *, extra_sharded_state: dict | None = None) -> dict:
    """Load the model weights (resharded to this rank's TP/PP layout) into `model_chunks`, plus `extra_sharded_state`
    (sharded state dicts shaped like the ones saved); returns the loaded extra state. Collective. Keys of the
    checkpoint that are not asked for (optimizer state, when loading the model alone) are not read."""
    import torch.distributed as dist

    check_intact(directory, group=dist.group.WORLD)  # a damaged file is named, not met as a reader's EOFError
    read_checkpoint_metadata(directory)
    state = model_state_to_load(directory, model_chunks)
    extra = dict(extra_sharded_state or {})
    with reading(directory):
        loaded = load_sharded({**state, **extra}, directory)
    load_model_state(directory, model_chunks, loaded)
    return {key: loaded[key] for key in extra}


# What megatron-core 0.16's torch_dist reader calls in torch 2.13, deprecated there: three FutureWarnings per load
# that name torch APIs a user of this package does not call.
_READER_DEPRECATIONS = ("`load_state_dict` is deprecated and will be removed in future versions",
                        "Please use DTensor instead and we are deprecating ShardedTensor")


def load_sharded(sharded_state: dict, directory: str) -> dict:
    """megatron.core.dist_checkpointing.load of `sharded_state` from `directory` (collective), without the
    deprecation warnings of megatron-core's reader."""
    import warnings

    from megatron.core import dist_checkpointing

    with warnings.catch_warnings():
        for message in _READER_DEPRECATIONS:
            warnings.filterwarnings("ignore", message=message, category=FutureWarning)
        return dist_checkpointing.load(sharded_state, directory)


def model_state_to_load(directory: str, model_chunks: list) -> dict:
    """The chunks' sharded state dict (`model_sharded_state_dict`) as the checkpoint in `directory` can fill it.
    Module extra state (Transformer Engine's FP8 scaling state; None in the local spec) is asked for only when the
    checkpoint has it: one written with the local spec, or by a converter (weights only), loads into a TE model.
    ValueError naming the model tensors the checkpoint lacks."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    available = stored_keys(directory)
    state = model_sharded_state_dict(model_chunks)
    missing = []
    for chunk_state in state.values():
        for name, value in list(chunk_state.items()):
            if isinstance(value, ShardedObject):
                if value.unique_key not in available:
                    if not _is_extra_state(value):
                        missing.append(value.unique_key)
                    del chunk_state[name]
            elif value.key not in available:
                missing.append(value.key)
    if missing:
        raise ValueError(f"checkpoint {directory!r} lacks model tensors {sorted(set(missing))[:8]} (it was written "
                         f"for a different model, or is incomplete)")
    return state


def _is_extra_state(value) -> bool:
    """Whether a ShardedObject of a model's sharded state dict is a module's extra state. Told by its checkpoint key,
    which ends in `_extra_state`, not by its name in the state dict: TEGroupedLinear names the extra state of its
    local experts 1 .. N-1 `_extra_state1` .. `_extra_state{N-1}`."""
    return value.key.rsplit(".", 1)[-1] == "_extra_state"


def load_model_state(directory: str, model_chunks: list, loaded: dict) -> None:
    """Put the model part of `loaded` (what dist_checkpointing.load returned for `model_state_to_load`) into the
    chunks; every parameter must be set (the `_extra_state` left out there stays as it is)."""
    chunks = _unwrapped(model_chunks)
    for chunk, key in zip(chunks, model_state_keys(len(chunks))):
        result = chunk.load_state_dict(loaded[key], strict=False)
        not_loaded = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if not_loaded or result.unexpected_keys:
            raise ValueError(f"loading {directory!r} into the model left parameters {not_loaded} unset and "
                             f"{result.unexpected_keys} unexpected")


def load_model_only(directory: str, model_chunks: list) -> None:
    """Load just the model weights of a checkpoint (converter or trainer output, with or without optimizer state)
    into this rank's chunks, at whatever TP/PP they were built with. Collective."""
    load_checkpoint(directory, model_chunks)
