"""Clipping: search the range shrink ratio that minimises the layer output error of each group.

The output error of a weight error `e` (one row, one group) is `e · H · eᵀ` with H the group's block of the
layer-input Hessian (`2/n Σ x xᵀ`). Large groups use the diagonal of H instead of the block, which keeps the
search linear in the group width; without calibration data the plain squared weight error is used.
"""

from __future__ import annotations

import torch

from qtool.quant.grid import GridSpec, fake_quantize, grid_params

# Above this group width the full Hessian block costs O(cols²) per row and candidate: use its diagonal.
FULL_BLOCK_MAX_COLS = 256


def clip_ratios(grid: int, min_ratio: float) -> list[float]:
    """`grid` ratios evenly spaced from 1.0 down to `min_ratio`."""
    if grid <= 1:
        return [1.0]
    step = (1.0 - min_ratio) / (grid - 1)
    return [1.0 - i * step for i in range(grid)]


def error_weight(hessian: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """What `output_error` weights a weight error with: the [cols, cols] Hessian block, or its diagonal when the
    block is wider than FULL_BLOCK_MAX_COLS or only the diagonal is given, or None (plain squared error)."""
    if hessian is None:
        return None
    if hessian.dim() == 2 and hessian.shape[0] > FULL_BLOCK_MAX_COLS:
        hessian = torch.diagonal(hessian)
    return hessian.to(dtype)


def output_error(e: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """Per-row output error of the weight error `e` [rows, cols]: `e H eᵀ`, `Σ e² diag(H)` or `Σ e²`."""
    if weight is None:
        return (e * e).sum(dim=1)
    if weight.dim() == 1:
        return (e * e * weight).sum(dim=1)
    return ((e @ weight) * e).sum(dim=1)


def clipped_grid_params(
    w: torch.Tensor,
    spec: GridSpec,
    ratios: list[float],
    hessian: torch.Tensor | None = None,
    score=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scale and zero for `w` [rows, cols] minimising the output error over `ratios`.

    `hessian` is the [cols, cols] block of H for these columns, or its diagonal [cols], or None. `score`, when
    given, replaces that error: a function of the fake-quantized rows giving each row's error (e.g. the attention
    objective of quant/attention_objective.py).
    """
    weight = error_weight(hessian, w.dtype)
    best_err = torch.full((w.shape[0],), float("inf"), dtype=w.dtype, device=w.device)
    best_scale = torch.empty_like(best_err)
    best_zero = torch.empty_like(best_err)
    for r in ratios:
        scale, zero = grid_params(w, spec, r)
        wq = fake_quantize(w, scale, zero, spec)
        err = score(wq) if score is not None else output_error(w - wq, weight)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero
