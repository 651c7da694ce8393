"""Stage `gptq`: second-order weight quantization with the layer-input Hessian from calibration."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.calibration.stats import LinearStats
from qtool.layouts.grouped_int.layout import GroupedIntWeight
from qtool.quant.clip import clip_ratios
from qtool.quant.gptq import gptq_quantize
from qtool.stages.base import (
    HessianStage,
    QuantResult,
    WeightScheme,
    act_order_option,
    block_size_option,
    damp_option,
    sequential_option,
    static_groups_option,
)


@dataclass
class GPTQOptions(WeightScheme):
    damp: float = damp_option()
    block_size: int = block_size_option()
    act_order: bool = act_order_option()
    static_groups: bool = static_groups_option()
    sequential: bool = sequential_option()

    def validate(self) -> tuple[str, str] | None:
        if self.act_order and self.group_size is not None and not self.static_groups:
            return (
                "static_groups",
                "found false with act_order and group_size set; expected true (the grouped_int "
                "layout keeps columns in their original order and has no per-column group index)",
            )
        return None


class GPTQStage(HessianStage):
    name = "gptq"
    options_cls = GPTQOptions
    layout_cls = GroupedIntWeight
    help = "GPTQ: column-wise quantization with inverse-Hessian error feedback"

    def row_split(self) -> int | None:
        # Each row is solved with the shared Hessian, act-order permutation and inverse-Hessian factor, and its own
        # group scales and zeros (static or not, clipped or not); grouped_int's tensors all lead with the rows.
        return 1

    def quantize(self, name: str, weight: torch.Tensor, stats: LinearStats | None) -> QuantResult:
        if stats is None or not stats.has_hessian:
            raise RuntimeError(f"gptq needs the Hessian of {name}")
        o: GPTQOptions = self.options
        spec = o.grid_spec()
        codes, scales, zeros = gptq_quantize(
            weight.float(),
            stats.hessian().to(weight.device),
            spec,
            damp=o.damp,
            block_size=o.block_size,
            act_order=o.act_order,
            static_groups=o.static_groups,
            clip_ratios=clip_ratios(o.clip_grid, o.clip_min_ratio) if o.clip else None,
        )
        packed = GroupedIntWeight.from_codes(codes, scales, zeros, spec)
        return QuantResult(packed, packed.dequantize(torch.float32, weight.device))
