"""The `mixed-2-4-16` layout (qtool/layouts/mixed/layout.py, formats/mixed-2-4-16.md): pack → unpack round trips on random
fields, the bit positions of the two code matrices, the torch reference forward, and the loader's one-line
errors naming the tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.errors import CheckpointError
from qtool.layouts.mixed.layout import MixedWeight
from qtool.layouts.mixed.module import MixedLinear
from qtool.layouts.registry import LAYOUTS


def _random_fields(seed: int, n: int, k: int, g1: int, g2: int, s4: int, nnz: int, block4: bool):
    g = torch.Generator().manual_seed(seed)
    s = k // g1
    if block4:
        is4 = torch.zeros(s, dtype=torch.bool)
        is4[torch.arange(0, s, 4) + torch.randint(0, 4, (s // 4,), generator=g)] = True
    else:
        is4 = torch.zeros(s, dtype=torch.bool)
        is4[torch.randperm(s, generator=g)[:s4]] = True
    s4 = int(is4.sum())
    s2 = s - s4
    nnz = min(nnz, n * s2 * g1)
    codes = torch.randint(0, 4, (n, s, g1), generator=g)
    codes[:, is4] = torch.randint(0, 16, (n, s4, g1), generator=g)
    half = lambda *shape: (torch.rand(*shape, generator=g) * 0.1 + 1e-3).half().float()  # noqa: E731
    cols2 = torch.nonzero(~is4).reshape(-1)
    positions = torch.randperm(n * s2 * g1, generator=g)[:nnz] if s2 else torch.zeros(0, dtype=torch.int64)
    rows = positions // (s2 * g1) if s2 else positions
    cols = cols2[(positions // g1) % max(s2, 1)] * g1 + positions % g1 if s2 else positions
    return dict(
        codes=codes.reshape(n, k),
        is4=is4,
        group_size=g1,
        scale_group_size=g2,
        assign="block4" if block4 else "global",
        scale_codes=torch.randint(0, 16, (n, s2), generator=g),
        zeros2=torch.randint(0, 4, (n, s2), generator=g),
        scales_2nd=half(n // g2, s2),
        zeros_2nd=torch.randint(0, 16, (n // g2, s2), generator=g),
        scales4=half(n, s4),
        zeros4=torch.randint(0, 16, (n, s4), generator=g),
        outlier_rows=rows,
        outlier_cols=cols,
        outlier_values=(torch.randn(nnz, generator=g)).half().float(),
    )


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_groups=st.integers(1, 3),
    g2=st.sampled_from([1, 2, 4]),
    g1=st.sampled_from([8, 16, 32]),
    blocks=st.integers(1, 3),
    frac4=st.floats(0, 1),
    block4=st.booleans(),
    nnz=st.integers(0, 12),
)
def test_pack_unpack_round_trip(seed, n_groups, g2, g1, blocks, frac4, block4, nnz):
    n, k = n_groups * g2, 4 * g1 * blocks
    s = k // g1
    f = _random_fields(seed, n, k, g1, g2, round(frac4 * s), nnz, block4)
    nnz = min(nnz, n * (s - int(f["is4"].sum())) * g1)
    layout = MixedWeight.from_codes(**f)
    assert torch.equal(layout.codes(), f["codes"])
    assert torch.equal(layout.is4, f["is4"])
    scale, zero = layout.group_params()
    is4 = f["is4"]
    assert torch.equal(scale[:, is4], f["scales4"]) and torch.equal(zero[:, is4], f["zeros4"].float())
    shat = (f["scale_codes"] + f["zeros_2nd"].repeat_interleave(g2, 0)) * f["scales_2nd"].repeat_interleave(
        g2, 0
    )
    assert torch.equal(scale[:, ~is4], shat.float()) and torch.equal(zero[:, ~is4], f["zeros2"].float())
    rows, cols, vals = layout.outliers()
    order = torch.argsort(f["outlier_rows"] * k + f["outlier_cols"])
    assert torch.equal(rows, f["outlier_rows"][order]) and torch.equal(cols, f["outlier_cols"][order])
    assert torch.equal(vals, f["outlier_values"][order])
    assert layout.num_outliers == nnz
    # Through the stored tensors and the loader's checks, nothing changes.
    again = MixedWeight.from_tensors("m", layout.layer_config(False), layout.tensors())
    assert torch.equal(again.dequantize(), layout.dequantize())
    for field, t in layout.tensors().items():
        assert t.shape == again.expected_shapes(layout.config())[field][0]


def test_bit_positions_of_matrix_a_and_b():
    """g1 16: stripe j of a row is word j of qweight_a; a 4-bit stripe's codes 0-7 are that word (code i at bits
    4i..4i+3), its codes 8-15 the next word of qweight_b."""
    g1 = 16
    is4 = torch.tensor([False, True, False, False])
    codes = torch.zeros(1, 4, g1, dtype=torch.int64)
    codes[0, 0] = torch.arange(16) % 4
    codes[0, 1] = torch.arange(16)
    f = _random_fields(0, 1, 64, g1, 1, 1, 0, True)
    f.update(
        codes=codes.reshape(1, 64),
        is4=is4,
        scales4=f["scales4"][:, :1],
        zeros4=f["zeros4"][:, :1],
        scale_codes=torch.zeros(1, 3, dtype=torch.int64),
        zeros2=torch.zeros(1, 3, dtype=torch.int64),
        scales_2nd=torch.ones(1, 3),
        zeros_2nd=torch.ones(1, 3, dtype=torch.int64),
    )
    layout = MixedWeight.from_codes(**f)
    a = layout.qweight_a.to(torch.int64) & 0xFFFFFFFF
    assert a.shape == (1, 4)
    assert int(a[0, 0]) == sum((i % 4) << (2 * i) for i in range(16))
    assert int(a[0, 1]) == sum(i << (4 * i) for i in range(8))
    assert int(layout.qweight_b[0, 0]) & 0xFFFFFFFF == sum((8 + i) << (4 * i) for i in range(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_forward_equals_dequantize(dtype):
    n, k = 24, 128
    f = _random_fields(7, n, k, 16, 8, 3, 20, False)
    layout = MixedWeight.from_codes(**f)
    bias = torch.randn(n)
    mod = MixedLinear(layout, bias)
    assert LAYOUTS["mixed-2-4-16"] is MixedLinear and MixedLinear.layout_cls is MixedWeight
    x = torch.randn(2, 5, k, dtype=dtype)
    y = mod.to(dtype)(x)
    ref = x @ layout.dequantize(dtype).T + bias.to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert torch.allclose(y, ref, atol=tol, rtol=tol)
    assert mod.scales4.dtype == torch.float16 and mod.outlier_values.dtype == torch.float16


def _stored(**changes):
    layout = MixedWeight.from_codes(**_random_fields(2, 16, 128, 16, 4, 2, 6, True))
    cfg, tensors = layout.layer_config(False), dict(layout.tensors())
    for key, value in changes.items():
        if key in tensors:
            tensors[key] = value(tensors[key])
        else:
            cfg[key] = value
    return cfg, tensors


def _bad_bits(t):
    t = t.clone()
    t[0] = 3
    return t


def _two_in_a_block(t):
    t = t.clone()
    t[:4] = torch.tensor([4, 4, 2, 2], dtype=torch.uint8)
    t[4:8] = 2
    return t


@pytest.mark.parametrize(
    "changes,words",
    [
        ({"qweight_a": lambda t: t[:, :-1]}, ["tensor m.qweight_a", "expected torch.int32 [16, 8]"]),
        ({"scales4": lambda t: t.float()}, ["tensor m.scales4", "found torch.float32"]),
        ({"outlier_cols": lambda t: t.to(torch.int32)}, ["tensor m.outlier_cols", "expected torch.int16"]),
        ({"stripe_bits": _bad_bits}, ["tensor m.stripe_bits", "expected 2 or 4"]),
        ({"stripe_bits": _two_in_a_block}, ["tensor m.stripe_bits", "one 4-bit stripe in every four"]),
        ({"scales_2nd": lambda t: t * 0}, ["tensor m.scales_2nd", "expected > 0"]),
        ({"zeros_2nd": lambda t: t + 16}, ["tensor m.zeros_2nd", "at most 15"]),
        ({"outlier_rowptr": lambda t: t.flip(0)}, ["tensor m.outlier_rowptr", "non-decreasing"]),
        (
            {"outlier_cols": lambda t: torch.full_like(t, 200)},
            ["tensor m.outlier_cols", "below in_features 128"],
        ),
        ({"group_size": 12}, ["layer m", "'group_size' found 12"]),
        ({"scale_group_size": 5}, ["layer m", "'scale_group_size' found 5"]),
        ({"stripes_4bit": 3}, ["layer m", "'stripes_4bit' found 3", "block4"]),
        ({"assign": "any"}, ["layer m", "'assign' found 'any'"]),
    ],
)
def test_loader_errors_name_the_tensor(changes, words):
    cfg, tensors = _stored(**changes)
    with pytest.raises(CheckpointError) as err:
        MixedWeight.from_tensors("m", cfg, tensors)
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_loader_refuses_an_outlier_in_a_4bit_stripe():
    cfg, tensors = _stored()
    first4 = int(torch.nonzero(tensors["stripe_bits"] == 4)[0])
    tensors["outlier_cols"] = torch.full_like(tensors["outlier_cols"], first4 * 16)
    with pytest.raises(CheckpointError, match=r"tensor m\.outlier_cols: found an outlier in a 4-bit stripe"):
        MixedWeight.from_tensors("m", cfg, tensors)
