"""Stage `rtn`: round-to-nearest weight quantization (the baseline every other quantizer must beat)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.calibration.stats import LinearStats
from qtool.layouts.grouped_int.layout import GroupedIntWeight
from qtool.quant.clip import clip_ratios
from qtool.quant.rtn import rtn_quantize
from qtool.stages.base import QuantizerStage, QuantResult, WeightScheme


@dataclass
class RTNOptions(WeightScheme):
    pass


class RTNStage(QuantizerStage):
    name = "rtn"
    options_cls = RTNOptions
    layout_cls = GroupedIntWeight
    help = "round-to-nearest; with clip, the shrink search weights errors by calibration statistics"

    def needs_calibration(self) -> bool:
        return self.options.clip

    def sequential(self) -> bool:
        return False

    def quantize(self, name: str, weight: torch.Tensor, stats: LinearStats | None) -> QuantResult:
        o: RTNOptions = self.options
        spec = o.grid_spec()
        ratios = clip_ratios(o.clip_grid, o.clip_min_ratio) if o.clip else None
        hessian = None
        if stats is not None:
            hessian = stats.hessian() if stats.has_hessian else stats.hessian_diag()
            hessian = hessian.to(weight.device)
        codes, scales, zeros = rtn_quantize(weight.float(), spec, clip_ratios=ratios, hessian=hessian)
        packed = GroupedIntWeight.from_codes(codes, scales, zeros, spec)
        return QuantResult(packed, packed.dequantize(torch.float32))
