"""The `qoq` layout and its reference forward: pack → load → dequantize round trips, the W8A8 integer arithmetic of
formats/qoq.md recomputed independently (numpy float32 / float64), and the loader's one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qtool.errors import CheckpointError
from qtool.layouts.qoq.layout import QoQWeight, quantize_activations
from qtool.layouts.qoq.module import QoQLinear
from qtool.layouts.registry import LAYOUTS

SCHEMES = [(8, None), (4, None), (4, 4), (4, 43)]


def _random_layout(n: int, k: int, bits: int, g: int | None, seed: int) -> tuple[QoQWeight, dict]:
    """A layout from random codes and parameters in their full stored ranges (progressive codes kept to those
    whose integer weight is in int8, as every producer must)."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, generator=gen) * 0.02 + 1e-3
    parts: dict = {"scales": scales}
    if bits == 8:
        codes = torch.randint(-127, 128, (n, k), generator=gen)
    elif g is None:
        codes = torch.randint(0, 16, (n, k), generator=gen)
        parts["zeros"] = torch.randint(0, 16, (n,), generator=gen)
    else:
        s1 = torch.randint(1, 17, (n, k // g), generator=gen)
        z = torch.randint(0, 16, (n, k // g), generator=gen)
        codes = torch.randint(0, 16, (n, k), generator=gen)
        s1e, ze = s1.repeat_interleave(g, 1), z.repeat_interleave(g, 1)
        lo = torch.clamp(ze - torch.div(128, s1e, rounding_mode="floor"), min=0)
        hi = torch.clamp(ze + torch.div(127, s1e, rounding_mode="floor"), max=15)
        codes = torch.minimum(torch.maximum(codes, lo), hi)
        parts.update(group_scales=s1, zeros=z)
    parts["codes"] = codes
    layout = QoQWeight.from_codes(codes, scales, bits, g, parts.get("group_scales"), parts.get("zeros"))
    return layout, parts


def _integer_weight_by_hand(bits: int, g: int | None, parts: dict) -> torch.Tensor:
    c = parts["codes"].to(torch.int64)
    if bits == 8:
        return c
    if g is None:
        return c - parts["zeros"][:, None]
    return parts["group_scales"].repeat_interleave(g, 1) * (c - parts["zeros"].repeat_interleave(g, 1))


@pytest.mark.parametrize("bits,g", SCHEMES)
@pytest.mark.parametrize("n,k", [(7, 172), (16, 344), (1, 516)])
def test_pack_load_dequantize_round_trip(bits, g, n, k):
    layout, parts = _random_layout(n, k, bits, g, seed=n * k + bits)
    cfg = layout.layer_config(has_bias=False)
    assert cfg == {
        "format": "qoq",
        "bits": bits,
        "act_bits": 8,
        "group_size": g,
        "in_features": k,
        "out_features": n,
        "bias": False,
    }
    loaded = QoQWeight.from_tensors("layer", cfg, {f: t.clone() for f, t in layout.tensors().items()})
    wint = _integer_weight_by_hand(bits, g, parts)
    assert torch.equal(loaded.integer_weight(), wint)
    expect = parts["scales"].half().float()[:, None] * wint.float()
    assert torch.equal(loaded.dequantize(), expect)
    assert loaded.stored_bits() == sum(t.numel() * t.element_size() * 8 for t in loaded.tensors().values())
    assert set(loaded.tensors()) == set(QoQWeight.expected_shapes(cfg))
    assert LAYOUTS["qoq"].layout_cls is QoQWeight


def _numpy_forward(x: torch.Tensor, wint: torch.Tensor, scales16: torch.Tensor, bias: torch.Tensor | None):
    """formats/qoq.md steps 1-3 in numpy: float32 IEEE ops for the activation scale and codes, float64 (exact)
    for the integer product, float32 for the epilogue."""
    xf = x.numpy().astype(np.float32)
    amax = np.abs(xf).max(axis=1)
    empty = amax == 0
    safe = np.where(empty, np.float32(1), amax)
    r = np.where(empty, np.float32(1), np.float32(127) / safe).astype(np.float32)
    sx = np.where(empty, np.float32(1), safe / np.float32(127)).astype(np.float32)
    prod = (xf * r[:, None]).astype(np.float32)
    qx = np.clip(np.rint(prod), -127, 127)
    acc = qx.astype(np.float64) @ wint.numpy().astype(np.float64).T
    s0 = scales16.numpy().astype(np.float32)
    y = acc.astype(np.float32) * (sx[:, None] * s0[None, :]).astype(np.float32)
    if bias is not None:
        y = y + bias.numpy().astype(np.float32)
    return qx, acc, y.astype(np.float32)


@pytest.mark.parametrize("bits,g", SCHEMES)
def test_reference_forward_matches_the_integer_arithmetic_exactly(bits, g):
    n, k, t = 13, 172, 21
    layout, parts = _random_layout(n, k, bits, g, seed=bits + (g or 0))
    bias = torch.randn(n)
    mod = QoQLinear(layout, bias)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(t, k, generator=gen) * torch.rand(t, 1, generator=gen) * 10
    x[:, 17] *= 30.0  # an outlier channel
    x[4] = 0.0  # a silent token: scale 1, output = bias
    x[9] = torch.round(x[9] * 4) / 4  # many exact ties after scaling are possible: half-to-even decides them

    act = quantize_activations(x)
    qx, acc64, y_np = _numpy_forward(x, _integer_weight_by_hand(bits, g, parts), layout.scales, bias)
    assert act.codes.dtype == torch.int32 and torch.equal(act.codes, torch.from_numpy(qx).to(torch.int32))
    assert torch.equal(act.rowsum, act.codes.sum(1, dtype=torch.int32))
    acc = mod.accumulate(act)
    assert acc.dtype == torch.int32 and torch.equal(acc.double(), torch.from_numpy(acc64))
    y = mod(x.reshape(3, 7, k)).reshape(t, n)
    assert torch.equal(y, torch.from_numpy(y_np))
    assert torch.equal(y[4], bias)

    # And, on tokens without an outlier channel, the float product with the dequantized weight to A8 rounding.
    x = torch.randn(t, k, generator=gen)
    exact = F.linear(x.double(), layout.dequantize(torch.float64), bias.double())
    rel = float((mod(x).double() - exact).norm() / exact.norm())
    assert rel < 0.02


def test_half_model_keeps_float16_scales_and_runs_in_half():
    layout, _ = _random_layout(8, 64, 4, 4, seed=3)
    mod = QoQLinear(layout, torch.randn(8)).to(torch.float16)
    assert mod.scales.dtype == torch.float16 and mod.group_scales.dtype == torch.uint8
    x = torch.randn(5, 64)
    y16 = mod(x.half())
    assert y16.dtype == torch.float16
    ref = QoQLinear(layout, mod.bias.float())(x.half().float())
    assert torch.equal(y16, ref.half())


def test_activation_quantization_uses_the_float32_product_and_ties_to_even():
    # 127/4 = 31.75 (exact); 2·31.75 = 63.5 → 64 (even), 6·31.75 = 190.5 → clamp 127; 0.5·31.75 = 15.875 → 16.
    x = torch.tensor([[4.0, 2.0, -2.0, 0.5, -4.0]])
    act = quantize_activations(x)
    assert act.codes.tolist() == [[127, 64, -64, 16, -127]]
    assert float(act.scale[0]) == float(torch.tensor(4.0) / torch.tensor(127.0))
    assert int(act.rowsum[0]) == 16


# ---- loader errors --------------------------------------------------------------------------------------


def _load(bits, g, edit):
    layout, _ = _random_layout(6, 172, bits, g, seed=11)
    cfg = layout.layer_config(False)
    tensors = {f: t.clone() for f, t in layout.tensors().items()}
    edit(tensors, cfg)
    with pytest.raises(CheckpointError) as e:
        QoQWeight.from_tensors("m.q", cfg, tensors)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def _put(field, fn):
    return lambda t, cfg: t.update({field: fn(t[field])})


@pytest.mark.parametrize(
    "bits,g,edit,fragments",
    [
        (
            4,
            4,
            _put("qweight", lambda v: v[:, :-1].contiguous()),
            ["m.q.qweight: found torch.int32 [6, 21]", "expected torch.int32 [6, 22]"],
        ),
        (8, None, _put("qweight", lambda v: v.to(torch.int64)), ["m.q.qweight: found torch.int64"]),
        (
            4,
            4,
            _put("scales", lambda v: v.float()),
            ["m.q.scales: found torch.float32 [6]", "expected torch.float16"],
        ),
        (4, None, _put("scales", lambda v: v[:5].contiguous()), ["m.q.scales: found torch.float16 [5]"]),
        (
            4,
            4,
            _put("group_scales", lambda v: v.to(torch.int8)),
            ["m.q.group_scales: found torch.int8 [6, 43]", "expected torch.uint8 [6, 43]"],
        ),
        (4, 4, _put("zeros", lambda v: v[:, :42].contiguous()), ["m.q.zeros: found torch.uint8 [6, 42]"]),
        (4, None, _put("zeros", lambda v: v.to(torch.int32)), ["m.q.zeros: found torch.int32 [6]"]),
        (4, 4, lambda t, cfg: t.pop("group_scales"), ["m.q.group_scales: missing"]),
        (4, None, lambda t, cfg: t.pop("zeros"), ["m.q.zeros: missing"]),
        (
            4,
            4,
            _put("group_scales", lambda v: v.index_fill(1, torch.tensor([3]), 0)),
            ["m.q.group_scales: found values in [0,", "expected integers in 1..16"],
        ),
        (
            4,
            4,
            _put("group_scales", lambda v: v.index_fill(1, torch.tensor([3]), 17)),
            ["m.q.group_scales: found values in [", ", 17]", "1..16"],
        ),
        (
            4,
            4,
            _put("zeros", lambda v: v.index_fill(1, torch.tensor([0]), 16)),
            ["m.q.zeros: found 16", "at most 15"],
        ),
        (4, None, _put("zeros", lambda v: v.index_fill(0, torch.tensor([2]), 200)), ["m.q.zeros: found 200"]),
        (
            8,
            None,
            _put("scales", lambda v: v.index_fill(0, torch.tensor([1]), float("nan"))),
            ["m.q.scales: found non-positive or non-finite"],
        ),
        (
            4,
            4,
            _put("scales", lambda v: v.index_fill(0, torch.tensor([1]), float("inf"))),
            ["m.q.scales: found non-positive or non-finite"],
        ),
        (
            4,
            None,
            _put("scales", lambda v: v.index_fill(0, torch.tensor([0]), 0.0)),
            ["m.q.scales: found non-positive"],
        ),
        # code 0 is Q8 = -128, outside the symmetric W8 range
        (
            8,
            None,
            _put("qweight", lambda v: v.index_fill(1, torch.tensor([0]), 0)),
            ["m.q.qweight: found code 0 (Q8 = -128)", "Q8 in -127..127"],
        ),
        # s1 = 16, z = 0, code 15: the integer weight 240 leaves int8
        (
            4,
            4,
            lambda t, cfg: (t["group_scales"].fill_(16), t["zeros"].fill_(0), t["qweight"].fill_(-1)),
            ["m.q.qweight: row 0 column 0 dequantizes to the integer 240", "expected -128..127"],
        ),
    ],
)
def test_broken_tensors_are_refused_naming_the_tensor(bits, g, edit, fragments):
    msg = _load(bits, g, edit)
    assert msg.startswith("tensor m.q."), msg
    for f in fragments:
        assert f in msg, (f, msg)


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("bits", 3, "'bits' found 3, expected 4 or 8"),
        ("act_bits", 4, "'act_bits' found 4, expected 8"),
        ("group_size", 32, "'group_size' found 32, expected a divisor of in_features 172"),
        ("group_size", 0, "'group_size' found 0, expected a positive integer or null"),
        ("in_features", "172", "'in_features' found '172', expected a positive integer"),
    ],
)
def test_bad_layer_config_is_refused_naming_layer_and_key(key, value, expected):
    msg = _load(4, 4, lambda t, cfg: cfg.update({key: value}))
    assert msg.startswith("layer m.q: quantization_config key ") and expected in msg, msg


def test_w8_with_groups_is_refused():
    msg = _load(8, None, lambda t, cfg: cfg.update(group_size=4))
    assert "'group_size' found 4, expected null with bits 8" in msg
    with pytest.raises(ValueError, match="null with bits 8"):
        QoQWeight.from_codes(torch.zeros(2, 8, dtype=torch.int64), torch.ones(2), 8, 4)
