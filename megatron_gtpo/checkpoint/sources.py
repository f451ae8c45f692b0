"""Where a model's weights come from: a Hugging Face directory or a megatron_gtpo checkpoint (converter or trainer
output). One place decides, for the scoring and evaluation CLIs and the trainer."""
from __future__ import annotations

import os
from dataclasses import dataclass

SYNTHETIC_TASK = "synthetic_task"  # a trainer checkpoint's metadata key: the synthetic task (data.task) it learned


@dataclass(frozen=True)
class ModelSource:
    path: str  # the model's own directory (a checkpoints folder or `latest` resolved to the checkpoint it names)
    is_megatron_checkpoint: bool

    @classmethod
    def detect(cls, path: str, what: str = "model") -> "ModelSource":
        """The model at `path`: a Hugging Face directory, a checkpoint, a trainer's checkpoints folder or its
        `latest` file (the checkpoint `latest` names). FileNotFoundError naming `what` (the flag or config key that
        gave the path) and what was found instead."""
        from .megatron_checkpoint import LATEST, METADATA_FILE

        latest = path if os.path.basename(os.path.normpath(path)) == LATEST else os.path.join(path, LATEST)
        if os.path.isfile(latest):
            with open(latest, encoding="utf-8") as f:
                path = os.path.join(os.path.dirname(latest), f.read().strip())
        if not os.path.exists(path):
            raise FileNotFoundError(f"{what}: {path!r} does not exist")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{what}: {path!r} is a file, not a model directory (a Hugging Face directory "
                                    f"or a megatron_gtpo checkpoint)")
        if os.path.isfile(os.path.join(path, METADATA_FILE)):
            return cls(path, True)
        if os.path.isfile(os.path.join(path, "config.json")):
            return cls(path, False)
        raise FileNotFoundError(f"{what}: {path!r} is neither a Hugging Face model directory (no config.json) nor a "
                                f"megatron_gtpo checkpoint (no {METADATA_FILE})")

    @property
    def tokenizer_dir(self) -> str:
        """Where its tokenizer files are: a HF directory's own, or the ones a checkpoint copied along."""
        from .megatron_checkpoint import HF_FILES_DIR

        return os.path.join(self.path, HF_FILES_DIR) if self.is_megatron_checkpoint else self.path

    @property
    def synthetic_task(self) -> str | None:
        """The synthetic task (data.task) a trainer checkpoint was trained on, whose tokenizer is built in code and
        not saved with it; None for any other model."""
        if not self.is_megatron_checkpoint:
            return None
        from .megatron_checkpoint import read_checkpoint_metadata

        return read_checkpoint_metadata(self.path).extra.get(SYNTHETIC_TASK)

    def missing_tokenizer(self) -> str | None:
        """Why the model has no tokenizer files, in a sentence naming it; None when it has them."""
        from megatron_gtpo.data.tokenizer import TOKENIZER_FILES

        directory = self.tokenizer_dir
        if any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES):
            return None
        if self.synthetic_task:
            return (f"{self.path} was trained on the synthetic task {self.synthetic_task!r}, whose character "
                    f"tokenizer is built in code (megatron_gtpo.data.synthetic_tasks), not saved with it")
        where = "does not exist" if not os.path.isdir(directory) else f"holds none of {', '.join(TOKENIZER_FILES)}"
        return (f"{self.path} holds no tokenizer files ({directory} {where}): it was written from a model directory "
                f"without them")

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
