"""The integer grid shared by every weight quantizer: scale/zero from a range, quantize, dequantize.

Scales are rounded to float16 before codes are computed, so the packed checkpoint holds exactly the
scale the quantizer used and the reference forward reproduces the pipeline's fake-quantized weights.
"""

from __future__ import annotations

import torch

from qtool.layouts.grouped_int.layout import GridSpec

# Smallest float16 subnormal: keeps all-zero groups from producing a zero scale.
_MIN_SCALE = 2.0**-24


def grid_params(
    w: torch.Tensor, spec: GridSpec, ratio: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero (both [rows], float) for the columns of `w` [rows, cols] treated as one group each row.

    `ratio` shrinks the range (clipping); a tensor gives one ratio per row.
    """
    zero_col = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
    xmin = torch.minimum(w.min(dim=1).values, zero_col) * ratio
    xmax = torch.maximum(w.max(dim=1).values, zero_col) * ratio
    if spec.symmetric:
        amax = torch.maximum(xmin.abs(), xmax)
        scale = 2 * amax / spec.maxq
        scale = _round_scale(scale)
        zero = torch.full_like(scale, float(spec.sym_zero))
    else:
        scale = _round_scale((xmax - xmin) / spec.maxq)
        zero = torch.clamp(torch.round(-xmin / scale), 0, spec.maxq)
    return scale, zero


def _round_scale(scale: torch.Tensor) -> torch.Tensor:
    return scale.clamp(min=_MIN_SCALE).to(torch.float16).to(scale.dtype)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: GridSpec) -> torch.Tensor:
    """Codes in [0, maxq] for `w` [rows, cols] with per-row `scale`, `zero` ([rows] or [rows, 1])."""
    if scale.dim() == 1:
        scale, zero = scale[:, None], zero[:, None]
    return torch.clamp(torch.round(w / scale) + zero, 0, spec.maxq)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    if scale.dim() == 1:
        scale, zero = scale[:, None], zero[:, None]
    return scale * (q - zero)


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: GridSpec) -> torch.Tensor:
    return dequantize(quantize(w, scale, zero, spec), scale, zero)
