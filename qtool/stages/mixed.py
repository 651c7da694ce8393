"""Stage `mixed`: 2/4-bit intra-weight mixed precision with sparse float16 outliers (Li et al., "Fast and Efficient
2-bit LLM Inference on GPU: 2/4/16-bit in a Weight Matrix with Asynchronous Dequantization", Sec. 3-4), in the
`mixed-2-4-16` layout (formats/mixed-2-4-16.md).

Per targeted linear: the Eq. 9 sensitivity of every stripe of `group_size` input channels (all output rows) from
the weights and the diagonal of the inverse calibration Hessian; the most sensitive stripes get 4 bits, the rest 2
bits (`assign: block4`, one in every four as the paper's packing assumes, or `global`, the top fraction of the
matrix, or with `target_bits` the most 4-bit stripes whose stored bits stay within the budget). Groups are
asymmetric min/max round to nearest (`solver: rtn`, the paper's); the 2-bit groups' scales are quantized to 4
bits over `scale_group_size` output rows; up to `outlier_fraction` of the weights, those of the 2-bit stripes with
the largest rounding error, are kept as float16 residuals in CSR form. `solver: gptq` (a deviation from the paper)
runs GPTQ's error feedback over the same grids, each group at its stripe's width.

Within the block-wise pipeline the next linears and blocks are calibrated on this layer's dequantized weights.
`finetune_steps` (off by default) stands in for the paper's QAT-like fine-tuning after the assignment: once a
block's linears are quantized, their scales (the 2-bit groups' second-order scales, the 4-bit groups' scales) are
trained, codes fixed, so that the block's output matches the float block's on the calibration inputs
(qtool/quant/blockwise.py), one block at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch

from qtool.calibration.stats import LinearStats
from qtool.layouts.mixed.layout import MAX_COLUMNS, SCALE_BITS, MixedWeight, bits_for, eq10_bits
from qtool.options import option
from qtool.quant.blockwise import tune_block
from qtool.quant.mixed import (
    TunableScales,
    assign_stripes,
    inverse_hessian_diag,
    mixed_quantize,
    mixed_quantize_gptq,
    obs_sensitivity,
    outlier_count,
    random_sensitivity,
    sensitivity,
    stripes_for_fraction,
    stripes_for_target,
)
from qtool.stages.base import HessianStage, QuantResult, block_size_option, damp_option

BLOCK4_FRACTION = 0.25


def bits_floor(group_size: int, scale_group_size: int, outlier_fraction: float) -> float:
    """Bits per weight of an all-2-bit layer of unbounded width: 2-bit codes, a 4-bit scale code and a 2-bit zero
    per group, a float16 scale and a byte zero per second-order group, 32 bits per outlier. Stored layers add
    the row pointers and row padding on top."""
    g1, g2 = group_size, scale_group_size
    return 2 + (SCALE_BITS + 2) / g1 + (16 + 8) / (g1 * g2) + 32 * outlier_fraction


def eq10_floor(group_size: int, scale_group_size: int, outlier_fraction: float) -> float:
    """Eq. 10 of an all-2-bit layer, with the paper's 30 bits per outlier."""
    g1, g2 = group_size, scale_group_size
    return 2 + (SCALE_BITS + 2) / g1 + (SCALE_BITS + 16) / (g1 * g2) + 30 * outlier_fraction


@lru_cache(maxsize=256)
def _stripes_for_target(
    n: int, k: int, g1: int, g2: int, outlier_fraction: float, target: float, counts: str
) -> int | None:
    return stripes_for_target(n, k, g1, g2, outlier_fraction, target, counts)


@dataclass
class MixedOptions:
    group_size: int = option(
        16, min=8, help="g1: input channels per stripe and per first-order group (multiple of 8)"
    )
    scale_group_size: int = option(
        16, min=1, help="g2: output rows per second-order group of the 2-bit groups' scales"
    )
    fraction_4bit: float = option(
        0.25, min=0.0, max=1.0, help="fraction of the stripes at 4 bits (block4: 0.25)"
    )
    target_bits: float | None = option(
        None,
        min=2.0,
        max=4.0,
        help="assign global: stored bits per weight per "
        "layer, picks the 4-bit stripes instead of "
        "fraction_4bit",
    )
    target_counts: Literal["stored", "eq10"] = option(
        "stored",
        help="what target_bits counts: the stored tensors, or the paper's Eq. 10 (with 30 bits per outlier)",
    )
    assign: Literal["block4", "global"] = option(
        "block4",
        help="block4: the most sensitive stripe of every four; global: the most sensitive of the matrix",
    )
    sensitivity: Literal["eq9", "obs", "random"] = option(
        "eq9",
        help="score that picks the 4-bit stripes: "
        "eq9 (Eq. 9 as printed, H⁻¹ diagonal "
        "squared), obs (w²/[H⁻¹]_qq), random "
        "(a control, seeded by layer name)",
    )
    outlier_fraction: float = option(
        0.002,
        min=0.0,
        max=0.005,
        help="weights kept as float16 outliers (2-bit stripes only), as a fraction of all weights",
    )
    solver: Literal["rtn", "gptq"] = option(
        "rtn",
        help="rtn: asymmetric min/max round to nearest (the paper's); "
        "gptq: the same grids with GPTQ error feedback",
    )
    damp: float = damp_option()
    block_size: int = block_size_option("gptq")
    finetune_steps: int = option(
        0,
        min=0,
        max=100000,
        help="block-wise fine-tuning: Adam steps per block on the "
        "scales (codes fixed) against the float block's "
        "output; 0 is off",
    )
    finetune_lr: float = option(
        0.005, min=1e-6, max=1.0, help="fine-tuning: Adam learning rate on the log of each scale"
    )
    finetune_samples: int = option(1, min=1, max=4096, help="fine-tuning: calibration windows per step")

    def validate(self) -> tuple[str, str] | None:
        if self.group_size % 8:
            return (
                "group_size",
                f"found {self.group_size}; expected a multiple of 8 (a 4-bit stripe is split in "
                f"two halves of whole 16-bit units)",
            )
        if self.assign == "block4" and self.target_bits is not None:
            return (
                "target_bits",
                f"found {self.target_bits} with assign block4; expected null, or assign global "
                f"(block4 fixes one 4-bit stripe in every four)",
            )
        if self.assign == "block4" and self.fraction_4bit != BLOCK4_FRACTION:
            return (
                "fraction_4bit",
                f"found {self.fraction_4bit} with assign block4; expected {BLOCK4_FRACTION} "
                f"(one 4-bit stripe in every four), or assign global",
            )
        if self.target_bits is not None:
            stored = self.target_counts == "stored"
            floor = (bits_floor if stored else eq10_floor)(
                self.group_size, self.scale_group_size, self.outlier_fraction
            )
            if self.target_bits < floor:
                return (
                    "target_bits",
                    f"found {self.target_bits}, which cannot be met: with every stripe at 2 bits "
                    f"this scheme {'stores' if stored else 'counts (Eq. 10)'} at least "
                    f"{floor:.4f} bits per weight (group_size "
                    f"{self.group_size}, scale_group_size {self.scale_group_size}, "
                    f"outlier_fraction {self.outlier_fraction}); expected at least that",
                )
        return None


class MixedStage(HessianStage):
    name = "mixed"
    options_cls = MixedOptions
    layout_cls = MixedWeight
    help = "2/4-bit mixed stripes by Eq. 9 sensitivity, second-order 4-bit scales, sparse float16 outliers"

    def sequential(self) -> bool:
        # GPTQ, as the gptq stage does: q/k/v, then o, then gate/up, then down, each on the outputs of the
        # already quantized linears. Round to nearest needs only the block's inputs.
        return self.options.solver == "gptq"

    def layer_problem(self, n: int, k: int) -> tuple[str, str] | None:
        """(key, message) for a linear of `n` x `k` this stage cannot quantize, else None."""
        o: MixedOptions = self.options
        g1, g2 = o.group_size, o.scale_group_size
        if k % g1:
            return "group_size", f"found {g1}, but {{}} has in_features {k}; expected a divisor of it"
        if n % g2:
            return "scale_group_size", f"found {g2}, but {{}} has out_features {n}; expected a divisor of it"
        s = k // g1
        if o.assign == "block4" and s % 4:
            return "assign", (
                f"found 'block4', but {{}} has {s} stripes of {g1} input channels (in_features {k}), "
                f"fewer than a whole number of blocks of four; expected in_features a multiple of "
                f"{4 * g1}, or assign global"
            )
        if o.outlier_fraction > 0 and k > MAX_COLUMNS:
            return "outlier_fraction", (
                f"found {o.outlier_fraction}, but {{}} has in_features {k} > {MAX_COLUMNS} "
                f"(16-bit outlier columns); expected 0"
            )
        if o.target_bits is not None:
            if _stripes_for_target(n, k, g1, g2, o.outlier_fraction, o.target_bits, o.target_counts) is None:
                nout = outlier_count(n, k, g1, 0, o.outlier_fraction)
                if o.target_counts == "eq10":
                    least, verb = eq10_bits(k, g1, g2, 0, nout, n), "counts (Eq. 10)"
                else:
                    least, verb = bits_for(n, k, g1, g2, 0, nout) / (n * k), "stores"
                return "target_bits", (
                    f"found {o.target_bits}, which cannot be met: {{}} {verb} {least:.4f} "
                    f"bits per weight with every stripe at 2 bits; expected at least that"
                )
        elif (
            o.assign == "global" and o.fraction_4bit > 0 and stripes_for_fraction(k, g1, o.fraction_4bit) == 0
        ):
            return "fraction_4bit", (
                f"found {o.fraction_4bit}, but {{}} has only {s} stripes of {g1} input "
                f"channels, too few for any 4-bit stripe; expected at least {0.5 / s:.4g}, "
                f"0, or the linear excluded in targets"
            )
        return None

    def check_config(self, config, where: str) -> None:
        self.check_layers(config, where)

    def distributed_problem(self) -> tuple[str, str] | None:
        if self.options.finetune_steps > 0:
            return "finetune_steps", (
                f"found {self.options.finetune_steps}: mixed fine-tunes each block on the "
                f"windows of one process; expected 0 with several processes (or one process)"
            )
        return None

    def finetunes(self) -> bool:
        return self.options.finetune_steps > 0

    def finetune_block(
        self,
        block,
        layouts: dict[str, MixedWeight],
        originals: dict[str, torch.Tensor],
        inputs: list[torch.Tensor],
        kwargs: dict,
        targets: list[torch.Tensor],
    ) -> tuple[dict[str, MixedWeight], dict]:
        o: MixedOptions = self.options
        device = inputs[0].device
        tunables = {rel: TunableScales(layout, originals[rel], device) for rel, layout in layouts.items()}
        params = [p for t in tunables.values() for p in t.parameters()]
        res = tune_block(
            block,
            {f"{rel}.weight": t for rel, t in tunables.items()},
            params,
            inputs,
            kwargs,
            targets,
            steps=o.finetune_steps,
            lr=o.finetune_lr,
            samples=o.finetune_samples,
        )
        tuned = {rel: t.layout() for rel, t in tunables.items()} if res.kept else layouts
        return tuned, {
            "finetune": {
                "error_before": round(res.error_before, 8),
                "error_after": round(res.error_after, 8),
                "kept": res.kept,
            }
        }

    def row_split(self) -> int | None:
        # GPTQ's solve is per row, its second-order scales per `scale_group_size` rows; the stripe widths and the
        # outlier positions are chosen from the whole matrix on every rank (`quantize_rows`).
        return self.options.scale_group_size if self.options.solver == "gptq" else None

    def quantize(self, name: str, weight: torch.Tensor, stats: LinearStats | None) -> QuantResult:
        return self.quantize_rows(name, weight, stats, range(weight.shape[0]))

    def quantize_rows(
        self, name: str, weight: torch.Tensor, stats: LinearStats | None, rows: range
    ) -> QuantResult:
        o: MixedOptions = self.options
        if stats is None or not stats.has_hessian:
            raise RuntimeError(f"mixed needs the Hessian of {name}")
        n, k = weight.shape
        self.refuse_layer(name, n, k)
        hessian = stats.hessian().cpu()
        hinv = inverse_hessian_diag(hessian, o.damp)
        if o.sensitivity == "random":
            sens = random_sensitivity(name, k // o.group_size)
        else:
            sens = (sensitivity if o.sensitivity == "eq9" else obs_sensitivity)(
                weight.cpu(), hinv, o.group_size
            )
        if o.target_bits is not None:
            count = _stripes_for_target(
                n, k, o.group_size, o.scale_group_size, o.outlier_fraction, o.target_bits, o.target_counts
            )
        else:
            count = stripes_for_fraction(k, o.group_size, o.fraction_4bit)
        is4 = assign_stripes(sens, o.assign, count)
        nout = outlier_count(n, k, o.group_size, int(is4.sum()), o.outlier_fraction)
        if o.solver == "gptq":
            mc = mixed_quantize_gptq(
                weight,
                hessian,
                is4,
                o.group_size,
                o.scale_group_size,
                nout,
                damp=o.damp,
                block_size=o.block_size,
                rows=rows,
            )
        elif len(rows) < n:
            raise ValueError(
                f"mixed: solver rtn solves every row of {name} at once (its outliers are refitted)"
            )
        else:
            mc = mixed_quantize(weight, is4, o.group_size, o.scale_group_size, nout)
        packed = MixedWeight.from_codes(
            mc.codes,
            mc.is4,
            o.group_size,
            o.scale_group_size,
            o.assign,
            mc.scale_codes,
            mc.zeros2,
            mc.scales_2nd,
            mc.zeros_2nd,
            mc.scales4,
            mc.zeros4,
            mc.outlier_rows,
            mc.outlier_cols,
            mc.outlier_values,
        )
        return QuantResult(packed, packed.dequantize(torch.float32).to(weight.device))
