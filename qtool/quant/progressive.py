"""QoQ weight quantization on one matrix (QServe §4.1; formats/qoq.md): the three weight rungs of the W4A8 layout.

- W8 per channel: `s0 = max|w|/127` (float16), `Q8 = clamp(round(w/s0), -127, 127)`.
- W4 per channel: the asymmetric 4-bit grid of quant/grid.py with one group per row.
- W4 progressive: level 0 is W8 with the protective range, `s0 = max|w|/119`, `Q8 = clamp(round(w/s0), ±119)`;
  level 1 quantizes the integers Q8 of each group of g columns to u4 with an integer scale `s1` and zero `z`
  chosen from the group's range `[min(minQ8, 0), max(maxQ8, 0)]`, so `Q8hat = s1·(q - z)` is back in int8.

Clipping shrinks the level-0 range (the per-row `max|w|`); for the progressive rung the whole two-level
quantization of the row is what the ratio is scored on. Rounding is torch.round (half to even) throughout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from qtool.quant.clip import error_weight, output_error
from qtool.quant.gptq import gptq_quantize, gptq_run
from qtool.quant.grid import GridSpec, _round_scale
from qtool.quant.rtn import rtn_quantize

W8_MAX = 127  # level 0 of W8: symmetric int8 without -128, so the grid is symmetric
PROTECT = 119  # level 0 of the progressive rung: 119 + s1/2 ≤ 127 for every s1 ≤ 16 (formats/qoq.md)
LEVEL1_MAX = 15  # u4 codes
INT8_MIN, INT8_MAX = -128, 127

W4_CHANNEL = GridSpec(bits=4, symmetric=False, group_size=None)


class QoQCodes(NamedTuple):
    codes: torch.Tensor  # [N, K] int64: signed Q8 (bits 8) or u4 codes q (bits 4)
    scales: torch.Tensor  # [N]: s0 (bits 8, progressive) or s (W4 per channel), float16 values
    group_scales: torch.Tensor | None  # [N, K/g] s1 (progressive)
    zeros: torch.Tensor | None  # [N] (W4 per channel) or [N, K/g] (progressive)


def level0_scales(w: torch.Tensor, qmax: int, ratio: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Per-row symmetric scale `max|w|·ratio / qmax`, rounded to float16 (kept in w's dtype)."""
    return _round_scale(w.abs().amax(dim=1) * ratio / qmax)


def level0_codes(w: torch.Tensor, s0: torch.Tensor, qmax: int) -> torch.Tensor:
    """`clamp(round(w/s0), -qmax, qmax)` with `s0` per row ([rows] or [rows, 1])."""
    if s0.dim() == 1:
        s0 = s0[:, None]
    return torch.clamp(torch.round(w / s0), -qmax, qmax)


def level1_params(q8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer scale `s1` in 1..16 and zero `z` in 0..15 per row of the integers `q8` [rows, cols].

    The range includes 0, as a u4 zero point in [0, 15] needs (Eq. 2 with q_min = 0 puts 0 on the grid):
    `s1 = max(1, round((hi - lo)/15))`, `z = clamp(round(-lo/s1), 0, 15)`. Every quotient here is of integers
    below 2^8, so float rounding is exact, ties included.
    """
    zero = torch.zeros(q8.shape[0], dtype=q8.dtype, device=q8.device)
    lo = torch.minimum(q8.amin(dim=1), zero)
    hi = torch.maximum(q8.amax(dim=1), zero)
    s1 = torch.clamp(torch.round((hi - lo) / LEVEL1_MAX), min=1)
    z = torch.clamp(torch.round(-lo / s1), 0, LEVEL1_MAX)
    return s1, z


def level1_codes(q8: torch.Tensor, s1: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """u4 codes `clamp(round(q8/s1) + z, 0, 15)` (`s1`, `z` per row, [rows] or [rows, 1]).

    The codes are also kept where `s1·(q - z)` stays in int8. For values inside the group's range that never
    binds (tests/test_qoq_progressive.py checks every range); it matters to GPTQ, whose error feedback can move a
    column past the range its group's parameters were chosen from.
    """
    if s1.dim() == 1:
        s1, z = s1[:, None], z[:, None]
    lo = torch.clamp(z - torch.floor(-INT8_MIN / s1), min=0)
    hi = torch.clamp(z + torch.floor(INT8_MAX / s1), max=LEVEL1_MAX)
    return torch.minimum(torch.maximum(torch.round(q8 / s1) + z, lo), hi)


def progressive_codes(w: torch.Tensor, s0: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    """RTN of `w` [N, K] on the two-level grid with level-0 scales `s0` [N]: (q [N, K], s1 [N, G], z [N, G])."""
    n, k = w.shape
    q8 = level0_codes(w, s0, PROTECT).reshape(n * (k // group_size), group_size)
    s1, z = level1_params(q8)
    q = level1_codes(q8, s1, z)
    return q.reshape(n, k), s1.reshape(n, -1), z.reshape(n, -1)


def progressive_dequantize(
    q: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor, z: torch.Tensor
) -> torch.Tensor:
    """`s0·(s1·(q - z))`: the integer `s1·(q - z)` first (exact), then one rounding to w's dtype."""
    n, k = q.shape
    g = k // s1.shape[1]
    q8hat = (q.reshape(n, -1, g) - z[:, :, None]) * s1[:, :, None]
    return s0[:, None] * q8hat.reshape(n, k)


def _fake_w8(w: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
    return s0[:, None] * level0_codes(w, s0, W8_MAX)


def _fake_progressive(group_size: int):
    def fake(w: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
        q, s1, z = progressive_codes(w, s0, group_size)
        return progressive_dequantize(q, s0, s1, z)

    return fake


def clipped_level0_scales(
    w: torch.Tensor, qmax: int, fake, ratios: list[float], hessian: torch.Tensor | None, score=None
) -> torch.Tensor:
    """The level-0 scale per row whose ratio (of `ratios`) minimises the output error of `fake(w, s0)`, weighted
    by `hessian` ([K, K] or its diagonal; None: plain squared error) as in quant/clip.py, or scored by `score`
    (a function of the fake-quantized rows giving each row's error)."""
    weight = error_weight(hessian, w.dtype)
    best_err = torch.full((w.shape[0],), float("inf"), dtype=w.dtype, device=w.device)
    best = torch.empty_like(best_err)
    for r in ratios:
        s0 = level0_scales(w, qmax, r)
        wq = fake(w, s0)
        err = score(wq) if score is not None else output_error(w - wq, weight)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, s0, best)
    return best


class Level0Grid:
    """GPTQ's column grid for W8: the per-row scale is fixed before the column loop."""

    def __init__(self, s0: torch.Tensor, qmax: int) -> None:
        self.s0 = s0
        self.qmax = qmax

    def group_params(self, w: torch.Tensor, h_block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.s0, torch.zeros_like(self.s0)

    def quantize_column(self, w, scale, zero):
        q8 = level0_codes(w[:, None], scale, self.qmax)[:, 0]
        return q8, scale * q8


class ProgressiveGrid(Level0Grid):
    """GPTQ's column grid for the progressive rung: `s0` is fixed per row before the column loop; each group's
    `s1` and `z` are chosen when GPTQ reaches the group, from the range of its error-updated columns at that
    point; each column is rounded through level 0 then level 1, as RTN does."""

    def __init__(self, s0: torch.Tensor) -> None:
        super().__init__(s0, PROTECT)

    def group_params(self, w, h_block):
        return level1_params(level0_codes(w, self.s0, PROTECT))

    def quantize_column(self, w, scale, zero):
        q8 = level0_codes(w[:, None], self.s0, PROTECT)[:, 0]
        q = level1_codes(q8[:, None], scale, zero)[:, 0]
        return q, self.s0 * (scale * (q - zero))


def qoq_quantize(
    weight: torch.Tensor,
    bits: int,
    group_size: int | None,
    *,
    solver: str = "rtn",
    hessian: torch.Tensor | None = None,
    clip_ratios: list[float] | None = None,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    static_groups: bool = False,
    score=None,
) -> QoQCodes:
    """Quantize `weight` [N, K] to one of the three QoQ rungs (bits 8 per channel; bits 4 per channel; bits 4 with
    groups of `group_size`). `solver` "gptq" needs the Hessian [K, K]; "rtn" uses `hessian` ([K, K] or its
    diagonal) only to score clip ratios; `act_order` / `static_groups` are GPTQ's (with groups, act_order needs
    static groups: every group's s1 and z are then chosen from the unquantized weights before the column loop).
    `score` (with `clip_ratios`) replaces the clipping search's error by a per-row function of the fake-quantized
    weight (QServe's attention objective for q_proj/k_proj); the per-channel W4 GPTQ path keeps GPTQ's own.
    Computes in weight's dtype."""
    n, k = weight.shape
    if bits == 8 and group_size is not None:
        raise ValueError(f"bits 8 is per channel; got group_size {group_size}")
    if group_size is not None and k % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {k}")
    if solver == "gptq" and (hessian is None or hessian.dim() != 2):
        raise ValueError("the gptq solver needs the [K, K] Hessian")
    if bits == 4 and group_size is None:
        if solver == "gptq":
            codes, scales, zeros = gptq_quantize(
                weight,
                hessian,
                W4_CHANNEL,
                damp=damp,
                block_size=block_size,
                act_order=act_order,
                clip_ratios=clip_ratios,
            )
        else:
            codes, scales, zeros = rtn_quantize(
                weight, W4_CHANNEL, clip_ratios=clip_ratios, hessian=hessian, score=score
            )
        return QoQCodes(codes, scales[:, 0], None, zeros[:, 0])

    qmax = W8_MAX if bits == 8 else PROTECT
    fake = _fake_w8 if bits == 8 else _fake_progressive(group_size)
    if clip_ratios is None:
        s0 = level0_scales(weight, qmax)
    else:
        s0 = clipped_level0_scales(weight, qmax, fake, clip_ratios, hessian, score)
    if solver == "gptq":
        grid = Level0Grid(s0, W8_MAX) if bits == 8 else ProgressiveGrid(s0)
        spec = GridSpec(bits=bits, symmetric=bits == 8, group_size=group_size)
        out = gptq_run(
            weight,
            hessian,
            spec,
            damp=damp,
            block_size=block_size,
            act_order=act_order,
            static_groups=static_groups,
            grid=grid,
        )
        if bits == 8:
            return QoQCodes(out.codes, s0, None, None)
        return QoQCodes(out.codes, s0, out.scales, out.zeros)
    if bits == 8:
        return QoQCodes(level0_codes(weight, s0, W8_MAX).to(torch.int64), s0, None, None)
    q, s1, z = progressive_codes(weight, s0, group_size)
    return QoQCodes(q.to(torch.int64), s0, s1, z)
