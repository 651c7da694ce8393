"""The contract every packed layout keeps (`StoredLayout`), the checks the layouts share on their stored tensors
(errors name the tensor), and the exact integer product their reference paths share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
    """A packed layer as stored: the dataclass fields before the tensors are its parameters (`params`), read from
    the layer's JSON config (`quantization_config.layers[name]`) under the same names unless the layout says
    otherwise (`params_from_config`); `FIELDS` are its tensors, in storage order (a field may be None where the
    layer's scheme has no such tensor). What the pipeline, the checkpoint writer and loader, the exporter and
    `qtool pack` need of a layer, they ask this contract, never the stage that made it:

    - `FORMAT`: the format name (`layers[name].format`), the registry's key (qtool/layouts/registry.py);
    - `config()` / `layer_config(has_bias)`: the layer's JSON config; `scheme_problem(cfg)` names the first key
      outside the layout's domain and `expected_shapes(cfg)` the shape and dtype of every tensor, so that
      `from_tensors` (through `checked`, then the layout's own value checks) refuses a bad checkpoint naming the
      key or tensor;
    - `tensors()`, `stored_bits()`, `bits_report()` (None, or the layout's own bits-per-weight accounting);
    - `dequantize(dtype)`: the weight [N, K] the layer computes with, the ground truth of every kernel;
    - `concat_rows(parts)`: one layer from consecutive row slices quantized apart (several processes)."""

    FORMAT: ClassVar[str]
    FIELDS: ClassVar[tuple[str, ...]]

    @classmethod
    def params(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name not in cls.FIELDS]

    @staticmethod
    def scheme_problem(cfg: dict) -> tuple[str, object, str] | None:
        """(key, found, expected) for the first layer parameter outside the layout's domain, else None."""
        return None

    @staticmethod
    def expected_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    @classmethod
    def params_from_config(cls, cfg: dict) -> dict:
        return {p: cfg.get(p) for p in cls.params()}

    def config(self) -> dict:
        raise NotImplementedError

    def layer_config(self, has_bias: bool) -> dict:
        return {**self.config(), "bias": has_bias}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f: t for f in self.FIELDS if (t := getattr(self, f)) is not None}

    def stored_bits(self) -> int:
        return stored_bits(self.tensors())

    def bits_report(self) -> dict[str, float] | None:
        return None

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        """The same layer with every stored tensor passed through `fn` (absent ones stay absent)."""
        return type(self)(
            **{p: getattr(self, p) for p in self.params()},
            **{f: None if (t := getattr(self, f)) is None else fn(t) for f in self.FIELDS},
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def concat_rows(cls, parts: list):
        raise NotImplementedError

    @classmethod
    def describe(cls, cfg: dict) -> str:
        """A layer's scheme in a few words, from its config (`qtool pack` counts layers by it): format, bits,
        group, symmetry, activation bits, outlier columns, as far as the config has them."""
        key = f"{cfg['format']} w{cfg['bits']} g{cfg['group_size'] or 'channel'}"
        if "symmetric" in cfg:  # qoq's rungs fix their symmetry by bits and group size, so it has no such key
            key += " sym" if cfg["symmetric"] else " asym"
        if "act_bits" in cfg:
            key += f" a{cfg['act_bits']}"
        if "num_outliers" in cfg:  # quik: the outlier count varies per layer
            key += f" outliers={cfg['num_outliers']}" + (" 2:4" if cfg.get("sparsity") else "")
        return key

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
        return cls(**cls.params_from_config(cfg), **{f: tensors.get(f) for f in cls.FIELDS})

    @classmethod
    def from_tensors(cls, name: str, cfg: dict, tensors: dict[str, torch.Tensor]):
        """Validate stored tensors against the layer config; errors name the key or tensor."""
        return cls.checked(name, cfg, tensors)


# Partial sums of integer products are exact in float32 below 2^24 and in float64 below 2^53.
EXACT_F32 = 1 << 24
EXACT_F64 = 1 << 53


def int_matmul(a: torch.Tensor, b: torch.Tensor, bound: int) -> torch.Tensor:
    """`a @ b.T` for int32 codes with int32 accumulation. `bound` ≥ Σ|a||b| over any row pair: below 2^24 (2^53) a
    float32 (float64) matmul is exact and much faster than an integer one, so the result is identical."""
    if bound < EXACT_F32:
        return (a.to(torch.float32) @ b.to(torch.float32).T).to(torch.int32)
    if bound < EXACT_F64:
        return (a.to(torch.float64) @ b.to(torch.float64).T).to(torch.int32)
    return a @ b.T
