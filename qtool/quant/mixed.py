"""2/4-bit intra-weight mixed precision (Li et al., "Fast and Efficient 2-bit LLM Inference on GPU", Sec. 3-4):
Eq. 9 sensitivity of each stripe of `g1` input channels, the 2-bit/4-bit assignment, round-to-nearest asymmetric
min/max groups with second-order 4-bit scales for the 2-bit groups, and sparse float16 outliers in the 2-bit
stripes. The layout and every rounding convention are in formats/mixed-2-4-16.md."""

from __future__ import annotations

import math
import zlib
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import nn

from qtool.layouts.bitpack import unpack_codes
from qtool.layouts.mixed.layout import SCALE_BITS, MixedWeight, bits_for, eq10_bits

MAX2 = 3  # 2-bit codes
MAX4 = 15  # 4-bit codes, and the 4-bit scale codes and second-order zeros
MIN_SCALE = 2.0**-14  # smallest normal float16: no stored scale is zero or subnormal


def inverse_hessian_diag(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """diag(H⁻¹) [K] in float64, with GPTQ's conditioning: dead inputs (diag 0) get 1 on the diagonal, then
    `damp·mean(diag H)` is added to the diagonal."""
    h = hessian.to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    k = h.shape[0]
    h += damp * torch.mean(torch.diagonal(h)) * torch.eye(k, dtype=h.dtype, device=h.device)
    # H = L·Lᵀ, so H⁻¹ = L⁻ᵀ·L⁻¹ and diag(H⁻¹)_q = Σ_r (L⁻¹)_rq² (one triangular solve; cholesky_inverse is
    # several times slower on CPU).
    lower = torch.linalg.cholesky(h)
    linv = torch.linalg.solve_triangular(lower, torch.eye(k, dtype=h.dtype, device=h.device), upper=False)
    return linv.pow(2).sum(dim=0)


def sensitivity(weight: torch.Tensor, hinv_diag: torch.Tensor, group_size: int) -> torch.Tensor:
    """Eq. 9 as printed: `S_i = Σ_{m<g1} Σ_j W[j, g1·i+m]² / ([H⁻¹]_{g1·i+m})²` for every stripe i, float64 [S]."""
    w2 = weight.to(torch.float64).pow(2).sum(dim=0)
    return (w2 / hinv_diag.to(torch.float64).pow(2)).reshape(-1, group_size).sum(dim=1)


def obs_sensitivity(weight: torch.Tensor, hinv_diag: torch.Tensor, group_size: int) -> torch.Tensor:
    """The OBS saliency summed per stripe, `Σ w² / [H⁻¹]_qq` (the denominator not squared): the reading of Eq. 9
    that its Eq. 8 motivation suggests, kept to measure against the printed one. float64 [S]."""
    w2 = weight.to(torch.float64).pow(2).sum(dim=0)
    return (w2 / hinv_diag.to(torch.float64)).reshape(-1, group_size).sum(dim=1)


def random_sensitivity(name: str, stripes: int) -> torch.Tensor:
    """A reproducible random score per stripe (seeded by the layer's name): the control for the Eq. 9 choice."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.rand(stripes, generator=gen, dtype=torch.float64)


def assign_stripes(sens: torch.Tensor, rule: str, count: int) -> torch.Tensor:
    """Which stripes get 4 bits (bool [S]): `block4` the most sensitive of every run of four stripes; `global`
    the `count` most sensitive of the matrix (ties: the lower index)."""
    s = sens.numel()
    is4 = torch.zeros(s, dtype=torch.bool)
    if rule == "block4":
        best = torch.argmax(sens.reshape(-1, 4).cpu(), dim=1)
        is4[torch.arange(0, s, 4) + best] = True
        return is4
    order = torch.argsort(-sens.cpu(), stable=True)
    is4[order[:count]] = True
    return is4


def outlier_count(
    out_features: int, in_features: int, group_size: int, stripes_4bit: int, fraction: float
) -> int:
    """floor(fraction·N·K), at most the number of weights in 2-bit stripes."""
    cap = out_features * (in_features - stripes_4bit * group_size)
    return min(math.floor(fraction * out_features * in_features + 1e-9), cap)


def stripes_for_target(
    out_features: int,
    in_features: int,
    group_size: int,
    scale_group_size: int,
    outlier_fraction: float,
    target_bits: float,
    counts: str = "stored",
) -> int | None:
    """The most 4-bit stripes whose bits per weight stay at or below `target_bits`, counted as stored (`counts`
    "stored") or as the paper's Eq. 10 with 30 bits per outlier ("eq10"); None when even no 4-bit stripe exceeds
    it."""
    n, k, g1, g2 = out_features, in_features, group_size, scale_group_size
    budget = target_bits * n * k

    def bits(s4: int) -> float:
        nout = outlier_count(n, k, g1, s4, outlier_fraction)
        if counts == "eq10":
            return eq10_bits(k, g1, g2, s4, nout, n) * n * k
        return bits_for(n, k, g1, g2, s4, nout)

    best = None
    for s4 in range(k // g1 + 1):
        if bits(s4) <= budget + 1e-6:
            best = s4
    return best


def stripes_for_fraction(in_features: int, group_size: int, fraction: float) -> int:
    """round(fraction·S) (halves up)."""
    return math.floor(fraction * (in_features // group_size) + 0.5)


class MixedCodes(NamedTuple):
    codes: torch.Tensor  # int64 [N, K]
    is4: torch.Tensor  # bool [S]
    scale_codes: torch.Tensor  # int64 [N, S2]
    zeros2: torch.Tensor  # int64 [N, S2]
    scales_2nd: torch.Tensor  # float32 (float16 values) [N/g2, S2]
    zeros_2nd: torch.Tensor  # int64 [N/g2, S2]
    scales4: torch.Tensor  # float32 (float16 values) [N, S4]
    zeros4: torch.Tensor  # int64 [N, S4]
    outlier_rows: torch.Tensor  # int64 [nnz]
    outlier_cols: torch.Tensor  # int64 [nnz]
    outlier_values: torch.Tensor  # float32 [nnz]: w - dense dequantized value


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.clamp_min(MIN_SCALE).to(torch.float16).to(torch.float32)


def _range(w: torch.Tensor, keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Group min and max over the last dim (over `keep` only), widened to include 0."""
    if keep is None:
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    else:
        inf = torch.tensor(float("inf"), dtype=w.dtype)
        lo = torch.where(keep, w, inf).amin(dim=-1)
        hi = torch.where(keep, w, -inf).amax(dim=-1)
    return lo.clamp_max(0), hi.clamp_min(0)


def quantize_4bit(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups w [N, S4, g1] at 4 bits: (codes, scale float16 values [N, S4], zero [N, S4], dequantized)."""
    lo, hi = _range(w, None)
    scale = _fp16((hi - lo) / MAX4)
    zero = torch.clamp(torch.round(-lo / scale), 0, MAX4)
    q = torch.clamp(torch.round(w / scale[..., None]) + zero[..., None], 0, MAX4)
    return q.to(torch.int64), scale, zero.to(torch.int64), (q - zero[..., None]) * scale[..., None]


def second_order(
    scale: torch.Tensor, g2: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first-order scales [N, S2] at 4 bits over `g2` output rows: (codes c [N, S2], s2 [N/g2, S2], u
    [N/g2, S2], ŝ [N, S2]) with ŝ = (c + u)·s2 > 0. s2 = max((max - min)/15, max/30), u = min(round(min/s2),
    15), c = clamp(round(s/s2) - u, max(0, 1 - u), 15) (formats/mixed-2-4-16.md, "Second order")."""
    n, s2n = scale.shape
    grp = scale.reshape(n // g2, g2, s2n)
    smin, smax = grp.amin(dim=1), grp.amax(dim=1)
    s2 = _fp16(torch.maximum((smax - smin) / MAX4, smax / (2 * MAX4)))
    u = torch.clamp(torch.round(smin / s2), 0, MAX4)
    c = torch.round(grp / s2[:, None]) - u[:, None]
    c = torch.maximum(torch.clamp(c, 0, MAX4), 1 - u[:, None])
    shat = (c + u[:, None]) * s2[:, None]
    return c.reshape(n, s2n).to(torch.int64), s2, u.to(torch.int64), shat.reshape(n, s2n)


def quantize_2bit(w: torch.Tensor, g2: int, keep: torch.Tensor | None = None):
    """Groups w [N, S2, g1] at 2 bits with second-order scales; `keep` excludes outliers from the range.
    Returns (codes, scale codes, zeros, s2, u, dequantized)."""
    lo, hi = _range(w, keep)
    c, s2, u, shat = second_order((hi - lo) / MAX2, g2)
    zero = torch.clamp(torch.round(-lo / shat), 0, MAX2)
    q = torch.clamp(torch.round(w / shat[..., None]) + zero[..., None], 0, MAX2)
    return q.to(torch.int64), c, zero.to(torch.int64), s2, u, (q - zero[..., None]) * shat[..., None]


def mixed_quantize(
    weight: torch.Tensor, is4: torch.Tensor, group_size: int, scale_group_size: int, outliers: int
) -> MixedCodes:
    """Round-to-nearest of `weight` [N, K] under the stripe assignment `is4` [S]. The `outliers` weights of the
    2-bit stripes with the largest error of a first pass are excluded from their groups' ranges in the second
    (final) pass, and their residuals `w - dense` become the sparse part."""
    w = weight.detach().to(torch.float32).cpu()
    n, k = w.shape
    g1 = group_size
    is4 = is4.cpu().bool()
    by_stripe = w.reshape(n, k // g1, g1)
    w4, w2 = by_stripe[:, is4], by_stripe[:, ~is4]
    q4, scales4, zeros4, _ = quantize_4bit(w4)

    q2, c, z2, s2, u, deq2 = quantize_2bit(w2, scale_group_size)
    rows = cols = torch.zeros(0, dtype=torch.int64)
    values = torch.zeros(0, dtype=torch.float32)
    if outliers > 0:
        err = (w2 - deq2).abs().reshape(-1)
        flat = torch.topk(err, outliers).indices
        keep = torch.ones(err.numel(), dtype=torch.bool)
        keep[flat] = False
        q2, c, z2, s2, u, deq2 = quantize_2bit(w2, scale_group_size, keep.reshape(w2.shape))
        s2n = w2.shape[1]
        rows = flat // (s2n * g1)
        stripe2 = (flat // g1) % s2n
        cols = torch.nonzero(~is4).reshape(-1)[stripe2] * g1 + flat % g1
        values = (w2.reshape(-1)[flat] - deq2.reshape(-1)[flat]).to(torch.float16).to(torch.float32)

    codes = torch.empty(n, k // g1, g1, dtype=torch.int64)
    codes[:, is4] = q4
    codes[:, ~is4] = q2
    return MixedCodes(codes.reshape(n, k), is4, c, z2, s2, u, scales4, zeros4, rows, cols, values)


class _MixedGrid:
    """The column grid of GPTQ (quant/gptq.py's ColumnGrid) for mixed stripes: GPTQ asks for each group's
    parameters when it reaches the group (stripes in order, all rows at once, so the second-order step sees its
    `g2` rows) and then rounds the group's columns one by one. A stripe's width decides the grid (2 or 4 bits);
    outlier positions are left out of their group's range and keep their error-updated value exactly (up to the
    float16 rounding of the residual), so GPTQ feeds back no error for them."""

    def __init__(
        self, is4: torch.Tensor, group_size: int, scale_group_size: int, outliers: torch.Tensor | None
    ):
        self.is4 = is4.tolist()
        self.g1, self.g2 = group_size, scale_group_size
        self.outliers = outliers  # bool [N, K] or None
        self.stripe = -1
        self.col = -1
        self.maxq = MAX2
        self.params4: list[tuple[torch.Tensor, torch.Tensor]] = []  # (scale, zero) [N] per 4-bit stripe
        self.params2: list[tuple[torch.Tensor, ...]] = []  # (c, z, s2, u) per 2-bit stripe
        self.residuals: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, col, value)

    def group_params(self, w: torch.Tensor, h_block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.stripe += 1
        j, g1 = self.stripe, self.g1
        if self.is4[j]:
            lo, hi = _range(w, None)
            scale = _fp16((hi - lo) / MAX4)
            zero = torch.clamp(torch.round(-lo / scale), 0, MAX4)
            self.maxq = MAX4
            self.params4.append((scale, zero))
            return scale, zero
        keep = None if self.outliers is None else ~self.outliers[:, j * g1 : (j + 1) * g1].to(w.device)
        lo, hi = _range(w, keep)
        c, s2, u, shat = second_order(((hi - lo) / MAX2)[:, None], self.g2)
        shat = shat[:, 0]
        zero = torch.clamp(torch.round(-lo / shat), 0, MAX2)
        self.maxq = MAX2
        self.params2.append((c[:, 0], zero, s2[:, 0], u[:, 0]))
        return shat, zero

    def quantize_column(
        self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.col += 1
        q = torch.clamp(torch.round(w / scale) + zero, 0, self.maxq)
        wq = (q - zero) * scale
        if self.outliers is not None and self.maxq == MAX2:
            rows = torch.nonzero(self.outliers[:, self.col]).reshape(-1).to(w.device)
            if rows.numel():
                value = (w[rows] - wq[rows]).to(torch.float16).to(w.dtype)
                wq = wq.clone()
                wq[rows] += value
                self.residuals.append((rows.cpu(), torch.full_like(rows.cpu(), self.col), value.cpu()))
        return q, wq


def mixed_quantize_gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    is4: torch.Tensor,
    group_size: int,
    scale_group_size: int,
    outliers: int,
    *,
    damp: float = 0.01,
    block_size: int = 128,
    rows: range | None = None,
) -> MixedCodes:
    """GPTQ over the mixed grid (a deviation from the paper, which rounds to nearest): columns in their original
    order, each group's parameters chosen when GPTQ reaches it from the error-updated weights, every rounding
    error fed back through the inverse Hessian. The outlier positions are those of the round-to-nearest first
    pass (largest error in the 2-bit stripes).

    `rows` (from and to multiples of `scale_group_size`): the codes of those output rows alone, exactly the
    whole solve's (the outlier positions are still chosen over the whole matrix; every other choice is per row,
    or per `scale_group_size` rows for the second-order scales)."""
    from qtool.quant.gptq import gptq_run
    from qtool.quant.grid import GridSpec

    w = weight.detach().to(torch.float32).cpu()
    n, k = w.shape
    g1 = group_size
    is4 = is4.cpu().bool()
    mask = None
    if outliers > 0:
        w2 = w.reshape(n, k // g1, g1)[:, ~is4]
        *_, deq2 = quantize_2bit(w2, scale_group_size)
        flat = torch.topk((w2 - deq2).abs().reshape(-1), outliers).indices
        s2n = w2.shape[1]
        at_rows = flat // (s2n * g1)
        cols = torch.nonzero(~is4).reshape(-1)[(flat // g1) % s2n] * g1 + flat % g1
        mask = torch.zeros(n, k, dtype=torch.bool)
        mask[at_rows, cols] = True
    if rows is not None and len(rows) < n:
        w = w[rows.start : rows.stop]
        mask = None if mask is None else mask[rows.start : rows.stop]
        n = w.shape[0]
    grid = _MixedGrid(is4, g1, scale_group_size, mask)
    out = gptq_run(
        w,
        hessian.to(torch.float32).cpu(),
        GridSpec(bits=2, symmetric=False, group_size=g1),
        damp=damp,
        block_size=block_size,
        grid=grid,
    )

    def stack(items, i):
        return torch.stack([t[i] for t in items], dim=1) if items else torch.zeros(n, 0)

    c, z2 = stack(grid.params2, 0), stack(grid.params2, 1)
    s2 = stack([(p[2],) for p in grid.params2], 0) if grid.params2 else torch.zeros(n // scale_group_size, 0)
    u = stack([(p[3],) for p in grid.params2], 0) if grid.params2 else torch.zeros(n // scale_group_size, 0)
    if grid.residuals:
        at_rows = torch.cat([r for r, _, _ in grid.residuals])
        cols = torch.cat([c_ for _, c_, _ in grid.residuals])
        values = torch.cat([v for _, _, v in grid.residuals]).to(torch.float32)
    else:
        at_rows = cols = torch.zeros(0, dtype=torch.int64)
        values = torch.zeros(0)
    return MixedCodes(
        out.codes.cpu(),
        is4,
        c.to(torch.int64),
        z2.to(torch.int64),
        s2,
        u.to(torch.int64),
        stack(grid.params4, 0),
        stack(grid.params4, 1).to(torch.int64),
        at_rows,
        cols,
        values,
    )


class TunableScales(nn.Module):
    """A `mixed-2-4-16` layer as a function of its continuous parameters, for block-wise fine-tuning: the
    second-order scales `s2` of the 2-bit stripes and the float16 scales `s4` of the 4-bit stripes, each times
    `exp(θ)` (θ starts at 0, so a step changes a scale by a ratio, whatever its size). Codes, zeros and scale
    codes stay as quantized; at the outliers the weight is the float original, so their stored residuals are
    recomputed against the tuned dense part (`layout()`)."""

    def __init__(self, layout: MixedWeight, original: torch.Tensor, device: torch.device) -> None:
        super().__init__()
        self.source = layout
        n, k, g1 = layout.out_features, layout.in_features, layout.group_size
        s = k // g1
        self.is4 = layout.is4.cpu()
        _, zero = layout.group_params()
        self.register_buffer("steps", (layout.codes().to(torch.float32).reshape(n, s, g1) - zero[:, :, None]))
        # ŝ = (c + u)·s2 for 2-bit groups: the integer factor (c + u) stays.
        c = unpack_codes(layout.scale_codes, SCALE_BITS, s - int(self.is4.sum())).to(torch.float32)
        u = layout.zeros_2nd.to(torch.float32).repeat_interleave(layout.scale_group_size, dim=0)
        self.register_buffer("c_u", c + u)
        self.register_buffer("s2", layout.scales_2nd.to(torch.float32))
        self.register_buffer("s4", layout.scales4.to(torch.float32))
        rows, cols, _ = layout.outliers()
        mask = torch.zeros(n, k, dtype=torch.bool)
        mask[rows, cols] = True
        self.register_buffer("mask", mask)
        self.register_buffer("original", original.detach().to(torch.float32).cpu())
        self.theta2 = nn.Parameter(torch.zeros_like(self.s2))
        self.theta4 = nn.Parameter(torch.zeros_like(self.s4))
        self.to(device)

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.s2 * torch.exp(self.theta2), self.s4 * torch.exp(self.theta4)

    def forward(self) -> torch.Tensor:
        """The dequantized weight [N, K] float32 (differentiable in θ)."""
        n, s, g1 = self.steps.shape
        s2, s4 = self.scales()
        g2 = self.source.scale_group_size
        is4 = self.is4.to(self.steps.device)
        scale = torch.zeros(n, s, dtype=torch.float32, device=self.steps.device)
        scale = scale.masked_scatter(~is4[None, :].expand(n, s), (self.c_u * s2.repeat_interleave(g2, 0)))
        scale = scale.masked_scatter(is4[None, :].expand(n, s), s4)
        w = (self.steps * scale[:, :, None]).reshape(n, s * g1)
        return torch.where(self.mask, self.original, w)

    def layout(self) -> MixedWeight:
        """The layer with the tuned scales rounded to float16 (at least 2^-14, as quantizing stores them) and
        each outlier's residual `fp16(w - dense)` against the new dense part."""
        with torch.no_grad():
            s2, s4 = (_fp16(t.cpu()) for t in self.scales())
        tuned = replace(self.source, scales_2nd=s2.to(torch.float16), scales4=s4.to(torch.float16))
        rows, cols, _ = tuned.outliers()
        values = self.original.cpu()[rows, cols] - tuned.dense()[rows, cols]
        return replace(tuned, outlier_values=values.to(torch.float16).contiguous())
