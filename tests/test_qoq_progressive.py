"""Progressive group quantization (quant/progressive.py): the protective range over every group range, the rungs
against the formulas of formats/qoq.md written out independently, GPTQ on the same grids, and clipping."""

from __future__ import annotations

import pytest
import torch

from qtool.layouts.qoq.layout import QoQWeight
from qtool.quant.progressive import (
    PROTECT,
    W8_MAX,
    level0_codes,
    level1_codes,
    level1_params,
    progressive_codes,
    progressive_dequantize,
    qoq_quantize,
)


def _all_ranges(p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (min, max) with -p ≤ min ≤ max ≤ p, as float32 (exact for these integers)."""
    mn, mx = torch.meshgrid(torch.arange(-p, p + 1), torch.arange(-p, p + 1), indexing="ij")
    keep = mn <= mx
    return mn[keep].float(), mx[keep].float()


def _level1_by_formula(v: torch.Tensor, s1: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The spec's level-1 rounding, `clamp(round(Q8/s1) + z, 0, 15)`, without the code's int8 window."""
    return torch.clamp(torch.round(v / s1[:, None]) + z[:, None], 0, 15)


def test_protective_range_exhaustive_every_group_range_stays_in_int8():
    """Every group of level-0 integers has min ≥ -119 and max ≤ 119; its parameters depend only on (min, max), and
    every value between them can occur. For all such (min, max) and every value in range: s1 ∈ 1..16,
    z ∈ 0..15, and `s1·(q - z)` ∈ [-128, 127] under half-to-even rounding; the code's int8 window never binds."""
    mn, mx = _all_ranges(PROTECT)
    s1, z = level1_params(torch.stack([mn, mx], dim=1))
    assert int(s1.min()) == 1 and int(s1.max()) == 16
    assert int(z.min()) == 0 and int(z.max()) == 15
    assert torch.equal(s1, s1.round()) and torch.equal(z, z.round())
    assert int((s1 * z).max()) <= 127  # formats/qoq.md: s1·z ≤ -lo + s1/2 ≤ 119 + 8

    v = torch.arange(-PROTECT, PROTECT + 1, dtype=torch.float32)[None, :].expand(mn.numel(), -1)
    inside = (v >= mn[:, None]) & (v <= mx[:, None])
    q = _level1_by_formula(v, s1, z)
    q8hat = s1[:, None] * (q - z[:, None])
    assert int(q8hat[inside].min()) >= -128 and int(q8hat[inside].max()) <= 127
    # The argument of formats/qoq.md gives more: |s1·round(v/s1)| ≤ |v| + s1/2 ≤ 127, so -128 never occurs.
    assert int(q8hat[inside].abs().max()) <= 127
    assert torch.equal(level1_codes(v, s1, z)[inside], q[inside])
    # The error of level 1 is at most s1/2 wherever the grid reaches the value.
    reach = inside & (q > 0) & (q < 15)
    assert bool(((q8hat - v).abs()[reach] <= s1[:, None].expand_as(v)[reach] / 2).all())


def test_range_120_overflows_the_papers_counterexample():
    """The check above can fail: the paper's group [-113, 120] (level 0 in ±127) gives s1 = 16, z = 7 and
    round(120/16) + 7 = 8 + 7 = 15 → 128, under half-to-even too (the paper's `round(Q8/s1 + z)` would round
    14.5 to 14 there; this layout adds z after rounding)."""
    s1, z = level1_params(torch.tensor([[-113.0, 120.0]]))
    assert (int(s1), int(z)) == (16, 7)
    q = _level1_by_formula(torch.tensor([[120.0]]), s1, z)
    assert int(s1 * (q - z)) == 128
    # The code's int8 window keeps GPTQ, whose feedback can push a column past its group's range, out of it.
    q = level1_codes(torch.tensor([[120.0]]), s1, z)
    assert int(s1 * (q - z)) == 112


def test_zero_is_in_every_group_range():
    """A group of all-positive integers still has z = 0 (range [0, max]), not a clamped negative zero point."""
    s1, z = level1_params(torch.tensor([[100.0, 119.0], [-50.0, -40.0], [0.0, 0.0]]))
    assert s1.tolist() == [8.0, 3.0, 1.0] and z.tolist() == [0.0, 15.0, 0.0]


def _reference_rungs(w: torch.Tensor, bits: int, g: int | None):
    """The three rungs of formats/qoq.md written out row by row, group by group, in float64."""
    n, k = w.shape
    out = torch.zeros(n, k, dtype=torch.float64)
    for r in range(n):
        row = w[r].double()
        if bits == 8:
            s0 = (row.abs().max() / 127).clamp(min=2**-24).half().double()
            out[r] = s0 * torch.clamp(torch.round(row / s0), -127, 127)
        elif g is None:
            lo, hi = min(float(row.min()), 0.0), max(float(row.max()), 0.0)
            s = torch.tensor((hi - lo) / 15).clamp(min=2**-24).half().double()
            z = torch.clamp(torch.round(-lo / s), 0, 15)
            out[r] = s * (torch.clamp(torch.round(row / s) + z, 0, 15) - z)
        else:
            s0 = (row.abs().max() / 119).clamp(min=2**-24).half().double()
            q8 = torch.clamp(torch.round(row / s0), -119, 119)
            for j in range(0, k, g):
                grp = q8[j : j + g]
                lo, hi = min(float(grp.min()), 0.0), max(float(grp.max()), 0.0)
                s1 = max(1.0, round((hi - lo) / 15))
                z = min(max(round(-lo / s1), 0), 15)
                q = torch.clamp(torch.round(grp / s1) + z, 0, 15)
                out[r, j : j + g] = s0 * (s1 * (q - z))
    return out


@pytest.mark.parametrize("bits,g", [(8, None), (4, None), (4, 4), (4, 43)])
def test_rtn_rungs_match_the_formulas(bits, g):
    torch.manual_seed(bits + (g or 0))
    w = torch.randn(7, 172, dtype=torch.float64) * torch.rand(7, 1, dtype=torch.float64)
    w[3, :50] += 4.0  # an all-positive stretch: groups whose range is [0, max]
    w[5] = 0.0  # an all-zero row
    out = qoq_quantize(w, bits, g)
    layout = QoQWeight.from_codes(out.codes, out.scales, bits, g, out.group_scales, out.zeros)
    torch.testing.assert_close(
        layout.dequantize(torch.float64), _reference_rungs(w, bits, g), rtol=0, atol=1e-12
    )


def test_progressive_dequantize_is_s0_times_int8():
    torch.manual_seed(1)
    w = torch.randn(5, 64)
    s0 = (w.abs().amax(1) / PROTECT).half().float()
    q, s1, z = progressive_codes(w, s0, 16)
    wq = progressive_dequantize(q, s0, s1, z)
    q8hat = wq / s0[:, None]
    assert torch.equal(q8hat, q8hat.round()) and float(q8hat.abs().max()) <= 128
    # Level 1 costs at most s1/2 per weight on top of level 0's rounding, where the code is not saturated.
    q8 = level0_codes(w, s0, PROTECT)
    gap = (q8hat - q8).abs().reshape(5, 4, 16)
    inner = ((q > 0) & (q < 15)).reshape(5, 4, 16)
    assert bool((gap <= s1[:, :, None] / 2)[inner].all()) and bool(inner.float().mean() > 0.8)


def _hessian(
    k: int, seed: int, tokens: int = 256, quiet: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g, dtype=torch.float64) @ (
        torch.eye(k, dtype=torch.float64) + 0.3 * torch.randn(k, k, generator=g, dtype=torch.float64)
    )
    if quiet is not None:
        x[:, quiet] *= 0.02
    return x, 2 * x.T @ x / tokens


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits,g", [(8, None), (4, None), (4, 16)])
def test_gptq_with_a_diagonal_hessian_is_rtn(bits, g, act_order):
    """No off-diagonal curvature, no feedback: GPTQ on the same grid must give RTN's codes and parameters, in any
    column order."""
    torch.manual_seed(2)
    w = torch.randn(9, 96, dtype=torch.float64)
    h = torch.diag(torch.rand(96, dtype=torch.float64) + 0.5)
    rtn = qoq_quantize(w, bits, g)
    gptq = qoq_quantize(
        w, bits, g, solver="gptq", hessian=h, block_size=32, act_order=act_order, static_groups=act_order
    )
    assert torch.equal(gptq.codes, rtn.codes)
    assert torch.equal(gptq.scales, rtn.scales)
    for a, b in ((gptq.group_scales, rtn.group_scales), (gptq.zeros, rtn.zeros)):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits,g", [(8, None), (4, None), (4, 16)])
def test_gptq_lowers_the_output_error_and_stays_in_the_layout(bits, g, act_order):
    x, h = _hessian(128, seed=3)
    torch.manual_seed(3)
    w = torch.randn(24, 128, dtype=torch.float64)
    errs = {}
    for solver in ("rtn", "gptq"):
        out = qoq_quantize(w, bits, g, solver=solver, hessian=h, act_order=act_order, static_groups=act_order)
        layout = QoQWeight.from_codes(out.codes, out.scales, bits, g, out.group_scales, out.zeros)
        # from_tensors refuses codes whose integer weight leaves int8 (the progressive invariant).
        layout = QoQWeight.from_tensors("layer", layout.layer_config(False), layout.tensors())
        errs[solver] = float(((x @ (w - layout.dequantize(torch.float64)).T) ** 2).mean())
    assert errs["gptq"] < 0.8 * errs["rtn"]


@pytest.mark.parametrize("bits,g", [(8, None), (4, 16)])
def test_clipping_never_raises_the_weighted_error_and_shrinks_some_rows(bits, g):
    x, h = _hessian(64, seed=4, quiet=7)
    torch.manual_seed(4)
    w = torch.randn(32, 64, dtype=torch.float64)
    w[:, 7] *= 6.0  # large weights on an input that is nearly silent: clipping them costs little output error
    ratios = [1.0 - i * 0.05 for i in range(10)]
    plain = qoq_quantize(w, bits, g)
    clipped = qoq_quantize(w, bits, g, hessian=h, clip_ratios=ratios)

    def row_err(c):
        layout = QoQWeight.from_codes(c.codes, c.scales, bits, g, c.group_scales, c.zeros)
        e = w - layout.dequantize(torch.float64)
        return ((e @ h) * e).sum(1)

    assert bool((row_err(clipped) <= row_err(plain) * (1 + 1e-9)).all())
    assert bool((clipped.scales < plain.scales).any())
    qmax = W8_MAX if bits == 8 else PROTECT
    # The chosen scale is one of the candidates: a ratio of the row's max|w|, rounded to float16.
    cand = torch.stack([(w.abs().amax(1) * r / qmax).half().double() for r in ratios], 1)
    assert bool((cand == clipped.scales[:, None]).any(1).all())


def test_bad_scheme_arguments():
    w = torch.randn(4, 172)
    with pytest.raises(ValueError, match="group_size 32 does not divide in_features 172"):
        qoq_quantize(w, 4, 32)
    with pytest.raises(ValueError, match="per channel"):
        qoq_quantize(w, 8, 4)
    with pytest.raises(ValueError, match="Hessian"):
        qoq_quantize(w, 4, 4, solver="gptq")
