"""What every recipe stage shares: targets (glob include/exclude over module names) and the weight scheme
(bits, symmetry, group size, clipping) that quantizers take as options."""

from __future__ import annotations

import fnmatch
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from qtool.calibration.stats import LinearStats
from qtool.options import option
from qtool.packing.grouped_int import GroupedIntWeight
from qtool.packing.quik import QuikWeight
from qtool.quant.grid import GridSpec


@dataclass
class Targets:
    include: list[str] = option(default_factory=lambda: ["*"], help="glob patterns of module names to quantize")
    exclude: list[str] = option(default_factory=list, help="glob patterns of module names to leave alone")

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.include) and not any(
            fnmatch.fnmatchcase(name, p) for p in self.exclude
        )


@dataclass
class WeightScheme:
    bits: int = option(4, min=2, max=8, help="bits per weight")
    symmetric: bool = option(True, help="zero point fixed at 2^(bits-1); false stores a zero point per group")
    group_size: int | None = option(128, min=1, help="input columns per scale; null for one scale per output row")
    clip: bool = option(False, help="search the range shrink ratio minimising the layer output error")
    clip_grid: int = option(20, min=2, max=200, help="number of shrink ratios tried by clip")
    clip_min_ratio: float = option(0.5, min=0.05, max=1.0, help="smallest shrink ratio tried by clip")

    def grid_spec(self) -> GridSpec:
        return GridSpec(bits=self.bits, symmetric=self.symmetric, group_size=self.group_size)


@dataclass
class QuantResult:
    packed: GroupedIntWeight | QuikWeight
    dequantized: torch.Tensor  # [N, K] float32, what the packed layer computes with


class QuantizerStage(ABC):
    """Chooses the representation of each targeted linear and produces its packed layer."""

    name: ClassVar[str]
    options_cls: ClassVar[type]
    help: ClassVar[str]

    def __init__(self, options, targets: Targets, index: int) -> None:
        self.options = options
        self.targets = targets
        self.index = index

    @property
    def label(self) -> str:
        return f"stages[{self.index}] ({self.name})"

    def needs_calibration(self) -> bool:
        """Whether this stage needs statistics of each linear's inputs from the block-wise pipeline."""
        return False

    def needs_hessian(self) -> bool:
        return False

    def sequential(self) -> bool:
        """Whether a block's linears must see the outputs of the already-quantized linears before them."""
        return True

    @abstractmethod
    def quantize(self, name: str, weight: torch.Tensor, stats: LinearStats | None) -> QuantResult: ...


class HessianStage(QuantizerStage):
    """A stage that solves with each linear's input Hessian (GPTQ and the stages built on it): it needs
    calibration statistics with Hessians, and its `sequential` option decides the order within a block."""

    def needs_calibration(self) -> bool:
        return True

    def needs_hessian(self) -> bool:
        return True

    def sequential(self) -> bool:
        return self.options.sequential
