"""Checks every packed layout applies to its stored tensors; errors name the tensor."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from qtool.errors import CheckpointError


def check_tensors(
    name: str, expected: dict[str, tuple[tuple[int, ...], torch.dtype]], tensors: dict[str, torch.Tensor]
) -> None:
    """Each expected field is present with its shape and dtype."""
    for field, (shape, dtype) in expected.items():
        t = tensors.get(field)
        if t is None:
            raise CheckpointError(f"tensor {name}.{field}: missing; expected {dtype} {list(shape)}")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise CheckpointError(
                f"tensor {name}.{field}: found {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}"
            )


def check_scales(name: str, scales: torch.Tensor) -> None:
    check_positive(name, "scales", scales)


def stored_bits(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() * 8 for t in tensors.values())


def posint(v) -> bool:
    """A positive int in a layer's JSON config (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def check_positive(name: str, field: str, t: torch.Tensor) -> None:
    """Every stored scale is finite and > 0."""
    if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        raise CheckpointError(f"tensor {name}.{field}: found non-positive or non-finite scales, expected > 0")


class StoredLayout:
    """What a packed layout dataclass shares with the others as stored: its parameters (the dataclass fields
    before the tensors, read from the layer's config under the same names) and its tensors (`FIELDS`), the
    config check that names the key (`scheme_problem`), and the shape and dtype check of every tensor
    (`expected_shapes`). A layout's own value checks follow `checked` in its `from_tensors`."""

    FIELDS: ClassVar[tuple[str, ...]]

    @staticmethod
    def scheme_problem(cfg: dict) -> tuple[str, object, str] | None:
        raise NotImplementedError

    @staticmethod
    def expected_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f: getattr(self, f) for f in self.FIELDS}

    def layer_config(self, has_bias: bool) -> dict:
        return {**self.config(), "bias": has_bias}

    def stored_bits(self) -> int:
        return stored_bits(self.tensors())

    @classmethod
    def check_config(cls, name: str, cfg: dict) -> None:
        problem = cls.scheme_problem(cfg)
        if problem is not None:
            key, found, expected = problem
            raise CheckpointError(
                f"layer {name}: quantization_config key {key!r} found {found!r}, expected {expected}"
            )

    @classmethod
    def checked(cls, name: str, cfg: dict, tensors: dict[str, torch.Tensor]):
        """The layout of layer `name` from its config and stored tensors, once both pass the common checks."""
        cls.check_config(name, cfg)
        check_tensors(name, cls.expected_shapes(cfg), tensors)
        params = [f.name for f in dataclasses.fields(cls) if f.name not in cls.FIELDS]
        return cls(**{p: cfg.get(p) for p in params}, **{f: tensors[f] for f in cls.FIELDS})
