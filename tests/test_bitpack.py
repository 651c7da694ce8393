"""Pack/unpack round trips and the documented bit order of the grouped_int layout."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.layouts.bitpack import pack_codes, packed_words, unpack_codes
from qtool.layouts.grouped_int.layout import GroupedIntWeight
from qtool.quant.grid import GridSpec


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 5, 6, 7, 8]),
    rows=st.integers(1, 9),
    cols=st.integers(1, 301),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip(bits, rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, cols), generator=g)
    words = pack_codes(codes, bits)
    assert words.dtype == torch.int32
    assert words.shape == (rows, packed_words(cols, bits))
    assert torch.equal(unpack_codes(words, bits, cols), codes)


def test_four_bit_order_is_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]])
    (word,) = pack_codes(codes, 4)[0].tolist()
    assert word & 0xFFFFFFFF == 0xF7654321


def test_three_bit_codes_straddle_words():
    # Code 10 sits at bits 30..32: two bits in word 0, one in word 1.
    codes = torch.zeros(1, 11, dtype=torch.int64)
    codes[0, 10] = 0b111
    words = pack_codes(codes, 3)[0].tolist()
    assert [w & 0xFFFFFFFF for w in words] == [0b11 << 30, 0b1]


def test_out_of_range_codes_are_refused():
    with pytest.raises(ValueError, match="out of range"):
        pack_codes(torch.tensor([[16]]), 4)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    n=st.integers(1, 7),
    k=st.integers(1, 200),
    group=st.sampled_from([None, 16, 32, 64, 128]),
    symmetric=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_grouped_int_dequantize_matches_definition(bits, n, k, group, symmetric, seed):
    spec = GridSpec(bits, symmetric, group)
    g = torch.Generator().manual_seed(seed)
    ngroups = spec.num_groups(k)
    codes = torch.randint(0, 1 << bits, (n, k), generator=g)
    scales = torch.rand(n, ngroups, generator=g) + 0.01
    zeros = torch.randint(0, 1 << bits, (n, ngroups), generator=g).float()
    layout = GroupedIntWeight.from_codes(codes, scales, zeros, spec)
    assert torch.equal(layout.codes(), codes)
    gs = group or k
    expected = torch.empty(n, k, dtype=torch.float64)
    for r in range(n):
        for c in range(k):
            z = (1 << (bits - 1)) if symmetric else int(zeros[r, c // gs])
            expected[r, c] = (int(codes[r, c]) - z) * float(scales[r, c // gs].half())
    torch.testing.assert_close(layout.dequantize(torch.float64), expected, rtol=0, atol=0)
    with mock.patch("qtool.layouts.grouped_int.layout.PACK_CHUNK", 2 * k):  # unpacked two rows at a time
        torch.testing.assert_close(layout.dequantize(torch.float64), expected, rtol=0, atol=0)
