"""Round-to-nearest: every group takes its scale from its own range (optionally clipped) and rounds."""

from __future__ import annotations

import torch

from qtool.quant.clip import clipped_grid_params
from qtool.quant.grid import GridSpec, grid_params, quantize


def rtn_quantize(
    weight: torch.Tensor,
    spec: GridSpec,
    *,
    clip_ratios: list[float] | None = None,
    hessian: torch.Tensor | None = None,
    score=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (codes [N,K] int64, scales [N,G], zeros [N,G]). `hessian` ([K,K] or its diagonal [K]) weights
    the clipping search by the layer output error."""
    n, k = weight.shape
    groups = spec.group_bounds(k)
    if score is not None and len(groups) != 1:
        raise ValueError("a clipping score over whole rows needs one group per row")
    scales = torch.zeros(n, len(groups), dtype=weight.dtype, device=weight.device)
    zeros = torch.zeros_like(scales)
    codes = torch.zeros(n, k, dtype=torch.int64, device=weight.device)
    for j, (s, e) in enumerate(groups):
        wg = weight[:, s:e]
        if clip_ratios is None:
            sc, z = grid_params(wg, spec)
        else:
            h = None if hessian is None else (hessian[s:e] if hessian.dim() == 1 else hessian[s:e, s:e])
            sc, z = clipped_grid_params(wg, spec, clip_ratios, h, score=score)
        scales[:, j], zeros[:, j] = sc, z
        codes[:, s:e] = quantize(wg, sc, z, spec).to(torch.int64)
    return codes, scales, zeros
