"""Checks every packed layout applies to its stored tensors; errors name the tensor."""

from __future__ import annotations

import torch

from qtool.errors import CheckpointError


def check_tensors(name: str, expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  tensors: dict[str, torch.Tensor]) -> None:
    """Each expected field is present with its shape and dtype."""
    for field, (shape, dtype) in expected.items():
        t = tensors.get(field)
        if t is None:
            raise CheckpointError(f"tensor {name}.{field}: missing; expected {dtype} {list(shape)}")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise CheckpointError(f"tensor {name}.{field}: found {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}")


def check_scales(name: str, scales: torch.Tensor) -> None:
    if not bool(torch.isfinite(scales).all()) or bool((scales <= 0).any()):
        raise CheckpointError(f"tensor {name}.scales: found non-positive or non-finite scales, expected > 0")


def stored_bits(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() * 8 for t in tensors.values())
