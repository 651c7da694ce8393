"""Stage `progressive`: QoQ's W4A8 weights (QServe §4.1) in the `qoq` layout: W8 or W4 per output channel, or W4
progressive groups (a per-channel INT8 level with the protective range, then u4 groups of it with integer scales).

Solvers: `rtn` rounds to nearest; `gptq` runs GPTQ on the same grid (level 0 fixed per row before the column loop,
each group's level-1 scale and zero chosen when GPTQ reaches the group, or all before the loop with
`static_groups`, which `act_order` needs). `clip` searches one ratio per output
channel that shrinks the level-0 range, scored by the layer output error of the whole quantized row (Hessian, or
its diagonal, as quant/clip.py weights it).

Within the block-wise pipeline, the next linears and the next block are calibrated on the outputs of this layer's
dequantized weights with float activations (weight-only fake quantization, as the `outliers` stage does). The
quantized model returned by the pipeline, and the one `qtool.load` builds from the checkpoint, run the full
W+A8 reference forward of formats/qoq.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from qtool.calibration.stats import LinearStats
from qtool.errors import RecipeError
from qtool.layouts.qoq.layout import QoQWeight, quantize_activations
from qtool.options import option
from qtool.quant.clip import clip_ratios
from qtool.quant.progressive import qoq_quantize
from qtool.stages.base import (
    QuantizerStage,
    QuantResult,
    act_order_option,
    block_size_option,
    damp_option,
    known_structure,
    sequential_option,
    static_groups_option,
)


@dataclass
class ProgressiveOptions:
    bits: Literal[4, 8] = option(
        4, help="weight bits: 8 (per channel) or 4 (per channel, or progressive groups)"
    )
    group_size: int | None = option(
        128, min=1, help="input columns per level-1 group (bits 4); null: one scale per output channel"
    )
    act_bits: Literal[8] = option(8, help="activation bits at run time (symmetric per token, dynamic)")
    solver: Literal["rtn", "gptq"] = option("rtn", help="round to nearest, or GPTQ on the same grid")
    clip: bool = option(False, help="search the level-0 range shrink minimising the layer output error")
    clip_grid: int = option(20, min=2, max=200, help="number of shrink ratios tried by clip")
    clip_min_ratio: float = option(0.5, min=0.05, max=1.0, help="smallest shrink ratio tried by clip")
    clip_qk: Literal["attention", "layer"] = option(
        "attention",
        help="what clip minimises for q_proj/k_proj: the attention output's error per head (QServe "
        "Eq. 10), or their own output's, like every other linear",
    )
    damp: float = damp_option("gptq")
    block_size: int = block_size_option("gptq")
    act_order: bool = act_order_option("gptq")
    static_groups: bool = static_groups_option("gptq")
    sequential: bool = sequential_option("gptq")

    def planned_layer(self, in_features: int) -> dict:
        """The qoq layer config these options give a linear of `in_features` inputs."""
        return {
            "format": QoQWeight.FORMAT,
            "bits": self.bits,
            "group_size": self.group_size,
            "act_bits": self.act_bits,
            "in_features": in_features,
        }

    def validate(self) -> tuple[str, str] | None:
        if self.bits == 8 and self.group_size is not None:
            return (
                "group_size",
                f"found {self.group_size} with bits 8; expected null (W8 has one scale per output channel)",
            )
        if self.act_order and self.group_size is not None and not self.static_groups:
            return (
                "static_groups",
                "found false with act_order and group_size set; expected true (the qoq "
                "layout keeps columns in their original order and has no per-column group index)",
            )
        return None


class ProgressiveStage(QuantizerStage):
    name = "progressive"
    options_cls = ProgressiveOptions
    layout_cls = QoQWeight
    help = "QoQ W4A8: W8 or W4 per channel, or W4 progressive groups on a protective-range INT8 level"

    def needs_calibration(self) -> bool:
        return self.options.solver == "gptq" or self.options.clip

    def needs_hessian(self) -> bool:
        return self.options.solver == "gptq"

    def sequential(self) -> bool:
        return self.options.solver == "gptq" and self.options.sequential

    def check_config(self, config, where: str) -> None:
        o: ProgressiveOptions = self.options
        if o.clip and o.clip_qk == "attention":
            adapter = known_structure(config, where, self.name, "q_proj and k_proj for clip_qk: attention")
            if not adapter.separate_qkv:
                raise RecipeError(
                    f"{where}.clip_qk: found 'attention', but {config.architectures[0]} computes queries and "
                    f"keys in one fused qkv_proj; expected clip_qk: layer"
                )
        g = o.group_size
        if g is None:
            return
        for full, lin in self.targeted_linears(config):
            if lin.in_features % g:
                raise RecipeError(
                    f"{where}.group_size: found {g}, but targeted linear {full} has "
                    f"in_features {lin.in_features}; expected a divisor of every targeted linear's "
                    f"in_features (or exclude it in targets)"
                )

    def preview(self, weight: torch.Tensor) -> torch.Tensor:
        o: ProgressiveOptions = self.options
        out = qoq_quantize(weight.float(), o.bits, o.group_size, solver="rtn")
        return (
            QoQWeight.from_codes(out.codes, out.scales, o.bits, o.group_size, out.group_scales, out.zeros)
            .dequantize(torch.float32)
            .to(weight.device)
        )

    def preview_activations(self, x: torch.Tensor) -> torch.Tensor:
        act = quantize_activations(x.float())
        return act.codes.to(torch.float32) * act.scale[:, None]

    def row_split(self) -> int | None:
        # Level 0 (its clip ratio too) and level 1 are per row, as is GPTQ over them. (A linear scored by the
        # attention objective is solved whole: its score reads the whole weight.) Round to nearest is quick
        # enough whole.
        return 1 if self.options.solver == "gptq" else None

    def distributed_problem(self) -> tuple[str, str] | None:
        if self.options.clip and self.options.clip_qk == "attention":
            return "clip_qk", (
                "found 'attention': progressive scores the clip ratios of q_proj/k_proj on the "
                "windows of one process; expected 'layer' with several processes (or one process)"
            )
        return None

    def attention_objective(self, rel: str, adapter) -> str | None:
        """ "q" or "k" when `rel` is the block's q_proj or k_proj and clip scores it by the attention output."""
        if not self.options.clip or self.options.clip_qk != "attention":
            return None
        return {adapter.q_proj: "q", adapter.k_proj: "k"}.get(rel)

    def quantize(self, name: str, weight: torch.Tensor, stats: LinearStats | None, score=None) -> QuantResult:
        o: ProgressiveOptions = self.options
        hessian = None
        if o.solver == "gptq":
            if stats is None or not stats.has_hessian:
                raise RuntimeError(f"progressive (gptq) needs the Hessian of {name}")
            hessian = stats.hessian().to(weight.device)
        elif o.clip and stats is not None:
            hessian = (stats.hessian() if stats.has_hessian else stats.hessian_diag()).to(weight.device)
        out = qoq_quantize(
            weight.float(),
            o.bits,
            o.group_size,
            solver=o.solver,
            hessian=hessian,
            clip_ratios=clip_ratios(o.clip_grid, o.clip_min_ratio) if o.clip else None,
            damp=o.damp,
            block_size=o.block_size,
            act_order=o.act_order,
            static_groups=o.static_groups,
            score=score,
        )
        packed = QoQWeight.from_codes(
            out.codes, out.scales, o.bits, o.group_size, out.group_scales, out.zeros
        )
        return QuantResult(packed, packed.dequantize(torch.float32).to(weight.device))
