"""GPTQ (Frantar et al., 2022): quantize a weight matrix column by column, folding each column's rounding error
into the columns not yet quantized through the inverse Hessian, in lazy batches of `block_size` columns."""

from __future__ import annotations

import torch

from qtool.quant.clip import clipped_grid_params
from qtool.quant.grid import GridSpec, grid_params, quantize


def _group_params(w: torch.Tensor, spec: GridSpec, ratios: list[float] | None, h_block: torch.Tensor | None):
    if ratios is None:
        return grid_params(w, spec)
    return clipped_grid_params(w, spec, ratios, h_block)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: GridSpec,
    *,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    static_groups: bool = False,
    clip_ratios: list[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (codes [N,K] int64, scales [N,G], zeros [N,G]) in the original column order.

    Computes in the dtype of `weight` (float32 in the pipeline, float64 in tests). Groups are formed over the
    original column order; with `act_order` that requires `static_groups` (scales fixed before the loop), so the
    packed layout needs no per-column group index.
    """
    w = weight.clone()
    h = hessian.to(w.dtype).clone()
    n, k = w.shape
    g = spec.group_size or k
    if act_order and spec.group_size is not None and not static_groups:
        raise ValueError("act_order with groups needs static_groups")

    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0

    num_groups = spec.num_groups(k)
    scales = torch.zeros(n, num_groups, dtype=w.dtype, device=w.device)
    zeros = torch.zeros_like(scales)
    if static_groups or spec.group_size is None:
        for j, (s, e) in enumerate(spec.group_bounds(k)):
            scales[:, j], zeros[:, j] = _group_params(w[:, s:e], spec, clip_ratios, h[s:e, s:e])

    perm = torch.arange(k, device=w.device)
    if act_order:
        perm = torch.argsort(torch.diagonal(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    group_of = perm // g  # group of each (permuted) column

    h += damp * torch.mean(torch.diagonal(h)) * torch.eye(k, dtype=h.dtype, device=h.device)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    # Dynamic groups take their range from the error-updated weights when the group starts; keeping each group
    # inside one lazy batch makes those the fully updated values.
    dynamic = not (static_groups or spec.group_size is None)
    bs = max(g, block_size // g * g) if dynamic else block_size

    codes = torch.zeros(n, k, dtype=torch.int64, device=w.device)
    for i1 in range(0, k, bs):
        i2 = min(i1 + bs, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if dynamic and col % g == 0:
                e = min(col + g, k)
                j = col // g
                scales[:, j], zeros[:, j] = _group_params(w1[:, i:i + (e - col)], spec, clip_ratios, h[col:e, col:e])
            j = int(group_of[col])
            s, z = scales[:, j:j + 1], zeros[:, j:j + 1]
            q = quantize(w1[:, i:i + 1], s, z, spec)
            codes[:, col] = q[:, 0].to(torch.int64)
            e_col = (w1[:, i] - (s[:, 0] * (q[:, 0] - z[:, 0]))) / hinv1[i, i]
            w1[:, i:] -= e_col[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e_col
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]

    if act_order:
        codes = codes[:, torch.argsort(perm)]
    return codes, scales, zeros
