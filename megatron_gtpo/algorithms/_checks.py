"""Input validation shared by the algorithm functions: one home for the ValueErrors they raise.

Shape and dtype checks cost nothing. `check_binary_rewards` reads the values of an [N, G] tensor (one host
sync per call); the shaping functions call it once per step, never per token.
"""
from __future__ import annotations

import torch


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def check_floating(name: str, tensor: torch.Tensor, ndim: int) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.ndim != ndim or not tensor.is_floating_point():
        raise ValueError(f"{name} must be a {ndim}-d floating-point tensor, got {_describe(tensor)}")


def check_bool_mask(name: str, mask: torch.Tensor, shape: torch.Size) -> None:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != shape:
        raise ValueError(f"{name} must be a bool tensor of shape {tuple(shape)}, got {_describe(mask)}")


def check_same_shape(name: str, tensor: torch.Tensor, shape: torch.Size) -> None:
    if tensor.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")


def check_binary_rewards(name: str, rewards: torch.Tensor) -> None:
    """Rewards that split a group into successful (1) and failed (0) responses must be exactly 0 or 1."""
    if not bool(((rewards == 0) | (rewards == 1)).all()):
        bad = rewards[(rewards != 0) & (rewards != 1)].flatten()[:4].tolist()
        raise ValueError(f"{name} must hold only 0.0 (failed) or 1.0 (correct); got values such as {bad}")


def check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_entropy_clip(entropy_clip: tuple[float, float] | None) -> None:
    if entropy_clip is None:
        return
    if (not isinstance(entropy_clip, (tuple, list)) or len(entropy_clip) != 2
            or not 0 <= entropy_clip[0] <= entropy_clip[1]):
        raise ValueError(f"entropy_clip must be None or (low, high) with 0 <= low <= high, got {entropy_clip!r}")
