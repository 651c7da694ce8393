"""The `quik` reference forward against a float64 computation of the same integer arithmetic, outlier selection,
GPTQ with the outliers last, and 2:4 pruning with dense outliers."""

from __future__ import annotations

import pytest
import torch

from qtool.calibration.stats import LinearStats
from qtool.errors import RecipeError
from qtool.layouts.base import int_matmul
from qtool.layouts.quik.layout import QuikWeight, quantize_activations, violations_24
from qtool.layouts.quik.module import QuikLinear
from qtool.options import parse_options
from qtool.quant.gptq import gptq_quantize, gptq_run
from qtool.quant.grid import GridSpec
from qtool.stages.base import Targets
from qtool.stages.outliers import OutliersOptions, OutliersStage, select_outliers

PLANTED = [3, 17, 40, 41, 90]


def _inputs(
    tokens: int, k: int, seed: int, planted: list[int] = PLANTED, scale: float = 40.0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g) @ (torch.eye(k) + 0.2 * torch.randn(k, k, generator=g))
    x[:, planted] *= scale
    return x


def _random_layout(n: int, k: int, bits: int, act_bits: int, outliers: list[int], seed: int) -> QuikWeight:
    g = torch.Generator().manual_seed(seed)
    kb = k - len(outliers)
    codes = torch.randint(0, 1 << bits, (n, kb), generator=g)
    scales = torch.rand(n, generator=g) * 0.05 + 1e-3
    ow = torch.randn(n, len(outliers), generator=g)
    return QuikWeight.from_codes(codes, scales, torch.tensor(outliers[::-1]), ow.flip(1), bits, act_bits)


def _stage(**opts) -> OutliersStage:
    return OutliersStage(parse_options(OutliersOptions, opts, "test"), Targets(), 0)


def _stats(x: torch.Tensor) -> LinearStats:
    s = LinearStats(x.shape[1], hessian=True)
    s.update(x)
    return s


@pytest.mark.parametrize("bits,act_bits,k", [(4, 4, 160), (8, 8, 160), (4, 8, 97), (8, 4, 2000)])
def test_reference_forward_matches_float64_integer_arithmetic(bits, act_bits, k):
    n, t = 24, 33
    outliers = [p for p in PLANTED if p < k]
    layout = _random_layout(n, k, bits, act_bits, outliers, seed=k + bits)
    bias = torch.randn(n)
    mod = QuikLinear(layout, bias)
    x = _inputs(t, k, seed=bits * act_bits, planted=outliers)
    y = mod(x.reshape(3, 11, k)).reshape(t, n)

    x64 = x.double()
    base = [c for c in range(k) if c not in outliers]
    xb = x64[:, base]
    lo, hi = xb.amin(1), xb.amax(1)
    maxq, half = (1 << act_bits) - 1, 1 << (act_bits - 1)
    s_x = (hi - lo) / maxq
    q64 = torch.clamp(torch.round((xb - lo[:, None]) / s_x[:, None]), 0, maxq) - half
    # The module quantizes in float32: its codes agree with float64 except at rounding ties.
    act = quantize_activations(x[:, base], act_bits)
    frac = ((xb - lo[:, None]) / s_x[:, None]) % 1.0
    differ = act.codes.double() != q64
    assert bool(((frac[differ] - 0.5).abs() < 1e-3).all()) and float(differ.double().mean()) < 0.01

    c = layout.signed_codes().double()
    acc64 = act.codes.double() @ c.T  # exact: integers far below 2^53
    acc, _ = mod.accumulate(x)
    assert acc.dtype == torch.int32 and torch.equal(acc.double(), acc64)

    s_w = layout.scales.double()
    wred = s_w * c.sum(1)
    assert torch.equal(layout.wreduced, wred.float())
    ref = (
        acc64 * act.scale.double()[:, None] * s_w[None, :]
        + (act.zero.double() + half * act.scale.double())[:, None] * wred[None, :]
        + x64[:, outliers] @ layout.outlier_weight.double().T
        + bias.double()
    )
    mag = (x64.abs() @ layout.dequantize().double().abs().T).max()
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=float(mag) * 2e-6)
    # And the whole thing approximates the float product with the dequantized weights.
    exact = x64 @ layout.dequantize().double().T + bias.double()
    rel = float((y.double() - exact).norm() / exact.norm())
    assert rel < (0.2 if act_bits == 4 else 0.02)


def test_int_matmul_paths_agree():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (7, 3000), generator=g, dtype=torch.int32)
    b = torch.randint(-128, 128, (5, 3000), generator=g, dtype=torch.int32)
    exact = a @ b.T
    assert torch.equal(int_matmul(a, b, 3000 * 128 * 128), exact)  # float64 path
    assert torch.equal(int_matmul(a, b, 1 << 60), exact)  # integer path
    a4, b4 = a % 16 - 8, b % 16 - 8
    assert torch.equal(int_matmul(a4, b4, 3000 * 64), a4 @ b4.T)  # float32 path


def test_constant_token_row_is_exact():
    layout = _random_layout(8, 32, 4, 4, [1], seed=1)
    mod = QuikLinear(layout)
    x = torch.full((2, 32), 0.75)
    x[:, 1] = 5.0
    exact = x.double() @ layout.dequantize().double().T
    torch.testing.assert_close(mod(x).double(), exact, rtol=1e-5, atol=1e-5)


def test_layout_dequantize_and_unpack_round_trip():
    layout = _random_layout(6, 40, 4, 4, [5, 0, 39], seed=2)
    assert layout.outlier_idx.tolist() == [0, 5, 39]
    w = layout.dequantize()
    assert torch.equal(w[:, [0, 5, 39]], layout.outlier_weight.float())
    assert torch.equal(QuikLinear(layout).wcodes.long(), layout.signed_codes())


def test_outlier_selection_picks_top_linf_columns():
    x = _inputs(64, 128, seed=3)
    stats = _stats(x)
    assert select_outliers(stats.absmax, 5).tolist() == PLANTED
    stage = _stage(outliers=5)
    result = stage.quantize("model.layers.0.self_attn.q_proj", torch.randn(16, 128), stats)
    assert result.packed.outlier_idx.tolist() == PLANTED
    assert select_outliers(torch.tensor([1.0, 3.0, 3.0, 2.0]), 1).tolist() == [1]  # ties: lower index


def test_plan_counts_fractions_overrides_and_threshold():
    stage = _stage(
        outliers=0.0625,
        threshold=4.0,
        overrides=[
            {"pattern": "*.down_proj", "bits": 8, "act_bits": 8, "outlier_multiplier": 3.5},
            {"pattern": "*.down_proj", "bits": 4},  # never reached: the first match wins
            {"pattern": "*.o_proj", "outliers": 3},
        ],
    )
    big = torch.tensor([10.0])
    assert stage.plan("m.self_attn.q_proj", 128, big) == (4, 4, 8)
    assert stage.plan("m.mlp.down_proj", 128, big) == (8, 8, 28)
    assert stage.plan("m.self_attn.o_proj", 128, big) == (4, 4, 3)
    assert stage.plan("m.mlp.down_proj", 128, torch.tensor([3.9])).num_outliers == 0  # below T
    assert _stage(outliers=63).plan("x", 64, big).num_outliers == 63
    # as many outlier columns as inputs would quantize nothing and still report W4A4
    with pytest.raises(RecipeError, match="asks for 500 outlier columns in x, which has 64 inputs"):
        _stage(outliers=500).plan("x", 64, big)


def _output_error(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> float:
    ref = x.double() @ w.double().T
    return float((y.double() - ref).norm() / ref.norm())


def test_outliers_lower_the_output_error_on_planted_channels():
    k, n = 128, 48
    w = torch.randn(n, k) / k**0.5
    calib, held = _inputs(512, k, seed=4), _inputs(128, k, seed=5)
    stats = _stats(calib)
    errors = {}
    for count in (0, 5):
        r = _stage(outliers=count, bits=4, act_bits=4).quantize("layer", w, stats)
        weight_only = _output_error(held, w, held @ r.dequantized.T)
        full = _output_error(held, w, QuikLinear(r.packed)(held))
        errors[count] = (weight_only, full)
    assert errors[5][0] < 0.7 * errors[0][0]
    assert errors[5][1] < 0.5 * errors[0][1]


def test_gptq_keeps_last_columns_and_feeds_them_the_error():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(16, 64, generator=g, dtype=torch.float64)
    x = torch.randn(256, 64, generator=g, dtype=torch.float64)
    h = 2 * x.T @ x / 256
    spec = GridSpec(4, True, None)
    plain = gptq_run(w, h, spec)
    assert all(torch.equal(a, b) for a, b in zip(plain[:3], gptq_quantize(w, h, spec), strict=True))
    out = gptq_run(w, h, spec, keep_last=8, block_size=16)
    assert out.codes.shape == (16, 56) and out.kept.shape == (16, 8)
    assert not torch.allclose(out.kept, w[:, 56:])  # the kept columns absorbed rounding error
    deq = torch.cat([(out.codes - 8) * out.scales, out.kept], dim=1)
    rtn_like = torch.cat([(plain.codes[:, :56] - 8) * plain.scales, w[:, 56:]], dim=1)
    err = lambda q: float(torch.einsum("ni,ij,nj->", w - q, h, w - q))  # noqa: E731
    assert err(deq) < err(rtn_like)


@pytest.mark.parametrize("kb,block", [(64, 128), (62, 30)])
def test_24_pattern_in_every_group_of_base_columns_outliers_dense(kb, block):
    g = torch.Generator().manual_seed(kb)
    k = kb + 5
    w = torch.randn(24, k, generator=g, dtype=torch.float64)
    x = torch.randn(512, k, generator=g, dtype=torch.float64)
    out = gptq_run(
        w, 2 * x.T @ x / 512, GridSpec(4, True, None), keep_last=5, sparsity_24=True, block_size=block
    )
    assert violations_24(out.codes, 4) is None
    signed = out.codes - 8
    assert float((signed == 0).double().mean()) >= 0.48  # half pruned (plus a few rounded to zero)
    assert bool((out.kept != 0).all())

    stats = _stats(_inputs(256, 128, seed=7))
    r = _stage(outliers=5, sparsity_24=True).quantize("layer", torch.randn(16, 128), stats)
    assert r.packed.sparsity_24 and violations_24(r.packed.codes(), 4) is None
    assert bool((r.dequantized[:, PLANTED] != 0).all())


@pytest.mark.parametrize("count", [0, 120])
def test_no_outliers_and_all_but_a_few(count):
    x = _inputs(64, 128, seed=8)
    w = torch.randn(8, 128)
    r = _stage(outliers=count).quantize("layer", w, _stats(x))
    assert r.packed.num_outliers == count and r.packed.base_features == 128 - count
    y = QuikLinear(r.packed)(x)
    err = _output_error(x, w, y)
    assert err < (0.1 if count == 120 else 0.5)


def test_as_many_outliers_as_inputs_are_refused():
    with pytest.raises(RecipeError, match="asks for 128 outlier columns in layer, which has 128 inputs"):
        _stage(outliers=128).quantize("layer", torch.randn(8, 128), _stats(_inputs(64, 128, seed=8)))
