"""Checkpoints: the megatron_gtpo distributed checkpoint (save / load at any TP/PP) and the streaming converters
between it and Hugging Face Qwen2 / Qwen3 directories. Importing this package does not import megatron."""
from .hf_export import convert_megatron_to_hf
from .hf_import import convert_hf_to_megatron
from .megatron_checkpoint import (CheckpointMetadata, load_checkpoint, load_model_only, read_checkpoint_metadata,
                                  save_checkpoint)

__all__ = [
    "CheckpointMetadata", "convert_hf_to_megatron", "convert_megatron_to_hf", "load_checkpoint", "load_model_only",
    "read_checkpoint_metadata", "save_checkpoint",
]
