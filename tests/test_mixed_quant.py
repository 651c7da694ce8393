"""The `mixed` quantizer (qtool/quant/mixed.py) against formulas written out independently: Eq. 9 sensitivity in
float64 loops, the two assignment rules, the bit budget, the second-order scales, the outliers, and the stored
bits against Eq. 10."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qtool.layouts.mixed.layout import MixedWeight, bits_for, eq10_bits
from qtool.quant.mixed import (
    MAX4,
    assign_stripes,
    inverse_hessian_diag,
    mixed_quantize,
    mixed_quantize_gptq,
    obs_sensitivity,
    outlier_count,
    random_sensitivity,
    second_order,
    sensitivity,
    stripes_for_target,
)


def _hessian(k: int, tokens: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g) * torch.linspace(0.2, 3.0, k)
    return 2.0 * x.T @ x / tokens


def _pack(mc, g1, g2, assign) -> MixedWeight:
    return MixedWeight.from_codes(
        mc.codes,
        mc.is4,
        g1,
        g2,
        assign,
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


def test_eq9_sensitivity_matches_float64_loops():
    n, k, g1, damp = 12, 48, 16, 0.01
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    h = _hessian(k)
    h[5, :] = 0
    h[:, 5] = 0  # a dead input: GPTQ puts 1 on its diagonal
    hd = h.double().numpy().copy()
    hd[5, 5] = 1.0
    hd += damp * np.mean(np.diag(hd)) * np.eye(k)
    hinv = np.linalg.inv(hd)
    wd = w.double().numpy()
    expected = []
    for i in range(k // g1):
        total = 0.0
        for m in range(g1):
            q = g1 * i + m
            for j in range(n):  # Eq. 9: w_{Mi+m, j}² / ([H⁻¹]_{Mi+m})², j over the output channels
                total += wd[j, q] ** 2 / hinv[q, q] ** 2
        expected.append(total)
    got = sensitivity(w, inverse_hessian_diag(h, damp), g1)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-9)
    np.testing.assert_allclose(inverse_hessian_diag(h, damp).numpy(), np.diag(hinv), rtol=1e-9)


def test_obs_and_random_sensitivities():
    """The ablation's alternatives to Eq. 9: the OBS saliency Σ w²/[H⁻¹]_qq (denominator not squared), and a
    random score that is reproducible per layer name and differs between layers."""
    n, k, g1 = 6, 32, 16
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2))
    hinv = inverse_hessian_diag(_hessian(k), 0.01)
    expected = [
        sum(float(w[j, q]) ** 2 / float(hinv[q]) for j in range(n) for q in range(i * g1, (i + 1) * g1))
        for i in range(k // g1)
    ]
    np.testing.assert_allclose(obs_sensitivity(w, hinv, g1).numpy(), expected, rtol=1e-9)
    a = random_sensitivity("model.layers.0.mlp.up_proj", 36)
    assert torch.equal(a, random_sensitivity("model.layers.0.mlp.up_proj", 36))
    assert not torch.equal(a, random_sensitivity("model.layers.1.mlp.up_proj", 36))


def test_block4_takes_the_most_sensitive_of_every_four():
    sens = torch.tensor([1.0, 5.0, 2.0, 3.0, 9.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.7, 0.1], dtype=torch.float64)
    is4 = assign_stripes(sens, "block4", 0)
    assert is4.tolist() == [False, True, False, False, True, False, False, False, False, False, True, False]
    assert (is4.reshape(-1, 4).sum(1) == 1).all()


def test_block4_exactly_one_per_four_on_random_matrices():
    for seed in range(5):
        sens = torch.rand(64, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        is4 = assign_stripes(sens, "block4", 0)
        assert (is4.reshape(-1, 4).sum(1) == 1).all()
        assert torch.equal(torch.nonzero(is4).reshape(-1) % 4, sens.reshape(-1, 4).argmax(1))


@pytest.mark.parametrize("count", [0, 1, 3, 7, 12])
def test_global_is_top_k(count):
    sens = torch.rand(12, generator=torch.Generator().manual_seed(count), dtype=torch.float64)
    is4 = assign_stripes(sens, "global", count)
    assert int(is4.sum()) == count
    if 0 < count < 12:
        assert sens[is4].min() > sens[~is4].max()


@pytest.mark.parametrize(
    "n,k,target,frac", [(64, 1536, 2.6, 0.0), (128, 1024, 3.0, 0.002), (48, 512, 3.5, 0.005)]
)
def test_target_bits_picks_the_fraction_and_hits_it_within_a_stripe(n, k, target, frac):
    g1, g2 = 16, 16
    s4 = stripes_for_target(n, k, g1, g2, frac, target)
    assert s4 is not None

    def stored(c: int) -> float:
        return bits_for(n, k, g1, g2, c, outlier_count(n, k, g1, c, frac)) / (n * k)

    assert stored(s4) <= target < stored(s4 + 1)
    # The bits of a real layer with that many 4-bit stripes are what the choice assumed.
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    sens = sensitivity(w, inverse_hessian_diag(_hessian(k), 0.01), g1)
    is4 = assign_stripes(sens, "global", s4)
    layout = _pack(mixed_quantize(w, is4, g1, g2, outlier_count(n, k, g1, s4, frac)), g1, g2, "global")
    got = layout.stored_bits() / (n * k)
    assert got == pytest.approx(stored(s4))
    assert target - (stored(s4 + 1) - stored(s4)) < got <= target


@pytest.mark.parametrize(
    "n,k,target,frac", [(576, 576, 2.6, 0.0), (576, 1536, 2.6, 0.0), (64, 1024, 2.91, 0.002)]
)
def test_target_counted_as_eq10(n, k, target, frac):
    """`target_counts: eq10`: the budget in the paper's accounting (Table 4: 2.60 bits is about 10% 4-bit)."""
    g1 = g2 = 16
    s4 = stripes_for_target(n, k, g1, g2, frac, target, "eq10")

    def eq10(c: int) -> float:
        return eq10_bits(k, g1, g2, c, outlier_count(n, k, g1, c, frac), n)

    assert eq10(s4) <= target < eq10(s4 + 1)
    assert 0.05 < s4 / (k // g1) < 0.3


def test_target_below_the_two_bit_floor_is_none():
    assert stripes_for_target(64, 576, 16, 16, 0.002, 2.5) is None


def test_second_order_scales_round_trip():
    g = torch.Generator().manual_seed(3)
    scale = torch.rand(64, 9, generator=g) * 0.05 + 0.001
    scale[:16, 0] = 0.02  # a group of equal scales (u saturates at 15)
    scale[16:32, 1] = torch.linspace(1e-6, 0.05, 16)  # a tiny scale next to large ones (u = 0, code ≥ 1)
    c, s2, u, shat = second_order(scale, 16)
    assert c.min() >= 0 and c.max() <= MAX4 and u.min() >= 0 and u.max() <= MAX4
    assert torch.equal(s2, s2.half().float())
    rebuilt = (c.reshape(4, 16, 9) + u[:, None]) * s2[:, None]
    assert torch.equal(rebuilt.reshape(64, 9), shat)
    assert (shat > 0).all()
    # Every scale is within half a step of its group's range (or clamped at its end).
    step = s2.repeat_interleave(16, 0)
    inside = (scale >= step) & (scale <= 30 * step)
    assert ((shat - scale).abs()[inside] <= step[inside] / 2 + 1e-7).all()
    # Equal scales come back exactly up to the float16 step.
    assert torch.allclose(shat[:16, 0], torch.full((16,), 0.02), rtol=1 / 30)


def test_outliers_only_in_two_bit_stripes_and_within_the_fraction():
    n, k, g1, frac = 64, 256, 16, 0.005
    g = torch.Generator().manual_seed(4)
    w = torch.randn(n, k, generator=g) * 0.02
    w[torch.randint(0, n, (40,), generator=g), torch.randint(0, k, (40,), generator=g)] += 0.5  # spikes
    is4 = assign_stripes(sensitivity(w, inverse_hessian_diag(_hessian(k), 0.01), g1), "block4", 0)
    nout = outlier_count(n, k, g1, int(is4.sum()), frac)
    assert nout == math.floor(frac * n * k)
    mc = mixed_quantize(w, is4, g1, 16, nout)
    layout = _pack(mc, g1, 16, "block4")
    rows, cols, vals = layout.outliers()
    assert rows.numel() == nout <= frac * n * k
    assert not is4[cols // g1].any()
    assert len(set(zip(rows.tolist(), cols.tolist(), strict=True))) == nout
    # The residual makes the outlier weights exact up to float16 rounding of the residual.
    dq = layout.dequantize()
    assert torch.allclose(dq[rows, cols], w[rows, cols], atol=1e-3)
    # Outliers are taken out of their groups' range: the spikes' groups quantize the rest better.
    no = _pack(mixed_quantize(w, is4, g1, 16, 0), g1, 16, "block4").dequantize()
    assert (dq - w).norm() < 0.95 * (no - w).norm()


def test_dense_codes_are_in_range_and_dequantize_exactly():
    n, k, g1 = 32, 128, 16
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * 0.03
    is4 = assign_stripes(torch.rand(k // g1, dtype=torch.float64), "block4", 0)
    mc = mixed_quantize(w, is4, g1, 16, 10)
    by = mc.codes.reshape(n, -1, g1)
    assert by[:, is4].max() <= 15 and by[:, ~is4].max() <= 3 and mc.codes.min() >= 0
    layout = _pack(mc, g1, 16, "block4")
    # (q - z)·ŝ written out per group in float64: the float32 dense part is exact.
    scale, zero = layout.group_params()
    ref = (mc.codes.double().reshape(n, -1, g1) - zero.double()[..., None]) * scale.double()[..., None]
    assert torch.equal(layout.dense().double(), ref.reshape(n, k))


def test_stored_bits_against_eq10():
    """Stored bits = Eq. 10 plus what Eq. 10 does not count, item by item (formats/mixed-2-4-16.md, "Bits")."""
    n, k, g1, g2 = 64, 1024, 16, 16
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(6)) * 0.02
    is4 = assign_stripes(torch.rand(k // g1, dtype=torch.float64), "block4", 0)
    nout = outlier_count(n, k, g1, int(is4.sum()), 0.002)
    layout = _pack(mixed_quantize(w, is4, g1, g2, nout), g1, g2, "block4")
    s = k // g1
    s4 = s // 4
    assert layout.stripes_4bit == s4
    eq10 = eq10_bits(k, g1, g2, s4, nout, n) * n * k
    assert eq10 / (n * k) == pytest.approx(2.8398 + 30 * nout / (n * k), abs=1e-4)
    extra = (
        n * s4 * (16 + 4)  # the 4-bit groups' float16 scale and 4-bit zero
        + (n // g2) * (s - s4) * 4  # second-order zeros stored as bytes (4 bits of padding)
        + s * 8  # stripe_bits
        + (n + 1) * 32  # CSR row pointers
        + nout * 2
    )  # Eq. 10's outlier term credits the replaced 2-bit code
    # k = 1024: the per-row streams of scale codes and zeros need no padding (48·4 and 48·2 bits).
    assert layout.stored_bits() == pytest.approx(eq10 + extra, abs=1e-6)
    assert layout.bits_report()["stored"] == pytest.approx(layout.stored_bits() / (n * k))


def _correlated(k: int, tokens: int = 1024) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    mix = torch.eye(k) + 0.3 * torch.randn(k, k, generator=g) / k**0.5
    x = torch.randn(tokens, k, generator=g) @ mix
    return 2.0 * x.T @ x / tokens


@pytest.mark.parametrize("nout", [0, 40])
def test_gptq_solver_lowers_the_output_error_and_keeps_the_layout_rules(nout):
    n, k, g1 = 64, 128, 16
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(12)) * 0.02
    h = _correlated(k)
    is4 = assign_stripes(sensitivity(w, inverse_hessian_diag(h, 0.01), g1), "block4", 0)
    rtn = _pack(mixed_quantize(w, is4, g1, 16, nout), g1, 16, "block4")
    gptq = _pack(mixed_quantize_gptq(w, h, is4, g1, 16, nout), g1, 16, "block4")

    def out_err(layout):
        d = (layout.dequantize() - w).double()
        return float(torch.trace(d @ h.double() @ d.T))

    assert out_err(gptq) < 0.95 * out_err(rtn)
    assert gptq.num_outliers == nout and torch.equal(gptq.is4, is4)
    _, cols, _ = gptq.outliers()
    assert not is4[cols // g1].any()
    by = gptq.codes().reshape(n, -1, g1)
    assert by[:, ~is4].max() <= 3
    # Same tensors, same shapes as round to nearest: only the values differ.
    for field, t in gptq.tensors().items():
        assert t.shape == rtn.tensors()[field].shape and t.dtype == rtn.tensors()[field].dtype, field


def test_stage_quantize_with_both_solvers():
    from qtool.calibration.stats import LinearStats
    from qtool.options import parse_options
    from qtool.stages.base import Targets
    from qtool.stages.mixed import MixedOptions, MixedStage

    n, k = 32, 128
    g = torch.Generator().manual_seed(13)
    stats = LinearStats(k, hessian=True)
    stats.update(torch.randn(256, k, generator=g))
    w = torch.randn(n, k, generator=g) * 0.02
    for solver in ("rtn", "gptq"):
        opts = parse_options(
            MixedOptions,
            {"solver": solver, "assign": "global", "fraction_4bit": 0.5, "outlier_fraction": 0.005},
            "stages[0]",
        )
        stage = MixedStage(opts, Targets(), 0)
        assert stage.sequential() == (solver == "gptq") and stage.needs_hessian()
        res = stage.quantize("layer", w, stats)
        assert res.packed.stripes_4bit == 4 and res.packed.num_outliers == math.floor(0.005 * n * k)
        assert torch.equal(res.dequantized, res.packed.dequantize())


def test_tuned_scales_lower_the_output_error_or_are_restored():
    """`TunableScales` + `tune_block` on a one-linear "block": the tuned layout is the quantized one with other
    scales (same codes), its output error is lower and is what the layout computes (outliers exact); a step
    that raises the error (learning rate 1: every scale times e or 1/e) leaves the quantized scales in place."""
    from torch import nn

    from qtool.quant.blockwise import tune_block
    from qtool.quant.mixed import TunableScales

    n, k, g1 = 32, 64, 16
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=gen) * 0.05
    xs = [torch.randn(1, 48, k, generator=gen) * torch.linspace(0.2, 3.0, k) for _ in range(2)]
    is4 = assign_stripes(sensitivity(w, inverse_hessian_diag(_hessian(k), 0.01), g1), "block4", 0)
    layout = _pack(mixed_quantize(w, is4, g1, 8, 6), g1, 8, "block4")
    block = nn.Sequential(nn.Linear(k, n, bias=False))
    block[0].weight.data.copy_(w)
    targets = [block(x).detach() for x in xs]

    def err(lay):
        return sum(float((x @ lay.dequantize().T - t).pow(2).sum()) for x, t in zip(xs, targets, strict=True))

    t = TunableScales(layout, w, torch.device("cpu"))
    assert torch.allclose(t(), layout.dequantize(), atol=1e-3)  # outliers exact here, float16 residuals there
    res = tune_block(
        block, {"0.weight": t}, list(t.parameters()), xs, {}, targets, steps=30, lr=0.01, samples=2
    )
    tuned = t.layout()
    assert res.kept and res.error_after < res.error_before
    assert err(tuned) < 0.95 * err(layout)
    assert torch.equal(tuned.qweight_a, layout.qweight_a) and torch.equal(tuned.zeros_2nd, layout.zeros_2nd)
    rows, cols, _ = tuned.outliers()
    assert torch.allclose(tuned.dequantize()[rows, cols], w[rows, cols], atol=1e-3)

    bad = TunableScales(layout, w, torch.device("cpu"))
    res = tune_block(
        block, {"0.weight": bad}, list(bad.parameters()), xs, {}, targets, steps=1, lr=1.0, samples=1
    )
    assert not res.kept and res.error_after > res.error_before
    assert torch.equal(bad.layout().scales_2nd, layout.scales_2nd) and torch.equal(
        bad.layout().scales4, layout.scales4
    )
