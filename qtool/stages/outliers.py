"""Stage `outliers`: weight and activation quantization with full-precision outlier input columns (QUIK).

For each targeted linear, the k input columns with the largest ℓ∞ over the calibration activations are the
outliers. The weight columns are permuted so the outliers come last, and GPTQ runs on the permuted matrix with the
Hessian permuted the same way: the base columns are quantized symmetrically per output channel (4 or 8 bits) and
their rounding error accumulates into the outlier columns, which are stored in float16 (with their GPTQ updates).
At run time the base columns of the input are quantized per token, asymmetrically, to `act_bits`
(formats/quik.md); the outlier columns of the input meet the float16 weights.

Per-target rules (`overrides`, first matching pattern wins) change the bits and the outlier count of some linears,
e.g. `down_proj` (Llama) / `fc2` (OPT) in 8 bits with 3.5x the outliers. One stage with rules, rather than two
stages with complementary targets, keeps the shared options (damping, clipping, threshold) in one place.

`threshold` (T): a linear whose largest calibration activation magnitude, max_k ℓ∞(x_k), is below T gets no
outliers (all columns integer); T = 0 turns the rule off.

Within the block-wise pipeline, the next linears and the next block are calibrated on the outputs of this layer's
dequantized weights (weight-only fake quantization: float16 outlier columns, `s_w·c` base columns, activations
unquantized). The quantized model returned by the pipeline, and the one `qtool.load` builds from the checkpoint,
run the full weight-and-activation-quantized reference forward.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from qtool.calibration.stats import LinearStats
from qtool.errors import RecipeError, shown
from qtool.layouts.quik.layout import QuikWeight
from qtool.options import option
from qtool.quant.clip import clip_ratios
from qtool.quant.gptq import gptq_run
from qtool.quant.grid import GridSpec
from qtool.stages.base import HessianStage, QuantResult, block_size_option, damp_option, sequential_option

_COUNT_HELP = "an integer count >= 0 or a fraction of in_features in [0, 1)"


def _count_problem(value: int | float | None) -> str | None:
    if isinstance(value, float) and not 0.0 <= value < 1.0:
        return f"found {shown(value)}, expected {_COUNT_HELP} (write counts without a decimal point)"
    return None


@dataclass
class OutlierOverride:
    pattern: str = option(help="glob over module names, e.g. '*.down_proj'")
    bits: Literal[4, 8] | None = option(None, help="weight bits for the matching linears")
    act_bits: Literal[4, 8] | None = option(None, help="activation bits for the matching linears")
    outliers: int | float | None = option(
        None, min=0, help=f"outlier columns: {_COUNT_HELP}; replaces the stage's value"
    )
    outlier_multiplier: float | None = option(
        None, min=0.0, max=1000.0, help="multiplies the outlier count (after `outliers`)"
    )

    def validate(self) -> tuple[str, str] | None:
        if not self.pattern:
            return ("pattern", "found '', expected a glob over module names such as '*.down_proj'")
        problem = _count_problem(self.outliers)
        return ("outliers", problem) if problem else None


@dataclass
class OutliersOptions:
    bits: Literal[4, 8] = option(4, help="weight bits (symmetric, one scale per output channel)")
    act_bits: Literal[4, 8] = option(4, help="activation bits at run time (asymmetric, per token)")
    outliers: int | float = option(256, min=0, help=f"outlier input columns kept in float16: {_COUNT_HELP}")
    threshold: float = option(
        0.0,
        min=0.0,
        help="no outliers for linears whose largest calibration activation magnitude is below this (0: off)",
    )
    overrides: list[OutlierOverride] = option(
        default_factory=list,
        help="per-target rules {pattern, bits, act_bits, outliers, "
        "outlier_multiplier}; the first matching pattern wins",
    )
    clip: bool = option(
        True, help="search the weight range shrink minimising the (Hessian-weighted) squared error"
    )
    clip_grid: int = option(20, min=2, max=200, help="number of shrink ratios tried by clip")
    clip_min_ratio: float = option(0.5, min=0.05, max=1.0, help="smallest shrink ratio tried by clip")
    sparsity_24: bool = option(
        False, help="prune the base weights to 2:4 in the same GPTQ pass (outliers stay dense)"
    )
    damp: float = damp_option()
    block_size: int = block_size_option()
    sequential: bool = sequential_option()

    def planned_layer(self, in_features: int) -> dict:
        """The quik layer config these options give a linear of `in_features` inputs (outliers: whether any)."""
        return {
            "format": QuikWeight.FORMAT,
            "bits": self.bits,
            "act_bits": self.act_bits,
            "group_size": None,
            "in_features": in_features,
            "num_outliers": self.outliers or any(getattr(v, "outliers", None) for v in self.overrides),
            "sparsity": "2:4" if self.sparsity_24 else None,
        }

    def validate(self) -> tuple[str, str] | None:
        problem = _count_problem(self.outliers)
        return ("outliers", problem) if problem else None


class LayerPlan(NamedTuple):
    bits: int
    act_bits: int
    num_outliers: int


def outlier_count(value: int | float, in_features: int) -> float:
    return float(value) * in_features if isinstance(value, float) else float(value)


def select_outliers(absmax: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending) of the k columns with the largest ℓ∞; ties go to the lower index."""
    order = torch.argsort(absmax.to(torch.float32).cpu(), descending=True, stable=True)
    return torch.sort(order[:k]).values


class OutliersStage(HessianStage):
    name = "outliers"
    options_cls = OutliersOptions
    layout_cls = QuikWeight
    help = (
        "QUIK: W4/W8 + per-token A4/A8 with float16 outlier columns chosen by calibration ℓ∞, GPTQ with the "
        "outliers last"
    )

    def _rule(self, name: str) -> tuple[int, OutlierOverride | None]:
        for i, rule in enumerate(self.options.overrides):
            if fnmatch.fnmatchcase(name, rule.pattern):
                return i, rule
        return -1, None

    def outlier_columns(self, name: str, in_features: int) -> tuple[int, str]:
        """How many outlier columns the options ask for in linear `name`, and the key that sets the count."""
        o: OutliersOptions = self.options
        count, key = outlier_count(o.outliers, in_features), "outliers"
        i, rule = self._rule(name)
        if rule is not None:
            if rule.outliers is not None:
                count, key = outlier_count(rule.outliers, in_features), f"overrides[{i}].outliers"
            if rule.outlier_multiplier is not None:
                count *= rule.outlier_multiplier
                key = f"overrides[{i}].outlier_multiplier"
        return int(round(count)), key

    def outliers_problem(self, name: str, in_features: int) -> tuple[str, str] | None:
        """(key, message) when linear `name` cannot take the outlier count the options ask for, else None: a count
        reaching its in_features would keep every column in float16, quantize nothing and still be reported as
        W4A4."""
        k, key = self.outlier_columns(name, in_features)
        if k < in_features:
            return None
        return key, (
            f"asks for {k} outlier columns in {name}, which has {in_features} inputs; expected fewer than its "
            f"in_features (every column would stay float16, nothing quantized)"
        )

    def check_config(self, config, where: str) -> None:
        for full, lin in self.targeted_linears(config):
            problem = self.outliers_problem(full, lin.in_features)
            if problem is not None:
                raise RecipeError(f"{where}.{problem[0]}: {problem[1]}")

    def plan(self, name: str, in_features: int, absmax: torch.Tensor | None) -> LayerPlan:
        """Bits, activation bits and outlier count of the linear `name` (rules, then the threshold)."""
        o: OutliersOptions = self.options
        problem = self.outliers_problem(name, in_features)
        if problem is not None:  # a model whose config did not show the linear's width
            raise RecipeError(f"stages[{self.index}].{problem[0]}: {problem[1]}")
        bits, act_bits = o.bits, o.act_bits
        _, rule = self._rule(name)
        if rule is not None:
            bits = rule.bits if rule.bits is not None else bits
            act_bits = rule.act_bits if rule.act_bits is not None else act_bits
        k = self.outlier_columns(name, in_features)[0]
        if o.threshold > 0 and absmax is not None and float(absmax.max()) < o.threshold:
            k = 0
        return LayerPlan(bits, act_bits, k)

    def row_split(self) -> int | None:
        # The outlier columns come from the activations' ranges (the same on every slice), the rest of the solve
        # is GPTQ's per row (per-channel scales, 2:4 chosen within each row).
        return 1

    def quantize(self, name: str, weight: torch.Tensor, stats: LinearStats | None) -> QuantResult:
        if stats is None or not stats.has_hessian:
            raise RuntimeError(f"outliers needs the Hessian and activation ranges of {name}")
        o: OutliersOptions = self.options
        n, kin = weight.shape
        plan = self.plan(name, kin, stats.absmax)
        idx = select_outliers(stats.absmax, plan.num_outliers).to(weight.device)
        keep = torch.ones(kin, dtype=torch.bool, device=weight.device)
        keep[idx] = False
        base = torch.nonzero(keep)[:, 0]
        spec = GridSpec(bits=plan.bits, symmetric=True, group_size=None)
        w = weight.float()
        if base.numel() == 0:  # every column is an outlier: nothing to quantize
            codes = torch.zeros(n, 0, dtype=torch.int64)
            scales = torch.ones(n, dtype=torch.float32)
            kept = w[:, idx]
        else:
            perm = torch.cat([base, idx])
            h = stats.hessian().to(weight.device)
            out = gptq_run(
                w[:, perm],
                h[perm][:, perm],
                spec,
                damp=o.damp,
                block_size=o.block_size,
                clip_ratios=clip_ratios(o.clip_grid, o.clip_min_ratio) if o.clip else None,
                keep_last=idx.numel(),
                sparsity_24=o.sparsity_24,
            )
            codes, scales, kept = out.codes, out.scales[:, 0], out.kept
        packed = QuikWeight.from_codes(codes, scales, idx, kept, plan.bits, plan.act_bits, o.sparsity_24)
        return QuantResult(packed, packed.dequantize(torch.float32).to(weight.device))
