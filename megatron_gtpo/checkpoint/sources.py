"""Where a model's weights come from: a Hugging Face directory or a megatron_gtpo checkpoint (converter or trainer
output). One place decides, for the scoring and evaluation CLIs and the trainer."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSource:
    path: str
    is_megatron_checkpoint: bool

    @classmethod
    def detect(cls, path: str) -> "ModelSource":
        from .megatron_checkpoint import METADATA_FILE

        if not os.path.isdir(path):
            raise FileNotFoundError(f"model directory {path!r} does not exist")
        if os.path.isfile(os.path.join(path, METADATA_FILE)):
            return cls(path, True)
        if os.path.isfile(os.path.join(path, "config.json")):
            return cls(path, False)
        raise FileNotFoundError(f"{path!r} is neither a Hugging Face model directory (no config.json) nor a "
                                f"megatron_gtpo checkpoint (no {METADATA_FILE})")

    def hf_config(self) -> dict:
        if self.is_megatron_checkpoint:
            from .megatron_checkpoint import read_checkpoint_metadata

            return read_checkpoint_metadata(self.path).hf_config
        from megatron_gtpo.models.qwen import load_hf_config

        return load_hf_config(self.path)

    def load_into(self, model_chunks: list, groups) -> None:
        """Copy the weights into this rank's chunks (any TP/PP/EP)."""
        if self.is_megatron_checkpoint:
            from .megatron_checkpoint import load_model_only

            load_model_only(self.path, model_chunks)
            return
        from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
        from megatron_gtpo.models.hf_mapping import ShardCoordinates

        with HFCheckpoint(self.path) as ckpt:
            load_hf_weights(model_chunks, ckpt, shard=ShardCoordinates.of(groups))
